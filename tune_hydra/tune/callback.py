"""Driver-side :class:`~ray.tune.Callback` that frees a finished trial in the engine and
makes Ctrl-C end a run promptly.

A trial process that dies hard never runs ``Trainable.cleanup``; without this callback its
model would stay registered (and spilled in host memory) in the engine until the run ends.

Ctrl-C: Tune stops its trial actors gracefully, but a trial whose ``step`` is still
waiting for its task factory (a slow download, or one that never returns) cannot take the
stop request until that wait ends; Tune then waits about 10 s before killing it. While the
run is going, the callback chains a SIGINT handler in front of Tune's: it tells the engines
to stop waiting for factories (those trials' steps end at once), then lets Tune's handler
do what it always does. The previous handler is back in place when the run ends.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from ray.tune import Callback

from tune_hydra.tune import executor as _executor

logger = logging.getLogger(__name__)


class HydraCallback(Callback):
    """Deregisters a trial from every active engine when it errors or completes, and on
    Ctrl-C stops the engines' waits for task factories (see the module docstring).

    It finds the engines through the executors active in this driver process, so it also
    works after ``Tuner.restore`` unpickles it.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._installed: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles callbacks with the experiment; signal handlers stay in this process.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def setup(
        self,
        stop: Any = None,
        num_samples: int | None = None,
        total_num_samples: int | None = None,
        **info: Any,
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set signal handlers (Tune does the same)
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum: int, frame: Any) -> None:
            _executor.abort_builds()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

        try:
            signal.signal(signal.SIGINT, on_sigint)
        except ValueError:  # not the main interpreter
            logger.debug("tune_hydra: could not install the SIGINT handler", exc_info=True)
            return
        self._previous, self._installed = previous, on_sigint

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        if self._installed is not None and signal.getsignal(signal.SIGINT) is self._installed:
            signal.signal(signal.SIGINT, self._previous)
        self._previous = self._installed = None

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        _executor.broadcast("deregister", trial.trial_id)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        _executor.broadcast("deregister", trial.trial_id)
