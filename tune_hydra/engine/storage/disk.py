"""The disk tier: shard states beyond ``host_memory`` live in files under ``spill_dir``.

A :class:`SpillFolder` is one engine's scratch folder,
``spill_dir/tune_hydra-<host>-<pid>-<random>``: created when the engine starts, removed
when it closes, and, if a crash left it behind, by the next engine of this host that
starts with the same ``spill_dir`` (its pid is no longer alive).

A :class:`SpillFile` holds one shard store's tensors as raw bytes, one after the other
(each at a 64-byte aligned offset). The layout (key, dtype, shape, offset) stays in
memory and nothing in the file is ever interpreted: reading it back is ``preadv`` into
tensors the engine allocated (``readinto``, no unpickling), and the live tensors of a
shard on disk are memory-mapped read views of the file (``torch.from_file``), so that a
checkpoint can read them without loading the shard. Writes go through :func:`write_at`
(``pwrite``), never through the mapping: pages written that way are the kernel's page
cache, not this process's memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path

import torch

from tune_hydra.exceptions import SpillDirError, SpillDiskFullError, format_bytes

log = logging.getLogger(__name__)

_ALIGN = 64
_MIN_FREE = 16 * 2**20  # a spill_dir with less free space than this is "full" at start
_PREFIX = "tune_hydra-"


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
    return memoryview(flat.numpy())  # type: ignore[arg-type]


def _host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


class SpillFolder:
    """One engine's scratch folder under ``spill_dir``.

    Args:
        spill_dir: an existing, writable folder (on a local disk, not a tmpfs).

    Raises:
        SpillDirError: the folder is missing, not a folder, not writable, or has less than
            16 MiB free.
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
        free = shutil.disk_usage(root).free
        if free < _MIN_FREE:
            raise SpillDirError(
                f"spill_dir {str(root)!r} is on a full disk ({format_bytes(free)} free); free "
                f"space there or choose a folder on a larger disk"
            )
        self.root = root
        self._clean_stale()
        try:
            self.path = Path(
                tempfile.mkdtemp(prefix=f"{_PREFIX}{_host_name()}-{os.getpid()}-", dir=root)
            )
        except OSError as err:
            raise SpillDirError(
                f"cannot create a folder in spill_dir {str(root)!r}: {err}"
            ) from err
        self._count = 0

    def _clean_stale(self) -> None:
        """Remove the folders of this host's engines whose process is gone (a crash)."""
        host = _host_name()
        for entry in self.root.iterdir():
            if not entry.name.startswith(_PREFIX) or not entry.is_dir():
                continue
            parts = entry.name[len(_PREFIX) :].rsplit("-", 2)
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
                continue
            if _alive(int(parts[1])):
                continue
            log.info("removing the spill folder of a dead engine: %s", entry)
            shutil.rmtree(entry, ignore_errors=True)

    def file(self, name: tuple[str, int]) -> SpillFile:
        """A new spill file for the store ``name`` (``(task, shard)``)."""
        self._count += 1
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name[0])[:80]
        return SpillFile(self, name, f"{safe}.{name[1]}.{self._count}")

    def close(self) -> None:
        """Remove the folder and everything in it."""
        shutil.rmtree(self.path, ignore_errors=True)


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
            SpillDiskFullError: the write failed (the file's previous content is gone: the
                caller keeps the values in host memory).
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
            raise SpillDiskFullError(
                self.name[0], self.name[1], offset, str(self.folder.path), str(err)
            ) from err
        self.layout = layout
        self.size = offset
        return written

    def read_into(self, key: Key, out: torch.Tensor) -> int:
        """Read ``key``'s value into ``out`` (contiguous, of its dtype and shape)."""
        offset, _, _ = self.layout[key]
        data = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        assert self._fd is not None
        read_at(self._fd, data, offset)
        return len(data)

    def views(self) -> dict[Key, torch.Tensor]:
        """Memory-mapped views of the values written, by key (reading pages them in)."""
        if not self.size:  # nothing but empty tensors
            return {
                k: torch.empty(shape, dtype=dtype) for k, (_, dtype, shape) in self.layout.items()
            }
        whole = torch.from_file(self.path, shared=True, size=self.size, dtype=torch.uint8)
        out = {}
        for key, (offset, dtype, shape) in self.layout.items():
            n = shape.numel() * dtype.itemsize
            out[key] = whole[offset : offset + n].view(dtype).view(shape)
        return out

    def _open_new(self, size: int) -> None:
        self.close()
        self._version += 1
        self.path = str(self.folder.path / f"{self._stem}.{self._version}.bin")
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(self._fd, size)
        except OSError as err:
            self.close()
            raise SpillDiskFullError(
                self.name[0], self.name[1], size, str(self.folder.path), str(err)
            ) from err

    def close(self) -> None:
        """Close and remove the file (views already made keep reading it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.layout = {}
        self.size = 0
