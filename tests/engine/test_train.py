"""``train_models`` with the disk tier (``host_memory``, ``spill_dir``): the same results as
without it and as plain PyTorch (float64: exact), within the host budget, and no folder
left behind."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

import tune_hydra as th
from tests.conftest import assert_same_history, assert_same_model, make_task, mlp, plain_copy
from tune_hydra.exceptions import HostBudgetError, SpillDirError, TrainingError

EPOCHS = 2
SEED = 3
BUDGET = 24_000  # cuts mlp() into at least 3 shards (tests.conftest.shards_3)


def _tasks() -> dict[str, th.ModelTask]:
    return {"a": make_task(mlp(seed=0), "adam"), "b": make_task(mlp(seed=1), "sgd")}


def _shard_states(tasks: dict[str, th.ModelTask]) -> list[int]:
    """The state bytes of every shard of ``tasks`` (as cut by a run on copies)."""
    history = th.train_models(
        copy.deepcopy(tasks), devices=["cpu"], device_memory=BUDGET, seed=SEED, copy_on_cpu=True
    )
    return [s.state_bytes for plan in history.plans.values() for s in plan.shards]


@pytest.mark.parametrize("factor", [3, 1])
def test_spilled_training_equals_plain_and_leaves_no_folder(factor: int, tmp_path: Path) -> None:
    """factor 3 = devices + 2: the budget is kept; factor 1: it may be exceeded by up to
    (devices + 1) x the largest shard's state (the documented slack)."""
    tasks = _tasks()
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    unspilled = copy.deepcopy(tasks)
    states = _shard_states(tasks)
    largest = max(states)
    host_memory = factor * largest
    assert host_memory < sum(states)  # the state of both tasks does not fit: some goes to disk

    history = th.train_models(
        tasks,
        devices=["cpu"],
        device_memory=BUDGET,
        epochs=EPOCHS,
        seed=SEED,
        copy_on_cpu=True,
        host_memory=host_memory,
        spill_dir=tmp_path,
    )
    without = th.train_models(
        unspilled,
        devices=["cpu"],
        device_memory=BUDGET,
        epochs=EPOCHS,
        seed=SEED,
        copy_on_cpu=True,
    )
    host = history.summary["host"]
    assert host["budget"] == host_memory
    assert host["spills"] > 0 and host["written_bytes"] > 0 and host["read_bytes"] > 0
    assert without.summary["host"]["written_bytes"] == 0
    slack = 0 if factor >= 3 else 2 * largest  # (devices + 1) x the largest shard state
    assert host["peak_held_bytes"] <= host_memory + slack
    history.trace.validate(host_budget=host_memory + slack)
    for name, task in tasks.items():
        assert history[name][0]["num_shards"] >= 3
        want = th.train_plain(refs[name], EPOCHS, seed=SEED)
        assert_same_history(history[name], want, tol=0.0)
        assert_same_history(history[name], without[name], tol=0.0)
        assert_same_model(task.model, refs[name].model, atol=0.0, rtol=0.0)
        assert_same_model(task.model, unspilled[name].model, atol=0.0, rtol=0.0)
    assert list(tmp_path.iterdir()) == []  # the engine's scratch folder is removed on close


def test_spill_dir_without_host_memory_writes_nothing(tmp_path: Path) -> None:
    history = th.train_models(
        _tasks(), devices=["cpu"], device_memory=BUDGET, copy_on_cpu=True, spill_dir=tmp_path
    )
    assert history.summary["host"]["budget"] is None
    assert history.summary["host"]["written_bytes"] == 0
    assert list(tmp_path.iterdir()) == []


def test_host_memory_below_one_shard_refuses_the_task(tmp_path: Path) -> None:
    tasks = _tasks()
    largest = max(_shard_states(tasks))
    with pytest.raises(TrainingError) as info:
        th.train_models(
            tasks,
            devices=["cpu"],
            device_memory=BUDGET,
            copy_on_cpu=True,
            host_memory=largest - 1,
            spill_dir=tmp_path,
        )
    errors = info.value.errors
    assert any(isinstance(err, HostBudgetError) for err in errors.values())
    for err in errors.values():
        if isinstance(err, HostBudgetError):
            assert err.budget == largest - 1 and err.nbytes > err.budget
    assert list(tmp_path.iterdir()) == []


def test_a_missing_spill_dir_trains_nothing(tmp_path: Path) -> None:
    tasks = _tasks()
    before = copy.deepcopy(tasks["a"].model.state_dict())
    with pytest.raises(SpillDirError):
        th.train_models(tasks, devices=["cpu"], host_memory="1MiB", spill_dir=tmp_path / "missing")
    after = tasks["a"].model.state_dict()
    assert all(value.equal(after[key]) for key, value in before.items())
