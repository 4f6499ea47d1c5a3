"""The memory room of one device: what may be resident on it now, and what to evict to
make room.

A :class:`DeviceRoom` belongs to one :class:`~tune_hydra.engine.dispatch.workers.DeviceWorker`
(its threads and leases are the worker's). It owns what occupies the device and what must
stay there: the device's :class:`~tune_hydra.core.ledger.DeviceLedger` (the arithmetic:
resident states, reservations), the leases pinning states here and the room granted to
copies in flight. It decides whether a state fits and which states to evict (least
recently used first, copied back to the host), and it holds the waits for room. The
worker's queue of assigned ops is read here, never changed (the dispatcher changes it,
under its own lock).

Design note (locks), in the order they may be taken:

- ``store.lock`` (a shard store's): :meth:`DeviceRoom.evict` holds it from the copy-out
  to the release, so that another device's copy thread taking the shard over and this
  device's own eviction of it never both free the room; the worker's prefetch holds it
  until the state is counted here. ``_lock`` (and the lease claims' condition) are taken
  under it.
- ``_lock``: guards the ledger, the pins and the grants. A leaf: nothing is taken and
  nothing waits under it (copies and lease revocations run outside it).
  :meth:`DeviceRoom.make_room` checks and grants room under one hold of it, so that two
  threads (the copy thread, a caller's lease) never take the same room.
- ``_op_done``: a condition with its own lock, never held with ``_lock``. A copy or a
  lease waiting for room waits on it (waking every ``_POLL_S`` to notice a close); each
  op's end (:meth:`DeviceRoom.op_ended`), a lease's release (:meth:`DeviceRoom.unpin`,
  only while someone waits: ``_room_waiters`` is read without the lock, and a missed
  wake-up costs one poll) and :meth:`DeviceRoom.close` notify it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tune_hydra.core.ledger import DeviceLedger
from tune_hydra.core.trace import Trace, TraceEvent
from tune_hydra.engine.storage import Store
from tune_hydra.exceptions import LeaseTimeoutError, ScheduleError, format_bytes

if TYPE_CHECKING:
    from tune_hydra.engine.dispatch.lease import Lease
    from tune_hydra.engine.dispatch.workers import Assignment

_POLL_S = 0.2  # every blocking wait wakes up this often to notice a close
_STUCK_S = 10.0  # a needed copy with nothing ahead of it that could free room: a bug


class DeviceRoom:
    """What may be resident on one device now, and what to evict for room.

    Args:
        owner: the device's worker (the ``owner`` of the stores promoted there).
        label: the device's label (traces, errors).
        trace: where evictions are traced.
        clock: the engine's clock.
        assigned: the worker's queue of assigned ops (read only here).
        depth: the most shard states kept resident at once.
        budget: device bytes for everything the ledger counts (``None``: no limit).
        copy_stream: the CUDA stream of the device's copies (``None`` off CUDA).
    """

    def __init__(
        self,
        owner: object,
        label: str,
        trace: Trace,
        clock: Callable[[], float],
        assigned: collections.deque[Assignment],
        *,
        depth: int,
        budget: int | None,
        copy_stream: Any,
    ) -> None:
        self._owner = owner
        self._label = label
        self._trace = trace
        self._clock = clock
        self._assigned = assigned
        self._depth = depth
        self._copy_stream = copy_stream
        # Device bytes for shard state + the running op's activations (None: no limit).
        # Each task's plan fits its own shards; tasks of different sizes sharing a device
        # are kept within it here, by what is resident at once. With recompute=False the
        # ledger holds the device memory each task's batch in flight here may hold (its
        # forward graphs, kept until their backward; set by the engine): its ops'
        # activations and boundary tensors are inside it.
        self.ledger: DeviceLedger[Store] = DeviceLedger(budget)
        self._lock = threading.Lock()  # the ledger, pins, grants (see the module)
        self._op_done = threading.Condition()  # waits for room are here
        # Leases held here, by id of their store (pinned: never evicted to make room), and
        # stores granted room whose copies are in flight (from any thread).
        self._leases: dict[int, Lease] = {}
        self._granted: dict[int, Store] = {}
        self._room_waiters = 0  # threads waiting in make_room (a release notifies them)
        self._closing = False

    @property
    def budget(self) -> int | None:
        """Device bytes for everything the ledger counts (None: no limit)."""
        return self.ledger.budget

    @property
    def reserved(self) -> dict[str, int]:
        """Bytes reserved for each task's batch in flight here (the ledger's)."""
        return self.ledger.reserved

    @property
    def closing(self) -> bool:
        """Whether the device is closing: no wait for room goes on."""
        return self._closing

    def holds(self, store: Store) -> bool:
        return self.ledger.holds(store)

    def what(self, store: Store) -> str:
        """How errors about leasing ``store`` here start."""
        return f"device {self._label}: leasing shard {store.name[1]} of task {store.name[0]!r}"

    # -- states held here ------------------------------------------------------------------

    def place(self, store: Store, lease: Lease | None = None) -> None:
        """Count ``store`` as resident (used in place: nothing to copy), pinned by
        ``lease`` if given, and forget the least recently used states beyond ``depth``."""
        with self._lock:
            self.ledger.hold(store)
            if lease is not None:
                self._leases[id(store)] = lease
            self._trim()

    def land(self, store: Store, lease: Lease | None = None) -> None:
        """The copy granted room for ``store`` landed: count it resident (pinned by
        ``lease`` if given)."""
        with self._lock:
            # Sizes cached at promotion: reading a store's tensors while another
            # thread computes with them (autograd writing .grad) is unsafe.
            store.last_nbytes = store.nbytes()
            self.ledger.hold(store, store.last_nbytes)
            self._granted.pop(id(store), None)  # landed: no longer in flight
            if lease is not None:
                self._leases[id(store)] = lease

    def ungrant(self, store: Store) -> None:
        """The copy granted room for ``store`` landed (counted resident) or failed."""
        with self._lock:
            self._granted.pop(id(store), None)

    def release(self, store: Store) -> None:
        """Forget ``store`` without copying; a lease on it here ends."""
        self.revoke(store)
        with self._lock:
            self.ledger.release(store)

    def prefetch_slot(self, store: Store) -> bool:
        """Whether a prefetch of ``store`` may take a slot: not resident here, and the
        assigned ops leave one of the ``depth`` free."""
        with self._lock:
            if self.ledger.holds(store):
                return False
            busy = {id(x.store) for x in list(self._assigned)}
        return len(busy) + 1 <= self._depth

    # -- leases (pins) ---------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        """The leases held on this device now."""
        with self._lock:
            return list(self._leases.values())

    def unpin(self, lease: Lease, *, revoke: bool = False) -> None:
        """``lease`` ended: its state may be evicted from now on."""
        with self._lock:
            key = id(lease._store)
            if self._leases.get(key) is lease:
                del self._leases[key]
        if not revoke and self._room_waiters:
            with self._op_done:  # a copy or a lease waiting for room may go on
                self._op_done.notify_all()

    def revoke(self, store: Store) -> None:
        """End the lease holding ``store`` here, if one does."""
        with self._lock:
            lease = self._leases.get(id(store))
        if lease is not None:
            lease.revoke(
                "was revoked: the engine took its state off the device (its task left the "
                "engine, was checkpointed or restored, or the engine closed)"
            )

    # -- waits -----------------------------------------------------------------------------

    def op_ended(self) -> None:
        """An op ended here: a copy waiting for room may go on."""
        with self._op_done:
            self._op_done.notify_all()

    def close(self) -> None:
        """The device closes: every wait for room gives up."""
        self._closing = True
        with self._op_done:
            self._op_done.notify_all()

    # -- room ------------------------------------------------------------------------------

    def fits(self, store: Store, extra: int = 0) -> bool:
        """Whether ``store`` can be resident beside the ops already assigned here and the
        leases held, with ``extra`` bytes more (the dispatcher asks before queueing a
        second op behind a running one; the batcher before running an op along)."""
        queued = [s for x in list(self._assigned) for s in x.stores()]
        with self._lock:
            keep = queued + [le._store for le in self._leases.values()] + [store]
            return self.ledger.need(keep, extra) is None

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
            queued = [s for a in list(self._assigned) for s in a.stores()]
            return self.ledger.admits(nbytes, room, queued)

    def make_room(
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
        success the room is granted to ``incoming`` (the caller calls :meth:`ungrant`
        once its copy is counted resident, or failed). ``wait=False`` is a speculative
        copy; ``patient=False`` a needed one that must not wait.

        Raises:
            LeaseTimeoutError: no room by ``deadline``.
            ScheduleError: no room, and nothing here could free it.
        """
        stuck_since = None
        while True:
            queued = list(self._assigned)
            if op is not None and any(x is op for x in queued):
                at = next(i for i, x in enumerate(queued) if x is op)
                # A state of op's batched pass: its group's states are needed with it.
                queued = queued[: at + 1] if any(s is incoming for s in op.along) else queued[:at]
            ahead = [s for x in queued for s in x.stores()] + [incoming]
            with self._lock:  # checked and granted at once: callers on other threads
                beside = self._beside(incoming)
                keep = ahead[:-1] + beside + [incoming]
                over = self.ledger.need(keep)
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
                    f"leased or coming in); release a lease on {self._label}, or give a "
                    f"longer timeout"
                )
            # Nothing runs ahead of this op and nothing is leased, yet it does not fit:
            # only ops queued behind it could free the room. Fail the op (its task)
            # rather than hang every task.
            stuck_since = (stuck_since or now) if not queued and not beside else None
            if stuck_since is not None and now - stuck_since > _STUCK_S:
                raise ScheduleError(
                    f"device {self._label}: shard {incoming.name} does not fit its budget "
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
        with self._lock:
            victims = self.ledger.victims(keep, self._depth)
        for s in victims:  # counted as resident until their copies are done
            self.evict(s)
        return True

    def evict(self, store: Store) -> None:
        """Copy ``store`` back to the host if this device still holds it (safe from any
        thread: another device's copy thread takes a shard over this way). Returns once
        the copy is done: until then the device memory is in use, and the shard stays
        counted here."""
        self.revoke(store)  # only a task leaving (or checkpointed) takes a leased state
        # Under the store's lock from the copy to the release: another device's copy thread
        # takes a shard over through this method, and this device's own eviction of it must
        # not free the room (and copy something into it) while that copy-out still runs,
        # nor before its end is taken for the trace.
        with store.lock:
            t0 = self._clock()
            # A device copy that changed nothing is dropped (0 bytes moved): its stay here
            # still ends with a copy_out event (the trace's replay frees it there).
            held = store.copied and store.owner is self._owner
            with self._lock:  # a part shared with a shard here stays (tied weights)
                others = [*self.ledger.resident.values(), *self._granted.values()]
                keep = {id(p) for s in others if s is not store for p in s.parts()}
            moved = store.demote(self._copy_stream, only_owner=self._owner, keep=keep)
            if moved:
                store.synchronize()
            t1 = self._clock()
            with self._lock:
                self.ledger.release(store)
                if moved:
                    self.ledger.note_spilled(store.name[0], moved)
        if moved or held:
            task, shard = store.name
            self._trace.add(TraceEvent(self._label, task, shard, "copy_out", t0, t1, moved))

    # -- internals (under _lock) -----------------------------------------------------------

    def _beside(self, store: Store | None) -> list[Store]:
        """The states held here besides ``store`` that no eviction may take: those of
        leases, and those granted room whose copies are in flight. Under ``_lock``."""
        out = [le._store for le in self._leases.values()]
        out += [s for s in self._granted.values() if s is not store]
        return out

    def _trim(self) -> None:
        """Forget the least recently used states beyond ``depth`` that no lease holds
        (nothing to copy: a device computing in host memory). Under ``_lock``."""
        resident = self.ledger.resident
        extra = len(resident) - self._depth
        if extra <= 0:
            return
        for key, s in list(resident.items()):
            if extra <= 0:
                break
            if key not in self._leases:
                self.ledger.release(s)
                extra -= 1


__all__ = ["DeviceRoom"]
