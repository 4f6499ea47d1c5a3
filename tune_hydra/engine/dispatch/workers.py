"""Device workers: one compute thread per device, plus a copy thread that promotes the
next assigned shard while the current one computes (double buffering).

A worker holds at most two shard states resident when prefetching (the running one and
the next), one otherwise; the least recently used other shard is demoted to make room.
On CUDA, copies run on a dedicated stream and compute waits on an event; on the CPU the
same bookkeeping runs with plain copies (or none, when ``copy=False``).

What may be resident on the device now, and what to evict for room, is the device's
:class:`~tune_hydra.engine.dispatch.room.DeviceRoom` (its ledger, pins, grants and the
waits for room, with its own locking note); a worker owns the threads, the queue
of assigned ops and the leases, and asks its room.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tune_hydra.core.ledger import DeviceLedger
from tune_hydra.core.ops import Op
from tune_hydra.core.trace import Trace, TraceEvent
from tune_hydra.engine.dispatch.lease import CLAIMS, Lease
from tune_hydra.engine.dispatch.room import _POLL_S, DeviceRoom
from tune_hydra.engine.storage import Store
from tune_hydra.exceptions import LeaseEndedError

if TYPE_CHECKING:
    from tune_hydra.engine.storage.host import HostMemory

log = logging.getLogger(__name__)


@dataclass
class Assignment:
    """An operation handed to a worker; ``ready`` (only when a copy thread promotes the
    shard) is set once its shard is resident."""

    op: Op
    store: Store
    run: Callable[[torch.device], None]
    done: Callable[[Assignment, BaseException | None], None]
    ready: threading.Event | None = None
    copy_error: BaseException | None = None
    event: Any = None  # CUDA event after the promotion
    moved: int = 0
    duration: float = 0.0
    # The run thread leases it in place first (its state is on disk, or a caller's lease
    # on another device holds it).
    lend: bool = False
    lease: Lease | None = None  # the shard held on the device from copy-in to the op's end
    # The stores of other tasks' ops run along with this one (one batched pass of a
    # shared shard, tune_hydra.engine.dispatch.batched), leased as it starts: counted as queued.
    along: list[Store] = field(default_factory=list)

    def stores(self) -> list[Store]:
        """Every store the assignment's op(s) use here."""
        return [self.store, *self.along] if self.along else [self.store]


@dataclass
class Prefetch:
    """A speculative promotion: the shard a task will most likely need next here."""

    store: Store
    task: str
    shard: int
    iteration: int


class DeviceWorker:
    """Runs shard operations on one device, in the order they were assigned."""

    def __init__(
        self,
        index: int,
        device: torch.device,
        label: str,
        trace: Trace,
        clock: Callable[[], float],
        *,
        prefetch: bool,
        copy: bool,
        intra_threads: int | None = None,
        budget: int | None = None,
    ) -> None:
        self.index = index
        self.device = device
        self.label = label
        self.trace = trace
        self.clock = clock
        self.copy = copy or device.type == "cuda"
        # Double buffering overlaps a copy with compute; with nothing to copy a second
        # queued op would only force tasks to alternate (and lose their warm caches).
        self.depth = 2 if prefetch and self.copy else 1
        self.intra_threads = intra_threads
        self.assigned: collections.deque[Assignment] = collections.deque()
        self.busy_s = 0.0
        # The task whose op ran here last: without copies its activations are what this
        # core's caches hold, the CPU's notion of "resident" (set by the engine).
        self.last_task: str | None = None
        self.last_error: BaseException | None = None
        self.last_prefetch_error: BaseException | None = None  # speculative: not fatal
        self._copy_q: queue.SimpleQueue[Assignment | Prefetch | None] = queue.SimpleQueue()
        self._run_q: queue.SimpleQueue[Assignment | None] = queue.SimpleQueue()
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.compute_stream = torch.cuda.Stream(device) if cuda else None
        # What is resident, leased or coming in here, within ``budget``.
        self.room = DeviceRoom(
            self,
            label,
            trace,
            clock,
            self.assigned,
            depth=self.depth,
            budget=budget,
            copy_stream=self.copy_stream,
        )
        self._threads = [
            threading.Thread(target=self._copy_loop, name=f"hydra-copy-{label}", daemon=True),
            threading.Thread(target=self._run_loop, name=f"hydra-run-{label}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def free_slots(self) -> int:
        return self.depth - len(self.assigned)

    # -- the room's (see DeviceRoom) -------------------------------------------------------

    @property
    def ledger(self) -> DeviceLedger[Store]:
        """The device's ledger (the room's)."""
        return self.room.ledger

    @property
    def budget(self) -> int | None:
        """Device bytes for everything the ledger counts (None: no limit)."""
        return self.room.budget

    @property
    def reserved(self) -> dict[str, int]:
        """Bytes reserved for each task's batch in flight here (the ledger's)."""
        return self.room.reserved

    @property
    def peak_resident_bytes(self) -> int:
        """Shard state held on the device at once, at most (measured bytes)."""
        return self.room.ledger.peak_resident_bytes

    def holds(self, store: Store) -> bool:
        return self.room.holds(store)

    def fits(self, store: Store, extra: int = 0) -> bool:
        """See :meth:`DeviceRoom.fits`."""
        return self.room.fits(store, extra)

    def reserve(self, task: str, nbytes: int | None) -> None:
        """See :meth:`DeviceRoom.reserve`."""
        self.room.reserve(task, nbytes)

    def hold_along(self, key: object, nbytes: int | None) -> None:
        """See :meth:`DeviceRoom.hold_along`."""
        self.room.hold_along(key, nbytes)

    def admits(self, nbytes: int, room: int) -> bool:
        """See :meth:`DeviceRoom.admits`."""
        return self.room.admits(nbytes, room)

    def evict(self, store: Store) -> None:
        """See :meth:`DeviceRoom.evict` (other devices' copy threads call it here)."""
        self.room.evict(store)

    # -- the queue -------------------------------------------------------------------------

    def submit(self, a: Assignment) -> None:
        """Queue ``a`` (called by the dispatcher, under its lock)."""
        self.assigned.append(a)
        if self.copy:
            a.ready = threading.Event()
            self._copy_q.put(a)
        else:  # nothing to copy (a CPU device uses host memory in place): no hand-off
            # Leased at once, unless it must be read back from disk or waits for a lease
            # elsewhere: then by the run thread, not under the dispatcher's lock.
            if not a.store.on_disk:
                a.lease = self.lease(a.store, blocking=False)
            a.lend = a.lease is None
            self.room.place(a.store)
        self._run_q.put(a)

    def finished(self, a: Assignment, task: str) -> None:
        """Take ``a`` off the queue as its op ends (called by the dispatcher, under its
        lock); ``task`` ran here last."""
        queued = self.assigned
        if queued and queued[0] is a:  # ops finish in the order they were queued
            queued.popleft()
        elif a in queued:
            queued.remove(a)
        self.last_task = task

    def prefetch(self, store: Store, task: str, shard: int, iteration: int) -> None:
        """Promote ``store`` ahead of its op if a slot is free by the time the copy thread
        gets to it (called by the dispatcher, under its lock)."""
        if self.copy:
            self._copy_q.put(Prefetch(store, task, shard, iteration))

    def release(self, store: Store) -> None:
        """Forget ``store`` without copying (another device took it, or its task left); a
        lease on it here ends."""
        self.room.release(store)

    # -- leases ---------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        """The leases held on this device now (the engine's ops' and callers')."""
        return self.room.leases()

    def lease(
        self,
        store: Store,
        *,
        ahead_of: Assignment | None = None,
        deadline: float | None = None,
        host: HostMemory | None = None,
        blocking: bool = True,
        room_now: bool = False,
    ) -> Lease | None:
        """Make ``store`` resident here and keep it so until the lease ends: the one way a
        shard's state comes onto a device to compute (see :mod:`tune_hydra.engine.dispatch.lease`).

        On a copying device: wait for the store to be free of other leases and for room
        (evicting the least recently used states not in use), take it from another
        device if one holds it, copy it in (traced) and count it in the ledger. On a
        device computing in host memory: use the host tensors in place (read back from
        disk if need be), marked busy with ``host`` if given.

        Args:
            store: the shard's store.
            ahead_of: the assigned op it is for (the copy thread's): only the ops queued
                before it must stay resident beside it (``None``: all queued ones).
            deadline: ``time.monotonic()`` by which the lease must be taken.
            host: the host memory manager to mark the state busy with (``None``: not
                marked here; the engine marks its ops' states as it assigns them).
            blocking: wait for the store to be free of other leases (``False``: return
                ``None`` if it is not).
            room_now: return ``None`` rather than wait for an op or a lease to end when
                there is no room (evicting what no one holds is not waiting): for a
                caller on this device's own run thread, whose op is the one running.

        Raises:
            LeaseTimeoutError: not taken by ``deadline``.
            LeaseEndedError: the device closed while a caller's lease waited.
        """
        if blocking:
            CLAIMS.claim(store, self, deadline)
        elif not CLAIMS.try_claim(store, self):
            return None
        lease = Lease(self, store, host)
        try:
            if host is not None:  # before the promotion: nothing spills it in between
                host.use(store.parts(), 1)
            if self.copy:
                if not self._copy_in(lease, store, ahead_of, deadline, patient=not room_now):
                    lease.revoke("found no room")
                    return None
            else:
                store.promote(self.device, None, copy=False, owner=self)
                self.room.place(store, lease)
        except BaseException:
            lease.revoke("could not be taken")
            raise
        return lease

    def unpin(self, lease: Lease, *, revoke: bool = False) -> None:
        """``lease`` ended (called by it): its state may be evicted from now on."""
        self.room.unpin(lease, revoke=revoke)

    def fence(self) -> None:
        """Order this device's later copies after the work queued so far on the calling
        thread's current CUDA stream (a caller's lease ends: its kernels may still run)."""
        if self.copy_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.copy_stream.wait_event(event)

    @property
    def closing(self) -> bool:
        """Whether the worker is closing (its engine closes)."""
        return self.room.closing

    def what(self, store: Store) -> str:
        """How errors about leasing ``store`` here start."""
        return self.room.what(store)

    def _copy_in(
        self,
        lease: Lease,
        store: Store,
        ahead_of: Assignment | None,
        deadline: float | None,
        patient: bool = True,
    ) -> bool:
        """Copy ``store`` in for ``lease``; False: not ``patient``, and no room now."""
        try:
            if not self.room.make_room(store, ahead_of, deadline=deadline, patient=patient):
                if not patient and not self.room.closing:
                    return False
                if ahead_of is None:
                    raise LeaseEndedError(f"{self.what(store)}: the engine closed while it waited")
            prev = store.owner
            if isinstance(prev, DeviceWorker) and prev is not self:
                prev.evict(store)  # traced there, on its copy stream
            queued = list(self.assigned) if ahead_of is not None else []
            ahead = bool(queued) and queued[0] is not ahead_of  # another op is first
            t0 = self.clock()
            moved = store.promote(self.device, self.copy_stream, copy=self.copy, owner=self)
            if self.copy_stream is not None:
                lease.event = torch.cuda.Event()
                lease.event.record(self.copy_stream)
            if moved:
                task, shard = store.name
                op = ahead_of.op if ahead_of is not None else None
                self.trace.add(
                    TraceEvent(
                        self.label,
                        task,
                        shard,
                        "copy_in",
                        t0,
                        self.clock(),
                        moved,
                        op.iteration if op is not None else 0,
                        op.batch if op is not None else -1,
                        ahead=ahead,
                    )
                )
            lease.moved = moved
            self.room.land(store, lease)  # no longer in flight: resident
        except BaseException:
            self.room.ungrant(store)
            raise
        return True

    def close(self) -> None:
        self.room.close()
        self._copy_q.put(None)
        self._run_q.put(None)

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    # -- threads -------------------------------------------------------------------------

    def _copy_loop(self) -> None:
        while True:
            a = self._copy_q.get()
            if a is None:
                return
            if isinstance(a, Prefetch):
                try:
                    self._speculate(a)
                except BaseException as err:  # the op that needs the shard will retry
                    self.last_prefetch_error = err
                    log.warning(
                        "device %s: prefetching shard %d of task %r failed (%s: %s); its op "
                        "will copy it in",
                        self.label,
                        a.shard,
                        a.task,
                        type(err).__name__,
                        err,
                    )
                continue
            try:
                lease = self.lease(a.store, ahead_of=a)
                assert lease is not None
                a.lease, a.moved, a.event = lease, lease.moved, lease.event
            except BaseException as err:  # reported through the op
                a.copy_error = err
            assert a.ready is not None
            a.ready.set()

    def _speculate(self, p: Prefetch) -> None:
        if not self.room.prefetch_slot(p.store):  # resident, or both slots taken
            return
        if not self.room.make_room(p.store, wait=False):  # no room beside the assigned ops
            return
        try:
            t0 = self.clock()
            with p.store.lock:  # held until counted here: its task may be leaving the engine
                # A lease on another device holds it (checked under the store's lock: that
                # lease promotes it only after this).
                if CLAIMS.elsewhere(p.store, self):
                    self.room.ungrant(p.store)
                    return
                moved = p.store.try_promote(
                    self.device, self.copy_stream, copy=self.copy, owner=self
                )
                if moved is None:  # another device holds it, or it was retired
                    self.room.ungrant(p.store)
                    return
                if moved:
                    self.trace.add(
                        TraceEvent(
                            self.label,
                            p.task,
                            p.shard,
                            "copy_in",
                            t0,
                            self.clock(),
                            moved,
                            p.iteration,
                            ahead=True,  # a prefetch: its op is not even ready yet
                        )
                    )
                self.room.land(p.store)
        except BaseException:
            self.room.ungrant(p.store)
            raise

    def _run_loop(self) -> None:
        if self.device.type == "cpu":
            # Set in this thread, even to the process's count: torch applies it to a new
            # thread only at its first parallel_for, and an MKL vector op before that
            # (Adam's sqrt) runs an OpenMP team of one thread per core that spins between
            # ops (a core burnt per device; 25x the CPU of a small op in a 2-core A/B).
            torch.set_num_threads(self.intra_threads or torch.get_num_threads())
        while True:
            a = self._run_q.get()
            if a is None:
                return
            if a.ready is not None:
                while not a.ready.wait(_POLL_S):
                    pass
            err = a.copy_error
            if a.lend:
                try:
                    a.lease = self.lease(a.store)
                except BaseException as e:  # e.g. the read failed: that task fails
                    err = e
            t0 = self.clock()
            if err is None:
                # The store learns whether the op changes its state (else its device copy
                # is dropped at eviction, and a valid host or disk copy is kept). Both ends
                # may fail the task alone: a shared frozen tensor it changed.
                try:
                    a.store.begin_op(a.op.kind)
                    if self.compute_stream is not None:
                        with torch.cuda.stream(self.compute_stream):
                            if a.event is not None:
                                self.compute_stream.wait_event(a.event)
                            a.run(self.device)
                        self.compute_stream.synchronize()
                    else:
                        a.run(self.device)
                except BaseException as e:  # the engine fails that task only
                    err = e
                try:
                    a.store.end_op(failed=err is not None)
                except BaseException as e:
                    err = e
            if a.lease is not None:  # its compute is over (on CUDA: synchronized)
                a.lease.release()
            t1 = self.clock()
            self.busy_s += t1 - t0
            a.duration = t1 - t0
            op = a.op
            self.trace.add(
                TraceEvent(
                    self.label,
                    op.task,
                    op.shard,
                    op.kind.value,
                    t0,
                    t1,
                    a.moved,
                    op.iteration,
                    op.batch,
                )
            )
            try:
                a.done(a, err)
            except BaseException as e:  # keep the worker alive; the engine notices
                self.last_error = e
                log.warning("device %s: after op %s: %r", self.label, a.op, e, exc_info=e)
            self.room.op_ended()  # a copy waiting for room may go on
            # Not held while waiting for the next op: a failed op's error gets its callers'
            # frames (a th.shard loop's model) once they raise it.
            a = err = None


def default_clock() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
