"""Existing Ray Tune code with tune_hydra (issue 13): a systematic mistake fails the
experiment once, Tune's ``with_parameters`` / ``with_resources`` wrappers, and a checkpoint
at the end of every trial without any checkpoint setting."""

from __future__ import annotations

import json
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
def test_a_function_trainable_fails_the_experiment_once(
    shared_executor: HydraExecutor, ray_session: Any, storage: str, tmp_path: Path
) -> None:
    """Its ``report`` call is hidden from the check before the run, so it runs in the
    engine: the first trial's error ends the experiment, th.run raises it once."""
    calls = tmp_path / "calls"
    calls.mkdir()
    ex = shared_executor
    with pytest.raises(NotATaskError) as info:
        th.run(
            tune_tasks.hidden_train_fn,
            config={"lr": tune.grid_search([0.001, 0.01, 0.1]), "calls": str(calls)},
            metric="loss",
            mode="min",
            stop={"training_iteration": 3},
            max_failures=2,  # a retry would fail the same way: not waited for
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    assert _registered(ex) == []
    assert ex.systematic_error() is info.value
    text = str(info.value)
    assert "returned NoneType, not a tune_hydra.ModelTask" in text
    assert "function trainable" in text and "drop trial_executor" in text
    assert "experiment stops at the first one" in text
    assert "Traceback" not in text  # one message, not a trial's traceback
    # Not retried (max_failures=2 would call it 3 times a trial): at most once a trial.
    # (Not a timed bound: one of 30 s failed on a loaded machine.)
    assert 1 <= len(list(calls.iterdir())) <= 3


def test_a_factory_returning_none_fails_a_tuner_run_once(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    ex = shared_executor
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


def test_with_parameters_both_ways(
    shared_executor: HydraExecutor, ray_session: Any, storage: str, tmp_path: Path
) -> None:
    """``ex.trainable(tune.with_parameters(make_task, data=...))`` (through th.run) and
    ``tune.with_parameters(ex.trainable(make_task), data=...)`` (through a Tuner) both
    call ``make_task(config, data=...)`` in the engine, which fetches the data once; the
    trial processes keep only the object references (Tune's own setup would fetch the
    data into each of them)."""
    data = tune_tasks.dataset()
    ex = shared_executor
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


_STARTED: list[dict[str, float]] = []  # what each started trial holds (driver side)


class _Resources(tune.Callback):
    def on_trial_start(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
        _STARTED.append(dict(trial.placement_group_factory.required_resources))


def test_with_resources_around_or_inside_is_dropped_with_one_warning(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """Ray's examples wrap their trainable in ``tune.with_resources``: around
    ``ex.trainable(...)`` or inside it, the request is dropped with one warning and every
    trial holds its engine slot (and no CPU), so the trials run side by side."""
    ex = shared_executor
    with pytest.warns(UserWarning, match=r"around executor\.trainable.*is dropped") as w:
        around = tune.with_resources(ex.trainable(tune_tasks.make_task), {"cpu": 2})
    assert sum("tune.with_resources" in str(x.message) for x in w) == 1

    def make(config: dict[str, Any]) -> Any:
        return tune_tasks.make_task(config)

    with pytest.warns(UserWarning, match=r"inside executor\.trainable.*is dropped") as w:
        inside = ex.trainable(tune.with_resources(make, {"cpu": 2, "gpu": 0.5}))
    assert sum("tune.with_resources" in str(x.message) for x in w) == 1
    for trainable in (around, inside):
        _STARTED.clear()
        results = tune.Tuner(
            trainable,
            param_space={"lr": tune.grid_search([0.01, 0.03])},
            tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
            run_config=tune.RunConfig(
                stop={"training_iteration": 2},
                callbacks=[_Resources()],
                storage_path=storage,
                verbose=0,
            ),
        ).fit()
        assert results.num_errors == 0
        assert [r.metrics["training_iteration"] for r in results] == [2, 2]
        assert _STARTED == [{"hydra_slot": 1.0}] * 2, _STARTED  # no CPU, one slot
    assert _registered(ex) == []


def test_the_tuner_form_needs_only_the_trainable(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """``tune.Tuner(ex.trainable(...), ...)`` alone: the Tuner gets the executor's
    stopper and callbacks (a systematic mistake ends the run at its first trial), its
    scheduler wrapper and max_concurrent_trials; the user's configs are not changed."""
    tune_config = tune.TuneConfig(metric="val_loss", mode="min", scheduler=ASHAScheduler())
    run_config = tune.RunConfig(stop={"training_iteration": 3}, storage_path=storage, verbose=0)
    ex = shared_executor
    tuner = tune.Tuner(
        ex.trainable(tune_tasks.make_no_task),
        param_space={"lr": tune.grid_search([0.001, 0.01, 0.1])},
        tune_config=tune_config,
        run_config=run_config,
    )
    results = tuner.fit()
    assert isinstance(ex.systematic_error(), NotATaskError)
    assert _registered(ex) == []
    assert results.num_errors == 1  # not three identical tracebacks
    assert all(r.metrics.get("training_iteration", 0) == 0 for r in results)
    assert type(tune_config.scheduler) is ASHAScheduler
    assert tune_config.max_concurrent_trials is None
    assert run_config.stop == {"training_iteration": 3} and not run_config.callbacks


def test_tuner_configs_complete_once_and_keep_the_executors_own(
    shared_executor: HydraExecutor, ray_session: Any
) -> None:
    from tune_hydra.frontends.ray.callback import HydraCallback, HydraStopper
    from tune_hydra.frontends.ray.run import tuner_configs
    from tune_hydra.frontends.ray.scheduler import HydraScheduler

    ex = shared_executor
    asha = ASHAScheduler(max_t=4)
    tc, rc = tuner_configs(
        ex,
        tune.TuneConfig(scheduler=asha, max_concurrent_trials=2),
        tune.RunConfig(stop={"training_iteration": 3}),
    )
    assert isinstance(tc.scheduler, HydraScheduler) and tc.scheduler.base is asha
    assert tc.scheduler.budget == 3 and tc.max_concurrent_trials == 2
    assert isinstance(rc.stop, HydraStopper) and rc.stop.run_id == ex.run_id
    assert [type(c) for c in rc.callbacks] == [HydraCallback]
    # By hand as before (the README's old form): nothing is added twice.
    again, rc2 = tuner_configs(ex, tc, rc)
    assert again.scheduler is tc.scheduler and rc2.stop is rc.stop
    assert rc2.callbacks == rc.callbacks
    dflt, _ = tuner_configs(ex, None, None)
    assert dflt.max_concurrent_trials == ex.max_concurrent_trials


def _checkpoint_iterations(trial: Any) -> list[int]:
    """The iteration of each checkpoint the trial kept (from the engine's manifest)."""
    return sorted(
        json.loads((path / META_FILE).read_text())["iteration"]
        for path in Path(trial.path).glob("checkpoint_*")
    )


def test_every_trial_ends_with_a_checkpoint_without_any_setting(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """ASHA stops trials at different iterations; each one's last iteration has a
    checkpoint whose model.pt loads, with no checkpoint_freq / checkpoint_config."""
    ex = shared_executor
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
