"""The disk tier below host memory (``host_memory=``, ``spill_dir=``): training stays
exact (float64, bit for bit against plain PyTorch on a deepcopy) while shard states go to
files and come back, the trace's replay keeps host memory within the budget, checkpoints
taken while shards are on disk resume exactly, bad folders (a RAM file system among them),
full disks, folders made unwritable or deleted mid-run give clear errors or lose nothing,
the engine's scratch folder is its own (locked: another engine removes it only once its
engine is gone) and is cleaned up, and ``train_models`` hands back models in RAM.

Every test spills to ``disk_path``: ``tmp_path``, or a folder on a disk when ``tmp_path``
is on a tmpfs (the disk tier refuses a RAM file system)."""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import make_task, plain_copy
from tests.engine.runtime.test_resume import assert_equal
from tune_hydra.engine import Engine
from tune_hydra.engine.storage.disk import LOCK_NAME, ram_file_system
from tune_hydra.exceptions import (
    HostBudgetError,
    SpillDirError,
    SpillDiskFullError,
    SpillWriteError,
    TrainingError,
)
from tune_hydra.frontends.task_loop import TaskLoop

# Every model is a stack of (Linear, ReLU) pairs and a last Linear: cut two layers per
# shard, every shard holds state, and the widest Linear(width, width) sets the largest.
CUT = 2
SEED = 3
CLIP_ACCUM = {"accumulate_steps": 2, "max_grad_norm": 0.5}


def disk_folder(tmp_path: Path) -> Iterator[Path]:
    """A fresh folder on a disk: ``tmp_path``, unless that is on a RAM file system (the
    disk tier refuses one); then a folder under /var/tmp or the repository, removed
    after the test. Skips only if there is no such folder."""
    if ram_file_system(tmp_path) is None:
        yield tmp_path
        return
    for root in (Path("/var/tmp"), Path(__file__).resolve().parents[3]):
        if root.is_dir() and os.access(root, os.W_OK) and ram_file_system(root) is None:
            folder = Path(tempfile.mkdtemp(prefix="hydra-disk-test-", dir=root))
            try:
                yield folder
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            return
    pytest.skip("no folder on a disk here (tmp_path, /var/tmp and the repository are in RAM)")


@pytest.fixture
def disk_path(tmp_path: Path) -> Iterator[Path]:
    """See :func:`disk_folder`."""
    yield from disk_folder(tmp_path)


def stack(depth: int, width: int = 16, seed: int = 0) -> nn.Sequential:
    """``depth`` Linear layers (8 -> width ... -> 4) with ReLUs between, float64."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers).to(torch.float64)


def build(specs: dict[str, tuple[str, int, int]], n: int = 3) -> dict[str, th.ModelTask]:
    """Tasks ``{name: (optimizer, depth, width)}``, each with ``n`` batches per epoch."""
    return {
        name: make_task(stack(depth, width, seed=i), opt, n=n)
        for i, (name, (opt, depth, width)) in enumerate(specs.items())
    }


def loops(
    eng: Engine, tasks: dict[str, th.ModelTask], *, cut: bool = False, **options: Any
) -> dict[str, TaskLoop]:
    """A TaskLoop of each task on ``eng`` (``cut``: registered now, not at its first
    batch). Keep the models referenced: a loop whose model is collected leaves the
    engine."""
    out = {name: TaskLoop(name, task, eng, seed=SEED, **options) for name, task in tasks.items()}
    if cut:
        for loop in out.values():
            loop.cut()
    return out


def state_sizes(tasks: dict[str, th.ModelTask]) -> tuple[int, int]:
    """(the largest shard state, all shards' states) of ``tasks`` as the engine cuts them,
    from the plans of deepcopies registered in an engine without a host budget."""
    with Engine("cpu", max_layers_per_shard=CUT, copy_on_cpu=True) as eng:
        copies = {name: copy.deepcopy(task) for name, task in tasks.items()}
        registered = loops(eng, copies, cut=True)
        states = [s.state_bytes for name in registered for s in eng.plan(name).shards]
    return max(states), sum(states)


def run_engine(
    tasks: dict[str, th.ModelTask],
    epochs: int,
    devices: list[str],
    host_memory: int | None,
    spill_dir: Path | None,
    options: dict[str, Any],
    **engine: Any,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any], Any]:
    """Train every task ``epochs`` iterations in one engine; returns the results, the
    host summary and the trace (after close: bringing the models back reads from disk)."""
    engine.setdefault("copy_on_cpu", True)
    with Engine(
        devices,
        max_layers_per_shard=CUT,
        host_memory=host_memory,
        spill_dir=spill_dir,
        **engine,
    ) as eng:
        registered = loops(eng, tasks, **options)
        futures = {name: loop.start(epochs) for name, loop in registered.items()}
        results = {name: f.result(timeout=120) for name, f in futures.items()}
    return results, eng.summary()["host"], eng.trace


def assert_plain(
    results: list[dict[str, Any]],
    model: nn.Module,
    ref: th.ModelTask,
    epochs: int,
    devices: int,
    options: dict[str, Any],
) -> None:
    """``model`` (trained by the engine, with ``results``) equals plain training of ``ref``
    bit for bit: every loss and every parameter and buffer."""
    # Emulated devices run torch with a share of the intra-op threads; so does the reference.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // devices))
    try:
        want = th.train_plain(ref, epochs, seed=SEED, **options)
    finally:
        torch.set_num_threads(threads)
    assert [r["loss"] for r in results] == [r["loss"] for r in want]
    assert [r["val_loss"] for r in results] == [r["val_loss"] for r in want]
    got, expected = model.state_dict(), ref.model.state_dict()
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(
            got[key], expected[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}"
        )


def assert_disk_used(host: dict[str, Any], trace: Any, host_memory: int) -> None:
    """The run (its engine closed) wrote shard states to disk and read them back, its own
    account of host memory stayed within ``host_memory``, and the trace agrees."""
    assert host["budget"] == host_memory
    assert host["written_bytes"] > 0 and host["read_bytes"] > 0, host
    assert host["spills"] > 0 and host["loads"] > 0, host
    assert host["peak_held_bytes"] <= host_memory, host
    disk = trace.summary()["disk"]
    assert disk["written_bytes"] == host["written_bytes"], (disk, host)
    assert disk["read_bytes"] == host["read_bytes"], (disk, host)
    trace.validate(host_budget=host_memory)


# Four tasks, one of each optimizer (Adam twice, one narrower): with the host budget at
# (devices + 2) x the largest shard state their states sum to more than 4x the budget.
PARITY_TASKS = {
    "sgd": ("sgd", 8, 16),
    "adam": ("adam", 8, 16),
    "adamw": ("adamw", 8, 16),
    "narrow": ("adam", 8, 12),
}


@pytest.mark.parametrize(
    ("devices", "prefetch", "copy_on_cpu", "options"),
    [
        pytest.param(1, True, True, CLIP_ACCUM, id="1dev-prefetch-accum-clip"),
        pytest.param(1, False, True, {}, id="1dev-no-prefetch"),
        pytest.param(2, True, True, {}, id="2dev-prefetch"),
        pytest.param(2, False, True, CLIP_ACCUM, id="2dev-no-prefetch-accum-clip"),
        pytest.param(1, True, False, CLIP_ACCUM, id="1dev-no-copy-accum-clip"),
        pytest.param(2, True, False, {}, id="2dev-no-copy"),
    ],
)
def test_float64_parity_with_the_disk_tier(
    disk_path: Path, devices: int, prefetch: bool, copy_on_cpu: bool, options: dict[str, Any]
) -> None:
    tasks = build(PARITY_TASKS)
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, total = state_sizes(tasks)
    host_memory = (devices + 2) * largest  # strict: no slack
    assert total >= 4 * host_memory, (total, host_memory)
    results, host, trace = run_engine(
        tasks,
        2,
        ["cpu"] * devices,
        host_memory,
        disk_path,
        options,
        prefetch=prefetch,
        copy_on_cpu=copy_on_cpu,
    )
    assert_disk_used(host, trace, host_memory)
    for name, task in tasks.items():
        assert_plain(results[name], task.model, refs[name], 2, devices, options)


def test_host_memory_of_one_shard_trains_exactly_within_the_slack(disk_path: Path) -> None:
    """At host_memory = the largest shard state (the least accepted), host memory may go
    over by at most (devices + 1) x that state, and training is still exact."""
    tasks = build({"a": ("adam", 6, 16), "b": ("sgd", 6, 16)})
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, _ = state_sizes(tasks)
    devices = 2
    results, host, trace = run_engine(tasks, 2, ["cpu"] * devices, largest, disk_path, CLIP_ACCUM)
    assert host["written_bytes"] > 0 and host["read_bytes"] > 0, host
    slack = largest + (devices + 1) * largest
    assert host["peak_held_bytes"] <= slack, host
    trace.validate(host_budget=slack)
    for name, task in tasks.items():
        assert_plain(results[name], task.model, refs[name], 2, devices, CLIP_ACCUM)


# Three iterations of 3 batches over epochs of 4, in groups of 2: each checkpoint falls in
# the middle of an epoch and of an accumulation group.
MID_GROUP: dict[str, Any] = {"accumulate_steps": 2, "iteration_batches": 3, "max_grad_norm": 0.05}
RESUME_TASKS = {"a": ("adam", 8, 16), "b": ("sgd", 8, 16), "c": ("adamw", 8, 16)}


def _first_leg(spill_dir: Path | None, host_memory: int | None, total: int) -> dict[str, Any]:
    """One iteration of each resume task (their states sum to ``total``); their
    checkpoints, taken in the engine."""
    tasks = build(RESUME_TASKS, n=4)
    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=host_memory,
        spill_dir=spill_dir,
    ) as eng:
        first = loops(eng, tasks, **MID_GROUP)
        for fut in [loop.start(1) for loop in first.values()]:
            fut.result(timeout=120)
        if host_memory is not None:
            # Some states are on disk now: the engine holds less than all of them in RAM.
            host = eng.summary()["host"]
            assert host["written_bytes"] > 0, host
            assert host["held_bytes"] <= host_memory < total, (host, total)
        return {name: loop.state() for name, loop in first.items()}


@pytest.mark.parametrize("second_on_disk", [True, False], ids=["disk-then-disk", "disk-then-ram"])
def test_resume_from_a_checkpoint_taken_while_shards_were_on_disk(
    disk_path: Path, second_on_disk: bool
) -> None:
    largest, total = state_sizes(build(RESUME_TASKS, n=4))
    host_memory = 3 * largest
    states = _first_leg(disk_path, host_memory, total)
    # The same checkpoints as an engine without the disk tier takes.
    for name, state in _first_leg(None, None, total).items():
        assert_equal(states[name], state, name)
    # Fresh models of other weights: the checkpoints bring theirs.
    fresh = {
        name: make_task(stack(depth, width, seed=99), opt, n=4)
        for name, (opt, depth, width) in RESUME_TASKS.items()
    }
    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=host_memory if second_on_disk else None,
        spill_dir=disk_path if second_on_disk else None,
    ) as eng:
        second = loops(eng, fresh, **MID_GROUP)
        for name, loop in second.items():
            loop.load_state(copy.deepcopy(states[name]))
        for fut in [loop.start(3) for loop in second.values()]:
            fut.result(timeout=120)
        final = {name: loop.state()["model"] for name, loop in second.items()}
    if second_on_disk:
        assert_disk_used(eng.summary()["host"], eng.trace, host_memory)
    # 4 iterations of 3 batches = 3 epochs of 4 batches, uninterrupted and plain.
    options = {k: v for k, v in MID_GROUP.items() if k != "iteration_batches"}
    for name, task in build(RESUME_TASKS, n=4).items():
        th.train_plain(task, 3, seed=SEED, **options)
        assert_equal(final[name], task.model.state_dict(), name)
        assert_equal(fresh[name].model.state_dict(), task.model.state_dict(), name)


# -- errors ----------------------------------------------------------------------------


def test_a_missing_spill_dir_is_refused_naming_it(disk_path: Path) -> None:
    missing = disk_path / "no" / "such"
    with pytest.raises(SpillDirError, match=re.escape(str(missing))):
        Engine("cpu", host_memory=10**6, spill_dir=missing)
    with pytest.raises(SpillDirError):
        th.train_models(
            build({"a": ("sgd", 3, 8)}), devices=["cpu"], host_memory=10**6, spill_dir=missing
        )


def test_a_file_as_spill_dir_is_refused(disk_path: Path) -> None:
    path = disk_path / "a_file"
    path.write_text("not a folder")
    with pytest.raises(SpillDirError, match=re.escape(str(path))):
        Engine("cpu", host_memory=10**6, spill_dir=path)
    assert path.read_text() == "not a folder"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_spill_dir_is_refused(disk_path: Path) -> None:
    folder = disk_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(SpillDirError, match=re.escape(str(folder))):
            Engine("cpu", host_memory=10**6, spill_dir=folder)
    finally:
        folder.chmod(0o700)


def test_host_memory_needs_a_spill_dir() -> None:
    with pytest.raises(SpillDirError, match="spill_dir"):
        Engine("cpu", host_memory="1GiB")


def test_a_host_budget_below_one_shard_state_is_refused_with_the_numbers(
    disk_path: Path,
) -> None:
    specs = {"big": ("adam", 4, 32)}
    largest, _ = state_sizes(build(specs))
    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=largest - 1,
        spill_dir=disk_path,
    ) as eng:
        big = build(specs)["big"]
        loop = TaskLoop("big", big, eng, seed=SEED)
        with pytest.raises(HostBudgetError) as err:
            loop.cut()  # registered at the cut
        assert "big" not in eng.tasks()
    assert (err.value.task, err.value.nbytes, err.value.budget) == ("big", largest, largest - 1)
    assert f"{largest} bytes" in str(err.value) and f"{largest - 1} bytes" in str(err.value)
    # exactly one shard's state is enough to register
    with Engine(
        "cpu", max_layers_per_shard=CUT, copy_on_cpu=True, host_memory=largest, spill_dir=disk_path
    ) as eng:
        big = build(specs)["big"]
        assert len(TaskLoop("big", big, eng, seed=SEED).cut()) > 1
        assert eng.tasks() == ["big"]


def test_a_full_disk_fails_the_task_that_could_not_spill_and_no_other(
    disk_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tune_hydra.engine.storage import disk

    # "doomed" alone holds more state than host memory: some of it must go to disk.
    specs = {"alpha": ("adam", 8, 16), "beta": ("sgd", 8, 16), "doomed": ("adamw", 10, 16)}
    tasks = build(specs)
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, _ = state_sizes(tasks)
    host_memory = 3 * largest
    _, doomed_total = state_sizes({"doomed": tasks["doomed"]})
    assert doomed_total > host_memory
    original = disk.write_at
    refused: list[str] = []

    def write_at(path: Any, fd: Any, data: Any, offset: int) -> Any:
        if "doomed" in os.path.basename(os.fspath(path)):
            refused.append(os.fspath(path))
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, fd, data, offset)

    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=host_memory,
        spill_dir=disk_path,
    ) as eng:
        registered = loops(eng, tasks, cut=True)
        monkeypatch.setattr(disk, "write_at", write_at)  # the disk fills up mid-run
        futures = {name: loop.start(2) for name, loop in registered.items()}
        with pytest.raises(SpillDiskFullError) as err:
            futures["doomed"].result(timeout=120)
        results = {name: futures[name].result(timeout=120) for name in ("alpha", "beta")}
        state = registered["doomed"].state()
    assert refused, "no write of the doomed task's state was attempted"
    assert err.value.task == "doomed"
    assert str(disk_path) in err.value.path
    assert "No space left on device" in str(err.value)
    # The failed task's model is whole: finite, and what its checkpoint says.
    model = tasks["doomed"].model.state_dict()
    assert list(model) == list(state["model"])
    for key, value in state["model"].items():
        assert torch.isfinite(value).all(), key
        torch.testing.assert_close(model[key], value, rtol=0, atol=0)
    for name in ("alpha", "beta"):
        assert_plain(results[name], tasks[name].model, refs[name], 2, 1, {})


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")
def test_a_spill_dir_in_ram_is_refused() -> None:
    if ram_file_system("/dev/shm") is None:
        pytest.skip("/dev/shm is not a RAM file system here")

    def ours() -> set[Path]:  # other programs (Ray's object store) use /dev/shm too
        return {p for p in Path("/dev/shm").iterdir() if p.name.startswith("tune_hydra-")}

    before = ours()
    with pytest.raises(SpillDirError, match=r"RAM file system \(tmpfs\).*saves no memory"):
        Engine("cpu", host_memory=10**6, spill_dir="/dev/shm")
    with pytest.raises(SpillDirError, match="on a local disk"):
        th.train_models(
            build({"a": ("sgd", 3, 8)}), devices=["cpu"], host_memory=10**6, spill_dir="/dev/shm"
        )
    assert ours() == before  # nothing made there


@contextlib.contextmanager
def _unwritable(folder: Path) -> Iterator[None]:
    """``folder`` cannot take new files nor lose any (its open files stay writable): by
    its mode, or for root (who ignores modes) by the immutable attribute."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        try:
            yield
        finally:
            folder.chmod(0o700)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(folder)]).returncode != 0:
        pytest.skip("root here, and the file system has no immutable attribute")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(folder)], check=True)


def test_a_spill_folder_made_unwritable_fails_only_the_task_that_must_write(
    disk_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A task that needs a new spill file while the folder cannot take one fails with
    SpillWriteError saying what to do; the other tasks (idle, their states in the files
    they have) lose nothing and go on exactly once it is writable again; close() raises
    nothing though it cannot remove the folder (logged), and the next engine removes it
    once writable. (A loop trains into new files: its state's layout changes as
    ``zero_grad`` drops the gradients and a backward makes them again, and a new layout
    goes to a new file. So no loop trains on while the folder is unwritable.)"""
    tasks = build({"alpha": ("adam", 6, 16), "beta": ("sgd", 6, 16)})
    late = build({"x": ("adamw", 10, 16)})["x"]  # alone more state than host memory
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, _ = state_sizes({**tasks, "late": late})
    eng = Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=3 * largest,
        spill_dir=disk_path,
    )
    folder = Path(eng.summary()["host"]["spill_dir"])
    try:
        registered = loops(eng, tasks)
        first = {name: loop.start(1).result(timeout=120) for name, loop in registered.items()}
        for loop in registered.values():  # every state on disk, in a file of its own
            loop.state()  # (its shards brought home)
            for store in loop.runner.stores:
                store.try_spill()
        written = eng.summary()["host"]["written_bytes"]
        with _unwritable(folder):
            with pytest.raises(OSError):
                (folder / "probe").write_bytes(b"")
            with pytest.raises(SpillWriteError) as err:
                TaskLoop("late", late, eng, seed=SEED).start(2).result(timeout=120)
            assert eng.summary()["host"]["written_bytes"] == written  # nothing else wrote
        futures = {name: loop.start(2) for name, loop in registered.items()}
        results = {name: first[name] + futures[name].result(timeout=120) for name in tasks}
        with _unwritable(folder):
            with caplog.at_level(logging.WARNING):
                eng.close()  # raises nothing
            assert folder.exists() and "remove it by hand" in caplog.text
    finally:
        eng.close()
    assert err.value.task == "late" and str(folder) in err.value.path
    assert not isinstance(err.value, SpillDiskFullError)
    assert err.value.code in (errno.EACCES, errno.EPERM), err.value
    assert "not writable" in str(err.value) and "write permission" in str(err.value)
    for name in tasks:
        assert_plain(results[name], tasks[name].model, refs[name], 3, 1, {})
    with Engine("cpu", host_memory=10**6, spill_dir=disk_path):
        assert not folder.exists()  # its engine is gone: its lock is free


def test_train_models_with_a_spill_folder_made_unwritable_raises_no_raw_os_error(
    disk_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder becomes unwritable after the first write (here every task soon needs a
    new file): train_models returns, or raises TrainingError with a SpillWriteError per
    failed task (and its history), and the other tasks' exact results."""
    from tune_hydra.engine.storage import disk

    tasks = build({"a": ("adam", 6, 16), "b": ("sgd", 6, 16)})
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, _ = state_sizes(tasks)
    original = disk.write_at
    stack = contextlib.ExitStack()

    def write_at(path: Any, fd: Any, data: Any, offset: int) -> Any:
        original(path, fd, data, offset)
        if not stack._exit_callbacks:  # the first write made the folder: lock it now
            stack.enter_context(_unwritable(Path(path).parent))

    monkeypatch.setattr(disk, "write_at", write_at)
    with stack:
        try:
            history = th.train_models(
                tasks,
                devices=["cpu"],
                epochs=2,
                seed=SEED,
                copy_on_cpu=True,
                max_layers_per_shard=CUT,
                host_memory=3 * largest,
                spill_dir=disk_path,
            )
            errors: dict[str, BaseException] = {}
            results: dict[str, Any] = dict(history)
        except TrainingError as err:
            errors, results = err.errors, err.history
        assert stack._exit_callbacks, "nothing was written"
        assert [p.name for p in disk_path.iterdir()], "the folder could be removed"
    for name, error in errors.items():
        assert isinstance(error, SpillWriteError) and error.task == name, error
        assert isinstance(results[name], list)
        for key, value in tasks[name].model.state_dict().items():  # whole, in RAM
            assert torch.isfinite(value).all() and value.untyped_storage().filename is None, key
    for name in set(tasks) - set(errors):
        assert_plain(results[name], tasks[name].model, refs[name], 2, 1, {})


def test_a_spill_folder_deleted_mid_run_loses_nothing(
    disk_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """States on disk are read through the files' open descriptors, and the folder is
    made again for new files (a task added after the deletion): every task is exact."""
    tasks = build({"a": ("adam", 6, 16), "b": ("sgd", 6, 16)})
    late = build({"x": ("adamw", 6, 16)})["x"]
    refs = {name: plain_copy(task) for name, task in {**tasks, "late": late}.items()}
    largest, _ = state_sizes({**tasks, "late": late})
    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=3 * largest,
        spill_dir=disk_path,
    ) as eng:
        registered = loops(eng, tasks)
        first = {name: loop.start(1).result(timeout=120) for name, loop in registered.items()}
        folder = Path(eng.summary()["host"]["spill_dir"])
        assert eng.summary()["host"]["written_bytes"] > 0
        shutil.rmtree(folder)  # a cleaner of old files, or someone
        with caplog.at_level(logging.WARNING):
            registered["late"] = TaskLoop("late", late, eng, seed=SEED)
            futures = {name: loop.start(2) for name, loop in registered.items()}
            results = {name: futures[name].result(timeout=120) for name in futures}
        assert "was removed while this engine used it" in caplog.text
        assert (folder / LOCK_NAME).exists()  # made again, locked again
    for name in tasks:
        assert_plain(first[name] + results[name], tasks[name].model, refs[name], 3, 1, {})
    assert_plain(results["late"], late.model, refs["late"], 2, 1, {})
    assert not list(disk_path.iterdir())


def _spill_mappings(root: Path) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if str(root) in line]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_train_models_returns_models_in_ram_not_views_of_spill_files(disk_path: Path) -> None:
    tasks = build({"a": ("adam", 6, 16), "b": ("sgd", 6, 16)})
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, _ = state_sizes(tasks)
    history = th.train_models(
        tasks,
        devices=["cpu"],
        epochs=2,
        seed=SEED,
        copy_on_cpu=True,
        max_layers_per_shard=CUT,
        host_memory=3 * largest,
        spill_dir=disk_path,
    )
    host = history.summary["host"]
    assert host["written_bytes"] > 0 and host["read_bytes"] > 0
    # No gc.collect(): nothing of the engine's, nor the models, maps a spill file.
    assert _spill_mappings(disk_path) == []
    for name, task in tasks.items():
        for t in [*task.model.parameters(), *task.model.buffers()]:
            assert t.untyped_storage().filename is None
        assert_plain(history[name], task.model, refs[name], 2, 1, {})
    disk = history.trace.summary()["disk"]
    assert (disk["written_bytes"], disk["read_bytes"]) == (
        host["written_bytes"],
        host["read_bytes"],
    )
    history.trace.validate(host_budget=3 * largest + (len(tasks) + 1) * largest)


# -- the scratch folder ----------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _spilling_engine(spill_dir: Path) -> tuple[Engine, dict[str, TaskLoop]]:
    tasks = build({"a": ("adam", 6, 16), "b": ("adam", 6, 16)})
    largest, total = state_sizes(tasks)
    assert total > 3 * largest
    eng = Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=3 * largest,
        spill_dir=spill_dir,
    )
    return eng, loops(eng, tasks, cut=True)


def test_the_engine_folder_lives_as_long_as_the_engine(disk_path: Path) -> None:
    (disk_path / "notes.txt").write_text("mine")
    eng, registered = _spilling_engine(disk_path)
    try:
        for fut in [loop.start(1) for loop in registered.values()]:
            fut.result(timeout=120)
        assert eng.summary()["host"]["written_bytes"] > 0
        mine = [p for p in disk_path.iterdir() if p.name != "notes.txt"]
        assert len(mine) == 1 and mine[0].is_dir(), mine
        assert mine[0].name.startswith("tune_hydra-")
        assert f"-{os.getpid()}-" in mine[0].name
        assert eng.summary()["host"]["spill_dir"] == str(mine[0])
    finally:
        eng.close()
    assert sorted(p.name for p in disk_path.iterdir()) == ["notes.txt"]
    assert (disk_path / "notes.txt").read_text() == "mine"


def _host_prefix(spill_dir: Path) -> str:
    """``tune_hydra-<host>``, as this host's engines name their folders."""
    with Engine("cpu", host_memory=10**6, spill_dir=spill_dir) as eng:
        own = Path(eng.summary()["host"]["spill_dir"]).name
    assert f"-{os.getpid()}-" in own, own
    return own[: own.rindex(f"-{os.getpid()}-")]


def test_only_folders_of_engines_that_are_gone_are_removed_at_start(
    disk_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder is stale only when its lock file can be locked (its engine is gone) and
    says who owned it; a folder without one (an older version's, or one being created) is
    left alone, whatever the pid in its name, and so is anything not ours."""
    prefix = _host_prefix(disk_path)
    dead = _dead_pid()
    stale = disk_path / f"{prefix}-{dead}-abc"  # an engine that crashed
    legacy = disk_path / f"{prefix}-{dead}-old"  # no lock file: its owner cannot be known
    live = disk_path / f"{prefix}-{os.getpid()}-abc"
    elsewhere = disk_path / f"tune_hydra-not{prefix[len('tune_hydra-') :]}x-{dead}-abc"
    data = disk_path / "data"
    for folder in (stale, legacy, live, elsewhere, data):
        folder.mkdir()
        (folder / "shard.bin").write_bytes(b"\0" * 64)
    for folder in (stale, elsewhere):
        (folder / LOCK_NAME).write_text(f"{prefix} {dead}\n")  # unlocked: gone
    (disk_path / "notes.txt").write_text("mine")
    with (
        caplog.at_level(logging.INFO, logger="tune_hydra.engine.storage.disk"),
        Engine("cpu", max_layers_per_shard=CUT, host_memory=10**6, spill_dir=disk_path),
    ):
        assert not stale.exists()
        for folder in (legacy, live, elsewhere, data):
            assert (folder / "shard.bin").read_bytes() == b"\0" * 64, folder
    assert f"leaving {legacy} alone" in caplog.text and "remove it by hand" in caplog.text
    left = sorted(p.name for p in disk_path.iterdir())
    assert left == sorted([legacy.name, live.name, elsewhere.name, data.name, "notes.txt"])
    assert (disk_path / "notes.txt").read_text() == "mine"


# An engine in another container (another PID namespace, the same host name): its pid,
# as its folder's name says, is a pid that is not alive here.
_FOREIGN_ENGINE = """
import os, sys
import torch
from tune_hydra.engine.storage import disk

real, os.getpid = os.getpid, lambda: int(sys.argv[2])
folder = disk.SpillFolder(sys.argv[1])
os.getpid = real
spill = folder.file(("live", 0))
spill.write([(("p", 0), torch.full((64,), 7.0, dtype=torch.float64))])
print(folder.path, flush=True)
sys.stdin.readline()  # alive until killed
"""


def test_a_live_engine_in_another_pid_namespace_keeps_its_folder(disk_path: Path) -> None:
    dead = _dead_pid()
    proc = subprocess.Popen(
        [sys.executable, "-c", _FOREIGN_ENGINE, str(disk_path), str(dead)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        theirs = Path(proc.stdout.readline().strip())
        assert theirs.parent == disk_path and f"-{dead}-" in theirs.name
        files = sorted(theirs.glob("*.bin"))
        assert files
        eng, registered = _spilling_engine(disk_path)  # it cleans stale folders as it starts
        with eng:
            for fut in [loop.start(1) for loop in registered.values()]:
                fut.result(timeout=120)
            assert eng.summary()["host"]["written_bytes"] > 0
        assert sorted(theirs.glob("*.bin")) == files, "a live engine's folder was touched"
        values = torch.from_file(str(files[0]), size=64, dtype=torch.float64)
        assert torch.equal(values, torch.full((64,), 7.0, dtype=torch.float64))
        proc.send_signal(signal.SIGKILL)  # now it is gone: the kernel drops its lock
        proc.wait(timeout=30)
        with Engine("cpu", host_memory=10**6, spill_dir=disk_path) as eng:
            assert not theirs.exists()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not list(disk_path.iterdir())


# -- randomized ------------------------------------------------------------------------


@pytest.mark.parametrize("draw", range(10))
def test_random_configurations_are_exact_and_within_the_host_budget(
    disk_path: Path, draw: int
) -> None:
    rng = random.Random(1400 + draw)
    devices = rng.choice([1, 2])
    specs = {
        f"t{i}": (
            rng.choice(["sgd", "adam", "adamw"]),
            rng.choice([3, 4, 6, 8]),
            rng.choice([8, 12, 16, 24, 32]),
        )
        for i in range(rng.choice([2, 3, 4]))
    }
    options = rng.choice([{}, {"accumulate_steps": 2}, CLIP_ACCUM])
    prefetch = rng.random() < 0.5
    tasks = build(specs, n=rng.choice([2, 3]))
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, total = state_sizes(tasks)
    # The strict range: (devices + 2) x the largest shard state, or up to 1.5x more.
    host_memory = math.floor((devices + 2 + rng.random() * 1.5 * (devices + 2)) * largest)
    results, host, trace = run_engine(
        tasks, 2, ["cpu"] * devices, host_memory, disk_path, options, prefetch=prefetch
    )
    config = (devices, specs, options, prefetch, host_memory, largest, total)
    assert host["peak_held_bytes"] <= host_memory, (config, host)
    trace.validate(host_budget=host_memory)
    if total > host_memory:
        assert host["written_bytes"] > 0, (config, host)
    for name, task in tasks.items():
        assert_plain(results[name], task.model, refs[name], 2, devices, options)


_CRASHING_ENGINE = """
import os, signal, sys
import torch
from torch import nn
import tune_hydra as th
from tune_hydra.engine import Engine
from tune_hydra.frontends.task_loop import TaskLoop

torch.manual_seed(0)
engine = Engine("cpu", max_layers_per_shard=1, host_memory=40_000, spill_dir=sys.argv[1])
loops = []
for i in range(3):
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)).double()
    data = [(torch.randn(4, 32, dtype=torch.float64), torch.randint(0, 4, (4,)))]
    loops.append(TaskLoop(f"t{i}", th.ModelTask(model, nn.CrossEntropyLoss(),
                                                lambda p: torch.optim.Adam(p), data), engine))
    loops[-1].cut()
loops[0].start(1).result(timeout=60)
print(engine.summary()["host"]["spill_dir"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: a crash
"""


def test_the_folder_of_a_killed_engine_is_removed_by_the_next_one(disk_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_ENGINE, str(disk_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    left = Path(proc.stdout.strip().splitlines()[-1])
    assert left.parent == disk_path and any(left.glob("*.bin")), "it spilled, then died"
    with Engine("cpu", host_memory="1MiB", spill_dir=disk_path) as engine:
        assert not left.exists()
        assert Path(engine.summary()["host"]["spill_dir"]).exists()
    assert not list(disk_path.iterdir())
