"""Driver-side :class:`~ray.tune.Callback` that frees a finished trial in the engine.

A trial process that dies hard never runs ``Trainable.cleanup``; without this callback its
model would stay registered (and spilled in host memory) in the engine until the run ends.
"""

from __future__ import annotations

from typing import Any

from ray.tune import Callback

from tune_hydra.tune import executor as _executor


class HydraCallback(Callback):
    """Deregisters a trial from every active engine when it errors or completes.

    It finds the engines through the executors active in this driver process, so it also
    works after ``Tuner.restore`` unpickles it.
    """

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        _executor.broadcast("deregister", trial.trial_id)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        _executor.broadcast("deregister", trial.trial_id)
