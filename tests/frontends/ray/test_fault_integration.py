"""Faults: retries from checkpoints resume exactly, Tuner.restore, engine actor killed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray import tune

import tune_hydra as th
from tests.frontends.ray import tune_tasks
from tune_hydra.engine import Engine
from tune_hydra.frontends.ray import HydraExecutor
from tune_hydra.frontends.task_loop import TaskLoop

pytestmark = pytest.mark.integration

BUDGET = "18KiB"  # 3 shards in float64
SEED = 11


def _leftovers(ex: HydraExecutor) -> list[str]:
    return [t for r in ex.registered_trials().values() for t in r["trials"] + r["engine_tasks"]]


def _straight(config: dict[str, Any], iterations: int) -> dict[str, torch.Tensor]:
    """The model after ``iterations`` uninterrupted epochs, trained in this process."""
    eng = Engine(devices="cpu", device_memory=BUDGET)
    try:
        loop = TaskLoop("ref", tune_tasks.make_task({**config, "marker": None}), eng, seed=SEED)
        loop.start(iterations).result(timeout=120)
        return loop.state()["model"]
    finally:
        eng.close()


def _final_model(trial: Any) -> dict[str, torch.Tensor]:
    ckpt = trial.checkpoint
    assert ckpt is not None
    return torch.load(Path(ckpt.path) / "model.pt")


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == torch.float64
        assert torch.equal(got[key], want[key]), key


def test_max_failures_retries_from_checkpoint_exactly(
    ray_session: Any, storage: str, tmp_path: Path
) -> None:
    marker = tmp_path / "fail-once"
    marker.touch()
    config = {"lr": 0.02, "float64": True, "marker": str(marker), "once": True}
    with HydraExecutor(devices="cpu", device_memory=BUDGET, seed=SEED) as ex:
        analysis = th.run(
            tune_tasks.make_task,
            config=config,
            stop={"training_iteration": 4},
            checkpoint_freq=1,
            max_failures=2,
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
        assert _leftovers(ex) == []
    (trial,) = analysis.trials
    assert not marker.exists()  # it failed once, in epoch 3 ...
    assert trial.num_failures == 1
    assert trial.status == "TERMINATED"
    assert trial.last_result["training_iteration"] == 4
    assert trial.last_result["num_shards"] == 3
    # ... and 2 epochs + restore + 2 epochs == 4 epochs straight, bit for bit
    _assert_exact(_final_model(trial), _straight(config, 4))


def test_tuner_restore_resume_errored(ray_session: Any, storage: str, tmp_path: Path) -> None:
    marker = tmp_path / "fail-while-present"
    marker.touch()
    space = {
        "lr": 0.02,
        "float64": True,
        "marker": tune.grid_search([str(marker), None]),
        "once": False,
    }
    with HydraExecutor(devices="cpu", device_memory=BUDGET, seed=SEED) as ex:

        def run_config() -> tune.RunConfig:
            return tune.RunConfig(
                name="restore",
                storage_path=storage,
                stop={"training_iteration": 4},
                checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1),
                callbacks=ex.callbacks(),
                verbose=0,
            )

        tuner = tune.Tuner(
            ex.trainable(tune_tasks.make_task),
            param_space=space,
            tune_config=tune.TuneConfig(
                metric="val_loss",
                mode="min",
                scheduler=ex.scheduler(),
                max_concurrent_trials=ex.max_concurrent_trials,
            ),
            run_config=run_config(),
        )
        first = tuner.fit()
        assert first.num_errors == 1 and first.num_terminated == 1
        failed = next(r for r in first if r.error is not None)
        assert failed.metrics["training_iteration"] == 2
        assert "injected failure" in str(failed.error)

        marker.unlink()
        path = str(Path(storage) / "restore")
        assert tune.Tuner.can_restore(path)
        restored = tune.Tuner.restore(
            path, trainable=ex.trainable(tune_tasks.make_task), resume_errored=True
        )
        second = restored.fit()
        assert _leftovers(ex) == []
    assert second.num_errors == 0
    assert all(r.metrics["training_iteration"] == 4 for r in second)
    resumed = next(r for r in second if r.config["marker"] is not None)
    got = torch.load(Path(resumed.checkpoint.path) / "model.pt")
    _assert_exact(got, _straight(space | {"marker": None}, 4))


class _KillEngineOnce(tune.Callback):
    """Kills the engine actor (it restarts) when the first trial reports iteration 2."""

    def __init__(self, ex: HydraExecutor) -> None:
        self.ex, self.done = ex, False

    def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: Any, **info: Any):
        if not self.done and result["training_iteration"] == 2:
            self.done = True
            for handle in self.ex.engines().values():
                ray.kill(handle, no_restart=False)


def test_engine_actor_killed_mid_run(ray_session: Any, storage: str) -> None:
    with HydraExecutor(devices="cpu", device_memory=BUDGET, seed=SEED) as ex:
        killer = _KillEngineOnce(ex)
        analysis = th.run(
            tune_tasks.make_task,
            config={"lr": tune.grid_search([0.01, 0.02, 0.03]), "float64": True},
            stop={"training_iteration": 5},
            checkpoint_freq=1,
            max_failures=5,
            callbacks=[killer],
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
        assert killer.done
        assert _leftovers(ex) == []
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    assert all(t.last_result["training_iteration"] == 5 for t in analysis.trials)
    assert sum(t.num_failures for t in analysis.trials) >= 1
    # nothing lost: every trial's model equals uninterrupted training
    for trial in analysis.trials:
        _assert_exact(_final_model(trial), _straight(trial.config, 5))


class _KillEngineAt(tune.Callback):
    """Kills the engine actor (it restarts) when the first trial reports ``iteration``."""

    def __init__(self, ex: HydraExecutor, iteration: int) -> None:
        self.ex, self.iteration, self.done = ex, iteration, False
        # the last iteration each trial reported before it was restored
        self.before_restore: dict[str, int] = {}

    def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: Any, **info: Any):
        if result["iterations_since_restore"] == result["training_iteration"]:
            self.before_restore[trial.trial_id] = result["training_iteration"]
        if not self.done and result["training_iteration"] == self.iteration:
            self.done = True
            for handle in self.ex.engines().values():
                ray.kill(handle, no_restart=False)


def test_tuner_keeps_a_checkpoint_every_iteration_by_default(
    ray_session: Any, storage: str
) -> None:
    """Issue 23, item 3: tune.Tuner turns checkpoint_at_end on for class trainables; the
    default checkpoint="every" must still save after every iteration, so an engine killed
    at iteration 3 resumes its trials from their latest checkpoint, not from scratch."""
    with HydraExecutor(devices="cpu", device_memory=BUDGET, seed=SEED) as ex:
        killer = _KillEngineAt(ex, 3)
        tuner = tune.Tuner(
            ex.trainable(tune_tasks.make_task),
            param_space={"lr": tune.grid_search([0.01, 0.02]), "float64": True},
            tune_config=tune.TuneConfig(
                metric="val_loss",
                mode="min",
                scheduler=ex.scheduler(),
                max_concurrent_trials=ex.max_concurrent_trials,
            ),
            run_config=tune.RunConfig(
                name="tuner_every",
                storage_path=storage,
                stop={"training_iteration": 5},
                failure_config=tune.FailureConfig(max_failures=3),
                callbacks=[*ex.callbacks(), killer],
                verbose=0,
            ),
        )
        results = tuner.fit()
        assert killer.done
    assert results.num_errors == 0
    for result in results:
        assert result.metrics["training_iteration"] == 5
        saved = sorted(Path(result.path).glob("checkpoint_*"))
        # one checkpoint per iteration reached (a save the kill interrupted is not kept)
        assert len(saved) >= 4, [p.name for p in saved]
        iterations = [json.loads((p / "hydra_meta.json").read_text())["iteration"] for p in saved]
        assert set(iterations) == {1, 2, 3, 4, 5}, iterations
        # a trial the kill hit resumed from its latest checkpoint, not from scratch: the
        # one of the last iteration it reported, or the one before where the kill
        # interrupted that save (trials need not be in step: under load one lags)
        reached = killer.before_restore.get(result.metrics["trial_id"], 0)
        resumed_from = 5 - result.metrics["iterations_since_restore"]
        expected = (0,) if reached == 5 else (max(reached - 1, 0), reached)
        assert resumed_from in expected, (reached, resumed_from)
        _assert_exact(_final_model_of(result), _straight(result.config, 5))
    assert any(r.metrics["iterations_since_restore"] < 5 for r in results)


def _final_model_of(result: Any) -> dict[str, torch.Tensor]:
    return torch.load(Path(result.checkpoint.path) / "model.pt")
