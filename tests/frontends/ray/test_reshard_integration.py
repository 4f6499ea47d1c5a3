"""``Tuner.restore`` under another ``device_memory``: the checkpoint of a trial cut into 3
shards resumes in an engine that cuts the model into 1, and the result equals an
uninterrupted run bit for bit (float64)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import tune

from tests.frontends.ray import tune_tasks
from tune_hydra.engine import Engine
from tune_hydra.frontends.checkpoint import META_FILE, MODEL_FILE
from tune_hydra.frontends.ray import HydraExecutor
from tune_hydra.frontends.task_loop import TaskLoop

pytestmark = pytest.mark.integration

SEED = 11
BEFORE = "18KiB"  # 3 shards for the float64 MLP
AFTER = None  # no budget: 1 shard


def _straight(config: dict[str, Any], device_memory: str | None) -> dict[str, torch.Tensor]:
    """The model after 4 uninterrupted epochs, trained in this process."""
    with Engine(devices="cpu", device_memory=device_memory) as eng:
        loop = TaskLoop("ref", tune_tasks.make_task(config), eng, seed=SEED)
        loop.start(4).result(timeout=120)
        return loop.state()["model"]


def _tuner_parts(ex: HydraExecutor, storage: str) -> dict[str, Any]:
    return {
        "tune_config": tune.TuneConfig(
            metric="val_loss",
            mode="min",
            scheduler=ex.scheduler(),
            max_concurrent_trials=ex.max_concurrent_trials,
        ),
        "run_config": tune.RunConfig(
            name="reshard",
            storage_path=storage,
            stop={"training_iteration": 4},
            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1),
            callbacks=ex.callbacks(),
            verbose=0,
        ),
    }


def test_tuner_restore_under_another_device_memory_equals_a_straight_run(
    ray_session: Any, storage: str, tmp_path: Path
) -> None:
    marker = tmp_path / "fail-while-present"
    marker.touch()
    config = {"lr": 0.02, "float64": True, "marker": str(marker), "once": False}
    with HydraExecutor(devices="cpu", device_memory=BEFORE, seed=SEED) as ex:
        first = tune.Tuner(
            ex.trainable(tune_tasks.make_task), param_space=config, **_tuner_parts(ex, storage)
        ).fit()
    (failed,) = first
    assert "injected failure" in str(failed.error)  # in its third epoch
    assert failed.metrics["training_iteration"] == 2 and failed.metrics["num_shards"] == 3
    saved = json.loads((Path(failed.checkpoint.path) / META_FILE).read_text())
    assert len(saved["shards"]) == 3

    marker.unlink()
    with HydraExecutor(devices="cpu", device_memory=AFTER, seed=SEED) as ex:
        second = tune.Tuner.restore(
            str(Path(storage) / "reshard"),
            trainable=ex.trainable(tune_tasks.make_task),
            resume_errored=True,
        ).fit()
    (resumed,) = second
    assert resumed.error is None
    assert resumed.metrics["training_iteration"] == 4 and resumed.metrics["num_shards"] == 1
    manifest = json.loads((Path(resumed.checkpoint.path) / META_FILE).read_text())
    assert len(manifest["shards"]) == 1  # the manifest records the new cut

    got = torch.load(Path(resumed.checkpoint.path) / MODEL_FILE, weights_only=True)
    straight = {**config, "marker": None}
    for device_memory in (BEFORE, AFTER):  # the same weights, however it was cut
        want = _straight(straight, device_memory)
        assert list(got) == list(want)
        for key, value in want.items():
            assert got[key].dtype == torch.float64 and torch.equal(got[key], value), key
