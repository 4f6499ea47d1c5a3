"""Device workers: one compute thread per device, plus a copy thread that promotes the
next assigned shard while the current one computes (double buffering).

A worker holds at most two shard states resident when prefetching (the running one and
the next), one otherwise; the least recently used other shard is demoted to make room.
Boundary tensors other tasks left waiting on the device count against the same budget
and are parked in host memory when they would not fit. On CUDA, copies run on a
dedicated stream and compute waits on an event; on the CPU the same bookkeeping runs with
plain copies (or none, when ``copy=False``).

The arithmetic of the budget (what is resident, reserved, waiting; what fits, what to
evict) is the device's :class:`~tune_hydra.core.ledger.DeviceLedger`, which the trace's
replay uses too; a worker reads and changes its ledger only under its ``_lock``.
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
from tune_hydra.engine.storage import Store
from tune_hydra.exceptions import LeaseEndedError, LeaseTimeoutError, ScheduleError, format_bytes

if TYPE_CHECKING:
    from tune_hydra.engine.storage.host import HostMemory

log = logging.getLogger(__name__)

_POLL_S = 0.2  # every blocking wait wakes up this often to notice a close
_STUCK_S = 10.0  # a needed copy with nothing ahead of it that could free room: a bug


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
    # Bytes of boundary tensors the op leaves on the device (None: not tracked here).
    carry_bytes: Callable[[torch.device], int] | None = None
    left: int = 0
    start: Callable[[], None] | None = None  # called as the op starts computing
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
class Carry:
    """Boundary tensors (activations or gradients) a waiting task left on a device."""

    nbytes: int
    shard: int  # the shard whose op will consume them (for the trace)
    park: Callable[[torch.device, Any], int]  # to host memory; bytes moved, 0 if busy


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
        # Device bytes for shard state + the running op's activations (None: no limit).
        # Each task's plan fits its own shards; tasks of different sizes sharing a device
        # are kept within it here, by what is resident at once. The ledger also holds the
        # boundary tensors other tasks left here for their next op (set by the engine):
        # they occupy the device too. Optional copies (a second queued op, a prefetch)
        # that fit only without them are not made; for a needed copy, or when an op ends
        # over budget, they are parked in host memory (those of running tasks cannot be,
        # and are then ignored: their owners may be waiting for this very device). With
        # recompute=False it holds the device memory each task's batch in flight here may
        # hold (its forward graphs, kept until their backward; set by the engine): its
        # ops' activations and boundary tensors are inside it.
        self.ledger: DeviceLedger[Store, Carry] = DeviceLedger(budget)
        self._op_done = threading.Condition()  # the copy thread waits here for room
        self._incoming: Store | None = None  # the store the copy thread is bringing in
        # Leases held here, by id of their store (pinned: never evicted to make room), and
        # stores granted room whose copies are in flight (from any thread).
        self._leases: dict[int, Lease] = {}
        self._granted: dict[int, Store] = {}
        self._room_waiters = 0  # threads waiting in _make_room (a release notifies them)
        self.last_park_error: Exception | None = None
        self._closing = False
        self.assigned: collections.deque[Assignment] = collections.deque()
        self.busy_s = 0.0
        # The task whose op ran here last: without copies its activations are what this
        # core's caches hold, the CPU's notion of "resident" (set by the engine).
        self.last_task: str | None = None
        self.last_error: BaseException | None = None
        self.last_prefetch_error: BaseException | None = None  # speculative: not fatal
        self._lock = threading.Lock()
        self._copy_q: queue.SimpleQueue[Assignment | Prefetch | None] = queue.SimpleQueue()
        self._run_q: queue.SimpleQueue[Assignment | None] = queue.SimpleQueue()
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.compute_stream = torch.cuda.Stream(device) if cuda else None
        self._threads = [
            threading.Thread(target=self._copy_loop, name=f"hydra-copy-{label}", daemon=True),
            threading.Thread(target=self._run_loop, name=f"hydra-run-{label}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def free_slots(self) -> int:
        return self.depth - len(self.assigned)

    @property
    def budget(self) -> int | None:
        """Device bytes for everything the ledger counts (None: no limit)."""
        return self.ledger.budget

    @property
    def carries(self) -> dict[str, Carry]:
        """Boundary tensors other tasks left waiting here, by task (the ledger's)."""
        return self.ledger.carries

    @carries.setter
    def carries(self, value: dict[str, Carry]) -> None:
        with self._lock:
            for task in list(self.ledger.carries):
                self.ledger.set_carry(task, None)
            for task, carry in value.items():
                self.ledger.set_carry(task, carry)

    @property
    def reserved(self) -> dict[str, int]:
        """Bytes reserved for each task's batch in flight here (the ledger's)."""
        return self.ledger.reserved

    @property
    def peak_resident_bytes(self) -> int:
        """Shard state held on the device at once, at most (measured bytes)."""
        return self.ledger.peak_resident_bytes

    @property
    def parked_bytes(self) -> int:
        """Bytes of boundary tensors parked from here in host memory, in total."""
        return self.ledger.parked_bytes

    def holds(self, store: Store) -> bool:
        return self.ledger.holds(store)

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
            with self._lock:
                self.ledger.hold(a.store)
                self._trim()
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
        self._revoke(store)
        with self._lock:
            self.ledger.release(store)

    # -- leases ---------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        """The leases held on this device now (the engine's ops' and callers')."""
        with self._lock:
            return list(self._leases.values())

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
                with self._lock:
                    self.ledger.hold(store)
                    self._leases[id(store)] = lease
                    self._trim()
        except BaseException:
            lease.revoke("could not be taken")
            raise
        return lease

    def unpin(self, lease: Lease, *, revoke: bool = False) -> None:
        """``lease`` ended (called by it): its state may be evicted from now on."""
        with self._lock:
            key = id(lease._store)
            if self._leases.get(key) is lease:
                del self._leases[key]
        if not revoke and self._room_waiters:
            with self._op_done:  # a copy or a lease waiting for room may go on
                self._op_done.notify_all()

    def fence(self) -> None:
        """Order this device's later copies after the work queued so far on the calling
        thread's current CUDA stream (a caller's lease ends: its kernels may still run)."""
        if self.copy_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.copy_stream.wait_event(event)

    def _revoke(self, store: Store) -> None:
        with self._lock:
            lease = self._leases.get(id(store))
        if lease is not None:
            lease.revoke(
                "was revoked: the engine took its state off the device (its task left the "
                "engine, was checkpointed or restored, or the engine closed)"
            )

    @property
    def closing(self) -> bool:
        """Whether the worker is closing (its engine closes)."""
        return self._closing

    def what(self, store: Store) -> str:
        """How errors about leasing ``store`` here start."""
        return f"device {self.label}: leasing shard {store.name[1]} of task {store.name[0]!r}"

    def _trim(self) -> None:
        """Forget the least recently used states beyond ``depth`` that no lease holds
        (nothing to copy: a device computing in host memory). Under ``_lock``."""
        resident = self.ledger.resident
        extra = len(resident) - self.depth
        if extra <= 0:
            return
        for key, s in list(resident.items()):
            if extra <= 0:
                break
            if key not in self._leases:
                self.ledger.release(s)
                extra -= 1

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
            if not self._make_room(store, ahead_of, deadline=deadline, patient=patient):
                if not patient and not self._closing:
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
            self._hold(store, lease)  # no longer in flight: resident
        except BaseException:
            self._ungrant(store)
            raise
        return True

    def close(self) -> None:
        self._closing = True
        with self._op_done:
            self._op_done.notify_all()
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
            # Counted by settle() from here on: it may run between this copy's room check
            # and its landing, when an op leaves boundary tensors behind.
            with self._lock:
                self._incoming = a.store
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
                finally:
                    with self._lock:
                        self._incoming = None
                continue
            try:
                lease = self.lease(a.store, ahead_of=a)
                assert lease is not None
                a.lease, a.moved, a.event = lease, lease.moved, lease.event
            except BaseException as err:  # reported through the op
                a.copy_error = err
            finally:
                with self._lock:
                    self._incoming = None
            assert a.ready is not None
            a.ready.set()

    def _speculate(self, p: Prefetch) -> None:
        with self._lock:
            if self.ledger.holds(p.store):
                return
            busy = {id(x.store) for x in list(self.assigned)}
        if len(busy) + 1 > self.depth:  # both slots taken by assigned ops
            return
        if not self._make_room(p.store, wait=False):  # no room beside the assigned ops
            return
        try:
            t0 = self.clock()
            with p.store.lock:  # held until counted here: its task may be leaving the engine
                # A lease on another device holds it (checked under the store's lock: that
                # lease promotes it only after this).
                if CLAIMS.elsewhere(p.store, self):
                    self._ungrant(p.store)
                    return
                moved = p.store.try_promote(
                    self.device, self.copy_stream, copy=self.copy, owner=self
                )
                if moved is None:  # another device holds it, or it was retired
                    self._ungrant(p.store)
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
                self._hold(p.store)
        except BaseException:
            self._ungrant(p.store)
            raise

    def _hold(self, store: Store, lease: Lease | None = None) -> None:
        with self._lock:
            # Sizes cached at promotion: reading a store's tensors while another
            # thread computes with them (autograd writing .grad) is unsafe.
            store.last_nbytes = store.nbytes()
            self.ledger.hold(store, store.last_nbytes)
            self._granted.pop(id(store), None)  # landed: no longer in flight
            if lease is not None:
                self._leases[id(store)] = lease

    def _ungrant(self, store: Store) -> None:
        """The copy granted room for ``store`` landed (counted resident) or failed."""
        with self._lock:
            self._granted.pop(id(store), None)

    def _beside(self, store: Store | None) -> list[Store]:
        """The states held here besides ``store`` that no eviction may take: those of
        leases, and those granted room whose copies are in flight. Under ``_lock``."""
        out = [le._store for le in self._leases.values()]
        out += [s for s in self._granted.values() if s is not store]
        return out

    def fits(self, store: Store, extra: int = 0) -> bool:
        """Whether ``store`` can be resident beside the ops already assigned here and the
        leases held, with ``extra`` bytes more (the dispatcher asks before queueing a
        second op behind a running one; the batcher before running an op along)."""
        queued = [s for x in list(self.assigned) for s in x.stores()]
        with self._lock:
            keep = queued + [le._store for le in self._leases.values()] + [store]
            return self.ledger.need(keep, True, extra) is None

    def _need(self, keep: list[Store], carries: bool = False) -> int | None:
        """Bytes over budget if ``keep`` were resident while each of them runs (plus the
        boundary tensors other tasks left waiting here, with ``carries``); None if they
        fit."""
        with self._lock:
            return self.ledger.need(keep, carries)

    def reserve(self, task: str, nbytes: int | None) -> None:
        """Hold ``nbytes`` for ``task``'s batch in flight here (``None``: release it)."""
        with self._lock:
            self.ledger.reserve(task, nbytes)

    def hold_along(self, key: object, nbytes: int | None) -> None:
        """Hold ``nbytes`` for the activations of the ops run along in batched pass
        ``key`` (``None``: release them; see ``DeviceLedger.hold_along``)."""
        with self._lock:
            self.ledger.hold_along(key, nbytes)

    def admits(self, nbytes: int, room: int) -> bool:
        """Whether a task may start a batch (or run an op outside one) needing ``nbytes``
        here beside the batches in flight, the activations of the other ops assigned here
        and ``room`` bytes of shard state. Always on an idle device: each plan fits the
        budget on its own."""
        with self._lock:
            queued = [s for a in list(self.assigned) for s in a.stores()]
            return self.ledger.admits(nbytes, room, queued)

    def set_carry(self, task: str, carry: Carry | None) -> None:
        """Record (or, with ``None``, forget) what ``task`` left waiting here."""
        with self._lock:
            self.ledger.set_carry(task, carry)

    def park_carries(
        self, over: int, running: str | None, queued: set[str], stream: Any = None
    ) -> int:
        """Park waiting tasks' boundary tensors in host memory until ``over`` bytes are
        freed: never those of the task about to run here (``running``: its op's input),
        those of other tasks queued here last, largest first; returns the bytes freed.
        On CUDA the copies run on ``stream`` and are complete on return."""
        freed = 0
        with self._lock:
            waiting = self.ledger.park_order(running, queued)
        for task, carry in waiting:
            if freed >= over:
                break
            t0 = self.clock()
            try:
                moved = carry.park(self.device, stream)
            except Exception as err:  # e.g. no pinned memory left: they stay, nothing lost
                self.last_park_error = err
                log.warning(
                    "device %s: parking the boundary tensors of task %r failed (%s: %s); "
                    "they stay on the device",
                    self.label,
                    task,
                    type(err).__name__,
                    err,
                )
                continue
            if not moved:  # its task is running: its inputs are in use
                continue
            t1 = self.clock()  # before the room is freed: no copy may be traced starting in it
            with self._lock:
                self.ledger.drop_carry(task, carry)
                self.ledger.note_parked(task, moved)
            freed += carry.nbytes
            self.trace.add(TraceEvent(self.label, task, carry.shard, "carry_out", t0, t1, moved))
        return freed

    def settle(self) -> None:
        """After an op: park waiting boundary tensors if, beside the resident shards and
        the next op's activations, they no longer fit the budget."""
        if self.budget is None or not self.carries:
            return
        with self._lock:
            queued = list(self.assigned)
            # Resident, being copied in, or about to be: all there when the next op runs.
            # (Copies granted room for a caller's lease count as the next op, if none is
            # queued: its holder computes on it then.)
            incoming = self._incoming
            coming = [s for x in queued for s in x.stores()]
            coming += [s for s in self._granted.values() if s is not incoming]
            over = self.ledger.settle_over(coming, incoming)
        nxt = queued[0].op.task if queued else None
        if over > 0:  # between two ops of this thread: its own stream made them
            self.park_carries(over, nxt, {x.op.task for x in queued}, self.compute_stream)

    def _make_room(
        self,
        incoming: Store,
        op: Assignment | None = None,
        wait: bool = True,
        deadline: float | None = None,
        patient: bool = True,
    ) -> bool:
        """Evict least recently used shards so that ``incoming`` fits beside the ops that
        run before it (those assigned ahead of ``op``, or all assigned ones for a
        speculative prefetch or a caller's lease; with the other states of ``op``'s
        batched pass, for one of them), the leases held and the copies granted room
        (count and bytes). If even those do not fit, wait for an op or a lease to end
        (``wait`` and ``patient``, until ``deadline``) or give up (returns False). On
        success the room is granted to ``incoming`` (the caller calls :meth:`_ungrant`
        once its copy is counted resident, or failed). ``wait=False`` is a speculative
        copy (waiting boundary tensors count, none is parked); ``patient=False`` a needed
        one that must not wait.

        Raises:
            LeaseTimeoutError: no room by ``deadline``.
            ScheduleError: no room, and nothing here could free it.
        """
        stuck_since = None
        while True:
            queued = list(self.assigned)
            if op is not None and any(x is op for x in queued):
                at = next(i for i, x in enumerate(queued) if x is op)
                # A state of op's batched pass: its group's states are needed with it.
                queued = queued[: at + 1] if any(s is incoming for s in op.along) else queued[:at]
            ahead = [s for x in queued for s in x.stores()] + [incoming]
            with self._lock:  # checked and granted at once: callers on other threads
                beside = self._beside(incoming)
                keep = ahead[:-1] + beside + [incoming]
                over = self.ledger.need(keep, not wait)
                if over is None:
                    self._granted[id(incoming)] = incoming
                    break
            if not wait or not patient or self._closing:
                return False
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise LeaseTimeoutError(
                    f"{self.what(incoming)}: no room within the timeout "
                    f"({format_bytes(over)} over the device budget beside the "
                    f"{len(queued)} op(s) queued and the {len(beside)} other state(s) "
                    f"leased or coming in); release a lease on {self.label}, or give a "
                    f"longer timeout"
                )
            # Nothing runs ahead of this op and nothing is leased, yet it does not fit:
            # only ops queued behind it could free the room. Fail the op (its task)
            # rather than hang every task.
            stuck_since = (stuck_since or now) if not queued and not beside else None
            if stuck_since is not None and now - stuck_since > _STUCK_S:
                raise ScheduleError(
                    f"device {self.label}: shard {incoming.name} does not fit its budget "
                    f"({format_bytes(over)} over) beside what the device holds "
                    f"({format_bytes(sum(self.reserved.values()))} reserved for kept "
                    f"graphs), and nothing ahead of it will free room; this is a "
                    f"tune_hydra bug, please report it"
                )
            with self._op_done:
                self._room_waiters += 1
                try:
                    self._op_done.wait(
                        _POLL_S if deadline is None else min(_POLL_S, deadline - now)
                    )
                finally:
                    self._room_waiters -= 1
        if wait:  # a needed copy: park waiting boundary tensors that leave it no room
            over = self._need(keep, carries=True)
            if over is not None:
                tasks = {s.name[0] for s in ahead}
                self.park_carries(over, ahead[0].name[0], tasks, self.copy_stream)
        with self._lock:  # carries that could not be parked count, too
            victims = self.ledger.victims(keep, self.depth)
        for s in victims:  # counted as resident until their copies are done
            self.evict(s)
        return True

    def evict(self, store: Store) -> None:
        """Copy ``store`` back to the host if this device still holds it (safe from any
        thread: another device's copy thread takes a shard over this way). Returns once
        the copy is done: until then the device memory is in use, and the shard stays
        counted here."""
        self._revoke(store)  # only a task leaving (or checkpointed) takes a leased state
        # Under the store's lock from the copy to the release: another device's copy thread
        # takes a shard over through this method, and this device's own eviction of it must
        # not free the room (and copy something into it) while that copy-out still runs,
        # nor before its end is taken for the trace.
        with store.lock:
            t0 = self.clock()
            # A device copy that changed nothing is dropped (0 bytes moved): its stay here
            # still ends with a copy_out event (the trace's replay frees it there).
            held = store.copied and store.owner is self
            moved = store.demote(self.copy_stream, only_owner=self)
            if moved:
                store.synchronize()
            t1 = self.clock()
            with self._lock:
                self.ledger.release(store)
                if moved:
                    self.ledger.note_spilled(store.name[0], moved)
        if moved or held:
            task, shard = store.name
            self.trace.add(TraceEvent(self.label, task, shard, "copy_out", t0, t1, moved))

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
            if err is None and a.start is not None:
                a.start()
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
            if err is None and a.carry_bytes is not None:
                a.left = a.carry_bytes(self.device)
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
                    a.left,
                )
            )
            try:
                a.done(a, err)
                self.settle()
            except BaseException as e:  # keep the worker alive; the engine notices
                self.last_error = e
                log.warning("device %s: after op %s: %r", self.label, a.op, e, exc_info=e)
            with self._op_done:  # a copy waiting for room may go on
                self._op_done.notify_all()
            # Not held while waiting for the next op: a failed op's error gets its callers'
            # frames (a th.shard loop's model) once they raise it.
            a = err = None


def default_clock() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
