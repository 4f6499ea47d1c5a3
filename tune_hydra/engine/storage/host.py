"""Host memory with a budget, and the disk tier below it.

With ``host_memory`` and ``spill_dir``, an engine's :class:`HostMemory` keeps what it
holds in host memory (shard states in RAM, the frozen pool's entries; its
:class:`~tune_hydra.core.host.HostLedger` counts them) within the budget:

- **Room on demand.** Before a state comes into host memory (a device evicts it, it is
  read back from disk, a task registers) the store asks :meth:`HostMemory.reserve`. If it
  would not fit, the *coldest* other states go to disk first: those whose next visit is
  furthest away, from each task's program (ops until its next visit of the shard) and the
  policy's ranking of the tasks (see :meth:`HostMemory.set_outlook`). A state that is on a
  device has only a stale host copy, dropped without a write.
- **Read-ahead.** The disk thread (one per engine, the tier's) reads the hottest states
  on disk back into host memory ahead of their visit, if it can make room by spilling
  only colder ones; the device's copy thread then takes them on (disk -> host -> device,
  each hop overlapped with other ops' compute). A visit that finds its state still on
  disk reads it then, and the wait is recorded (``disk_wait_s``, ``disk_wait`` events).
- **Faults.** A failed write fails the task of the state that could not be spilled, with
  :class:`~tune_hydra.exceptions.SpillWriteError` (its subclass ``SpillDiskFullError``
  for a full disk; also a folder made unwritable or read-only); the state stays in host
  memory and is not picked again; other tasks go on. A state that
  cannot be read back fails its task with :class:`~tune_hydra.exceptions.SpillReadError`.
  Closing never raises for the disk tier: a spill folder that cannot be removed is logged.

Design note (locks): ``HostMemory._lock`` is a leaf. :meth:`reserve` is called by a store
under its own lock and spills *other* stores only through ``try_spill`` (a non-blocking
try of their lock), so two stores making room for each other cannot deadlock; whoever
holds a store's lock is using it, so it is not a victim then. A store in use by an op
assigned to a device is marked busy (:meth:`use`, before the op is handed to its device)
and is never spilled: its store checks that under its own lock, after taking it.

The budget holds strictly when ``host_memory`` is at least (devices + 2) times the
largest shard state: every state a thread may be moving at once (one per device's copy
thread and the disk thread) besides the one being made room for can then be spilled (a
reservation whose victims are all being moved waits up to 50 ms for one to be free).
With less (at least one shard state, or :class:`~tune_hydra.exceptions.HostBudgetError`),
a reservation that finds every other state in use goes over by its own size: held host
memory stays within ``host_memory + (devices + 1) x`` the largest shard state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tune_hydra.core.host import HostLedger
from tune_hydra.core.trace import Trace, TraceEvent
from tune_hydra.engine.storage.disk import SpillFolder
from tune_hydra.engine.storage.store import ShardStore
from tune_hydra.exceptions import SpillReadError, SpillWriteError

SpillError = SpillWriteError | SpillReadError

log = logging.getLogger(__name__)


def _libc() -> Any:
    """glibc, for ``malloc_trim`` (None elsewhere: other allocators return memory)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 (musl and others have none)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()

_COLD = math.inf  # a state no outlook mentions: its task has no work granted
_AHEAD_S = 0.05  # the disk thread looks again this often (and whenever the outlook changes)
# A reservation whose victims are all being moved by other threads retries this often, for
# at most this long, before it goes over (two threads may each hold what the other needs).
_RETRY_S = 0.001
_WAIT_S = 0.05


def _victim_order(store: ShardStore) -> int:
    """0: a stale host copy of a state a device changes; 1: a host copy of a state on a
    device that is still valid; 2: a state at home."""
    if not store.copied:
        return 2
    return 1 if store.host_copy_valid else 0


class _EntryVictim:
    """A frozen pool entry as a spill victim (see ``FrozenPool.try_spill``)."""

    copied = False  # read by _victim_order: a state at home

    def __init__(self, host: HostMemory, entry: Any, stores: list[ShardStore]) -> None:
        self.host = host
        self.entry = entry
        self.stores = stores

    def heat(self, heat: Mapping[int, float]) -> float:
        return min((heat.get(id(s), _COLD) for s in self.stores), default=_COLD)

    def try_spill(self) -> bool:
        return bool(self.host.pool.try_spill(self.entry, self.host))


class HostMemory:
    """The engine's host memory account, the disk tier's folder and its thread.

    Args:
        budget: host bytes (``None``: unlimited; nothing goes to disk).
        folder: the engine's spill folder (needed with a budget).
        trace: the engine's trace (``host`` and ``disk`` events).
        clock: the engine's clock (seconds since it started).
        lookahead: how many of the hottest states on disk the disk thread reads ahead.
    """

    def __init__(
        self,
        budget: int | None,
        folder: SpillFolder | None,
        trace: Trace,
        clock: Callable[[], float],
        lookahead: int = 4,
    ) -> None:
        self.ledger = HostLedger(budget)
        self.folder = folder
        self.trace = trace
        self.clock = clock
        self.lookahead = lookahead
        self._lock = threading.Lock()
        self._stores: dict[int, ShardStore] = {}
        self._busy: dict[int, int] = {}
        self._heat: Mapping[int, float] = {}
        self._failed: set[int] = set()  # could not be written: never picked again
        self.failures: list[tuple[str, SpillError]] = []
        self.written_bytes = 0
        self.read_bytes = 0
        self.disk_wait_s = 0.0
        self.spills = 0
        self.loads = 0
        self.over_bytes = 0  # the most a reservation went over budget (the slack)
        self.pool: Any = None  # the frozen pool (see attach)
        self._freed = 0  # host bytes freed since the last malloc_trim
        self._t0 = time.perf_counter() - clock()  # perf_counter() at the clock's zero
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        if budget is not None:
            self._thread = threading.Thread(target=self._ahead_loop, name="hydra-disk", daemon=True)
            self._thread.start()

    @property
    def budget(self) -> int | None:
        return self.ledger.budget

    @property
    def active(self) -> bool:
        """Whether there is a budget (and so a disk tier)."""
        return self.ledger.budget is not None

    # -- registration --------------------------------------------------------------------

    def register(self, stores: Iterable[ShardStore]) -> None:
        """Count newly registered stores (their tensors are in host memory), spilling
        colder states, or these, to stay within the budget."""
        if not self.active:
            return  # unlimited: nothing to count, nothing to hold on to
        for store in stores:
            with self._lock:
                self._stores[id(store)] = store
            # No colder state to make room with: this one goes to disk right away (its
            # tensors are still the user's: they never count here). If the write fails, it
            # stays (and its task fails).
            charge = store.host_charge()
            if not self.reserve(store, charge, speculative=True) and not self._spill_or_fail(store):
                with self._lock:
                    self._take(store, charge)

    def unregister(self, stores: Iterable[ShardStore]) -> None:
        """Stop counting stores whose task leaves the engine (or is rebuilt): their memory
        is the user's again, and loading them back is not the engine's (call
        :meth:`discard` once they are loaded)."""
        for store in stores:
            with self._lock:
                self._stores.pop(id(store), None)
                self._busy.pop(id(store), None)
                self._failed.discard(id(store))
                self._give(store)

    def discard(self, stores: Iterable[ShardStore]) -> None:
        """Remove the spill files of unregistered stores (a state still on disk keeps
        its views: the file's disk space is freed once nothing uses them), and drop their
        references into the frozen pool (``tune_hydra.engine.storage.frozen``)."""
        for store in stores:
            store.leave_frozen()
            if store.spill_file is not None:
                store.spill_file.close()

    # -- frozen tensors held once for several tasks (tune_hydra.engine.storage.frozen) -----------

    def attach(self, pool: Any) -> None:
        """The engine's frozen pool (``tune_hydra.engine.storage.frozen.FrozenPool``): its entries
        are spill victims too, once no task using them is on a device or computing."""
        self.pool = pool

    def hold(
        self,
        key: object,
        nbytes: int,
        name: tuple[str, int],
        store: Any = None,
        spill: Callable[[], bool] | None = None,
    ) -> None:
        """Count ``nbytes`` of the frozen pool under ``key`` (a new entry, or one read back
        from disk for ``store``, which is not spilled for it: the caller holds its lock),
        after making room by spilling colder states; if none can be made, ``spill()`` (a
        new entry's: to disk right away) or over within the slack."""
        if not self.active or not nbytes:
            return
        waited = 0.0
        while True:
            with self._lock:
                if self.ledger.over(nbytes) <= 0:
                    self._hold(key, nbytes, name)
                    return
                victims = self._victims(store, None)
            if any(self._spill_or_fail(v) for v in victims):
                continue
            if not victims or waited >= _WAIT_S:
                break
            time.sleep(_RETRY_S)
            waited += _RETRY_S
        if spill is not None and spill():
            return
        with self._lock:
            self.over_bytes = max(self.over_bytes, self.ledger.over(nbytes))
            self._hold(key, nbytes, name)

    def _hold(self, key: object, nbytes: int, name: tuple[str, int]) -> None:
        self.ledger.take(key, nbytes)
        t = self.clock()
        self.trace.add(TraceEvent("host", name[0], name[1], "host_take", t, t, nbytes))

    def frozen_file(self, key: tuple[str, int]) -> Any:
        """A new spill file for the frozen pool's entry ``key`` (written once)."""
        assert self.folder is not None
        return self.folder.file(key)

    def note_frozen_io(self, entry: Any, op: str, nbytes: int, start: float) -> None:
        """The frozen pool moved ``entry`` (see :meth:`note_io`)."""
        self._count_io(entry.ledger_key[0], -1, op, nbytes, start)

    def drop(self, key: object, name: tuple[str, int]) -> None:
        """The frozen pool freed ``key``'s tensor (its last user left, or it went to
        disk)."""
        if not self.active:
            return
        with self._lock:
            nbytes = self.ledger.give(key)
            self._freed += nbytes
            if nbytes:
                t = self.clock()
                self.trace.add(TraceEvent("host", name[0], name[1], "host_give", t, t, nbytes))

    # -- what the engine tells it --------------------------------------------------------

    def use(self, stores: Iterable[ShardStore], delta: int) -> None:
        """Mark ``stores`` in use (``delta=1``, as their op is assigned to a device) or no
        longer (``-1``, as it ends)."""
        with self._lock:
            for s in stores:
                n = self._busy.get(id(s), 0) + delta
                if n > 0:
                    self._busy[id(s)] = n
                else:
                    self._busy.pop(id(s), None)

    def set_outlook(self, heat: Mapping[int, float]) -> None:
        """How soon each store (by ``id``) will be visited: an estimate in ops, lower is
        sooner; a store not mentioned is the coldest."""
        self._heat = heat
        self._wake.set()

    def take_failures(self) -> list[tuple[str, SpillError]]:
        """The tasks whose state could not be written since the last call, with the error."""
        with self._lock:
            out, self.failures = self.failures, []
        return out

    # -- HostAccount: what the stores call -----------------------------------------------

    def busy(self, store: ShardStore) -> bool:
        with self._lock:
            # A store not registered (its task left) is not the engine's to spill.
            return id(store) in self._busy or id(store) not in self._stores

    def reserve(self, store: ShardStore, nbytes: int, *, speculative: bool = False) -> bool:
        if not self.active or id(store) not in self._stores:
            return True  # unlimited, or the user's memory (its task left)
        mine = self._heat.get(id(store), _COLD)
        waited = 0.0
        while True:
            with self._lock:
                over = self.ledger.over(nbytes - self.ledger.states.get(id(store), 0))
                if over <= 0:
                    self._take(store, nbytes)
                    return True
                victims = self._victims(store, mine if speculative else None)
            freed = False
            for v in victims:
                if self._spill_or_fail(v):
                    freed = True
                    break  # look again: the room may suffice now
            if freed:
                continue
            if speculative:
                return False
            if victims and waited < _WAIT_S:
                # The victims are being moved by other threads (a copy in, a read): their
                # locks are free again in a moment, or they stop being candidates.
                time.sleep(_RETRY_S)
                waited += _RETRY_S
                continue
            # Every other state is in use or unspillable: go over (the documented slack).
            with self._lock:
                self.over_bytes = max(self.over_bytes, self.ledger.over(nbytes))
                self._take(store, nbytes)
            log.debug("host memory over budget by %d bytes for %s", self.over_bytes, store.name)
            return True

    def release(self, store: ShardStore) -> None:
        with self._lock:
            if id(store) in self._stores:
                self._freed += self._give(store)
        self._wake.set()

    def note_io(self, store: ShardStore, op: str, nbytes: int, start: float) -> None:
        if not nbytes:
            return  # a shard without tensors (only parameter-free layers)
        task, shard = store.name
        self._count_io(task, shard, op, nbytes, start)

    def _count_io(self, task: str, shard: int, op: str, nbytes: int, start: float) -> None:
        """Count a disk write (``op == "to_disk"``) or read and trace it."""
        t0 = start - self._t0
        t1 = max(t0, time.perf_counter() - self._t0)  # one time base: never before t0
        with self._lock:
            if op == "to_disk":
                self.written_bytes += nbytes
                self.spills += 1
            else:
                self.read_bytes += nbytes
                self.loads += 1
        self.trace.add(TraceEvent("disk", task, shard, op, t0, t1, nbytes))

    def note_wait(self, store: ShardStore, owner: object, start: float) -> None:
        t0 = start - self._t0
        t1 = max(t0, time.perf_counter() - self._t0)
        with self._lock:
            self.disk_wait_s += t1 - t0
        label = getattr(owner, "label", "host")
        task, shard = store.name
        self.trace.add(TraceEvent(label, task, shard, "disk_wait", t0, t1))

    # -- figures -------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Host memory and disk figures (see ``Engine.summary``)."""
        with self._lock:
            return {
                "budget": self.ledger.budget,
                "held_bytes": self.ledger.held,
                "peak_held_bytes": self.ledger.peak,
                "written_bytes": self.written_bytes,
                "read_bytes": self.read_bytes,
                "disk_wait_s": self.disk_wait_s,
                "spills": self.spills,
                "loads": self.loads,
                "over_bytes": self.over_bytes,
                "spill_dir": str(self.folder.path) if self.folder is not None else None,
            }

    def close(self) -> None:
        """Stop the disk thread and remove the spill folder. Never raises for the disk
        tier: what cannot be removed is logged."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10.0)
        if self.folder is not None:
            try:
                self.folder.close()
            except OSError as err:  # it logs its own failures; this is a last resort
                log.warning("removing the spill folder %s: %s", self.folder.path, err)

    # -- internals -----------------------------------------------------------------------

    def _take(self, store: ShardStore, nbytes: int) -> None:
        before = self.ledger.states.get(id(store), 0)
        self.ledger.take(id(store), nbytes)
        if nbytes != before:
            t = self.clock()
            task, shard = store.name
            op = "host_take" if nbytes > before else "host_give"
            self.trace.add(TraceEvent("host", task, shard, op, t, t, abs(nbytes - before)))

    def _give(self, store: ShardStore) -> int:
        nbytes = self.ledger.give(id(store))
        if nbytes:
            t = self.clock()
            task, shard = store.name
            self.trace.add(TraceEvent("host", task, shard, "host_give", t, t, nbytes))
        return nbytes

    def _victims(self, store: ShardStore | None, colder_than: float | None) -> list[Any]:
        """States in host memory that may go to disk, coldest first (under the lock):
        not ``store``, not in use, not failed; with ``colder_than``, only colder ones. The
        frozen pool's entries too: as hot as the hottest store using them (one whose
        user is on a device or computing is left out by its own spill)."""
        heat = self._heat
        out: list[tuple[float, Any]] = []
        for key in self.ledger.states:
            if not isinstance(key, int):
                victim = self._entry_victim(key, store)
                if victim is not None:
                    h = victim.heat(heat)
                    if colder_than is None or h > colder_than:
                        out.append((h, victim))
                continue
            s = self._stores.get(key)
            if s is None or s is store or key in self._busy or key in self._failed:
                continue
            h = heat.get(key, _COLD)
            if colder_than is not None and not h > colder_than:
                continue
            out.append((h, s))
        # Stale copies of states on a device first (dropped, no write): those a visit
        # changed or will change (useless) before those still valid (a visit that changes
        # nothing drops its device copy and keeps them); then the coldest.
        out.sort(key=lambda hs: (_victim_order(hs[1]), -hs[0]))
        return [s for _, s in out]

    def _entry_victim(self, key: object, store: ShardStore | None) -> _EntryVictim | None:
        if self.pool is None:
            return None
        entry = self.pool.entry_of(key)
        if entry is None or not self.pool.spillable(entry):
            return None
        stores = self.pool.stores_of(entry)
        if store is not None and any(s is store for s in stores):
            return None  # its lock is the caller's (see hold)
        return _EntryVictim(self, entry, stores)

    def _spill_or_fail(self, store: ShardStore) -> bool:
        try:
            return store.try_spill()
        except (SpillWriteError, SpillReadError) as err:
            log.warning("%s", err)
            with self._lock:
                self._failed.add(id(store))
                self.failures.append((store.name[0], err))
            return False

    def _ahead_loop(self) -> None:
        while not self._closing:
            self._wake.wait(_AHEAD_S)
            self._wake.clear()
            if self._closing:
                return
            try:
                self._read_ahead()
                self._trim()
            except Exception as err:  # speculative: the visit reads it itself
                log.warning("disk read-ahead failed: %s: %s", type(err).__name__, err)

    def _trim(self) -> None:
        """Hand freed host memory back to the system once a quarter of the budget was
        freed since the last time: glibc keeps freed blocks in its heaps (and raises its
        mmap threshold as large blocks are freed), so without this the process's RSS
        follows the most it ever held, not what the engine holds."""
        budget = self.ledger.budget
        if _LIBC is None or budget is None or self._freed < budget // 4:
            return
        self._freed = 0
        _LIBC.malloc_trim(0)

    def _read_ahead(self) -> None:
        heat = self._heat
        with self._lock:
            cands = [
                (heat[k], s)
                for k, s in self._stores.items()
                if k in heat and not self.ledger.holds(k)
            ]
        cands.sort(key=lambda hs: hs[0])
        for _, store in cands[: self.lookahead]:
            if self._closing:
                return
            if store.on_disk and not store.load(speculative=True):
                return  # no room without spilling something hotter: the rest is colder
