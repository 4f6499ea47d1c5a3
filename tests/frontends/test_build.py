"""Building a trial (``tune_hydra.frontends.build``): the kit's contract, on a real engine,
and the same outcome through both front ends that use it (the Ray engine actor, hosted
in-process without starting Ray, and ``th.optimize``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import make_task, mlp
from tune_hydra.engine import Engine
from tune_hydra.exceptions import (
    NotATaskError,
    ReusedModelError,
    SharedModelError,
    SystematicTaskError,
    TaskFactoryError,
    UncuttableModelError,
)
from tune_hydra.frontends.build import TrialSet, check_task
from tune_hydra.frontends.failures import not_a_task


class _Branchy(nn.Module):
    """A model of a type the engine cannot cut (a branch that torch.fx cannot trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if float(x.sum()) > 0 else self.b(x)


def test_a_trial_is_added_under_its_key_and_a_newer_copy_replaces_it() -> None:
    with Engine("cpu") as engine:
        trials = TrialSet(engine, {"seed": 0})
        first, shards = trials.add("a", make_task(mlp()), token="t1", config={"lr": 0.1})
        assert (first.key, first.name, first.token, first.config) == ("a", "a", "t1", {"lr": 0.1})
        assert shards == 1 and trials.trains("a") and trials.keys() == ["a"]
        newer, _ = trials.add("a", make_task(mlp()), token="t2")
        # a stale copy's calls (by the old name) can never reach the new task
        assert newer.name != "a" and engine.tasks() == [newer.name]
        assert trials.get("a") is newer
        assert trials.remove("a", only=first) is None  # the stale copy cannot remove it
        assert trials.remove("a", only=newer) is newer
        assert engine.tasks() == [] and not trials.trains("a") and trials.remove("a") is None
        trials.cancel("a")  # nothing to cancel: no error


def test_a_name_the_engine_already_uses_is_not_taken() -> None:
    with Engine("cpu") as engine:
        engine.add_task("trial_0", make_task(mlp(seed=1)))  # the caller's own task
        trial, _ = TrialSet(engine, {}).add("trial_0", make_task(mlp()))
        assert trial.name != "trial_0" and sorted(engine.tasks()) == sorted(["trial_0", trial.name])


def test_concurrent_adds_of_one_key_leave_one_task() -> None:
    """Two copies of one trial registering at once (PBT): the later replaces the earlier,
    whichever finishes first, and no task of the replaced copy stays in the engine."""
    with Engine("cpu") as engine:
        trials = TrialSet(engine, {"seed": 0})
        start = threading.Barrier(4)
        errors: list[BaseException] = []

        def add(i: int) -> None:
            start.wait()
            try:
                trials.add("a", make_task(mlp(seed=i)), token=f"t{i}")
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)

        threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        trial = trials.get("a")
        assert trial is not None and engine.tasks() == [trial.name]


def test_models_another_trial_trained_are_refused() -> None:
    shared = mlp()
    with Engine("cpu") as engine, Engine("cpu") as other:
        trials = TrialSet(engine, {})
        trials.add("a", make_task(shared))
        # another engine of this process trains it now
        with pytest.raises(SharedModelError) as shared_err:
            TrialSet(other, {}).add("x", make_task(shared))
        assert not isinstance(shared_err.value, ReusedModelError)
        trials.remove("a")
        # the trial that trained it ended: reusing it would start from trained weights
        with pytest.raises(ReusedModelError, match="inside make_task"):
            trials.add("b", make_task(shared))
        assert trials.keys() == [] and engine.tasks() == []


def test_an_uncuttable_model_type_fails_that_trial_alone() -> None:
    task = th.ModelTask(
        _Branchy(), nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1), [(torch.randn(2, 8),) * 2]
    )
    with Engine("cpu") as engine:
        trials = TrialSet(engine, {})
        with pytest.raises(UncuttableModelError, match=r"nn\.Sequential") as info:
            trials.add("a", task)
        assert not isinstance(info.value, SystematicTaskError) and info.value.trial == "a"
        assert trials.keys() == [] and engine.tasks() == []


def test_check_task() -> None:
    task = make_task(mlp())
    assert check_task(task, "a") is task
    with pytest.raises(NotATaskError, match="returned dict") as info:
        check_task({}, "a", trainable=lambda: "tune.report")
    assert "it calls tune.report(...)" in str(info.value)
    with pytest.raises(TaskFactoryError, match=r"make_task\(trial\) must") as one:
        check_task(None, "3", takes="trial", systematic=False)
    assert not isinstance(one.value, SystematicTaskError)
    asked: list[int] = []
    check_task(task, "a", trainable=lambda: asked.append(1) or None)
    assert asked == []  # only asked about a factory that built no task


# ---------------------------------------------------- the same outcome in both front ends
def _ray_register(factory: Any, keys: list[str]) -> BaseException | None:
    """Register trials ``keys`` with an engine actor hosted in-process (each trial
    deregistered before the next); the first error, or None."""
    pytest.importorskip("ray")
    from ray import cloudpickle

    from tune_hydra.frontends.ray.actor import EngineActor
    from tune_hydra.options import EngineOptions

    secret = "s"
    actor = EngineActor(
        EngineOptions(devices="cpu"), {"seed": 0}, factories={"f": cloudpickle.dumps(factory)},
        secret=secret,
    )  # fmt: skip
    try:
        for key in keys:
            asyncio.run(actor.register(key, "tok", "f", {}, secret=secret))
            asyncio.run(actor.deregister(key, "tok"))
    except BaseException as err:
        return err
    finally:
        asyncio.run(actor.close(secret))
    return None


def _optuna_errors(factory: Any, n_trials: int) -> list[str]:
    """The ``error`` of each trial of a ``th.optimize`` study ("" for a trial that ran)."""
    optuna = pytest.importorskip("optuna")
    study = optuna.create_study()
    th.optimize(study, lambda trial: factory({}), n_trials=n_trials, devices=["cpu"],
                max_concurrent=1, metric="loss")  # fmt: skip
    return [t.user_attrs.get("error", "") for t in study.trials]


@pytest.mark.usefixtures("quiet_optuna")
def test_a_factory_that_builds_no_task_reads_the_same_in_both_front_ends() -> None:
    kit = not_a_task("x", {})
    assert isinstance(kit, NotATaskError)
    said = kit.problem  # in the kit's words
    ray_err = _ray_register(lambda config: {}, ["a"])
    assert isinstance(ray_err, NotATaskError) and said in str(ray_err)
    (optuna_err,) = _optuna_errors(lambda config: {}, 1)
    assert optuna_err.startswith("TaskFactoryError") and said in optuna_err
    assert "experiment stops" not in optuna_err  # one trial fails, the study goes on


@pytest.mark.usefixtures("quiet_optuna")
def test_a_model_an_ended_trial_trained_is_refused_in_both_front_ends() -> None:
    model = mlp()  # module-level in a user's script: one object, every factory call

    def factory(config: Any) -> th.ModelTask:
        return make_task(model)

    assert isinstance(_ray_register(factory, ["a", "b"]), ReusedModelError)
    model = mlp()
    errors = _optuna_errors(factory, 2)
    assert errors[0] == "" and errors[1].startswith("ReusedModelError")


@pytest.mark.usefixtures("quiet_optuna")
def test_an_uncuttable_model_fails_its_trial_in_both_front_ends() -> None:
    def factory(config: Any) -> th.ModelTask:
        return th.ModelTask(
            _Branchy(), nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1),
            [(torch.randn(2, 8), torch.randn(2, 4))],
        )  # fmt: skip

    assert isinstance(_ray_register(factory, ["a"]), UncuttableModelError)
    (optuna_err,) = _optuna_errors(factory, 1)
    assert optuna_err.startswith("UncuttableModelError")
