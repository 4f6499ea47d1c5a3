"""Per-task random streams, swapped into torch's global generators around each op.

Dropout and ``DataLoader`` shuffling draw from torch's *global* generators, so a task's
stream is installed there for the duration of each of its operations and read back
afterwards. The CPU generator is shared by every worker thread, so installing it takes
``CPU_RNG_LOCK``; a GPU's generator is used by that device's one compute thread only, so
it needs no lock. Shards seen not to draw from a generator skip it (and the lock).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

CPU_RNG_LOCK = threading.RLock()


@dataclass
class RngState:
    """A snapshot of the generators a task uses: CPU, and CUDA (philox seed + offset)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None


def _cuda_seeded(seed: int, device: torch.device) -> torch.Tensor:
    return torch.Generator(device=device).manual_seed(seed).get_state()


@dataclass
class Scope:
    """What :func:`task_stream` installed (``entry``) and whether the block drew."""

    entry: RngState
    drew_cpu: bool = False
    drew_cuda: bool = False


@contextlib.contextmanager
def task_stream(
    stream: RngState,
    device: torch.device,
    seed: int,
    *,
    replay: RngState | None = None,
    cpu: bool = True,
    cuda: bool = True,
) -> Iterator[Scope]:
    """Run a block on the task's stream (or on ``replay``, a saved earlier point of it).

    Installs the CPU generator (under ``CPU_RNG_LOCK``) if ``cpu``, and the device's
    generator if ``cuda`` and the device is a GPU. Yields a :class:`Scope` whose ``entry``
    is the state installed (save it to replay this block later). On exit the task's stream
    advances to where the block left the generators, except when replaying, and the scope
    tells which generators the block drew from.
    """
    gpu = cuda and device.type == "cuda"
    start = replay if replay is not None else stream
    with CPU_RNG_LOCK if cpu else contextlib.nullcontext():
        if cpu:
            torch.set_rng_state(start.cpu)
        if gpu:
            if start.cuda is None:
                start.cuda = _cuda_seeded(seed, device)
            torch.cuda.set_rng_state(start.cuda, device)
        scope = Scope(
            RngState(
                torch.get_rng_state() if cpu else start.cpu.clone(),
                torch.cuda.get_rng_state(device) if gpu else start.cuda,
            )
        )
        yield scope
        after_cpu = torch.get_rng_state() if cpu else None
        after_cuda = torch.cuda.get_rng_state(device) if gpu else None
    if after_cpu is not None:
        scope.drew_cpu = not torch.equal(after_cpu, scope.entry.cpu)
    if after_cuda is not None:
        scope.drew_cuda = not torch.equal(after_cuda, scope.entry.cuda)  # type: ignore[arg-type]
    if replay is None:
        if after_cpu is not None:
            stream.cpu = after_cpu
        if after_cuda is not None:
            stream.cuda = after_cuda
