"""Helpers of the function and class trainable tests (driver side only).

:func:`plain` calls a function trainable directly in this thread with a fake Tune
session (the plain run a trial is compared with); :func:`live_functions` names the
trials whose thread still runs in an engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from ray.train._internal import session as train_session


class FakeSession:
    """Enough of Ray's Tune session to call a function trainable directly: the results
    it reports, and the ``ckpt.pt`` of each checkpoint it reports."""

    world_rank = None

    def __init__(self, checkpoint: Any = None) -> None:
        self.loaded_checkpoint = checkpoint
        self.results: list[dict[str, Any]] = []
        self.states: list[dict[str, Any]] = []

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        self.results.append(dict(metrics))
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                path = os.path.join(d, "ckpt.pt")
                if os.path.exists(path):
                    self.states.append(torch.load(path, weights_only=False))


def plain(
    fn: Callable[[dict[str, Any]], Any], config: dict[str, Any], checkpoint: Any = None
) -> FakeSession:
    """``fn(config)`` in this thread, with a fake session (starting from ``checkpoint``)."""
    fake = FakeSession(checkpoint)
    old = train_session._session
    train_session._session = fake  # type: ignore[assignment]
    try:
        fn(config)
    finally:
        train_session._session = old
    return fake


def live_functions(ex: Any, wait_s: float = 15.0) -> list[str]:
    """The trials whose thread (a function's, or a class Trainable's) still runs in an
    engine of ``ex``, once they had ``wait_s`` to end (a stopped function ends at its
    next forward or report)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        live = [k for h in ex.engines().values() for k in ray.get(h.functions.remote(ex._secret))]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def emulated_executor(max_layers_per_shard: int, **options: Any) -> Any:
    """A ``HydraExecutor`` on 2 emulated copying CPU devices, at most
    ``max_layers_per_shard`` layers a shard (engine options the executor does not take,
    set on its fleet before it starts); ``options`` go to the executor."""
    import dataclasses

    from tune_hydra.frontends.ray import HydraExecutor

    ex = HydraExecutor(devices=["cpu", "cpu"], **options)
    fleet = ex._engines
    fleet.engine_options = dataclasses.replace(
        fleet.engine_options, copy_on_cpu=True, max_layers_per_shard=max_layers_per_shard
    )
    return ex
