"""The disk tier's files: raw bytes written and read back exactly, mapped views, layout
changes, write and read failures (each its error), reads through open descriptors after
the folder is deleted, the folder's lock; and a store going to disk and back."""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.engine.storage.test_disk_tier import disk_folder
from tune_hydra.core.ops import OpKind
from tune_hydra.engine.storage import Residency, ShardStore
from tune_hydra.engine.storage import disk as disk_mod
from tune_hydra.engine.storage.disk import LOCK_NAME, SpillFolder, ram_file_system
from tune_hydra.exceptions import (
    SpillDirError,
    SpillDiskFullError,
    SpillReadError,
    SpillWriteError,
)


@pytest.fixture
def disk_path(tmp_path: Path) -> Iterator[Path]:
    """A fresh folder on a disk (see ``disk_folder``)."""
    yield from disk_folder(tmp_path)


def _items() -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (("p", 0), torch.randn(3, 5, dtype=torch.float64, generator=g)),
        (("p", 1), torch.randn(7, generator=g).to(torch.bfloat16)),  # no numpy dtype
        (("b", 0), torch.arange(5, dtype=torch.int64)),
        (("o", 0, "exp_avg"), torch.randn(3, 5, dtype=torch.float64, generator=g).t()),
        (("g", 0), torch.empty(0)),
    ]


def test_written_values_read_back_bit_for_bit(disk_path: Path) -> None:
    folder = SpillFolder(disk_path)
    f = folder.file(("task/with:odd name", 2))
    items = _items()
    written = f.write(items)
    assert written == sum(t.numel() * t.element_size() for _, t in items)
    assert "task_with_odd_name.2" in os.path.basename(f.path)
    views = f.views()
    for key, t in items:
        out = torch.empty(t.shape, dtype=t.dtype)
        f.read_into(key, out)
        assert torch.equal(out, t) and out.dtype == t.dtype
        assert torch.equal(views[key], t)
    folder.close()
    assert not folder.path.exists()


def test_a_new_layout_goes_to_a_new_file_and_old_views_stay_valid(disk_path: Path) -> None:
    folder = SpillFolder(disk_path)
    f = folder.file(("a", 0))
    first = [(("p", 0), torch.full((4,), 1.5, dtype=torch.float64))]
    f.write(first)
    old_path, old_view = f.path, f.views()[("p", 0)]
    f.write(first)  # same layout: rewritten in place
    assert f.path == old_path
    grown = [*first, (("o", 0, "momentum_buffer"), torch.full((4,), 2.0, dtype=torch.float64))]
    f.write(grown)  # optimizer state appeared: a new file
    assert f.path != old_path and not os.path.exists(old_path)
    assert torch.equal(old_view, first[0][1])  # the unlinked file is still mapped
    f.close()
    assert not os.path.exists(f.path)
    folder.close()


def test_a_failed_write_raises_the_disk_full_error(
    disk_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: str, fd: int, data: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    folder = SpillFolder(disk_path)
    f = folder.file(("a", 3))
    monkeypatch.setattr(disk_mod, "write_at", full)
    with pytest.raises(SpillDiskFullError, match=r"task 'a': writing shard 3.*No space left"):
        f.write(_items())
    assert not f.layout  # nothing is believed to be there
    folder.close()


@pytest.mark.parametrize(
    ("code", "cls", "advice"),
    [
        (errno.EACCES, SpillWriteError, "give it write permission back"),
        (errno.EROFS, SpillWriteError, "became read-only"),
        (errno.EIO, SpillWriteError, "Check the disk"),
        (errno.ENOSPC, SpillDiskFullError, "Free space there"),
        (errno.EDQUOT, SpillDiskFullError, "Free space there"),
    ],
)
def test_each_failed_write_says_what_to_do(
    disk_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, cls: type, advice: str
) -> None:
    def failing(path: str, fd: int, data: memoryview, offset: int) -> None:
        raise OSError(code, os.strerror(code))

    folder = SpillFolder(disk_path)
    f = folder.file(("a", 3))
    monkeypatch.setattr(disk_mod, "write_at", failing)
    with pytest.raises(SpillWriteError) as err:
        f.write(_items())
    assert type(err.value) is cls and err.value.code == code
    assert (err.value.task, err.value.shard, err.value.path) == ("a", 3, str(folder.path))
    assert advice in str(err.value) and "restore the task" in str(err.value)
    assert pickle.loads(pickle.dumps(err.value)).args == err.value.args
    folder.close()


def test_reads_go_through_open_files_after_the_folder_is_deleted(disk_path: Path) -> None:
    folder = SpillFolder(disk_path)
    f = folder.file(("a", 0))
    items = _items()
    f.write(items)
    shutil.rmtree(folder.path)
    views = f.views()  # mapped through the descriptor, not the (gone) name
    for key, t in items:
        out = torch.empty(t.shape, dtype=t.dtype)
        f.read_into(key, out)
        assert torch.equal(out, t) and torch.equal(views[key], t)
    f.write(items)  # the same layout: rewritten through the descriptor
    assert not folder.path.exists()
    g = folder.file(("b", 0))  # a new file: the folder is made again, and locked
    g.write(items[:1])
    assert folder.path.is_dir() and (folder.path / LOCK_NAME).stat().st_size > 0
    assert torch.equal(g.views()[items[0][0]], items[0][1])
    folder.close()
    assert not folder.path.exists()


def test_a_spill_file_that_cannot_be_read_names_the_task_and_folder(disk_path: Path) -> None:
    folder = SpillFolder(disk_path)
    f = folder.file(("a", 4))
    f.write(_items())
    assert f._fd is not None
    os.ftruncate(f._fd, 8)  # changed under the engine
    key, t = _items()[0]
    with pytest.raises(SpillReadError, match=r"task 'a': reading shard 4's state") as err:
        f.read_into(key, torch.empty(t.shape, dtype=t.dtype))
    assert err.value.path == str(folder.path) and "short" in err.value.detail
    folder.close()


def test_a_folder_is_removed_only_once_its_lock_can_be_taken(disk_path: Path) -> None:
    """Whatever pid its name carries (one from another PID namespace means nothing here),
    another engine's folder goes only when its lock is free and says who held it."""
    own = SpillFolder(disk_path)
    prefix = own.path.name[: own.path.name.rindex(f"-{os.getpid()}-")]
    own.close()
    theirs = disk_path / f"{prefix}-999999999-abc"  # a pid no process has here
    theirs.mkdir()
    (theirs / "x.bin").write_bytes(b"1" * 64)
    lock = theirs / LOCK_NAME
    lock.write_text(f"{prefix} 1\n")
    fd = os.open(lock, os.O_RDWR)  # its engine, alive: flock is per open file description
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        SpillFolder(disk_path).close()
        assert (theirs / "x.bin").read_bytes() == b"1" * 64
    finally:
        os.close(fd)  # it is gone
    lock.write_text("")  # ... or being made: locked only after its lock file exists
    SpillFolder(disk_path).close()
    assert (theirs / "x.bin").exists()
    lock.write_text(f"{prefix} 1\n")
    SpillFolder(disk_path).close()
    assert not theirs.exists()
    assert not list(disk_path.iterdir())


def test_a_folder_in_ram_is_refused(disk_path: Path) -> None:
    assert ram_file_system(disk_path) is None
    if not os.path.isdir("/dev/shm") or ram_file_system("/dev/shm") is None:
        pytest.skip("no RAM file system at /dev/shm here")
    assert ram_file_system("/dev/shm") in ("tmpfs", "ramfs")
    with pytest.raises(SpillDirError, match=r"'/dev/shm' is on a RAM file system"):
        SpillFolder("/dev/shm")


class _Host:
    """A host account without a budget that records what the store tells it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reserve(self, store: ShardStore, nbytes: int, *, speculative: bool = False) -> bool:
        self.calls.append("reserve")
        return True

    def release(self, store: ShardStore) -> None:
        self.calls.append("release")

    def busy(self, store: ShardStore) -> bool:
        return False

    def note_io(self, store: ShardStore, op: str, nbytes: int, start: float) -> None:
        self.calls.append(op)

    def note_wait(self, store: ShardStore, owner: object, start: float) -> None:
        self.calls.append("wait")


def test_a_store_goes_to_disk_and_back_exactly(disk_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    folder = SpillFolder(disk_path)
    host = _Host()
    store = ShardStore([model], opt, host=host, spill_file=folder.file(("a", 0)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    moments = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]

    assert store.try_spill()
    assert store.residency is Residency.DISK and store.on_disk and not store.in_host
    assert host.calls == ["to_disk", "release"]
    # On disk the live tensors are views of the file: a checkpoint reads them as they were.
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert not store.try_spill()  # already there

    assert store.load(speculative=False)
    assert store.residency is Residency.HOST and store.in_host
    assert host.calls[-2:] == ["reserve", "from_disk"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    for p, g, m in zip(model.parameters(), grads, moments, strict=True):
        assert p.grad is not None and torch.equal(p.grad, g)
        assert torch.equal(opt.state[p]["exp_avg_sq"], m)
    # Untouched since it was read back: going to disk again writes nothing.
    assert store.try_spill()
    assert host.calls[-1] == "release" and host.calls.count("to_disk") == 1
    # A promotion reads it back first; a visit that changed nothing keeps the file valid.
    store.promote(torch.device("cpu"), copy=True)
    assert store.residency is Residency.DEVICE and "wait" in host.calls
    store.begin_op(OpKind.EVAL)
    store.end_op()
    assert store.demote() == 0  # dropped, not copied back
    assert store.try_spill() and host.calls.count("to_disk") == 1
    # One that changed it (a step) is written next time.
    store.promote(torch.device("cpu"), copy=True)
    store.begin_op(OpKind.STEP)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    store.end_op()
    assert store.demote() > 0
    assert store.try_spill() and host.calls.count("to_disk") == 2
    store.load(speculative=False)
    assert torch.equal(next(model.parameters()), before["0.weight"] + 1.0)
    folder.close()
