"""Fast checks of the front end's parts, without starting Ray: the engine actor's logic
(called in-process), the scheduler wrapper's budget, the task-factory check."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray import cloudpickle
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, HyperBandScheduler

from tests.frontends.ray import tune_tasks
from tune_hydra.exceptions import TuneHydraError
from tune_hydra.frontends.checkpoint import MODEL_FILE, merge_hyperparameters
from tune_hydra.frontends.ray.actor import EngineActor
from tune_hydra.frontends.ray.errors import (
    EngineUnavailableError,
    NotATaskFactoryError,
    NotOwnerError,
    TaskFactoryError,
    TaskFactoryTimeoutError,
    TrialNotRegisteredError,
)
from tune_hydra.frontends.ray.executor import check_task_factory
from tune_hydra.frontends.ray.scheduler import HydraScheduler
from tune_hydra.options import EngineOptions

ENGINE = EngineOptions(devices="cpu", device_memory="18KiB", policy="lrtf", prefetch=True)
FACTORIES = {"f": cloudpickle.dumps(tune_tasks.make_task)}  # the store, without Ray
BLOB = "f"  # the factory's id
SECRET = "driver-secret"


def _call(coro: Any) -> Any:
    return asyncio.run(coro)


def _start(
    a: Any,
    key: str,
    token: str,
    config: dict[str, Any],
    params: dict[str, Any] | None = None,
    *,
    factory: str = BLOB,
    secret: str = SECRET,
    task: dict[str, Any] | None = None,
) -> None:
    """A factory trial's start, as its proxy makes it (its canned class's setup runs)."""
    context = {"task": task} if task is not None else {}
    _call(a.cls_start(key, token, factory, config, params, secret, context))


def _steps(a: Any, token: str, n: int = 1) -> list[dict[str, Any]]:
    return [_call(a.cls_call(token, "step", (), {})) for _ in range(n)]


def _loop(a: Any, token: str) -> Any:
    """The TaskLoop of the proxy ``token``'s trial."""
    return a._classes._run(token).instance.loop


@pytest.fixture
def actor() -> Any:
    a = EngineActor(ENGINE, {"seed": 5}, factories=FACTORIES, secret=SECRET)
    yield a
    _call(a.close(SECRET))


def test_start_step_save_load_with_mutated_config(actor: Any, tmp_path: Path) -> None:
    _start(actor, "a", "t1", {"lr": 0.01})
    results = _steps(actor, "t1", 2)
    assert [r["epoch"] for r in results] == [1, 2] and results[0]["num_shards"] == 2
    _call(actor.cls_call("t1", "save_checkpoint", (str(tmp_path),), {}))
    saved = torch.load(tmp_path / MODEL_FILE)
    model = tune_tasks.build_model(16, torch.float32)
    model.load_state_dict(saved)  # the user's own keys

    # PBT: another trial with a mutated lr restores this checkpoint
    _start(actor, "b", "t2", {"lr": 0.05})
    _call(actor.cls_call("t2", "load_checkpoint", (str(tmp_path),), {}))
    state = _loop(actor, "t2").state()
    groups = state["optimizer"]["param_groups"]
    assert groups and all(g["lr"] == 0.05 for g in groups)
    assert all(torch.equal(state["model"][k], saved[k]) for k in saved)
    assert state["iteration"] == 2
    # same config: everything, lr included, comes from the checkpoint
    _start(actor, "c", "t3", {"lr": 0.01})
    _call(actor.cls_call("t3", "load_checkpoint", (str(tmp_path),), {}))
    state_c = _loop(actor, "t3").state()
    assert all(g["lr"] == 0.01 for g in state_c["optimizer"]["param_groups"])


def test_ownership_token(actor: Any) -> None:
    _start(actor, "a", "old", {"lr": 0.01})
    _start(actor, "a", "new", {"lr": 0.01})  # a newer copy takes over
    # each copy's loop is registered at its setup, the newer under a free name
    assert sorted(actor._engine.tasks()) == ["a", "a~1"]
    assert _call(actor.deregister("a", "old")) is False  # the stale copy cannot free it
    assert _call(actor.registered(SECRET))["trials"] == ["a"]
    assert len(_steps(actor, "new")) == 1
    assert _call(actor.deregister("a", "new")) is True
    _call(actor.cls_end("old"))
    assert _call(actor.registered(SECRET))["trials"] == []
    with pytest.raises(TrialNotRegisteredError, match=r"no longer runs|does not run"):
        _steps(actor, "new")


def test_factory_errors_are_clear(actor: Any) -> None:
    with pytest.raises(TaskFactoryError, match=r"(?s)Factory traceback.*factory exploded"):
        _start(actor, "f", "t1", {"fail": "factory"})
    with pytest.raises(TaskFactoryError, match=r"not a tune_hydra\.ModelTask"):
        _start(actor, "g", "t2", {"fail": "type"})
    with pytest.raises(Exception, match="Raise device_memory"):
        _start(actor, "h", "t3", {"width": 512})  # cut at setup, as a task was registered
    assert _call(actor.registered(SECRET)) == {"trials": [], "engine_tasks": []}


def test_hints_reach_the_engine(actor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tune_hydra.engine import Engine

    given: list[tuple[str, int]] = []
    forward = Engine.set_remaining

    def recording(self: Engine, name: str, iterations: int) -> None:
        given.append((name, iterations))
        forward(self, name, iterations)

    monkeypatch.setattr(Engine, "set_remaining", recording)
    _call(actor.set_remaining("a", SECRET, 7))  # before the trial started: kept for later
    assert given == []
    _start(actor, "a", "t", {"lr": 0.01})
    _steps(actor, "t")
    per = _loop(actor, "t").ops_per_iteration()
    assert given[0] == ("a", math.ceil(8 * per))  # (7 + 1) iterations of ops
    _call(actor.cancel("a", SECRET))  # nothing being built: nothing to stop


def test_milestones_reach_the_engine(actor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tune_hydra.engine import Engine

    given: list[tuple[str, int | None]] = []
    forward = Engine.set_milestone

    def recording(self: Engine, name: str, iterations: int | None) -> None:
        given.append((name, iterations))
        forward(self, name, iterations)

    monkeypatch.setattr(Engine, "set_milestone", recording)
    _call(actor.set_milestone("a", SECRET, 2))  # before the trial started: kept for later
    _start(actor, "a", "t", {"lr": 0.01})
    _steps(actor, "t")
    per = _loop(actor, "t").ops_per_iteration()
    assert given[0] == ("a", math.ceil(2.5 * per))  # its first ops: 2 iterations ahead
    _call(actor.set_milestone("a", SECRET, None))  # past its last milestone
    _call(actor.set_milestone("b", SECRET, 1))  # not started: kept, not sent
    assert given[-1] == ("a", None) and all(name == "a" for name, _ in given)
    summary = _call(actor.summary(SECRET))
    # the one given to its run (the first waited in the hints, before the run)
    assert summary["policy"] == "lrtf" and summary["milestones_given"] == 1
    with pytest.raises(NotOwnerError):
        _call(actor.set_milestone("a", "stranger", 1))


def test_merge_hyperparameters_keeps_state() -> None:
    # per parameter: the checkpoint's state, the fresh groups (cut another way: 2 shards
    # then, 1 now)
    loaded = {
        "state": {"0.weight": "m0", "2.weight": "m2"},
        "param_groups": [{"lr": 1.0, "params": ["0.weight"]}, {"lr": 1.0, "params": ["2.weight"]}],
    }
    fresh = {"state": {}, "param_groups": [{"lr": 2.0, "params": ["0.weight", "2.weight"]}]}
    assert merge_hyperparameters(loaded, fresh) == {
        "state": {"0.weight": "m0", "2.weight": "m2"},
        "param_groups": [{"lr": 2.0, "params": ["0.weight", "2.weight"]}],
    }
    other_model = {"state": {}, "param_groups": [{"lr": 2.0, "params": ["0.weight"]}]}
    assert merge_hyperparameters(loaded, other_model) is loaded
    assert merge_hyperparameters(loaded, None) is loaded
    # the older per-shard layout: group by group, in order
    legacy = [
        {"state": {0: "m"}, "param_groups": [{"lr": 1.0, "params": [0]}]},
        None,  # a shard without parameters
        {"state": {}, "param_groups": [{"lr": 1.0, "params": [0]}]},
    ]
    two = {"param_groups": [{"lr": 2.0, "params": ["a"]}, {"lr": 3.0, "params": ["b"]}]}
    assert merge_hyperparameters(legacy, two) == [
        {"state": {0: "m"}, "param_groups": [{"lr": 2.0, "params": [0]}]},
        None,
        {"state": {}, "param_groups": [{"lr": 3.0, "params": [0]}]},
    ]
    assert merge_hyperparameters(legacy, fresh) is legacy  # 2 groups then, 1 now


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
    async def start_all() -> None:
        config = {"lr": 0.01, "width": 24}
        await asyncio.gather(
            *[actor.cls_start(f"t{i}", f"tok{i}", BLOB, config, None, SECRET, {}) for i in range(8)]
        )

    for _ in range(3):
        _call(start_all())
        states = [_loop(actor, f"tok{i}").state()["model"] for i in range(8)]
        for state in states[1:]:
            assert all(torch.equal(state[k], states[0][k]) for k in state)
        for i in range(8):
            _call(actor.cls_end(f"tok{i}"))


def test_recompute_reaches_the_engine() -> None:
    """HydraExecutor(recompute=...) is passed through the actor's engine options."""
    from tune_hydra.frontends.ray.executor import HydraExecutor

    assert HydraExecutor(recompute=True).recompute is True
    a = EngineActor(
        dataclasses.replace(ENGINE, recompute=True), {"seed": 5}, factories=FACTORIES, secret=SECRET
    )
    try:
        _start(a, "a", "t1", {"lr": 0.01})
        assert a._engine.recompute is True
        assert [r["num_shards"] for r in _steps(a, "t1")] == [2]
    finally:
        _call(a.close(SECRET))


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
    from tune_hydra.frontends.ray.executor import HydraExecutor

    with pytest.raises(InvalidOptionError) as info:
        HydraExecutor(devices="cpu", **{option: value})
    err = info.value
    assert isinstance(err, ValueError)
    assert err.option == option and err.value == value and err.where == "HydraExecutor"
    assert str(err).startswith(f"HydraExecutor: {option}={value!r} is not valid: give ")


def test_executor_accepts_good_options() -> None:
    from tune_hydra.frontends.ray.executor import HydraExecutor

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


def test_executor_checks_the_disk_tier_options_at_construction(tmp_path: Path) -> None:
    """host_memory without spill_dir, a budget that does not parse, or a spill_dir that is
    not a path are refused by HydraExecutor() itself, not by every engine later."""
    from tune_hydra.exceptions import BudgetFormatError, InvalidOptionError, SpillDirError
    from tune_hydra.frontends.ray.executor import HydraExecutor

    started = ray.is_initialized()  # another test's session may be up already
    with pytest.raises(SpillDirError, match=r"^HydraExecutor: host_memory='1GiB' needs spill_dir="):
        HydraExecutor(devices="cpu", host_memory="1GiB")
    with pytest.raises(BudgetFormatError, match="cannot parse the host_memory budget 'lots'"):
        HydraExecutor(devices="cpu", host_memory="lots", spill_dir=tmp_path)
    with pytest.raises(BudgetFormatError, match=r"^host_memory must be positive"):
        HydraExecutor(devices="cpu", host_memory=0, spill_dir=tmp_path)
    with pytest.raises(InvalidOptionError) as info:
        HydraExecutor(devices="cpu", host_memory="1GiB", spill_dir=7)  # type: ignore[arg-type]
    assert info.value.option == "spill_dir" and info.value.where == "HydraExecutor"
    assert ray.is_initialized() == started  # refused before anything started


def test_disk_tier_options_reach_each_engine_actor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The EngineOptions the executor holds, and hands every engine actor it creates,
    carry host_memory and spill_dir (Ray's actor creation is recorded, not run)."""
    from tune_hydra.frontends.ray.executor import HydraExecutor

    ex = HydraExecutor(
        devices="auto", device_memory="18KiB", host_memory="1GiB", spill_dir=tmp_path
    )
    assert (ex.host_memory, ex.spill_dir) == ("1GiB", tmp_path)
    assert ex.engine_options.host_memory == "1GiB" and ex.engine_options.spill_dir == tmp_path
    assert "host_memory='1GiB'" in repr(ex)

    created: list[tuple[Any, ...]] = []

    class _Remote:  # stands for ray.remote(...)(EngineActor).options(...)
        def __call__(self, cls: Any) -> _Remote:
            return self

        def options(self, **options: Any) -> _Remote:
            return self

        def remote(self, *args: Any) -> str:
            created.append(args)
            return "handle"

    monkeypatch.setattr(ray, "remote", lambda **kw: _Remote())
    monkeypatch.setattr(ray, "nodes", lambda: [{}])
    with pytest.warns(UserWarning, match="no GPU"):
        assert ex._engines.create_actor("ab" * 28, {"CPU": 2.0}, 0) == "handle"
    options = created[0][0]
    assert isinstance(options, EngineOptions)
    kwargs = options.kwargs()
    assert kwargs["devices"] == "cpu"  # "auto" resolved for the node; the rest as given
    assert (kwargs["device_memory"], kwargs["host_memory"]) == ("18KiB", "1GiB")
    assert kwargs["spill_dir"] == tmp_path


def test_driver_calls_need_the_executors_secret(actor: Any) -> None:
    _start(actor, "a", "tok", {"lr": 0.01})
    for call in (
        lambda: actor.set_remaining("a", "stranger", 3),
        lambda: actor.registered("stranger"),
        lambda: actor.abort_builds("stranger"),
        lambda: actor.release_factory("stranger", BLOB),
        # issue 23, item 6: the timeline, the figures, closing, re-starting
        lambda: actor.trace(),
        lambda: actor.trace("stranger"),
        lambda: actor.summary("stranger"),
        lambda: actor.close("stranger"),
        lambda: actor.cls_start("a", "evil", BLOB, {"lr": 0.01}, None, "", {}),
        lambda: actor.cls_start("a", "evil", BLOB, {"lr": 0.01}, None, "stranger", {}),
    ):
        with pytest.raises(NotOwnerError, match="key of the experiment"):
            _call(call())
    with pytest.raises(TrialNotRegisteredError):
        _steps(actor, "stranger")  # a proxy reaches its own run only
    assert _call(actor.registered(SECRET))["trials"] == ["a"]
    assert _call(actor.deregister("a", "stranger")) is False
    assert _call(actor.registered(SECRET))["trials"] == ["a"]
    assert len(_steps(actor, "tok")) == 1  # the owner's run is untouched
    assert _call(actor.deregister("a", SECRET)) is True  # the driver may stop any trial


def test_a_released_factory_says_the_experiment_ended(actor: Any) -> None:
    _start(actor, "a", "tok", {"lr": 0.01})
    _call(actor.release_factory(SECRET, BLOB))
    backup = dict(FACTORIES)
    FACTORIES.clear()  # the driver freed it in the cluster store too
    try:
        with pytest.raises(TaskFactoryError, match="experiment ended"):
            _start(actor, "b", "tok2", {"lr": 0.01})
        assert len(_steps(actor, "tok")) == 1  # started trials go on
    finally:
        FACTORIES.update(backup)


def test_a_factory_wait_is_aborted_by_its_owner_or_the_driver(tmp_path: Path) -> None:
    hang = {"h": cloudpickle.dumps(tune_tasks.make_slow_task)}
    a = EngineActor(ENGINE, {"seed": 5}, factories=hang, secret=SECRET, factory_timeout_s=60)

    async def scenario(aborter: str) -> BaseException:
        started = tmp_path / f"started-{aborter}"
        config = {"hang": True, "started": str(started)}
        reg = asyncio.ensure_future(a.cls_start("k", "tok", "h", config, None, SECRET, {}))
        while not started.exists():
            await asyncio.sleep(0.05)
        with pytest.raises(TrialNotRegisteredError):
            await a.cancel("k", "stranger")  # not its experiment's driver
        if aborter == "driver":
            assert await a.abort_builds(SECRET) == 1
        elif aborter == "scheduler":
            await a.cancel("k", SECRET)  # Tune stopped or paused it
        else:
            await a.cls_end("tok")  # its proxy's cleanup
        try:
            await asyncio.wait_for(reg, 10)
        except BaseException as err:
            return err
        raise AssertionError("the registration was not aborted")

    try:
        for aborter in ("owner", "driver", "scheduler"):
            err = _call(scenario(aborter))
            assert isinstance(err, EngineUnavailableError) and "stopped while" in str(err)
        assert _call(a.registered(SECRET))["trials"] == []
    finally:
        _call(a.close(SECRET))


def test_a_hung_factory_times_out() -> None:
    hang = {"h": cloudpickle.dumps(tune_tasks.make_slow_task)}
    a = EngineActor(ENGINE, {"seed": 5}, factories=hang, secret=SECRET, factory_timeout_s=0.5)
    try:
        with pytest.raises(TaskFactoryTimeoutError, match=r"within 0\.5 s"):
            _start(a, "k", "tok", {"hang": True}, factory="h")
    finally:
        _call(a.close(SECRET))


def test_a_module_level_model_is_refused_live_or_reused() -> None:
    from tune_hydra.exceptions import ReusedModelError, SharedModelError

    shared = {"s": cloudpickle.dumps(tune_tasks.make_shared_task)}
    a = EngineActor(ENGINE, {"seed": 5}, factories=shared, secret=SECRET)
    try:
        _start(a, "t1", "tok", {"lr": 0.01}, factory="s")
        with pytest.raises(SharedModelError, match="inside make_task") as info:
            _start(a, "t2", "tok2", {"lr": 0.02}, factory="s")
        assert not isinstance(info.value, ReusedModelError)  # t1 is live: the engine says
        _steps(a, "tok")
        assert _call(a.deregister("t1", "tok")) is True  # its run ends
        with pytest.raises(ReusedModelError, match=r"trial 't1' already trained"):
            _start(a, "t3", "tok3", {"lr": 0.02}, factory="s")
        assert _call(a.registered(SECRET))["trials"] == []
        _start(a, "t1", "tok4", {"lr": 0.01}, factory="s")  # the same trial again: allowed
    finally:
        _call(a.close(SECRET))


# -- issue 13: fail once, Tune's wrappers, checkpoints by default (no Ray started) ---------


def test_a_function_trainable_is_recognised_before_any_trial() -> None:
    """A function trainable (it calls tune.report) is no longer refused (#20): it is told
    apart from a task factory by its code, before any engine starts."""
    from tune_hydra.frontends.ray.reports import tune_report_call

    assert tune_report_call(tune_tasks.train_fn) == "ray.tune.report"
    assert tune_report_call(tune_tasks.make_task) is None
    assert check_task_factory(tune_tasks.train_fn) is True
    assert check_task_factory(tune_tasks.make_task) is False


class _ReportingCallback:
    """A Trainer callback's shape: the report is in a method, the function only names
    the class."""

    def on_log(self, logs: dict[str, float]) -> None:
        from ray import tune

        tune.report(dict(logs))


def _train_with_reporting_callback(config: dict[str, Any]) -> None:
    _ReportingCallback().on_log({"loss": 1.0})


def _hf_style_trainable() -> Any:
    """What transformers' ``run_hp_search_ray`` hands ``ray.tune.run``: an ``_objective``
    using the enclosing function's ``import ray.tune``, bound by ``tune.with_parameters``
    and wrapped by ``functools.wraps``."""
    import functools

    import ray.tune

    def _objective(trial: dict[str, Any], local_trainer: Any) -> None:
        ray.tune.report({"objective": 1.0})

    trainable = ray.tune.with_parameters(_objective, local_trainer=1)

    @functools.wraps(trainable)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return trainable(*args, **kwargs)

    return wrapper


def test_reports_in_a_callback_class_or_behind_wrappers_are_recognised() -> None:
    """#32: a function whose tune.report is in a method of a class of its module (a
    Hugging Face TrainerCallback's on_log), and Hugging Face's Ray-backend trainable, are
    function trainables, not task factories."""
    from tune_hydra.frontends.ray.reports import tune_report_call

    assert tune_report_call(_train_with_reporting_callback) == "ray.tune.report"
    hf_style = _hf_style_trainable()
    assert tune_report_call(hf_style) == "ray.tune.report"
    assert check_task_factory(_train_with_reporting_callback) is True
    assert check_task_factory(hf_style) is True


def test_a_metric_nobody_reports_is_refused_before_any_trial() -> None:
    import tune_hydra as th
    from tune_hydra.frontends.ray.errors import UnreportedMetricError
    from tune_hydra.frontends.ray.executor import HydraExecutor
    from tune_hydra.frontends.ray.run import _check_reported

    ex = HydraExecutor(devices="cpu")
    with pytest.raises(UnreportedMetricError) as info:
        th.run(tune_tasks.make_task, metric="iteration", mode="max", trial_executor=ex)
    text = str(info.value)
    assert text.startswith("metric='iteration' is not reported")
    for key in ("loss", "val_loss", "device_time_s", "training_iteration", "time_total_s"):
        assert key in text, key
    assert "ModelTask(metrics=" in text
    with pytest.raises(UnreportedMetricError, match="scheduler='iteration'"):
        th.run(
            tune_tasks.make_task,
            scheduler=ASHAScheduler(metric="iteration", mode="max"),
            trial_executor=ex,
        )
    # a name of the task's own (known once a factory ran) is checked by each trial instead
    assert _check_reported({"metric": "mean_accuracy", "mode": "max"}) == ("mean_accuracy",)
    assert isinstance(info.value, ValueError)
    assert not ex.started
    for ok in ("val_loss", "loss", "training_iteration", "time_total_s", "config/lr"):
        _check_reported({"metric": ok, "mode": "min"})


def test_with_resources_on_the_factory_is_no_mistake() -> None:
    """The request is dropped by executor.trainable (one warning), not refused here."""
    from ray import tune

    def make(config: dict[str, Any]) -> Any:
        return tune_tasks.make_task(config)

    assert check_task_factory(tune.with_resources(make, {"cpu": 2})) is False


def test_with_parameters_around_the_factory_is_unwrapped() -> None:
    from ray import tune

    from tune_hydra.frontends.ray.actor import BoundFactory
    from tune_hydra.frontends.ray.executor import unwrap_with_parameters

    data = tune_tasks.dataset()
    wrapped = tune.with_parameters(tune_tasks.make_task_with, data=data)
    check_task_factory(wrapped)
    fn, params = unwrap_with_parameters(wrapped)  # type: ignore[misc]
    assert fn is tune_tasks.make_task_with and list(params) == ["data"]
    value = params["data"]  # what Tune holds: the value, or its reference once Ray is up
    if isinstance(value, ray.ObjectRef):
        value = ray.get(value)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(value, data, strict=True))
    assert unwrap_with_parameters(tune_tasks.make_task) is None
    with pytest.raises(NotATaskFactoryError, match=r"keyword arguments \['dataset'\]"):
        check_task_factory(tune.with_parameters(tune_tasks.make_task, dataset=data))

    def train_with(config: dict[str, Any], data: Any) -> None:
        ray.tune.report({"n": len(data)})

    assert check_task_factory(tune.with_parameters(train_with, data=data)) is True

    bound = BoundFactory(tune_tasks.make_task_with, {"data": data})
    assert bound.__name__ == "make_task_with"
    assert bound({"lr": 0.01}).train_data is data
    copy = cloudpickle.loads(cloudpickle.dumps(bound))
    assert copy.parameters["data"][0][0].shape == data[0][0].shape and copy._values is None


@pytest.mark.filterwarnings("ignore:`report` is meant")  # hidden_train_fn reports, no session
def test_systematic_mistakes_are_marked_and_config_ones_are_not() -> None:
    from tune_hydra.exceptions import (
        InvalidModelError,
        NotATaskError,
        ShardTooLargeError,
        SystematicTaskError,
        UncuttableModelError,
    )

    factories = {
        name: cloudpickle.dumps(getattr(tune_tasks, name))
        for name in ("make_no_task", "hidden_train_fn", "make_net_task", "make_task")
    }
    a = EngineActor(ENGINE, {"seed": 5}, factories=factories, secret=SECRET)
    try:
        with pytest.raises(NotATaskError) as info:
            _start(a, "t1", "tok1", {"lr": 0.01}, factory="make_no_task")
        err = info.value
        assert isinstance(err, TaskFactoryError) and isinstance(err, TypeError)
        assert err.trial == "t1" and "returned NoneType, not a tune_hydra.ModelTask" in str(err)
        assert "function trainable passed by mistake" in str(err)
        assert "experiment stops at the first one" in str(err)
        with pytest.raises(NotATaskError, match="function trainable"):
            _start(a, "t2", "tok2", {"lr": 0.01}, factory="hidden_train_fn")
        with pytest.raises(UncuttableModelError, match=r"nn\.Sequential") as cut:
            _start(a, "t3", "tok3", {"lr": 0.01}, factory="make_net_task")
        # a search space may choose the architecture: that trial alone
        assert isinstance(cut.value, InvalidModelError)
        assert not isinstance(cut.value, SystematicTaskError)
        assert "trial t3:" in str(cut.value) and "the other trials go on" in str(cut.value)
        # config-dependent: that trial alone
        for i, config in enumerate(({"fail": "factory"}, {"width": 512})):
            with pytest.raises(Exception) as other:
                _start(a, "t4", f"tok4{i}", config, factory="make_task")
            assert not isinstance(other.value, SystematicTaskError)
        assert isinstance(other.value, ShardTooLargeError)
        # with the budget to give (issue 32), as it reaches the trial
        assert other.value.min_device_memory is not None
        assert "give device_memory >=" in str(other.value)
        # what tune.with_parameters around the trainable sends: keyword arguments
        data = tune_tasks.dataset(n_batches=2)
        factories["with"] = cloudpickle.dumps(tune_tasks.make_task_with)  # the store
        _start(a, "t5", "tok5", {"lr": 0.01}, {"data": data}, factory="with")
        assert [r["num_shards"] for r in _steps(a, "tok5")] == [2]
        assert "t5" in _call(a.registered(SECRET))["trials"]
    finally:
        _call(a.close(SECRET))


def test_stopper_keeps_tune_semantics_and_stops_all_on_a_systematic_mistake() -> None:
    from ray.tune.stopper import MaximumIterationStopper

    from tune_hydra.exceptions import NotATaskError
    from tune_hydra.frontends.ray.callback import (
        HydraStopper,
        clear_systematic,
        find_systematic,
        systematic_error,
    )
    from tune_hydra.frontends.ray.scheduler import _budget_from_stop

    stopper = HydraStopper("run-a", {"training_iteration": 3, "info/loss": 5})
    assert not stopper("t", {"training_iteration": 2, "info": {"loss": 1}})
    assert stopper("t", {"training_iteration": 3})
    assert stopper("t", {"training_iteration": 1, "info": {"loss": 7}})
    assert _budget_from_stop(stopper) == 3  # the scheduler wrapper still sees the budget
    assert HydraStopper("r", lambda trial_id, result: result["x"] > 1)("t", {"x": 2})
    counting = HydraStopper("r", MaximumIterationStopper(2))  # counts its own calls
    assert [counting("t", {}), counting("t", {})] == [False, True]
    assert not HydraStopper("r")("t", {"training_iteration": 99})
    with pytest.raises(ValueError, match="Stopper"):
        HydraStopper("r", 3)

    mistake = NotATaskError("t1", "the task factory returned NoneType", "return a ModelTask")

    class Wrapped(Exception):  # what Ray makes of an error raised in a trial
        def __init__(self, cause: BaseException) -> None:
            super().__init__("ray::train()")
            self.cause = cause

    assert find_systematic(Wrapped(Wrapped(mistake))) is mistake
    assert find_systematic(Wrapped(ValueError("config-dependent"))) is None
    assert find_systematic(None) is None

    from tune_hydra.frontends.ray import callback as cb

    assert not stopper.stop_all()
    cb._SYSTEMATIC["run-a"] = mistake  # what HydraCallback records on the trial's error
    try:
        assert stopper.stop_all() and systematic_error("run-a") is mistake
        assert not HydraStopper("run-b").stop_all()  # another executor's experiment
    finally:
        clear_systematic("run-a")
    assert not stopper.stop_all()


def test_callback_checkpoint_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from ray.tune.result import DONE, SHOULD_CHECKPOINT

    from tune_hydra.exceptions import NotATaskError
    from tune_hydra.frontends.ray.callback import HydraCallback, clear_systematic, systematic_error
    from tune_hydra.frontends.ray.executor import HydraExecutor

    plain = SimpleNamespace(checkpoint_freq=0, checkpoint_at_end=None)
    theirs = SimpleNamespace(checkpoint_freq=2, checkpoint_at_end=None)

    def after(cb: HydraCallback, trial: Any, **result: Any) -> bool:
        cb.on_trial_result(0, [], trial, result)
        return bool(result.get(SHOULD_CHECKPOINT))

    every, end = HydraCallback("r", "every", secret="s"), HydraCallback("r", "end", secret="s")
    assert after(every, plain, **{SHOULD_CHECKPOINT: True})  # the proxy asked: kept
    # tune.Tuner sets checkpoint_at_end=True for every class trainable: it adds the last
    # checkpoint and must not drop the per-iteration ones (issue 23, item 3)
    tuner = SimpleNamespace(checkpoint_freq=0, checkpoint_at_end=True)
    assert after(every, tuner, **{SHOULD_CHECKPOINT: True})
    assert after(end, tuner, **{DONE: True})
    assert not after(every, theirs, **{SHOULD_CHECKPOINT: True})  # the run's setting rules
    assert not after(end, plain) and after(end, plain, **{DONE: True})
    assert not after(end, theirs, **{DONE: True})
    assert not after(HydraCallback("r", None), plain, **{DONE: True})
    copy = cloudpickle.loads(cloudpickle.dumps(end))
    assert (copy.run_id, copy.checkpoint) == ("r", "end")
    assert b"secret" not in cloudpickle.dumps(end)  # Tune writes callbacks to disk

    # a trial's recorded mistake (JSON in the cluster store; here a dict) -> recorded once
    # for the executor, rebuilt as its own class
    from ray.experimental import internal_kv

    from tune_hydra.frontends.ray.factories import FactoryStore

    kv: dict[bytes, bytes] = {}
    monkeypatch.setattr(internal_kv, "_internal_kv_put", lambda k, v, **_: kv.__setitem__(k, v))
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda k, **_: kv.get(k))
    mistake = NotATaskError("t1", "the task factory returned NoneType", "return a ModelTask")
    # issue 23, item 6: a record another driver planted (no tag, or one made with
    # another key) is ignored; the experiment goes on
    FactoryStore("r", "other-key").record_error("t1", mistake)
    failed = SimpleNamespace(trial_id="t1")
    every.on_trial_error(0, [], failed)
    assert systematic_error("r") is None
    kv[next(iter(kv))] = json.dumps(
        {"type": "NotATaskError", "trial": "t1", "problem": "planted", "fix": "none"}
    ).encode()
    every.on_trial_error(0, [], failed)
    assert systematic_error("r") is None
    FactoryStore("r", "s").record_error("t1", mistake)
    assert b"NoneType" in next(iter(kv.values()))  # plain JSON, nothing to unpickle
    try:
        every.on_trial_error(0, [], failed)
        found = systematic_error("r")
        assert type(found) is NotATaskError and str(found) == str(mistake)
    finally:
        clear_systematic("r")

    assert HydraExecutor(devices="cpu").checkpoint == "every"
    assert HydraExecutor(devices="cpu", checkpoint=False).checkpoint is None
    with pytest.raises(TuneHydraError, match="'every'"):
        HydraExecutor(devices="cpu", checkpoint="sometimes")


# ---------------------------------------------------------------- issue 23: items 2 and 8
class _Payload:
    """Pickles as a call that creates ``marker`` (what an attacker plants)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def _bare_proxy() -> Any:
    """A HydraTrainable that Tune did not build (no Ray, no engine): enough for the
    methods that must refuse before they reach anything."""
    from tune_hydra.frontends.ray.trainable import HydraTrainable

    proxy = HydraTrainable.__new__(HydraTrainable)
    proxy._token, proxy._key, proxy._actor = "tok", None, None
    return proxy


@pytest.mark.parametrize("form", ["path", "checkpoint", "result"])
def test_restore_refuses_a_planted_dict_checkpoint_before_ray_unpickles_it(
    actor: Any, tmp_path: Path, form: str
) -> None:
    import pickle

    from ray.tune import Checkpoint
    from ray.tune.trainable.trainable import _DICT_CHECKPOINT_FILE_NAME

    from tune_hydra.exceptions import CheckpointError, ForeignCheckpointFileError

    _start(actor, "a", "t", {"lr": 0.01})
    _steps(actor, "t")
    ckpt = tmp_path / "checkpoint_000000"
    _call(actor.cls_call("t", "save_checkpoint", (str(ckpt),), {}))
    marker = tmp_path / "payload-ran"
    (ckpt / _DICT_CHECKPOINT_FILE_NAME).write_bytes(pickle.dumps(_Payload(marker)))
    given: Any = str(ckpt)
    if form != "path":
        given = Checkpoint.from_directory(str(ckpt))
    if form == "result":
        from ray.train._internal.session import _TrainingResult

        given = _TrainingResult(checkpoint=given, metrics={"training_iteration": 1})
    proxy = _bare_proxy()
    with pytest.raises(ForeignCheckpointFileError) as info:
        proxy.restore(given)
    assert not marker.exists()  # Ray's Trainable.restore would have run it
    text = str(info.value)
    assert isinstance(info.value, CheckpointError) and _DICT_CHECKPOINT_FILE_NAME in text
    assert str(ckpt) in text and "unpickle" in text and "earlier checkpoint" in text
    # a direct load_checkpoint refuses the folder too (before reaching the engine)
    with pytest.raises(ForeignCheckpointFileError):
        proxy.load_checkpoint(str(ckpt))
    with pytest.raises(CheckpointError, match="not a folder"):
        proxy.load_checkpoint({"model": 1})  # what Ray passes after unpickling one
    assert not marker.exists()


def test_an_engine_lost_mid_train_is_the_engine_unavailable_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class _Method:
        def remote(self, *args: Any) -> str:
            return "ref"

    class _Engine:
        cls_call = _Method()

    def unavailable(ref: Any, **kw: Any) -> Any:
        raise ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable", None)

    class _Context:
        def get_node_id(self) -> str:
            return "node-1"

    monkeypatch.setattr(ray, "get", unavailable)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _Context())
    proxy = _bare_proxy()
    proxy._actor = _Engine()
    lost = r"(?s)node-1.*'cls_call'.*max_failures"
    with pytest.raises(EngineUnavailableError, match=lost) as info:
        proxy._call("cls_call", "tok", "step", (), {}, retry=False)
    assert not isinstance(info.value, ray.exceptions.RayError)
