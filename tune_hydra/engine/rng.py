"""Per-task random streams, swapped into torch's global generators around each op.

Dropout and ``DataLoader`` shuffling draw from torch's *global* generators, so a task's
stream is installed there for the duration of each of its operations and read back
afterwards. The CPU generator is shared by every worker thread, so installing it takes
``CPU_RNG_LOCK``; shards seen not to draw skip the lock (see ``ShardRuntime.uses_rng``).
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

    def same_as(self, other: RngState) -> bool:
        if not torch.equal(self.cpu, other.cpu):
            return False
        if (self.cuda is None) != (other.cuda is None):
            return False
        return self.cuda is None or torch.equal(self.cuda, other.cuda)  # type: ignore[arg-type]


def seeded_state(seed: int) -> RngState:
    """The state ``torch.manual_seed(seed)`` leaves the CPU generator in (CUDA is filled in
    lazily, the first time the task runs on a GPU)."""
    return RngState(torch.Generator().manual_seed(seed).get_state())


def _cuda_seeded(seed: int, device: torch.device) -> torch.Tensor:
    return torch.Generator(device=device).manual_seed(seed).get_state()


def read_global(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return RngState(torch.get_rng_state(), cuda)


def install(state: RngState, device: torch.device, seed: int) -> None:
    torch.set_rng_state(state.cpu)
    if device.type == "cuda":
        if state.cuda is None:
            state.cuda = _cuda_seeded(seed, device)
        torch.cuda.set_rng_state(state.cuda, device)


@contextlib.contextmanager
def task_stream(
    stream: RngState, device: torch.device, seed: int, *, replay: RngState | None = None
) -> Iterator[RngState]:
    """Run a block on the task's stream (or on ``replay``, a saved earlier point of it).

    Yields the state installed at entry (save it to replay this block later). On exit the
    task's stream advances to where the block left the globals, except when replaying.
    Holds ``CPU_RNG_LOCK`` throughout.
    """
    with CPU_RNG_LOCK:
        start = replay if replay is not None else stream
        install(start, device, seed)
        entry = read_global(device)
        yield entry
        if replay is None:
            after = read_global(device)
            stream.cpu = after.cpu
            if after.cuda is not None:
                stream.cuda = after.cuda
