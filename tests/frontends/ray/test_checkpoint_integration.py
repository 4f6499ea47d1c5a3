"""Checkpoints under Ray Tune: tampered checkpoints are refused on ``Tuner.restore`` (no
code runs, no mix loads), and an engine killed mid-save leaves no temp file or folder."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch
from ray import tune

import tune_hydra as th
from tests.frontends.ray import tune_tasks
from tests.frontends.test_checkpoint import plant_payload, replace_file
from tune_hydra.exceptions import CheckpointError
from tune_hydra.frontends.checkpoint import (
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    config_digest,
    is_temp_name,
    restore_trial,
    save_trial,
)
from tune_hydra.frontends.ray import HydraExecutor
from tune_hydra.frontends.task_loop import TaskLoop
from tune_hydra.options import EngineOptions

pytestmark = pytest.mark.integration

BUDGET = "18KiB"  # 2 shards for the 16-wide float32 MLP
SEED = 11


def _error_text(result: Any) -> str:
    """The trial's error, which must be a CheckpointError (as Ray re-raises it)."""
    assert isinstance(result.error, CheckpointError), (result.config, result.error)
    return str(result.error)


def _checkpoints(trial_dir: Path) -> list[Path]:
    return sorted(trial_dir.glob("checkpoint_*"))


def _tamper(latest: Path, kind: str, marker: Path) -> None:
    """Spoil the trial's latest checkpoint the way ``kind`` says."""
    if kind == "payload":  # a payload whose digest was also put into the manifest
        plant_payload(latest, marker, update_manifest=True)
    elif kind == "stale":  # model.pt of the checkpoint before, over the latest one's
        earlier = _checkpoints(latest.parent)[-2]
        shutil.copyfile(earlier / MODEL_FILE, latest / MODEL_FILE)
    elif kind == "garbage":
        size = (latest / STATE_FILE).stat().st_size
        (latest / STATE_FILE).write_bytes(os.urandom(size))
    elif kind == "dictpkl":  # Ray's own dict checkpoint, which Trainable.restore unpickles
        import pickle

        from tests.frontends.test_checkpoint import Payload

        pkl_marker = marker.with_name(marker.name + "-pkl")
        (latest / "_dict_checkpoint.pkl").write_bytes(pickle.dumps(Payload(pkl_marker)))


def test_tuner_restore_refuses_tampered_checkpoints(
    ray_session: Any, storage: str, tmp_path: Path
) -> None:
    fail = tmp_path / "fail-while-present"
    fail.touch()
    marker = tmp_path / "payload-ran"
    kinds = ["payload", "stale", "garbage", "dictpkl", "intact"]
    space = {"lr": 0.02, "marker": str(fail), "once": False, "tamper": tune.grid_search(kinds)}
    with HydraExecutor(devices="cpu", device_memory=BUDGET, seed=SEED) as ex:
        tuner = tune.Tuner(
            ex.trainable(tune_tasks.make_task),
            param_space=space,
            tune_config=tune.TuneConfig(
                metric="val_loss",
                mode="min",
                scheduler=ex.scheduler(),
                max_concurrent_trials=ex.max_concurrent_trials,
            ),
            run_config=tune.RunConfig(
                name="tamper",
                storage_path=storage,
                stop={"training_iteration": 4},
                checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1),
                callbacks=ex.callbacks(),
                verbose=0,
            ),
        )
        first = tuner.fit()
        assert first.num_errors == len(kinds)  # every trial failed in its third epoch
        latest: dict[str, Path] = {}
        for result in first:
            assert result.metrics["training_iteration"] == 2
            latest[result.config["tamper"]] = Path(result.checkpoint.path)
            _tamper(latest[result.config["tamper"]], result.config["tamper"], marker)

        fail.unlink()
        restored = tune.Tuner.restore(
            str(Path(storage) / "tamper"),
            trainable=ex.trainable(tune_tasks.make_task),
            resume_errored=True,
        )
        second = restored.fit()
    by_kind = {r.config["tamper"]: r for r in second}

    # the untouched checkpoint resumes and finishes: restore itself works
    assert by_kind["intact"].error is None
    assert by_kind["intact"].metrics["training_iteration"] == 4

    payload = _error_text(by_kind["payload"])
    assert "CheckpointError" in payload and STATE_FILE in payload
    assert str(latest["payload"]) in payload and "weights_only" in payload
    assert not marker.exists()  # the payload did not run in the engine ...
    torch.load(latest["payload"] / STATE_FILE, weights_only=False)
    assert marker.exists()  # ... though it runs wherever the file is loaded unsafely

    stale = _error_text(by_kind["stale"])
    assert "CheckpointError" in stale and str(latest["stale"]) in stale
    assert f"{MODEL_FILE} has sha256" in stale and "stale" in stale

    # issue 23 item 2: refused in the trial process before Ray's restore unpickles it
    planted = _error_text(by_kind["dictpkl"])
    assert "ForeignCheckpointFileError" in planted and "_dict_checkpoint.pkl" in planted
    assert str(latest["dictpkl"]) in planted and "earlier checkpoint" in planted
    assert not marker.with_name(marker.name + "-pkl").exists()

    garbage = _error_text(by_kind["garbage"])
    assert "CheckpointError" in garbage and str(latest["garbage"]) in garbage
    assert f"{STATE_FILE} has sha256" in garbage
    assert "earlier checkpoint" in garbage


class _KillDuringSave(threading.Thread):
    """SIGKILLs process ``pid`` the first time it holds a checkpoint temp file open (it is
    then writing or hashing that file), and remembers the file."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.seen: Path | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        fd_dir = f"/proc/{self.pid}/fd"
        while not self.stop.is_set():
            try:
                fds = os.listdir(fd_dir)
            except OSError:  # the process is gone
                return
            for fd in fds:
                try:
                    target = os.readlink(f"{fd_dir}/{fd}")
                except OSError:
                    continue
                if is_temp_name(os.path.basename(target)):
                    os.kill(self.pid, signal.SIGKILL)
                    self.seen = Path(target)
                    return
            time.sleep(0.001)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")
def test_engine_killed_during_save_leaves_no_temp_files(ray_session: Any, storage: str) -> None:
    with HydraExecutor(devices="cpu", device_memory="2GiB", seed=SEED) as ex:
        (engine,) = ex.engines().values()
        killer = _KillDuringSave(int(ray.get(engine.start.remote())["pid"]))
        killer.start()
        try:
            analysis = th.run(
                tune_tasks.make_wide_task,
                config={"layers": 2},
                stop={"training_iteration": 2},
                checkpoint_freq=1,
                max_failures=1,
                storage_path=storage,
                trial_executor=ex,
                verbose=0,
            )
        finally:
            killer.stop.set()
            killer.join(10)
    assert killer.seen is not None, "the engine was never seen writing a checkpoint"
    save_dir = killer.seen.parent
    # The save was interrupted: Tune's folder for it (made by Trainable.save in the trial
    # process's temp dir) and the temp file in it are gone ...
    assert str(save_dir).startswith(tempfile.gettempdir())
    assert not save_dir.exists(), sorted(os.listdir(save_dir))
    # ... nothing of it reached the trial's folder, and the retried trial saved normally.
    (trial,) = analysis.trials
    assert trial.num_failures == 1 and trial.status == "TERMINATED"
    left = [p for p in Path(storage).rglob("*") if is_temp_name(p.name)]
    assert left == []
    final = Path(trial.checkpoint.path)
    assert sorted(os.listdir(final)) == sorted([META_FILE, MODEL_FILE, STATE_FILE])
    assert json.loads((final / META_FILE).read_text())["iteration"] == 2


# ------------- a trial saved and restored as its TaskTrainable does, in-process (no Ray)
ENGINE = EngineOptions(devices="cpu", device_memory=BUDGET, policy="lrtf", prefetch=True)


@pytest.fixture
def engine() -> Any:
    with th.Engine(options=ENGINE) as eng:
        yield eng


def _trial(engine: Any, key: str, config: dict[str, Any], iterations: int = 0) -> Any:
    """Trial ``key``'s task as a factory's trial trains it (a ``TaskLoop``), after
    ``iterations``; with what ``_save``/``_load`` read of a trial (its id and config)."""
    loop = TaskLoop(key, tune_tasks.make_task(config), engine, seed=SEED)
    for _ in range(iterations):
        loop.train_iteration()
    return SimpleNamespace(key=key, loop=loop, config=config)


def _save(trial: Any, path: str) -> dict[str, Any]:
    """What ``TaskTrainable.save_checkpoint`` runs for ``trial``."""
    return save_trial(trial.loop, path, trial_id=trial.key, config=trial.config)


def _load(trial: Any, path: str) -> None:
    """What ``TaskTrainable.load_checkpoint`` runs for ``trial``."""
    restore_trial(trial.loop, path, trial_id=trial.key, config=trial.config)


def _lrs(trial: Any) -> list[float]:
    return [g["lr"] for g in trial.loop.state()["optimizer"]["param_groups"]]


def test_a_trial_writes_a_verified_manifest_without_the_config(engine: Any, tmp_path: Path) -> None:
    config = {"lr": 0.01, "note": object()}  # not something a checkpoint may pickle
    trial = _trial(engine, "a", config, iterations=2)
    manifest = _save(trial, str(tmp_path))
    assert manifest["format"] == 2 and manifest["iteration"] == 2 and manifest["trial_id"] == "a"
    assert manifest["shards"] == trial.loop.cut()
    assert manifest["num_shards"] == len(trial.loop.cut()) == 2
    assert manifest["config_digest"] == config_digest(config)
    assert json.loads((tmp_path / META_FILE).read_text()) == manifest
    assert sorted(os.listdir(tmp_path)) == sorted([META_FILE, MODEL_FILE, STATE_FILE])
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)  # plain data only
    assert "_tune_config" not in state and state["iteration"] == 2


def test_a_restore_merges_hyperparameters_only_for_another_config(
    engine: Any, tmp_path: Path
) -> None:
    first = _trial(engine, "a", {"lr": 0.01}, iterations=2)
    _save(first, str(tmp_path))
    moments = first.loop.state()["optimizer"]["state"]
    # Mark the checkpoint's own hyperparameters, to tell where a trial's lr came from.
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    for group in state["optimizer"]["param_groups"]:
        group["lr"] = 0.3
    replace_file(tmp_path, STATE_FILE, state, update_manifest=True)
    # PBT: a trial with a mutated lr takes the checkpoint: moments from it, lr its own
    b = _trial(engine, "b", {"lr": 0.05})
    _load(b, str(tmp_path))
    state_b = b.loop.state()
    assert state_b["iteration"] == 2
    assert _lrs(b) and set(_lrs(b)) == {0.05}
    assert sorted(state_b["optimizer"]["state"]) == sorted(moments)
    for k, v in moments.items():
        assert torch.equal(
            state_b["optimizer"]["state"][k]["momentum_buffer"], v["momentum_buffer"]
        )
    # the same config (another dict, same digest) is a resume: lr from the checkpoint
    c = _trial(engine, "c", {"lr": 0.01})
    _load(c, str(tmp_path))
    assert set(_lrs(c)) == {0.3}


def test_a_checkpoint_cut_differently_restores_exactly(tmp_path: Path) -> None:
    """A checkpoint written under one budget restores into an engine of another (and a
    PBT exploit across the two still takes the new config's lr), in both layouts: by
    parameter name, and the older per shard (its manifest names its cut)."""
    with (
        th.Engine(options=ENGINE) as two_shards,
        th.Engine(options=dataclasses.replace(ENGINE, device_memory=None)) as one_shard,
    ):
        a = _trial(two_shards, "a", {"lr": 0.01}, iterations=1)
        _save(a, str(tmp_path))
        a.loop.train_iteration()
        want = a.loop.state()
        assert len(a.loop.cut()) == 2
        back = _trial(one_shard, "b", {"lr": 0.01})
        assert len(back.loop.cut()) == 1
        _load(back, str(tmp_path))
        back.loop.train_iteration()
        got = back.loop.state()
        for k, v in want["model"].items():
            assert torch.equal(got["model"][k], v), k
        for k, v in want["optimizer"]["state"].items():
            assert torch.equal(
                got["optimizer"]["state"][k]["momentum_buffer"], v["momentum_buffer"]
            )
        c = _trial(one_shard, "c", {"lr": 0.07})
        _load(c, str(tmp_path))  # PBT: the new lr
        assert set(_lrs(c)) == {0.07}


def test_the_checkpoint_of_an_interrupted_save_is_named(engine: Any, tmp_path: Path) -> None:
    trial = _trial(engine, "a", {"lr": 0.01})
    _save(trial, str(tmp_path))
    (tmp_path / META_FILE).unlink()
    with pytest.raises(CheckpointError, match="interrupted") as info:
        _load(trial, str(tmp_path))
    assert info.value.checkpoint == str(tmp_path) and info.value.file == META_FILE
    assert isinstance(info.value, th.TuneHydraError)


def test_a_position_past_the_data_is_named_as_a_damaged_checkpoint(
    engine: Any, tmp_path: Path
) -> None:
    """Issue 23, item 8: batch_in_epoch past the task's data (digests updated) was a
    TaskFailedError: StopIteration in the next epoch; now the load is refused naming the
    field, and the trial keeps what it had."""
    _save(_trial(engine, "a", {"lr": 0.01}, iterations=1), str(tmp_path))
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    replace_file(tmp_path, STATE_FILE, {**state, "batch_in_epoch": 99}, update_manifest=True)
    back = _trial(engine, "b", {"lr": 0.01})
    before = back.loop.state()
    with pytest.raises(CheckpointError, match=r"'batch_in_epoch' is 99, past the end") as info:
        _load(back, str(tmp_path))
    assert info.value.checkpoint == str(tmp_path) and info.value.file == STATE_FILE
    assert "tampered" in str(info.value)
    after = back.loop.state()
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())
    assert back.loop.train_iteration()["epoch"] == 1
