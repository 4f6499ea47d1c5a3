"""Checkpoints written by earlier tune_hydra versions (tests/frontends/data/checkpoints,
see its make_checkpoints.py) restore exactly: a trial goes on from them as it would have
gone on in the version that wrote them (float64, bit for bit).

The older per-shard layout that other tests make with ``per_shard_state`` is checked here
against the folder that version wrote.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import tune_hydra as th
from tests.conftest import assert_same, make_task, mlp
from tests.engine.runtime.test_resume import assert_equal, per_shard_state
from tune_hydra.exceptions import CheckpointError
from tune_hydra.frontends import checkpoint as ck
from tune_hydra.frontends.task_loop import TaskLoop

DATA = Path(__file__).resolve().parent / "data" / "checkpoints"
OPTIONS: dict[str, Any] = {"accumulate_steps": 2, "iteration_batches": 3}
CONFIG = {"lr": 0.01}
FOLDERS = ["v2_by_name", "v2_per_shard", "v1_per_shard"]
SAVED_UNDER = 24_000  # the device_memory they were cut by


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


def _engine(device_memory: int | None) -> th.Engine:
    return th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, device_memory=device_memory)


@pytest.fixture(scope="module")
def straight() -> th.ModelTask:
    """The task trained on without a stop: 3 iterations (the checkpoints hold 2)."""
    task = make_task(mlp(), "adam")
    with _engine(SAVED_UNDER) as engine:
        loop = TaskLoop("a", task, engine, seed=3, **OPTIONS)
        for _ in range(3):
            loop.train_iteration()
        loop.close()
    return task


def _copy(folder: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / folder, tmp_path / folder))


@pytest.mark.parametrize("device_memory", [SAVED_UNDER, None])
@pytest.mark.parametrize("folder", FOLDERS)
def test_an_old_checkpoint_goes_on_as_a_task_loop(
    folder: str, device_memory: int | None, straight: th.ModelTask, tmp_path: Path
) -> None:
    # None: one shard, another cut than the checkpoint's (a format-2 manifest names its
    # cut; a format-1 one does not, so its per-shard state needs the cut it was made with)
    path = _copy(folder, tmp_path)
    resumed = make_task(mlp(seed=9), "adam")  # other weights: the checkpoint's win
    with _engine(device_memory) as engine:
        loop = TaskLoop("a", resumed, engine, seed=3, **OPTIONS)
        if folder == "v1_per_shard" and device_memory is None:
            with pytest.raises(CheckpointError, match=r"per shard.*give the cut it was saved"):
                ck.restore_trial(loop, path, trial_id="t", config=CONFIG)
            loop.close()
            return
        ck.restore_trial(loop, path, trial_id="t", config=CONFIG)
        assert loop.iteration == 2 and loop.epoch == 1 and loop.batch_in_epoch == 1
        result = loop.train_iteration()
        loop.close()
    assert result["iteration"] == 3
    assert_same(resumed.model, straight.model)


@pytest.mark.parametrize("folder", FOLDERS)
def test_an_old_checkpoint_saved_again_goes_on_under_any_cut(
    folder: str, straight: th.ModelTask, tmp_path: Path
) -> None:
    # Restored under the cut it was made with and saved again (the fix a refused per-shard
    # checkpoint's error gives): the new checkpoint keeps optimizer state by parameter
    # name, and goes on as one shard, trained on the loop's own thread.
    path = _copy(folder, tmp_path)
    with _engine(SAVED_UNDER) as engine:
        loop = TaskLoop("a", make_task(mlp(seed=9), "adam"), engine, seed=3, **OPTIONS)
        ck.restore_trial(loop, path, trial_id="t", config=CONFIG)
        manifest = ck.save_trial(loop, tmp_path / "again", trial_id="t", config=CONFIG)
        cut = loop.cut()
        loop.close()
    assert manifest["format"] == ck.FORMAT and manifest["shards"] == cut
    _, state, _ = ck.read_checkpoint(tmp_path / "again")
    assert "optimizers" not in state and "grads" not in state
    assert sorted(state["optimizer"]["state"]) == sorted(state["param_grads"])
    resumed = make_task(mlp(seed=5), "adam")
    with _engine(None) as engine:
        loop = TaskLoop("a", resumed, engine, seed=3, **OPTIONS)
        ck.restore_trial(loop, tmp_path / "again", trial_id="t", config=CONFIG)
        assert len(loop.cut()) == 1 < len(manifest["shards"])
        (result,) = loop.start(1).result(timeout=120)
        loop.close()
    assert result["iteration"] == 3
    assert_same(resumed.model, straight.model)


def test_the_per_shard_layout_is_rebuilt_as_the_old_version_wrote_it() -> None:
    # v2_by_name and v2_per_shard hold one state (saved together), in the two layouts:
    # restored from the first under its cut, per_shard_state gives the second exactly.
    model, by_name, _ = ck.read_checkpoint(DATA / "v2_by_name")
    want_model, want, manifest = ck.read_checkpoint(DATA / "v2_per_shard")
    with _engine(SAVED_UNDER) as engine:
        loop = TaskLoop("a", make_task(mlp(seed=9), "adam"), engine, seed=3, **OPTIONS)
        loop.load_state({**by_name, "model": model})
        assert loop.cut() == manifest["shards"]
        got = per_shard_state(loop)
        loop.close()
    assert_equal(got.pop("model"), want_model)
    assert_equal(got, want)


def test_the_old_checkpoints_are_unchanged() -> None:
    # Each still verifies against its own manifest (format 2: sizes and SHA-256 of files).
    for folder in FOLDERS:
        manifest = ck.verify_checkpoint(DATA / folder)
        assert manifest["iteration"] == 2 and manifest["trial_id"] == "old", folder
