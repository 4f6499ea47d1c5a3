"""A task's exact resume point: what :meth:`TaskRunner.get_state` captures between
iterations and :meth:`TaskRunner.set_state` loads into a fresh runner.

Besides the weights it holds the optimizers' state, any accumulated gradients, the task's
RNG streams and where in the epoch it stopped (with the epoch's starting RNG, so the data
order is replayed and the batches already seen are skipped): training resumed from it
equals training that never stopped.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.engine import rng
from tune_hydra.exceptions import InvalidTaskError

if TYPE_CHECKING:
    from tune_hydra.engine.runner import TaskRunner


def capture(runner: TaskRunner) -> dict[str, Any]:
    """Everything needed to resume ``runner`` exactly (tensors cloned, on the host side
    of the shard stores: the engine calls this between iterations)."""
    model = runner.task.model
    assert isinstance(model, nn.Module)
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizers": [
            None if s.optimizer is None else copy.deepcopy(s.optimizer.state_dict())
            for s in runner.shards
        ],
        "grads": [
            [None if p.grad is None else p.grad.detach().clone() for p in s.params]
            for s in runner.shards
        ],
        "rng": {"cpu": runner.rng.cpu.clone(), "cuda": _clone(runner.rng.cuda)},
        "epoch_rng": runner._epoch_rng.cpu.clone(),
        "seed": runner.options.seed,
        "iteration": runner.iteration,
        "epoch": runner.epoch,
        "batch_in_epoch": runner.batch_in_epoch,
        "num_shards": len(runner.shards),
    }


def restore(runner: TaskRunner, state: dict[str, Any]) -> None:
    """Load :func:`capture`'s output into a fresh ``runner``."""
    if state.get("num_shards") != len(runner.shards):
        raise InvalidTaskError(
            f"task {runner.name!r}: the checkpoint was made with {state.get('num_shards')} "
            f"shards but the model is now cut into {len(runner.shards)}; restore with the "
            f"same device_memory"
        )
    model = runner.task.model
    assert isinstance(model, nn.Module)
    model.load_state_dict(state["model"])
    for s, sd, grads in zip(runner.shards, state["optimizers"], state["grads"], strict=True):
        if s.optimizer is not None:
            s.optimizer.load_state_dict(sd)
        for p, g in zip(s.params, grads, strict=True):
            p.grad = None if g is None else g.to(p.device, copy=True)
    runner.rng = rng.RngState(state["rng"]["cpu"].clone(), _clone(state["rng"]["cuda"]))
    runner.iteration = state["iteration"]
    runner.epoch = state["epoch"]
    runner.batch_in_epoch = state["batch_in_epoch"]
    runner._skip = runner.batch_in_epoch
    runner._resume_epoch_rng = rng.RngState(state["epoch_rng"].clone())


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
