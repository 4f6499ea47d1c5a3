"""th.run with a HydraExecutor: grid search, results, checkpoints, forwarding, bad input."""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler

import tune_hydra as th
from tests.frontends.ray import tune_tasks
from tune_hydra.exceptions import SpillDirError, TuneHydraError, UnknownPolicyError
from tune_hydra.frontends.ray import (
    HydraExecutor,
    InvalidExecutorError,
    MissingMetricError,
    NotATaskFactoryError,
    run,
)

pytestmark = pytest.mark.integration

BUDGET = "18KiB"  # cuts the 16-wide MLP into 2 shards (3 in float64)


def _registered(ex: HydraExecutor) -> list[str]:
    regs = ex.registered_trials()
    return [t for r in regs.values() for t in r["trials"] + r["engine_tasks"]]


def test_signature_mirrors_tune_run() -> None:
    ours = inspect.signature(run).parameters
    theirs = inspect.signature(tune.run).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    assert ours["trial_executor"].default is None
    assert ours["trial_executor"].kind is inspect.Parameter.KEYWORD_ONLY
    assert th.run is run and th.HydraExecutor is HydraExecutor


def test_trainable_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, tune_hydra.frontends.ray.trainable; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_grid_search_results_and_checkpoints(ray_session: Any, storage: str) -> None:
    ex = HydraExecutor(devices="cpu", device_memory=BUDGET, seed=3)
    with ex:
        assert ex.max_concurrent_trials == 8
        analysis = th.run(
            tune_tasks.make_task,
            config={"lr": tune.grid_search([0.003, 0.01, 0.03])},
            metric="val_loss",
            mode="min",
            stop={"training_iteration": 3},
            checkpoint_freq=1,
            storage_path=storage,
            trial_executor=ex,
            max_concurrent_trials=2,  # the third trial reuses a proxy (reuse_actors)
            verbose=0,
        )
        assert ex.started  # th.run leaves an executor it did not start running
        assert _registered(ex) == []  # every trial freed its registration
        trace = ex.trace()
    assert not ex.started
    assert len(analysis.trials) == 3
    for trial in analysis.trials:
        assert trial.status == "TERMINATED"
        result = trial.last_result
        assert result["training_iteration"] == 3
        for key in ("loss", "val_loss", "num_shards", "device_time_s", "bytes_spilled", "epoch"):
            assert key in result, key
        assert result["num_shards"] >= 2
        assert result["epoch"] == 3
    assert analysis.best_config["lr"] in (0.003, 0.01, 0.03)
    # model.pt is the whole model's state_dict, loadable into a fresh model
    ckpt = analysis.best_checkpoint
    assert ckpt is not None
    model = tune_tasks.build_model(16, torch.float32)
    model.load_state_dict(torch.load(Path(ckpt.path) / "model.pt"))
    # the engine ran all three trials' shards, each under its own trial's name (a reused
    # proxy's run builds the next trial's task for that trial)
    assert {e.task for e in trace.events} == {t.trial_id for t in analysis.trials}


def test_none_executor_forwards_to_tune_run(ray_session: Any, storage: str) -> None:
    def trainable(config: dict[str, Any]) -> None:
        tune.report({"score": config["x"] * 2})

    analysis = th.run(
        trainable,
        config={"x": tune.grid_search([1, 2])},
        metric="score",
        mode="max",
        storage_path=storage,
        verbose=0,
    )
    assert isinstance(analysis, tune.ExperimentAnalysis)
    assert analysis.best_config == {"x": 2}


def test_failing_trials_error_alone(ray_session: Any, storage: str) -> None:
    ex = HydraExecutor(devices="cpu", device_memory=BUDGET)
    with ex:
        analysis = th.run(
            tune_tasks.make_task,
            config={
                # A factory returning no ModelTask is systematic: it ends the whole run
                # (tests/frontends/ray/test_dropin_integration.py), so it is not among these.
                "case": tune.grid_search(["ok", "factory", "nan", "big", "raise"]),
                "fail": tune.sample_from(
                    lambda s: {"factory": "factory", "nan": "nan"}.get(s.config["case"])
                ),
                "width": tune.sample_from(lambda s: 512 if s.config["case"] == "big" else 16),
                "marker": tune.sample_from(
                    lambda s: __file__ if s.config["case"] == "raise" else None
                ),
                "fail_after": 1,
            },
            stop={"training_iteration": 2},
            storage_path=storage,
            trial_executor=ex,
            raise_on_failed_trial=False,
            verbose=0,
        )
        assert _registered(ex) == []
    by_case = {t.config["case"]: t for t in analysis.trials}
    assert by_case["ok"].status == "TERMINATED"
    assert by_case["ok"].last_result["training_iteration"] == 2
    expected = {
        "factory": ["factory exploded on purpose", "Factory traceback", "make_task"],
        "nan": ["nan"],
        "big": ["ShardTooLargeError", "Raise device_memory"],
        "raise": ["injected failure", "training its task", "tune_tasks.py"],
    }
    for case, needles in expected.items():
        trial = by_case[case]
        assert trial.status == "ERROR", case
        text = Path(trial.error_file).read_text() if trial.error_file else ""
        for needle in needles:
            assert needle.lower() in text.lower(), (case, needle, text[-2000:])


def test_bad_input_is_rejected_early(ray_session: Any, storage: str) -> None:
    ex = HydraExecutor(devices="cpu")
    with pytest.raises(NotATaskFactoryError, match="task factory"):
        th.run("PPO", trial_executor=ex)
    with pytest.raises(NotATaskFactoryError, match="class"):
        th.run(tune.Trainable, trial_executor=ex)
    with pytest.raises(NotATaskFactoryError, match="one argument"):
        th.run(lambda: None, trial_executor=ex)
    with pytest.raises(InvalidExecutorError, match="HydraExecutor"):
        th.run(tune_tasks.make_task, trial_executor=object())  # type: ignore[arg-type]
    with pytest.raises(MissingMetricError, match="metric"):
        th.run(tune_tasks.make_task, scheduler=ASHAScheduler(), trial_executor=ex)
    with pytest.raises(MissingMetricError, match="mode"):
        th.run(tune_tasks.make_task, metric="loss", mode="lowest", trial_executor=ex)
    with pytest.raises(TypeError, match="unexpected"):
        th.run(tune_tasks.make_task, not_an_arg=1, trial_executor=ex)
    with pytest.raises(UnknownPolicyError, match="lrtf"):
        HydraExecutor(policy="fastest")
    with pytest.raises(TuneHydraError, match="8GiB"):
        HydraExecutor(device_memory="lots")
    assert not ex.started  # nothing was started by the rejected calls
    assert not [n for n in ray.util.list_named_actors() if n.startswith("tune_hydra_engine")]


class _Resources(tune.Callback):
    """Records each started trial's resource request."""

    def __init__(self) -> None:
        self.started: list[dict[str, float]] = []

    def on_trial_start(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
        self.started.append(dict(trial.placement_group_factory.required_resources))


def test_resources_per_trial_is_dropped_with_one_warning(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """As ``tune.with_resources`` around ``ex.trainable(...)``: the request is dropped with
    one warning, and every trial holds its engine slot (and no CPU)."""
    resources = _Resources()
    ex = shared_executor
    with pytest.warns(UserWarning, match=r"resources_per_trial of th\.run\) is dropped") as w:
        analysis = th.run(
            tune_tasks.make_task,
            config={"lr": tune.grid_search([0.01, 0.03])},
            resources_per_trial={"cpu": 2, "gpu": 0.5},
            stop={"training_iteration": 2},
            callbacks=[resources],
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    dropped = [x for x in w if "is dropped" in str(x.message)]
    assert len(dropped) == 1 and "{'CPU': 2.0, 'GPU': 0.5}" in str(dropped[0].message)
    assert _registered(ex) == []
    assert [t.status for t in analysis.trials] == ["TERMINATED"] * 2
    assert resources.started == [{"hydra_slot": 1.0}] * 2, resources.started


def test_a_tasks_own_metric_named_loss_ranks_the_run(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """metric='loss' with a task whose own metric is named loss: the trials report that
    metric as loss (the best checkpoint's model gives it) and the training loss as
    train_loss, and the run's scheduler wrapper says nothing about ranking by training
    loss."""

    def make_task(config: dict[str, Any]) -> th.ModelTask:
        task = tune_tasks.make_task(config)
        return dataclasses.replace(task, metrics={"loss": lambda out, y: (out - y).abs().mean()})

    ex = shared_executor
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analysis = th.run(
            make_task,
            config={"lr": tune.grid_search([0.003, 0.03])},
            metric="loss",
            mode="min",
            stop={"training_iteration": 2},
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    assert _registered(ex) == []
    assert not [x for x in caught if "training loss" in str(x.message)]
    for trial in analysis.trials:
        result = trial.last_result
        assert trial.status == "TERMINATED" and result["training_iteration"] == 2
        assert {"loss", "train_loss", "val_loss"} <= set(result)
        assert result["loss"] != result["train_loss"]
    best = analysis.get_best_trial("loss", "min", "last")
    assert best is not None
    assert best.last_result["loss"] == min(t.last_result["loss"] for t in analysis.trials)
    ckpt = analysis.get_last_checkpoint(best)  # the trial's end: its last result
    assert ckpt is not None
    model = tune_tasks.build_model(16, torch.float32)
    model.load_state_dict(torch.load(Path(ckpt.path) / "model.pt"))
    model.eval()
    eval_data = tune_tasks.dataset()[:2]  # make_task's eval_data
    with torch.no_grad():
        mae = sum(float((model(x) - y).abs().mean()) * len(y) for x, y in eval_data) / sum(
            len(y) for _, y in eval_data
        )
    assert best.last_result["loss"] == pytest.approx(mae, rel=1e-5)


def test_auto_devices_without_gpu_warns(ray_session: Any) -> None:
    # No wall-clock bound (< 60 s failed under load: it measured the machine, not this).
    with pytest.warns(UserWarning, match="no GPU"), HydraExecutor(devices="auto") as ex:
        assert len(ex.engines()) == 1
    assert os.environ.get("RAY_AUTH_MODE") == "disabled"


def test_disk_tier_search(ray_session: Any, storage: str, tmp_path: Path) -> None:
    """HydraExecutor(host_memory=, spill_dir=): trials finish with their state partly on
    disk, and the engine's scratch folder is gone after shutdown."""
    report = th.plan(tune_tasks.make_task, {"lr": 0.01}, device_memory=BUDGET)[0]
    largest = max(s.state_bytes for s in report.shards)
    host_memory = 2 * largest  # two trials' state does not fit: some of it goes to disk
    assert host_memory < 2 * report.state_bytes
    spill_dir = tmp_path / "spill"
    missing = HydraExecutor(devices="cpu", host_memory=host_memory, spill_dir=spill_dir)
    with pytest.raises(SpillDirError):  # checked where the engine starts, on its node
        missing.start()
    assert not missing.started
    spill_dir.mkdir()
    ex = HydraExecutor(
        devices="cpu", device_memory=BUDGET, host_memory=host_memory, spill_dir=spill_dir
    )
    with ex:
        analysis = th.run(
            tune_tasks.make_task,
            config={"lr": tune.grid_search([0.003, 0.03])},
            metric="val_loss",
            mode="min",
            stop={"training_iteration": 2},
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
        (summary,) = ex.summary().values()
        # the engine's own scratch folder, while it is up
        assert [p.name.startswith("tune_hydra-") for p in spill_dir.iterdir()] == [True]
    assert summary["host"]["budget"] == host_memory
    assert summary["host"]["written_bytes"] > 0 and summary["host"]["read_bytes"] > 0
    assert len(analysis.trials) == 2
    for trial in analysis.trials:
        assert trial.status == "TERMINATED"
        assert trial.last_result["training_iteration"] == 2
    assert list(spill_dir.iterdir()) == []  # removed when the engine closed
