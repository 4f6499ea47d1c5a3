"""A trial that fails to build (``tune_hydra.frontends.failures.check_task``), and the same
outcome through both front ends that use it (the Ray engine actor, hosted in-process
without starting Ray, and ``th.optimize``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import make_task, mlp
from tune_hydra.exceptions import (
    NotATaskError,
    ReusedModelError,
    SystematicTaskError,
    TaskFactoryError,
    UncuttableModelError,
)
from tune_hydra.frontends.failures import check_task, not_a_task


class _Branchy(nn.Module):
    """A model of a type the engine cannot cut (a branch that torch.fx cannot trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if float(x.sum()) > 0 else self.b(x)


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
    """Start trials ``keys`` in an engine actor hosted in-process and train each one
    iteration (each trial stopped before the next); the first error, or None."""
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
            asyncio.run(actor.cls_start(key, f"tok-{key}", "f", {}, None, secret, {}))
            asyncio.run(actor.cls_call(f"tok-{key}", "step", (), {}))
            asyncio.run(actor.deregister(key, f"tok-{key}"))
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
