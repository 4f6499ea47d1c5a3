"""The disk tier: shard states beyond ``host_memory`` live in files under ``spill_dir``.

A :class:`SpillFolder` is one engine's scratch folder,
``spill_dir/tune_hydra-<host>-<pid>-<random>``: created when the engine starts, removed
when it closes, and, if a crash left it behind, by the next engine of this host that
starts with the same ``spill_dir``. Whether its owner is gone is never inferred from the
pid in its name (an engine in another container, another PID namespace, may have the
same host name and a pid that means nothing here): the owner holds an exclusive
``flock`` on the folder's ``owner.lock`` for its whole life (the kernel drops it when the
process dies, even by ``SIGKILL``), and writes its name into it once locked. A folder is
stale only if another engine can take that lock and the file says who owned it; a folder
without the file (an older tune_hydra's, or one being created) or with an empty one is left
alone (logged). Without ``flock`` (not Linux or macOS, or a file system without it) no
other folder is ever removed.

``spill_dir`` must be on a disk: a RAM file system (``tmpfs``, ``ramfs``: ``/dev/shm``,
often ``/tmp``) is refused with :class:`~tune_hydra.exceptions.SpillDirError`, since
spilling there saves no memory.

A :class:`SpillFile` holds one shard store's tensors as raw bytes, one after the other
(each at a 64-byte aligned offset). The layout (key, dtype, shape, offset) stays in
memory and nothing in the file is ever interpreted: reading it back is ``preadv`` into
tensors the engine allocated (``readinto``, no unpickling), and the live tensors of a
shard on disk are memory-mapped read views of the file (``torch.from_file``), so that a
checkpoint can read them without loading the shard. Writes go through :func:`write_at`
(``pwrite``), never through the mapping: pages written that way are the kernel's page
cache, not this process's memory.

Every read and mapping goes through the descriptor the file keeps open (mapped as
``/proc/self/fd/<n>``, or with :mod:`mmap` where there is no ``/proc``), never through its
name: a spill folder deleted under a running engine loses nothing, and the engine makes
it again for the files it creates next (a warning says so). Errors: a write that fails
raises :class:`~tune_hydra.exceptions.SpillWriteError` (a full disk:
:class:`~tune_hydra.exceptions.SpillDiskFullError`), a read that fails
:class:`~tune_hydra.exceptions.SpillReadError`, both naming the task and the folder;
removing files and folders never raises (a failure is logged, with what to remove by
hand).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from tune_hydra.exceptions import (
    SpillDirError,
    SpillDiskFullError,
    SpillReadError,
    SpillWriteError,
    format_bytes,
)

try:
    import fcntl
except ImportError:  # not POSIX: no flock, so no other engine's folder is ever removed
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_ALIGN = 64
_MIN_FREE = 16 * 2**20  # a spill_dir with less free space than this is "full" at start
_PREFIX = "tune_hydra-"
LOCK_NAME = "owner.lock"  # in each engine's folder: flocked by its engine while it lives
_RAM_FS = frozenset({"tmpfs", "ramfs"})
_PROC_FD = os.path.isdir("/proc/self/fd")
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# POSIX flags (0 where absent). Descriptors are not inherited by exec'd children anyway
# (PEP 446), so no O_CLOEXEC is needed.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a planted FIFO must not block the cleanup


def write_at(path: str, fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of the open file ``fd`` (``path``: its name).

    The one place the disk tier writes (tests replace it to emulate a full disk).
    """
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def read_at(fd: int, out: memoryview, offset: int) -> None:
    """Fill ``out`` from ``offset`` of the open file ``fd``."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise OSError(f"spill file ended at byte {offset + done}, {len(out) - done} short")
        done += n


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() and torch._C._is_cow_tensor(flat):  # type: ignore[attr-defined]
        # A frozen pool tensor a finished task's model shares copy-on-write: numpy()
        # asks for a writable pointer, which would copy it; the write only reads it.
        address = int(torch._C._data_address(flat))  # type: ignore[attr-defined]
        return memoryview((ctypes.c_char * flat.numel()).from_address(address)).cast("B")
    return memoryview(flat.numpy())  # type: ignore[arg-type]


def _host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def ram_file_system(path: str | os.PathLike[str]) -> str | None:
    """The type of the file system holding ``path`` if it keeps files in RAM (``"tmpfs"``,
    ``"ramfs"``), else ``None`` (a disk, or unknown: no ``/proc/self/mountinfo``).

    The mount is found by the device number of ``path`` (exact, whatever bind mounts
    and symlinks lead there), else by the longest mount point above its real path.
    """
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        st = os.stat(path)
    except OSError:
        return None
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    real = os.path.realpath(path)
    by_dev: str | None = None
    best: tuple[int, str] = (-1, "")
    for line in lines:
        # "id parent maj:min root mount-point options [optional...] - fstype source ..."
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        fstype = fields[fields.index("-", 6) + 1]
        point = fields[4].replace("\\040", " ")
        if fields[2] == dev:
            by_dev = fstype  # the last one wins: mounts over mounts come later
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best[0]:
            best = (len(point), fstype)
    fstype = by_dev if by_dev is not None else best[1]
    return fstype if fstype in _RAM_FS else None


def _write_error(name: tuple[str, int], nbytes: int, folder: Path, err: OSError) -> SpillWriteError:
    """The error for a failed write or create of ``name``'s file: a full disk, or not."""
    cls = SpillDiskFullError if err.errno in _FULL else SpillWriteError
    return cls(name[0], name[1], nbytes, str(folder), str(err), err.errno)


class SpillFolder:
    """One engine's scratch folder under ``spill_dir``, locked for the engine's life.

    Args:
        spill_dir: an existing, writable folder on a local disk (not a RAM file system).

    Raises:
        SpillDirError: the folder is missing, not a folder, not writable, on a RAM file
            system (``tmpfs``, ``ramfs``), or has less than 16 MiB free.
    """

    def __init__(self, spill_dir: str | os.PathLike[str]) -> None:
        root = Path(spill_dir).expanduser()
        if not root.exists():
            raise SpillDirError(
                f"spill_dir {str(root)!r} does not exist; create it (on a local NVMe disk) "
                f"or point spill_dir at an existing folder"
            )
        if not root.is_dir():
            raise SpillDirError(f"spill_dir {str(root)!r} is a file, not a folder")
        if not os.access(root, os.W_OK | os.X_OK):
            raise SpillDirError(
                f"spill_dir {str(root)!r} is not writable by this process; give it write "
                f"permission or choose another folder"
            )
        ram = ram_file_system(root)
        if ram is not None:
            raise SpillDirError(
                f"spill_dir {str(root)!r} is on a RAM file system ({ram}): what is spilled "
                f"there stays in memory, so it saves no memory. Give a folder on a local "
                f"disk (NVMe), e.g. /var/tmp or a scratch disk; to keep everything in RAM, "
                f"leave host_memory unset"
            )
        free = shutil.disk_usage(root).free
        if free < _MIN_FREE:
            raise SpillDirError(
                f"spill_dir {str(root)!r} is on a full disk ({format_bytes(free)} free); free "
                f"space there or choose a folder on a larger disk"
            )
        self.root = root
        self._mutex = threading.Lock()  # making the folder again (stores' threads)
        self._lock_fd: int | None = None
        self._warned = False  # a file could not be removed: said once
        self._clean_stale()
        try:
            self.path = Path(
                tempfile.mkdtemp(prefix=f"{_PREFIX}{_host_name()}-{os.getpid()}-", dir=root)
            )
        except OSError as err:
            raise SpillDirError(
                f"cannot create a folder in spill_dir {str(root)!r}: {err}"
            ) from err
        try:
            self._lock_fd = self._take_lock(self.path)
        except SpillDirError:
            _rmtree(self.path)
            raise
        self._count = 0

    # -- the lock ----------------------------------------------------------------------------

    @staticmethod
    def _take_lock(path: Path) -> int | None:
        """Create ``path/owner.lock``, hold an exclusive ``flock`` on it and write who
        holds it (only then: a cleaner that takes the lock of an empty file leaves the
        folder alone). Returns the descriptor to keep open, or ``None`` without flock."""
        try:
            fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        except OSError as err:
            raise SpillDirError(
                f"cannot create a file in the spill folder {str(path)!r}: {err}"
            ) from err
        if fcntl is None:
            log.info("no flock here: other engines will leave %s alone after a crash", path)
            return fd
        try:
            # Blocking: another engine's cleanup holds it only for a moment (it finds the
            # file empty and lets it go).
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{_host_name()} {os.getpid()}\n".encode())
        except OSError as err:
            log.warning(
                "cannot lock %s (%s): if this engine crashes, remove its folder by hand",
                path / LOCK_NAME,
                err,
            )
        return fd

    def _clean_stale(self) -> None:
        """Remove the folders of this host's engines that are certainly gone: their lock
        can be taken. Never a folder whose owner may live, nor anything not ours."""
        if fcntl is None:
            return
        host = _host_name()
        try:
            entries = list(self.root.iterdir())
        except OSError as err:
            log.info("not looking for stale spill folders in %s: %s", self.root, err)
            return
        for entry in entries:
            if not entry.name.startswith(_PREFIX):
                continue
            parts = entry.name[len(_PREFIX) :].rsplit("-", 2)
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
                continue
            if entry.is_symlink() or not entry.is_dir():
                continue
            self._clean_if_stale(entry)

    @staticmethod
    def _clean_if_stale(entry: Path) -> None:
        assert fcntl is not None
        try:
            fd = os.open(entry / LOCK_NAME, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
        except FileNotFoundError:
            log.info(
                "leaving %s alone: it has no %s (an older tune_hydra's folder, or one being "
                "created), so whether its engine lives cannot be known; remove it by hand "
                "if no engine uses it",
                entry,
                LOCK_NAME,
            )
            return
        except OSError as err:
            log.info("leaving %s alone: cannot open its lock (%s)", entry, err)
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.info("leaving %s alone: its %s is not a file", entry, LOCK_NAME)
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.debug("%s is in use by a live engine", entry)
                return
            except OSError as err:
                log.info("leaving %s alone: cannot lock it (%s)", entry, err)
                return
            if os.fstat(fd).st_size == 0:
                # Its engine may be between creating the file and locking it.
                log.info("leaving %s alone: its lock file is empty", entry)
                return
            log.info("removing the spill folder of an engine that is gone: %s", entry)
            # Removed while locked: a new engine never takes over a half-removed folder.
            _rmtree(entry)
        finally:
            os.close(fd)

    # -- files -------------------------------------------------------------------------------

    def file(self, name: tuple[str, int]) -> SpillFile:
        """A new spill file for the store ``name`` (``(task, shard)``)."""
        self._count += 1
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name[0])[:80]
        return SpillFile(self, name, f"{safe}.{name[1]}.{self._count}")

    def create(self, name: str) -> tuple[str, int]:
        """Create the file ``name`` in the folder, open for reading and writing; returns
        its path and descriptor. If the folder was deleted under the engine, it is made
        again (with a new lock) first.

        Raises:
            OSError: the file cannot be created.
        """
        path = self.path / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW
        try:
            return str(path), os.open(path, flags, 0o600)
        except FileNotFoundError:
            if self.path.exists():
                raise
        with self._mutex:  # two stores may find it gone at once
            if not self.path.exists():
                log.warning(
                    "the spill folder %s was removed while this engine used it (the states "
                    "spilled before are still read through open files); making it again. "
                    "Keep other programs, such as cleaners of old temporary files, out of "
                    "spill_dir",
                    self.path,
                )
                os.mkdir(self.path, 0o700)
                old, self._lock_fd = self._lock_fd, self._take_lock(self.path)
                if old is not None:
                    os.close(old)
        return str(path), os.open(path, flags, 0o600)

    def unlinked(self, path: str) -> None:
        """Remove the file ``path`` of this folder; a failure is logged (once), not raised:
        the folder's removal at close tries again."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "cannot remove the spill file %s: %s", path, err)

    def close(self) -> None:
        """Remove the folder and everything in it, then let its lock go. Never raises: what
        cannot be removed is logged (and removed by the next engine on this spill_dir
        that can)."""
        if self._lock_fd is None and not self.path.exists():
            return
        _rmtree(self.path)
        if self.path.exists():
            log.warning(
                "cannot remove the spill folder %s: remove it by hand; "
                "the next engine started on this spill_dir removes it if it can",
                self.path,
            )
        if self._lock_fd is not None:
            try:
                os.close(self._lock_fd)
            except OSError as err:
                log.warning("closing the lock of %s: %s", self.path, err)
            self._lock_fd = None


def _rmtree(path: Path) -> None:
    """Remove ``path`` and what is in it; what cannot be removed is logged (the first
    failure, and how many there were)."""
    failures: list[str] = []

    def failed(func: Callable[..., Any], name: str, err: BaseException) -> None:
        if not isinstance(err, FileNotFoundError):
            failures.append(f"{name} ({getattr(func, '__name__', func)}: {err})")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=failed)
    else:
        shutil.rmtree(path, onerror=lambda func, name, info: failed(func, name, info[1]))
    if failures:
        log.warning("cannot remove %d entries under %s, e.g. %s", len(failures), path, failures[0])


def _map(fd: int, size: int) -> torch.Tensor:
    """``size`` bytes of the open file ``fd``, memory-mapped (shared, as a uint8 tensor)
    through the descriptor, not the file's name (which may be gone)."""
    if _PROC_FD:
        try:
            return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
        except RuntimeError as err:
            log.debug("mapping /proc/self/fd/%d failed (%s): mapping the descriptor", fd, err)
    # The mapping object stays alive as long as the tensor made from it.
    return torch.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_WRITE), dtype=torch.uint8)


Key = tuple[Hashable, ...]


class SpillFile:
    """One store's tensors in one file of a :class:`SpillFolder`.

    Not thread-safe: its store uses it under the store's lock.
    """

    def __init__(self, folder: SpillFolder, name: tuple[str, int], stem: str) -> None:
        self.folder = folder
        self.name = name
        self._stem = stem
        self._version = 0
        self.path = ""
        self._fd: int | None = None
        # key -> (offset, dtype, shape) of the values last written.
        self.layout: dict[Key, tuple[int, torch.dtype, torch.Size]] = {}
        self.size = 0

    def write(self, items: Sequence[tuple[Key, torch.Tensor]]) -> int:
        """Write ``items``' values; returns the bytes written.

        Raises:
            SpillWriteError: the write failed (:class:`SpillDiskFullError` for a full
                disk); the file's previous content is gone: the caller keeps the values in
                host memory.
        """
        layout: dict[Key, tuple[int, torch.dtype, torch.Size]] = {}
        offset = 0
        for key, t in items:
            layout[key] = (offset, t.dtype, t.shape)
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if layout != self.layout or self._fd is None:
            # A new layout goes to a new file: views of the old one (a checkpoint may still
            # hold them) keep reading the old, unlinked file instead of past its end.
            self._open_new(offset)
        self.layout = {}
        written = 0
        try:
            for key, t in items:
                data = _bytes_of(t)
                write_at(self.path, self._fd, data, layout[key][0])  # type: ignore[arg-type]
                written += len(data)
        except OSError as err:
            self.close()
            raise _write_error(self.name, offset, self.folder.path, err) from err
        self.layout = layout
        self.size = offset
        return written

    def read_into(self, key: Key, out: torch.Tensor) -> int:
        """Read ``key``'s value into ``out`` (contiguous, of its dtype and shape).

        Raises:
            SpillReadError: the read failed.
        """
        offset, _, _ = self.layout[key]
        data = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        if self._fd is None:
            raise self._read_error("its file is closed")
        try:
            read_at(self._fd, data, offset)
        except OSError as err:
            raise self._read_error(str(err)) from err
        return len(data)

    def templates(self) -> dict[Key, torch.Tensor]:
        """Tensors without storage (``meta``) of the dtype and shape of each value written."""
        return {
            k: torch.empty(shape, dtype=dtype, device="meta")
            for k, (_, dtype, shape) in self.layout.items()
        }

    def views(self) -> dict[Key, torch.Tensor]:
        """Memory-mapped views of the values written, by key (reading pages them in).

        Raises:
            SpillReadError: the file cannot be mapped.
        """
        if not self.size:  # nothing but empty tensors
            return {
                k: torch.empty(shape, dtype=dtype) for k, (_, dtype, shape) in self.layout.items()
            }
        if self._fd is None:
            raise self._read_error("its file is closed")
        try:
            whole = _map(self._fd, self.size)
        except (OSError, RuntimeError, ValueError) as err:
            raise self._read_error(f"cannot map it: {err}") from err
        out = {}
        for key, (offset, dtype, shape) in self.layout.items():
            n = shape.numel() * dtype.itemsize
            out[key] = whole[offset : offset + n].view(dtype).view(shape)
        return out

    def _read_error(self, detail: str) -> SpillReadError:
        return SpillReadError(self.name[0], self.name[1], str(self.folder.path), detail)

    def _open_new(self, size: int) -> None:
        self.close()
        self._version += 1
        try:
            self.path, self._fd = self.folder.create(f"{self._stem}.{self._version}.bin")
            os.ftruncate(self._fd, size)
        except OSError as err:
            self.close()
            raise _write_error(self.name, size, self.folder.path, err) from err

    def close(self) -> None:
        """Close and remove the file (views already made keep reading it). Never raises:
        a failure is logged."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as err:
                log.warning("closing the spill file %s: %s", self.path, err)
        if self.path:
            self.folder.unlinked(self.path)
        self.layout = {}
        self.size = 0
