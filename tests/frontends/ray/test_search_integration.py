"""Tune's search algorithms and trial schedulers work unchanged on HydraExecutor trials."""

from __future__ import annotations

from typing import Any

import pytest
from ray import tune
from ray.tune.schedulers import (
    ASHAScheduler,
    HyperBandScheduler,
    MedianStoppingRule,
    PopulationBasedTraining,
)
from ray.tune.search.optuna import OptunaSearch

import tune_hydra as th
from tests.frontends.ray import tune_tasks
from tune_hydra.frontends.ray import HydraExecutor

pytestmark = pytest.mark.integration

BUDGET = "18KiB"


def _leftovers(ex: HydraExecutor) -> list[str]:
    return [t for r in ex.registered_trials().values() for t in r["trials"] + r["engine_tasks"]]


def _run(ex: HydraExecutor, storage: str, **kwargs: Any) -> Any:
    kwargs.setdefault("metric", "val_loss")
    kwargs.setdefault("mode", "min")
    return th.run(
        tune_tasks.make_task, trial_executor=ex, storage_path=storage, verbose=0, **kwargs
    )


def test_optuna_with_points_to_evaluate_and_asha(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    ex = shared_executor
    (before,) = ex.summary().values()
    analysis = _run(
        ex,
        storage,
        config={"lr": tune.loguniform(1e-3, 1e-1), "width": tune.choice([8, 16])},
        num_samples=5,
        search_alg=OptunaSearch(points_to_evaluate=[{"lr": 0.01, "width": 16}], seed=0),
        scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2),
        stop={"training_iteration": 4},
        # One at a time: which trials ASHA stops then follows from the results alone (5 at
        # once, all reached their rungs in an order that stopped none, once in a quiet CI).
        max_concurrent_trials=1,
    )
    assert _leftovers(ex) == []
    # Started before the run: the engine's own "auto", the milestone policy, which got
    # each trial's rungs from the wrapped ASHA.
    (summary,) = ex.summary().values()
    assert summary["policy"] == "milestone"
    assert summary["milestones_given"] - before["milestones_given"] >= 5
    assert len(analysis.trials) == 5
    assert analysis.trials[0].config == {"lr": 0.01, "width": 16}
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    iters = sorted(t.last_result["training_iteration"] for t in analysis.trials)
    assert iters[-1] == 4 and iters[0] < 4  # ASHA stopped some trials early
    assert analysis.best_config["width"] in (8, 16)


def test_th_run_chooses_lrtf_for_a_fixed_budget(ray_session: Any, storage: str) -> None:
    """th.run starts the engines after choosing: FIFO with a fixed budget and a grid is
    LRTF, and no milestones are sent."""
    ex = HydraExecutor(devices="cpu", device_memory=BUDGET)
    _run(ex, storage, config={"lr": tune.grid_search([0.01, 0.02])}, stop={"training_iteration": 2})
    (summary,) = ex.summary().values()  # collected when th.run shut the engines down
    assert ex.engine_policy == "lrtf" and ex.policy == "auto"
    assert summary["policy"] == "lrtf" and summary["milestones_given"] == 0


def _define_by_run(trial: Any) -> None:
    trial.suggest_float("lr", 1e-3, 1e-1, log=True)
    if trial.suggest_categorical("wide", [True, False]):
        trial.suggest_categorical("width", [16, 24])


def test_optuna_define_by_run_and_median_stopping(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    ex = shared_executor
    analysis = _run(
        ex,
        storage,
        num_samples=4,
        search_alg=OptunaSearch(space=_define_by_run, metric="val_loss", mode="min", seed=1),
        scheduler=MedianStoppingRule(
            metric="val_loss", mode="min", grace_period=1, min_samples_required=2
        ),
        stop={"training_iteration": 3},
        metric=None,
        mode=None,
    )
    assert _leftovers(ex) == []
    assert len(analysis.trials) == 4
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    assert all("lr" in t.config and "wide" in t.config for t in analysis.trials)


def test_hyperband_random_search(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    ex = shared_executor
    analysis = _run(
        ex,
        storage,
        config={"lr": tune.uniform(0.001, 0.05)},
        num_samples=4,
        scheduler=HyperBandScheduler(max_t=4, reduction_factor=2),
        stop={"training_iteration": 4},
        checkpoint_freq=1,
        reuse_actors=True,
    )
    assert _leftovers(ex) == []
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    assert max(t.last_result["training_iteration"] for t in analysis.trials) == 4


def test_population_based_training(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"lr": [0.001, 0.003, 0.01, 0.03]},
        quantile_fraction=0.5,
        synch=True,  # exploit once all trials reach the interval: deterministic, not timing
    )
    ex = shared_executor
    analysis = _run(
        ex,
        storage,
        config={"lr": tune.grid_search([0.001, 0.003, 0.01, 0.03])},
        scheduler=pbt,
        stop={"training_iteration": 4},  # one perturbation round (at 2) is the point
        checkpoint_freq=2,
        reuse_actors=False,  # the proxies' processes are reused all the same (README)
    )
    assert _leftovers(ex) == []
    assert len(analysis.trials) == 4
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    assert all(t.last_result["training_iteration"] == 4 for t in analysis.trials)
    # exploitation happened: some trial restored another's checkpoint and changed its lr
    assert pbt._num_perturbations > 0


@pytest.mark.parametrize("form", ["run", "tuner"])
def test_trials_reuse_their_proxy_process(
    shared_executor: HydraExecutor, ray_session: Any, storage: str, form: str
) -> None:
    """A trial's process is only a proxy (the task factory runs in the engine actor):
    Tune keeps it for the next trial, also where the run says ``reuse_actors=False``, and
    each trial still trains its own config from its first iteration."""
    ex = shared_executor
    config = {"lr": tune.grid_search([0.001, 0.01, 0.1])}
    stop = {"training_iteration": 2}
    if form == "run":
        analysis = _run(
            ex, storage, config=config, stop=stop, max_concurrent_trials=1, reuse_actors=False
        )
        results = [t.last_result for t in analysis.trials]
    else:
        grid = tune.Tuner(
            ex.trainable(tune_tasks.make_task),
            param_space=config,
            tune_config=tune.TuneConfig(
                metric="val_loss", mode="min", max_concurrent_trials=1, reuse_actors=False
            ),
            run_config=tune.RunConfig(stop=stop, storage_path=storage, verbose=0),
        ).fit()
        assert grid.num_errors == 0
        results = [r.metrics for r in grid]
    assert _leftovers(ex) == []
    assert [r["training_iteration"] for r in results] == [2, 2, 2]
    assert len({r["pid"] for r in results}) == 1, [r["pid"] for r in results]
    assert len({r["loss"] for r in results}) == 3  # three lrs, three trainings


def test_hyperopt_search_if_installed(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    pytest.importorskip("hyperopt")
    from ray.tune.search.hyperopt import HyperOptSearch

    ex = shared_executor
    analysis = _run(
        ex,
        storage,
        config={"lr": tune.loguniform(1e-3, 1e-1)},
        num_samples=3,
        search_alg=HyperOptSearch(random_state_seed=0),
        stop={"training_iteration": 2},
    )
    assert _leftovers(ex) == []
    assert all(t.status == "TERMINATED" for t in analysis.trials)
