"""th.run on a metric of the task's own (``ModelTask(metrics=...)``): results carry it and
an ASHA scheduler maximises it; a metric that the tasks do not declare ends the run once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ray import tune
from ray.tune.schedulers import ASHAScheduler

import tune_hydra as th
from tests.frontends.ray import tune_tasks
from tune_hydra.exceptions import UndeclaredMetricError
from tune_hydra.frontends.ray import HydraExecutor

pytestmark = pytest.mark.integration

BUDGET = "18KiB"


def test_run_maximises_accuracy_with_asha(ray_session: Any, storage: str) -> None:
    with HydraExecutor(devices="cpu", device_memory=BUDGET, seed=3) as ex:
        analysis = th.run(
            tune_tasks.make_classifier_task,
            config={"lr": tune.grid_search([0.01, 0.1, 0.3])},
            metric="accuracy",
            mode="max",
            scheduler=ASHAScheduler(max_t=3, grace_period=1),
            stop={"training_iteration": 3},
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    assert len(analysis.trials) == 3
    for trial in analysis.trials:
        assert trial.status == "TERMINATED"
        result = trial.last_result
        assert 0.0 <= result["accuracy"] <= 1.0
        assert result["num_shards"] >= 2 and "val_loss" in result
    best = analysis.get_best_trial("accuracy", "max")
    assert best is not None and best.last_result["accuracy"] == max(
        t.last_result["accuracy"] for t in analysis.trials
    )


def test_a_metric_the_tasks_do_not_declare_ends_the_run_once(
    ray_session: Any, storage: str, tmp_path: Path
) -> None:
    ex = HydraExecutor(devices="cpu", device_memory=BUDGET)
    calls = tmp_path / "calls"
    calls.mkdir()
    with pytest.raises(UndeclaredMetricError) as info:
        th.run(
            tune_tasks.make_classifier_task,
            config={
                "lr": tune.grid_search([0.01, 0.1, 0.3]),
                "metrics": False,
                "calls": str(calls),
            },
            metric="accuracy",
            mode="max",
            stop={"training_iteration": 2},
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    text = str(info.value)
    assert "'accuracy'" in text and "metrics={'accuracy'" in text
    assert "experiment stops at the first one" in text
    # Ended there: each trial's factory ran at most once (no retry, no trial restarted).
    # (Not a timed bound: one of 60 s failed on a loaded machine.)
    assert 1 <= len(list(calls.iterdir())) <= 3
