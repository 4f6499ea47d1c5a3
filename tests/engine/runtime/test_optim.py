"""A task's optimizer steps (``TaskLoop``: accumulation over batches, clipping by the
global norm over every shard, the epoch's partial last group, a scheduler's step per
optimizer step) equal plain PyTorch's exactly: float64, ``torch.equal``, the model cut
into >= 3 shards on 2 emulated copying devices. A shard's step is applied at its next op;
these check what the steps compute, not when."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tune_hydra as th
from tests.conftest import assert_same, make_task, mlp, plain_copy
from tune_hydra.frontends.task_loop import TaskLoop


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread: the engine gives each emulated device a share of the
    threads, and a gradient norm's float64 sum split differently rounds differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(task: th.ModelTask, epochs: int, **options: Any) -> tuple[list[Any], dict[str, Any]]:
    """``epochs`` of ``task`` as a loop cut into >= 3 shards; its results and its state."""
    engine = th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, device_memory=24_000)
    with engine:
        loop = TaskLoop("a", task, engine, seed=3, **options)
        history = [loop.train_iteration() for _ in range(epochs)]
        state = loop.state()
        loop.close()
    assert state["num_shards"] >= 3
    return history, state


def _losses(history: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return [(h["loss"], h["val_loss"]) for h in history]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_clipping_by_the_global_norm_over_all_shards_equals_clip_grad_norm(opt: str) -> None:
    # Groups of 2 over 5 batches, each group's gradients clipped to a total norm of 0.05
    # over every shard's parameters (each shard holds a part of them).
    task = make_task(mlp(), opt)
    ref, unclipped = plain_copy(task), plain_copy(task)
    history, _ = _train(task, 2, accumulate_steps=2, max_grad_norm=0.05)
    want = th.train_plain(ref, 2, seed=3, accumulate_steps=2, max_grad_norm=0.05)
    assert _losses(history) == _losses(want)
    assert_same(task.model, ref.model)
    # the norm really was clipped: without clipping the model is another
    th.train_plain(unclipped, 2, seed=3, accumulate_steps=2)
    sa, sb = ref.model.state_dict(), unclipped.model.state_dict()
    assert not torch.equal(sa["0.weight"], sb["0.weight"])


def _halving(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
@pytest.mark.parametrize(("batches", "steps_per_epoch"), [(4, 1), (5, 2)])
def test_accumulated_groups_and_a_partial_last_group_step_as_plain_training(
    batches: int, steps_per_epoch: int, max_grad_norm: float | None
) -> None:
    # Groups of 4: 4 batches an epoch make one full group; 5 make one and a partial group
    # of 1, which steps at the epoch's end (clipped, and the scheduler steps with it).
    task = make_task(mlp(), "adam", n=batches)
    task.lr_scheduler = _halving
    ref = plain_copy(task)
    ref.lr_scheduler = _halving
    options: dict[str, Any] = {"accumulate_steps": 4, "max_grad_norm": max_grad_norm}
    history, state = _train(task, 3, **options)
    want = th.train_plain(ref, 3, seed=3, **options)
    assert _losses(history) == _losses(want)
    assert_same(task.model, ref.model)
    steps = 3 * steps_per_epoch
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {steps}
    assert state["lr_scheduler"]["last_epoch"] == steps
    assert {g["lr"] for g in state["optimizer"]["param_groups"]} == {1e-2 * 0.5**steps}
