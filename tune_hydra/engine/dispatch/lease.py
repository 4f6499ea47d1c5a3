"""Leases: a shard's state held on a device while its holder computes with it.

Holding a :class:`Lease` on ``(task, shard, device)`` means that the shard's state is
resident on that device: promoted (copied in on a device that copies, and counted in the
device's :class:`~tune_hydra.core.ledger.DeviceLedger`), or, on a CPU device that computes
in host memory, its host tensors are marked busy with the engine's host memory manager, so
that the disk tier cannot take them. The holder may compute with the shard's modules and
optimizer from any thread. :meth:`Lease.release` ends it; the state stays resident and is
evicted least recently used first when another shard needs the room, or dropped rather
than copied back if the visit changed nothing (see ``ShardStore.begin_op``).

There is one implementation of "make this shard resident here and keep it while
computing": :meth:`DeviceWorker.lease <tune_hydra.engine.dispatch.workers.DeviceWorker.lease>`. The
engine's own ops take it too: a device's copy thread leases the shard of each assigned op
(while the op before it computes: prefetching is unchanged), its run thread computes and
releases it. :func:`~tune_hydra.engine.dispatch.acquire.acquire` (``Engine.acquire``) leases for
a caller's own thread.

Rules:

- **One lease per shard state.** A shard's own store is held by one lease at a time (the
  engine's op or a caller's): a second ``acquire`` of it, or the engine's op on it, waits
  until it is released. A store of parameters several shards share (tied weights) may be
  held by leases on one device at once, never on two.
- **Leases and the dispatcher.** ``Engine.acquire`` refuses (:class:`LeaseConflictError`)
  a task that has iterations granted (``train()`` not finished) or an op on a device:
  the dispatcher may run its next op on any device at any time. All leases held on one
  task at once are on one device (its shared parameters can be in one place only).
  Training a task while a caller holds a lease on one of its shards is allowed but
  waits: that shard's op waits for the release.
- **Room.** A lease waits for room as an op's copy does: least recently used states not
  in use are evicted; the states of queued ops, of other leases and of copies in flight
  stay. A lease's activations are counted as an op's (the ledger's peak over the shards
  that stay); a holder computing at the same moment as the device's own op is not
  counted twice.
- **Ending.** Releasing twice is a no-op; using a lease after it ended (released, its
  task removed, checkpointed or restored, the engine closed) raises
  :class:`~tune_hydra.exceptions.LeaseEndedError`.

Locks: the claim registry's condition is a leaf (nothing else is taken under it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tune_hydra.core.ops import OpKind
from tune_hydra.engine.storage import ShardStore, Store
from tune_hydra.exceptions import LeaseEndedError, LeaseTimeoutError

if TYPE_CHECKING:
    from tune_hydra.engine.storage.host import HostMemory

_POLL_S = 0.2  # a wait for a claim wakes up this often to notice a close


class LeaseWorker(Protocol):
    """What a lease and the claim registry use of the device worker that made them
    (:class:`~tune_hydra.engine.dispatch.workers.DeviceWorker`, which imports this module)."""

    @property
    def closing(self) -> bool: ...

    @property
    def label(self) -> str: ...

    @property
    def device(self) -> torch.device: ...

    def what(self, store: Store) -> str: ...

    def fence(self) -> None: ...

    def unpin(self, lease: Lease, *, revoke: bool = False) -> None: ...


class _Claims:
    """Which worker's leases hold each shard store (by identity): a shard's own store is
    held by one lease at a time, a shared store by leases on one worker."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        # id(part) -> (part, worker, count); the part is kept so that its id stays unique.
        self._held: dict[int, tuple[ShardStore, object, int]] = {}
        self._waiting = 0  # threads waiting in claim() (none: a release notifies no one)

    def _free(self, store: Store, worker: object) -> bool:
        held = self._held
        own, *shared = store.parts()
        if id(own) in held:
            return False
        return all(id(s) not in held or held[id(s)][1] is worker for s in shared)

    def _take(self, store: Store, worker: object) -> None:
        held = self._held
        for s in store.parts():
            _, _, n = held.get(id(s), (s, worker, 0))
            held[id(s)] = (s, worker, n + 1)

    def try_claim(self, store: Store, worker: object) -> bool:
        """Claim ``store`` for a lease on ``worker`` if it is free; whether it was."""
        with self._cv:
            if not self._free(store, worker):
                return False
            self._take(store, worker)
            return True

    def claim(self, store: Store, worker: LeaseWorker, deadline: float | None) -> None:
        """Claim ``store`` for a lease on ``worker``, waiting until it is free.

        Raises:
            LeaseTimeoutError: not free by ``deadline`` (``time.monotonic()``).
            LeaseEndedError: the worker closes meanwhile.
        """
        with self._cv:
            if self._free(store, worker):  # the common case
                self._take(store, worker)
                return
            self._waiting += 1
            try:
                while not self._free(store, worker):
                    if worker.closing:
                        raise LeaseEndedError(
                            f"{worker.what(store)}: the engine closed while it waited"
                        )
                    wait = _POLL_S
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            raise LeaseTimeoutError(
                                f"{worker.what(store)}: another lease held it for the whole "
                                f"timeout; release that lease first, or give a longer timeout"
                            )
                    self._cv.wait(wait)
            finally:
                self._waiting -= 1
            self._take(store, worker)

    def unclaim(self, store: Store) -> None:
        with self._cv:
            held = self._held
            for s in store.parts():
                entry = held.get(id(s))
                if entry is None:
                    continue
                if entry[2] > 1:
                    held[id(s)] = (entry[0], entry[1], entry[2] - 1)
                else:
                    del held[id(s)]
            if self._waiting:
                self._cv.notify_all()

    def elsewhere(self, store: Store, worker: object) -> bool:
        """Whether a lease on another worker holds ``store`` (or a part of it)."""
        with self._cv:
            held = self._held
            return any(id(s) in held and held[id(s)][1] is not worker for s in store.parts())


CLAIMS = _Claims()


class Lease:
    """A shard's state held resident on one device (see the module docstring).

    Made by :meth:`DeviceWorker.lease <tune_hydra.engine.dispatch.workers.DeviceWorker.lease>`
    (callers use ``Engine.acquire``). A context manager: leaving the ``with`` block
    releases it.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> task = th.ModelTask(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)),
        ...                     nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1),
        ...                     [(torch.randn(2, 4), torch.randn(2, 1))])
        >>> from tune_hydra.frontends.task_loop import TaskLoop
        >>> with th.Engine(devices="cpu") as engine:
        ...     _ = TaskLoop("a", task, engine, seed=0).cut()
        ...     with engine.acquire("a", 0, 0) as lease:
        ...         y = task.model[0](torch.randn(2, 4).to(lease.device))
        ...     lease.active
        False
    """

    __slots__ = ("_ended", "_fence", "_host", "_store", "_worker", "event", "moved")

    def __init__(self, worker: LeaseWorker, store: Store, host: HostMemory | None) -> None:
        self._worker = worker
        self._store = store
        self._host = host  # marked its state busy there (a device computing in place)
        self._ended: str | None = None  # why it ended, once it did
        # A caller's lease on a CUDA device: its compute is on the caller's stream, which
        # the device's copies must wait for once it is released.
        self._fence = False
        self.moved = 0  # bytes copied onto the device to take it
        self.event: Any = None  # CUDA event after the copy-in (compute waits on it)

    def __repr__(self) -> str:
        state = "active" if self._ended is None else self._ended
        return f"Lease(task={self.task!r}, shard={self.shard}, device={self.label!r}, {state})"

    # -- what the holder reads -------------------------------------------------------------

    @property
    def task(self) -> str:
        return self._store.name[0]

    @property
    def shard(self) -> int:
        return self._store.name[1]

    @property
    def label(self) -> str:
        """The device's label (``"cuda:0"``, ``"cpu#1"``)."""
        return self._worker.label

    @property
    def active(self) -> bool:
        """Whether the lease still holds the state (not released, not revoked)."""
        return self._ended is None

    @property
    def device(self) -> torch.device:
        """The device to compute on (inputs go there).

        Raises:
            LeaseEndedError: the lease ended.
        """
        self.check()
        return self._worker.device

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The shard's optimizer (its state moves with the shard; ``None`` for a shard
        without parameters).

        Raises:
            LeaseEndedError: the lease ended.
        """
        self.check()
        return self._store.parts()[0].optimizer

    @property
    def nbytes(self) -> int:
        """The plan's state bytes of the shard, as the device's ledger counts them."""
        return self._store.state_bytes

    def check(self) -> None:
        """Raise if the lease ended.

        Raises:
            LeaseEndedError: it was released, revoked or its engine closed.
        """
        if self._ended is not None:
            raise LeaseEndedError(
                f"the lease on shard {self.shard} of task {self.task!r} on device "
                f"{self.label} {self._ended}; take a new one with engine.acquire()"
            )

    @contextmanager
    def op(self, kind: OpKind) -> Iterator[None]:
        """Say what the holder computes (optional): inside ``with lease.op(OpKind.EVAL)``
        a visit that changes nothing lets the device copy be dropped instead of copied
        back. Without it a leased visit counts as a change.

        Raises:
            LeaseEndedError: the lease ended.
        """
        self.check()
        self._store.begin_op(kind)
        failed = True
        try:
            yield
            failed = False
        finally:
            self._store.end_op(failed=failed)

    # -- ending ---------------------------------------------------------------------------

    def release(self) -> None:
        """End the lease (a no-op if it already ended): the state stays resident, and may
        be evicted from now on."""
        self._end("was released", revoke=False)

    def revoke(self, why: str) -> None:
        """End the lease because the engine took the state away (its worker, evicting a
        leased store: the task left, is checkpointed, or the engine closes)."""
        self._end(why, revoke=True)

    def _end(self, why: str, *, revoke: bool) -> None:
        if self._ended is not None:
            return
        self._ended = why
        if self._fence and not revoke:
            self._worker.fence()  # before it may be evicted
        self._worker.unpin(self, revoke=revoke)
        CLAIMS.unclaim(self._store)
        if self._host is not None:
            self._host.use(self._store.parts(), -1)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["CLAIMS", "Lease", "LeaseWorker"]
