"""Existing Ray Tune code with tune_hydra (issue 13): a systematic mistake fails the
experiment once, Tune's ``with_parameters`` / ``with_resources`` wrappers, and a checkpoint
at the end of every trial without any checkpoint setting."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

import tune_hydra as th
from tests.frontends.ray import tune_tasks
from tune_hydra.frontends.checkpoint import META_FILE
from tune_hydra.frontends.ray import (
    HydraExecutor,
    NotATaskError,
    TrialResourcesError,
)
from tune_hydra.frontends.ray.trainable import HydraTrainable

pytestmark = pytest.mark.integration

BUDGET = "18KiB"  # cuts the 16-wide MLP into 2 shards


def _registered(ex: HydraExecutor) -> list[str]:
    regs = ex.registered_trials()
    return [t for r in regs.values() for t in r["trials"] + r["engine_tasks"]]


def _tuner(ex: HydraExecutor, trainable: Any, storage: str, iterations: int, **config: Any) -> Any:
    """A Tuner built from the executor as the README shows (stopper, scheduler, callbacks)."""
    stop = {"training_iteration": iterations}
    return tune.Tuner(
        trainable,
        param_space=config,
        tune_config=tune.TuneConfig(
            metric="val_loss",
            mode="min",
            scheduler=ex.scheduler(stop=stop),
            max_concurrent_trials=ex.max_concurrent_trials,
        ),
        run_config=tune.RunConfig(
            stop=ex.stopper(stop), callbacks=ex.callbacks(), storage_path=storage, verbose=0
        ),
    )


@pytest.mark.filterwarnings("ignore:`report` is meant")
def test_a_function_trainable_fails_the_experiment_once(ray_session: Any, storage: str) -> None:
    """Its ``report`` call is hidden from the check before the run, so it runs in the
    engine: the first trial's error ends the experiment, th.run raises it once."""
    with HydraExecutor(devices="cpu", device_memory=BUDGET) as ex:
        start = time.monotonic()
        with pytest.raises(NotATaskError) as info:
            th.run(
                tune_tasks.hidden_train_fn,
                config={"lr": tune.grid_search([0.001, 0.01, 0.1])},
                metric="loss",
                mode="min",
                stop={"training_iteration": 3},
                max_failures=2,  # a retry would fail the same way: not waited for
                storage_path=storage,
                trial_executor=ex,
                verbose=0,
            )
        elapsed = time.monotonic() - start
        assert _registered(ex) == []
        assert ex.systematic_error() is info.value
    text = str(info.value)
    assert "returned NoneType, not a tune_hydra.ModelTask" in text
    assert "function trainable" in text and "drop trial_executor" in text
    assert "experiment stops at the first one" in text
    assert "Traceback" not in text  # one message, not a trial's traceback
    assert elapsed < 30, elapsed


def test_a_factory_returning_none_fails_a_tuner_run_once(ray_session: Any, storage: str) -> None:
    with HydraExecutor(devices="cpu", device_memory=BUDGET) as ex:
        tuner = _tuner(
            ex,
            ex.trainable(tune_tasks.make_no_task),
            storage,
            3,
            lr=tune.grid_search([0.001, 0.01, 0.1]),
        )
        results = tuner.fit()
        assert _registered(ex) == []
        assert isinstance(ex.systematic_error(), NotATaskError)
    assert results.num_errors == 1  # not three identical tracebacks
    assert "not a tune_hydra.ModelTask" in str(results.errors[0])
    # Ended at the first trial, not after all three (no timed assertion: a loaded machine
    # made the 30 s bound fail while the run did end early).
    assert all(r.metrics.get("training_iteration", 0) == 0 for r in results)


def test_with_parameters_both_ways(ray_session: Any, storage: str, tmp_path: Path) -> None:
    """``ex.trainable(tune.with_parameters(make_task, data=...))`` (through th.run) and
    ``tune.with_parameters(ex.trainable(make_task), data=...)`` (through a Tuner) both
    call ``make_task(config, data=...)`` in the engine, which fetches the data once; the
    trial processes keep only the object references (Tune's own setup would fetch the
    data into each of them)."""
    data = tune_tasks.dataset()
    with HydraExecutor(devices="cpu", device_memory=BUDGET) as ex:
        first = tmp_path / "factory.log"
        analysis = th.run(
            tune.with_parameters(tune_tasks.make_task_with, data=data, log=str(first)),
            config={"lr": tune.grid_search([0.003, 0.03])},
            metric="val_loss",
            mode="min",
            stop={"training_iteration": 2},
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
        assert [t.status for t in analysis.trials] == ["TERMINATED"] * 2
        assert all(t.last_result["val_loss"] < 100 for t in analysis.trials)

        second = tmp_path / "trainable.log"
        trainable = tune.with_parameters(
            ex.trainable(tune_tasks.make_task_with), data=data, log=str(second)
        )
        assert sorted(trainable._param_refs) == ["data", "log"]
        assert trainable.setup is HydraTrainable.setup  # not Tune's fetching setup
        results = _tuner(ex, trainable, storage, 2, lr=tune.grid_search([0.003, 0.03])).fit()
        assert _registered(ex) == []
    assert results.num_errors == 0
    assert [r.metrics["training_iteration"] for r in results] == [2, 2]
    for log in (first, second):
        calls = log.read_text().split("\n")[:-1]  # "<pid> <id(data)>" per factory call
        assert len(calls) == 2 and len(set(calls)) == 1, calls  # one engine, one copy


def test_with_resources_is_refused(ray_session: Any, storage: str) -> None:
    """Trials that would hold CPUs instead of slots: refused when Tune adds the first
    (with the executor's scheduler), or by the first trial (without it)."""
    with HydraExecutor(devices="cpu", device_memory=BUDGET) as ex:
        trainable = tune.with_resources(ex.trainable(tune_tasks.make_task), {"cpu": 2})
        start = time.monotonic()
        with pytest.raises(TrialResourcesError, match=r"without tune\.with_resources") as info:
            _tuner(ex, trainable, storage, 2, lr=tune.grid_search([0.01, 0.03])).fit()
        assert "'hydra_slot'" in str(info.value) and time.monotonic() - start < 20

        # a plain scheduler: the proxy refuses to run, and the stopper ends the run
        stop = {"training_iteration": 2}
        results = tune.Tuner(
            trainable,
            param_space={"lr": tune.grid_search([0.01, 0.03, 0.1])},
            tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
            run_config=tune.RunConfig(
                stop=ex.stopper(stop), callbacks=ex.callbacks(), storage_path=storage, verbose=0
            ),
        ).fit()
        assert isinstance(ex.systematic_error(), TrialResourcesError)
        assert _registered(ex) == []
    assert results.num_errors == 1
    assert "hold CPUs instead of engine slots" in str(results.errors[0])


def _checkpoint_iterations(trial: Any) -> list[int]:
    """The iteration of each checkpoint the trial kept (from the engine's manifest)."""
    return sorted(
        json.loads((path / META_FILE).read_text())["iteration"]
        for path in Path(trial.path).glob("checkpoint_*")
    )


def test_every_trial_ends_with_a_checkpoint_without_any_setting(
    ray_session: Any, storage: str
) -> None:
    """ASHA stops trials at different iterations; each one's last iteration has a
    checkpoint whose model.pt loads, with no checkpoint_freq / checkpoint_config."""
    with HydraExecutor(devices="cpu", device_memory=BUDGET) as ex:
        analysis = th.run(
            tune_tasks.make_task,
            # one at a time, best first: the later, worse trials are cut at a rung
            config={"lr": tune.grid_search([0.03, 1e-4, 3e-5])},
            max_concurrent_trials=1,
            metric="val_loss",
            mode="min",
            scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2),
            stop={"training_iteration": 4},
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    last = [t.last_result["training_iteration"] for t in analysis.trials]
    assert last[0] == 4 and max(last[1:]) < 4, last  # ASHA stopped the others early
    model = tune_tasks.build_model(16, torch.float32)
    for trial, iterations in zip(analysis.trials, last, strict=True):
        assert trial.checkpoint is not None
        assert _checkpoint_iterations(trial)[-1] == iterations
        model.load_state_dict(torch.load(Path(trial.checkpoint.path) / "model.pt"))
    assert analysis.best_checkpoint is not None


def test_checkpoint_at_end_or_none_and_pbt_without_settings(ray_session: Any, storage: str) -> None:
    with HydraExecutor(devices="cpu", device_memory=BUDGET, checkpoint="end") as ex:
        kwargs: dict[str, Any] = {
            "config": {"lr": tune.grid_search([0.003, 0.03])},
            "metric": "val_loss",
            "mode": "min",
            "stop": {"training_iteration": 2},
            "storage_path": storage,
            "trial_executor": ex,
            "verbose": 0,
        }
        at_end = th.run(tune_tasks.make_task, **kwargs)
        assert [_checkpoint_iterations(t) for t in at_end.trials] == [[2], [2]]
        ex.checkpoint = None
        unset = th.run(tune_tasks.make_task, **kwargs)
        assert [t.checkpoint for t in unset.trials] == [None, None]
        ex.checkpoint = "every"

        pbt = PopulationBasedTraining(
            time_attr="training_iteration",
            perturbation_interval=2,
            hyperparam_mutations={"lr": [0.001, 0.003, 0.01, 0.03]},
            quantile_fraction=0.5,
            synch=True,
        )
        analysis = th.run(
            tune_tasks.make_task,
            **{
                **kwargs,
                "config": {"lr": tune.grid_search([0.001, 0.03])},
                "stop": {"training_iteration": 4},
            },
            scheduler=pbt,
        )
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    assert pbt._num_perturbations > 0  # exploited another trial's checkpoint
