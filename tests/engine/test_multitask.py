"""Tasks trained together (and interleaved over devices) equal each trained alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import (
    assert_same_history,
    assert_same_model,
    make_task,
    mlp,
    plain_copy,
)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"], ["cpu", "cpu", "cpu"]])
@pytest.mark.parametrize("policy", ["lrtf", "fifo", "round_robin"])
def test_three_tasks_different_optimizers(devices: list[str], policy: str) -> None:
    tasks = {
        "sgd": make_task(mlp(seed=1), "sgd"),
        "adam": make_task(mlp(seed=2), "adam", n=3),
        "adamw": make_task(mlp(seed=3, width=24), "adamw", n=4),
    }
    refs = {k: plain_copy(t) for k, t in tasks.items()}
    h = th.train_models(
        tasks,
        devices=devices,
        device_memory=60_000,
        epochs=2,
        seed=11,
        policy=policy,
        max_layers_per_shard=3,
        copy_on_cpu=True,
    )
    for name, task in tasks.items():
        want = th.train_plain(refs[name], 2, seed=11)
        assert_same_history(h[name], want)
        assert_same_model(task.model, refs[name].model)
    h.validate()
    used = {e.device for e in h.trace.events if e.op in "FLBSE"}
    assert len(used) == len(devices)


def test_two_tasks_with_their_own_seeds() -> None:
    a, b = make_task(mlp(seed=1), "adam"), make_task(mlp(seed=1), "adam")
    a.seed, b.seed = 1, 2
    ra, rb = plain_copy(a), plain_copy(b)
    h = th.train_models(
        {"a": a, "b": b}, devices=["cpu", "cpu"], device_memory=24_000, epochs=2, recompute=True
    )
    assert_same_history(h["a"], th.train_plain(ra, 2, seed=1))
    assert_same_history(h["b"], th.train_plain(rb, 2, seed=2))
    assert_same_model(a.model, ra.model)
    assert_same_model(b.model, rb.model)
    assert h["a"][0]["loss"] != h["b"][0]["loss"]  # different dropout masks


def test_nan_task_fails_alone() -> None:
    good = make_task(mlp(seed=1), "adam")
    bad = th.ModelTask(
        mlp(seed=2),
        lambda out, y: nn.functional.cross_entropy(out, y) * float("nan"),
        lambda p: torch.optim.SGD(p, lr=0.1),
        good.train_data,
    )
    ref = plain_copy(good)
    with pytest.raises(th.exceptions.TrainingError) as info:
        th.train_models(
            {"good": good, "bad": bad},
            devices=["cpu", "cpu"],
            device_memory=24_000,
            epochs=2,
            seed=0,
        )
    err = info.value
    assert set(err.errors) == {"bad"}
    assert isinstance(err.errors["bad"], th.exceptions.NonFiniteLossError)
    assert isinstance(err.errors["bad"], FloatingPointError)
    assert "'bad'" in str(err.errors["bad"]) and "epoch 0" in str(err.errors["bad"])
    assert len(err.history["good"]) == 2
    th.train_plain(ref, 2, seed=0)
    assert_same_model(good.model, ref.model)


def test_user_exception_fails_alone() -> None:
    good = make_task(mlp(seed=1), "sgd")

    def broken_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise KeyError("oops in loss")

    bad = th.ModelTask(
        mlp(seed=2), broken_loss, lambda p: torch.optim.SGD(p, lr=0.1), good.train_data
    )
    with pytest.raises(th.exceptions.TrainingError) as info:
        th.train_models({"good": good, "bad": bad}, devices=["cpu"], epochs=1)
    cause = info.value.errors["bad"]
    assert isinstance(cause, th.exceptions.TaskFailedError)
    assert isinstance(cause.__cause__, KeyError)
    assert "broken_loss" in cause.original_traceback and "Original traceback" in str(cause)
    assert len(info.value.history["good"]) == 1


def test_grouped_visits_multiplexed_over_devices() -> None:
    def no_dropout(seed: int) -> nn.Sequential:
        return nn.Sequential(*(m for m in mlp(seed=seed) if not isinstance(m, nn.Dropout)))

    tasks = {f"t{i}": make_task(no_dropout(i), opt, n=5) for i, opt in enumerate(("sgd", "adam"))}
    refs = {k: plain_copy(t) for k, t in tasks.items()}
    h = th.train_models(
        tasks,
        devices=["cpu", "cpu"],
        device_memory=24_000,
        epochs=2,
        seed=1,
        accumulate_steps=2,
        copy_on_cpu=True,
        recompute=True,
    )
    for name, task in tasks.items():
        assert_same_history(h[name], th.train_plain(refs[name], 2, seed=1, accumulate_steps=2))
        assert_same_model(task.model, refs[name].model)
    visits = [e for e in h.trace.events if e.task == "t0" and e.op == "F" and e.shard == 0]
    assert len(visits) < 2 * (5 + 1)  # ungrouped: one visit per batch + one finding the end
    h.validate()
