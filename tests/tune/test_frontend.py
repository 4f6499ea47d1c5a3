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
from tune_hydra.tune.errors import (
    EngineUnavailableError,
    NotATaskFactoryError,
    TaskFactoryError,
    TaskFactoryTimeoutError,
    TrialNotRegisteredError,
)
from tune_hydra.tune.executor import check_task_factory
from tune_hydra.tune.scheduler import HydraScheduler

ENGINE = {"devices": "cpu", "device_memory": "18KiB", "policy": "lrtf", "prefetch": True}
FACTORIES = {"f": cloudpickle.dumps(tune_tasks.make_task)}  # the store, without Ray
BLOB = "f"  # the factory's id
SECRET = "driver-secret"


def _call(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def actor() -> Any:
    a = EngineActor(ENGINE, {"seed": 5}, factories=FACTORIES, secret=SECRET)
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
    assert _call(actor.registered(SECRET))["trials"] == ["a"]
    assert len(_call(actor.train("a", "new", 1))) == 1
    assert _call(actor.deregister("a", "new")) is True
    assert _call(actor.registered(SECRET)) == {"trials": [], "engine_tasks": []}
    with pytest.raises(TrialNotRegisteredError, match="does not know"):
        _call(actor.train("a", "new", 1))


def test_factory_errors_are_clear(actor: Any) -> None:
    with pytest.raises(TaskFactoryError, match=r"(?s)Factory traceback.*factory exploded"):
        _call(actor.register("f", "t", BLOB, {"fail": "factory"}))
    with pytest.raises(TaskFactoryError, match=r"not a tune_hydra\.ModelTask"):
        _call(actor.register("g", "t", BLOB, {"fail": "type"}))
    with pytest.raises(Exception, match="Raise device_memory"):
        _call(actor.register("h", "t", BLOB, {"width": 512}))
    assert _call(actor.registered(SECRET)) == {"trials": [], "engine_tasks": []}


def test_hints_reach_the_engine(actor: Any) -> None:
    _call(actor.set_remaining("a", SECRET, 7))  # before registration: kept for later
    _call(actor.register("a", "t", BLOB, {"lr": 0.01}))
    name = actor._regs["a"].name
    assert actor._engine._tasks[name].hint == 7
    _call(actor.cancel("a", SECRET))
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
            _call(actor.deregister(f"t{i}", "tok"))


def test_recompute_reaches_the_engine() -> None:
    """HydraExecutor(recompute=...) is passed through the actor's engine options."""
    from tune_hydra.tune.executor import HydraExecutor

    assert HydraExecutor(recompute=True).recompute is True
    a = EngineActor({**ENGINE, "recompute": True}, {"seed": 5}, factories=FACTORIES)
    try:
        assert _call(a.register("a", "t1", BLOB, {"lr": 0.01})) == 2
        assert a._engine.recompute is True
        assert [r["iteration"] for r in _call(a.train("a", "t1", 1))] == [1]
    finally:
        _call(a.close())


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("precision", "fp8"),
        ("accumulate_steps", 0),
        ("seed", "x"),
        ("max_grad_norm", "1.0"),
        ("iteration_batches", 0),
        ("slots_per_node", -2),
    ],
)
def test_executor_refuses_bad_options_at_construction(option: str, value: Any) -> None:
    """Options every trial would fail on are refused by HydraExecutor() itself, with the
    engine's own rules (tune_hydra.options), naming the option, the value and the fix."""
    from tune_hydra.exceptions import InvalidOptionError
    from tune_hydra.tune.executor import HydraExecutor

    with pytest.raises(InvalidOptionError) as info:
        HydraExecutor(devices="cpu", **{option: value})
    err = info.value
    assert isinstance(err, ValueError)
    assert err.option == option and err.value == value and err.where == "HydraExecutor"
    assert str(err).startswith(f"HydraExecutor: {option}={value!r} is not valid: give ")


def test_executor_accepts_good_options() -> None:
    from tune_hydra.tune.executor import HydraExecutor

    ex = HydraExecutor(
        devices="cpu",
        precision="bf16",
        accumulate_steps=2,
        seed=7,
        max_grad_norm=1.0,
        iteration_batches=3,
    )
    assert ex.task_options == {
        "seed": 7,
        "max_grad_norm": 1.0,
        "accumulate_steps": 2,
        "precision": "bf16",
        "iteration_batches": 3,
    }
    assert HydraExecutor(devices="cpu", precision="fp32").task_options["precision"] == "fp32"


def test_driver_calls_need_the_executors_secret(actor: Any) -> None:
    _call(actor.register("a", "tok", BLOB, {"lr": 0.01}))
    for call in (
        lambda: actor.cancel("a", "stranger"),
        lambda: actor.set_remaining("a", "stranger", 3),
        lambda: actor.registered("stranger"),
        lambda: actor.abort_builds("stranger"),
        lambda: actor.release_factory("stranger", BLOB),
        lambda: actor.train("a", "stranger", 1),
    ):
        with pytest.raises(TrialNotRegisteredError):
            _call(call())
    assert _call(actor.deregister("a", "stranger")) is False
    assert _call(actor.registered(SECRET))["trials"] == ["a"]
    assert len(_call(actor.train("a", SECRET, 1))) == 1  # the driver may act for a trial
    assert _call(actor.deregister("a", SECRET)) is True


def test_a_released_factory_says_the_experiment_ended(actor: Any) -> None:
    _call(actor.register("a", "tok", BLOB, {"lr": 0.01}))
    _call(actor.release_factory(SECRET, BLOB))
    backup = dict(FACTORIES)
    FACTORIES.clear()  # the driver freed it in the cluster store too
    try:
        with pytest.raises(TaskFactoryError, match="experiment ended"):
            _call(actor.register("b", "tok", BLOB, {"lr": 0.01}))
        assert len(_call(actor.train("a", "tok", 1))) == 1  # registered trials go on
    finally:
        FACTORIES.update(backup)


def test_a_factory_wait_is_aborted_by_its_owner_or_the_driver(tmp_path: Path) -> None:
    hang = {"h": cloudpickle.dumps(tune_tasks.make_slow_task)}
    a = EngineActor(ENGINE, {"seed": 5}, factories=hang, secret=SECRET, factory_timeout_s=60)

    async def scenario(aborter: str) -> BaseException:
        started = tmp_path / f"started-{aborter}"
        reg = asyncio.ensure_future(
            a.register("k", "tok", "h", {"hang": True, "started": str(started)})
        )
        while not started.exists():
            await asyncio.sleep(0.05)
        with pytest.raises(TrialNotRegisteredError):
            await a.cancel("k", "stranger")  # not its owner
        if aborter == "driver":
            assert await a.abort_builds(SECRET) == 1
        else:
            await a.cancel("k", "tok")
        try:
            await asyncio.wait_for(reg, 10)
        except BaseException as err:
            return err
        raise AssertionError("the registration was not aborted")

    try:
        for aborter in ("owner", "driver"):
            err = _call(scenario(aborter))
            assert isinstance(err, EngineUnavailableError) and "stopped while" in str(err)
        assert _call(a.registered(SECRET))["trials"] == []
    finally:
        _call(a.close())


def test_a_hung_factory_times_out() -> None:
    hang = {"h": cloudpickle.dumps(tune_tasks.make_slow_task)}
    a = EngineActor(ENGINE, {"seed": 5}, factories=hang, secret=SECRET, factory_timeout_s=0.5)
    try:
        with pytest.raises(TaskFactoryTimeoutError, match=r"within 0\.5 s"):
            _call(a.register("k", "tok", "h", {"hang": True}))
    finally:
        _call(a.close())


def test_a_module_level_model_is_refused_live_or_reused() -> None:
    from tune_hydra.exceptions import ReusedModelError, SharedModelError

    shared = {"s": cloudpickle.dumps(tune_tasks.make_shared_task)}
    a = EngineActor(ENGINE, {"seed": 5}, factories=shared, secret=SECRET)
    try:
        _call(a.register("t1", "tok", "s", {"lr": 0.01}))
        with pytest.raises(SharedModelError, match="inside make_task") as info:
            _call(a.register("t2", "tok", "s", {"lr": 0.02}))
        assert not isinstance(info.value, ReusedModelError)  # t1 is live: the engine says
        _call(a.train("t1", "tok", 1))
        assert _call(a.deregister("t1", "tok")) is True
        with pytest.raises(ReusedModelError, match=r"trial 't1' already trained"):
            _call(a.register("t3", "tok", "s", {"lr": 0.02}))
        assert _call(a.registered(SECRET))["trials"] == []
        _call(a.register("t1", "tok2", "s", {"lr": 0.01}))  # the same trial again: allowed
    finally:
        _call(a.close())
