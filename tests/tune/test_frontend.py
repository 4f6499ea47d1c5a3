"""Fast checks of the front end's parts, without starting Ray: the engine actor's logic
(called in-process), the scheduler wrapper's budget, the task-factory check."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import cloudpickle
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, HyperBandScheduler

from tests.tune import tune_tasks
from tune_hydra.tune.actor import MODEL_FILE, EngineActor, _merge_hyperparameters
from tune_hydra.tune.errors import NotATaskFactoryError, TaskFactoryError, TrialNotRegisteredError
from tune_hydra.tune.executor import check_task_factory
from tune_hydra.tune.scheduler import HydraScheduler

ENGINE = {"devices": "cpu", "device_memory": "18KiB", "policy": "lrtf", "prefetch": True}
BLOB = cloudpickle.dumps(tune_tasks.make_task)


def _call(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def actor() -> Any:
    a = EngineActor(ENGINE, {"seed": 5})
    yield a
    _call(a.close())


def test_register_train_save_load_with_mutated_config(actor: Any, tmp_path: Path) -> None:
    assert _call(actor.register("a", "t1", BLOB, {"lr": 0.01})) == 2
    results = _call(actor.train("a", "t1", 2))
    assert [r["iteration"] for r in results] == [1, 2]
    meta = _call(actor.save("a", "t1", str(tmp_path)))
    assert meta["iteration"] == 2
    saved = torch.load(tmp_path / MODEL_FILE)
    model = tune_tasks.build_model(16, torch.float32)
    model.load_state_dict(saved)  # the user's own keys

    # PBT: another trial with a mutated lr restores this checkpoint
    _call(actor.register("b", "t2", BLOB, {"lr": 0.05}))
    _call(actor.load("b", "t2", str(tmp_path)))
    state = actor._engine.get_state(actor._regs["b"].name)
    groups = [g for opt in state["optimizers"] for g in opt["param_groups"]]
    assert groups and all(g["lr"] == 0.05 for g in groups)
    assert all(torch.equal(state["model"][k], saved[k]) for k in saved)
    assert state["iteration"] == 2
    # same config: everything, lr included, comes from the checkpoint
    _call(actor.register("c", "t3", BLOB, {"lr": 0.01}))
    _call(actor.load("c", "t3", str(tmp_path)))
    state_c = actor._engine.get_state(actor._regs["c"].name)
    assert all(g["lr"] == 0.01 for opt in state_c["optimizers"] for g in opt["param_groups"])


def test_ownership_token(actor: Any) -> None:
    _call(actor.register("a", "old", BLOB, {"lr": 0.01}))
    _call(actor.register("a", "new", BLOB, {"lr": 0.01}))  # a newer copy takes over
    with pytest.raises(TrialNotRegisteredError, match="newer copy"):
        _call(actor.train("a", "old", 1))
    assert _call(actor.deregister("a", "old")) is False  # the stale copy cannot free it
    assert _call(actor.registered())["trials"] == ["a"]
    assert len(_call(actor.train("a", "new", 1))) == 1
    assert _call(actor.deregister("a", "new")) is True
    assert _call(actor.registered()) == {"trials": [], "engine_tasks": []}
    with pytest.raises(TrialNotRegisteredError, match="does not know"):
        _call(actor.train("a", "new", 1))


def test_factory_errors_are_clear(actor: Any) -> None:
    with pytest.raises(TaskFactoryError, match=r"(?s)Factory traceback.*factory exploded"):
        _call(actor.register("f", "t", BLOB, {"fail": "factory"}))
    with pytest.raises(TaskFactoryError, match=r"not a tune_hydra\.ModelTask"):
        _call(actor.register("g", "t", BLOB, {"fail": "type"}))
    with pytest.raises(Exception, match="Raise device_memory"):
        _call(actor.register("h", "t", BLOB, {"width": 512}))
    assert _call(actor.registered()) == {"trials": [], "engine_tasks": []}


def test_hints_reach_the_engine(actor: Any) -> None:
    _call(actor.set_remaining("a", 7))  # before registration: kept for later
    _call(actor.register("a", "t", BLOB, {"lr": 0.01}))
    name = actor._regs["a"].name
    assert actor._engine._tasks[name].hint == 7
    _call(actor.cancel("a"))
    with pytest.raises(Exception, match="cancelled"):
        _call(actor.train("a", "t", 1))


def test_merge_hyperparameters_keeps_state() -> None:
    loaded = [{"state": {0: "m"}, "param_groups": [{"lr": 1.0, "params": [0]}]}]
    fresh = [{"state": {}, "param_groups": [{"lr": 2.0, "params": [9]}]}]
    assert _merge_hyperparameters(loaded, fresh) == [
        {"state": {0: "m"}, "param_groups": [{"lr": 2.0, "params": [0]}]}
    ]
    assert _merge_hyperparameters(loaded, []) is loaded


def test_scheduler_budget() -> None:
    assert HydraScheduler(None, stop={"training_iteration": 6}).budget == 6
    assert HydraScheduler(ASHAScheduler(max_t=4), stop={"training_iteration": 9}).budget == 4
    assert HydraScheduler(HyperBandScheduler(max_t=5)).budget == 5
    assert HydraScheduler(ASHAScheduler(time_attr="time_total_s", max_t=4)).budget is None
    assert HydraScheduler(FIFOScheduler(), stop=lambda trial, result: False).budget is None
    assert HydraScheduler(None, stop={"training_iteration": 6}, max_iterations=3).budget == 3
    wrapped = HydraScheduler(ASHAScheduler(metric="loss", mode="min"))
    assert wrapped.metric == "loss" and wrapped.base._max_t == 100
    restored = cloudpickle.loads(cloudpickle.dumps(wrapped))
    assert restored.budget == 100 and restored.metric == "loss"


def test_check_task_factory() -> None:
    check_task_factory(tune_tasks.make_task)
    check_task_factory(lambda config: None)
    for bad in ("PPO", EngineActor, 3, lambda: None, lambda a, b: None):
        with pytest.raises(NotATaskFactoryError):
            check_task_factory(bad)


def test_concurrent_registrations_build_identical_models(actor: Any) -> None:
    # The factory seeds torch's global generator; builds running at once in the actor's
    # thread pool must not interleave their draws (it broke exact resume parity once).
    async def register_all() -> None:
        await asyncio.gather(
            *[actor.register(f"t{i}", "tok", BLOB, {"lr": 0.01, "width": 24}) for i in range(8)]
        )

    for _ in range(3):
        _call(register_all())
        states = [actor._engine.get_state(actor._regs[f"t{i}"].name)["model"] for i in range(8)]
        for state in states[1:]:
            assert all(torch.equal(state[k], states[0][k]) for k in state)
        for i in range(8):
            _call(actor.deregister(f"t{i}"))


def test_recompute_reaches_the_engine() -> None:
    """HydraExecutor(recompute=...) is passed through the actor's engine options."""
    from tune_hydra.tune.executor import HydraExecutor

    assert HydraExecutor(recompute=True).recompute is True
    a = EngineActor({**ENGINE, "recompute": True}, {"seed": 5})
    try:
        assert _call(a.register("a", "t1", BLOB, {"lr": 0.01})) == 2
        assert a._engine.recompute is True
        assert [r["iteration"] for r in _call(a.train("a", "t1", 1))] == [1]
    finally:
        _call(a.close())
