"""A store's moves between host memory and the disk tier below it.

With a host budget, a :class:`~tune_hydra.engine.storage.store.ShardStore` has a
:class:`~tune_hydra.engine.storage.disk.SpillFile` and the engine's host memory manager
(``tune_hydra.engine.storage.host``, a :class:`HostAccount`): host memory is reserved before the
store's buffers are filled, and the manager spills or loads the store when it needs room
or reads ahead. :class:`DiskSpill` is the store's part that makes those moves: a spill
writes the live tensors to the file (nothing, if the file still holds their values) and
points them at views of it; a load reads them back into the tier's buffers; a device
copy that changed nothing, whose host copy was dropped meanwhile, goes straight back to
the file. It runs under the store's lock, and changes the store's residency only in
these moves (``ShardResidency.spill``, ``load``, ``drop_to_disk``).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from tune_hydra.engine.storage.changes import ChangeTracker
from tune_hydra.engine.storage.disk import SpillFile
from tune_hydra.engine.storage.frozen import FrozenSlots
from tune_hydra.engine.storage.residency import Residency, ShardResidency
from tune_hydra.engine.storage.slots import LiveSlots
from tune_hydra.engine.storage.tiers import StorageTier
from tune_hydra.exceptions import SpillReadError


class HostAccount(Protocol):
    """What a store tells the engine's host memory manager (``tune_hydra.engine.storage.host``);
    ``store`` is the :class:`~tune_hydra.engine.storage.store.ShardStore`.

    The store calls it under its own lock; the manager never waits on a store's lock
    while holding its own (it only *tries* other stores' locks to spill them).
    """

    def reserve(self, store: Any, nbytes: int, *, speculative: bool = False) -> bool:
        """Count ``nbytes`` of ``store`` in host memory, spilling colder stores to disk
        first if they would not fit. ``speculative``: only stores colder than ``store``
        may go, and if that is not enough nothing is counted and ``False`` is returned."""
        ...

    def release(self, store: Any) -> None:
        """``store``'s host buffers were freed."""
        ...

    def busy(self, store: Any) -> bool:
        """Whether an op assigned to a device uses ``store`` (it must not be spilled)."""
        ...

    def note_io(self, store: Any, op: str, nbytes: int, start: float) -> None:
        """``op`` (``"to_disk"`` or ``"from_disk"``) moved ``nbytes`` since ``start``
        (``time.perf_counter()``)."""
        ...

    def note_wait(self, store: Any, owner: object, start: float) -> None:
        """``owner`` (a worker) waited for ``store``'s disk read since ``start``."""
        ...


class SpillOwner(Protocol):
    """What :class:`DiskSpill` uses of its store (``ShardStore``)."""

    state_bytes: int
    lock: Any
    host: HostAccount | None
    spill_file: SpillFile | None
    slots: LiveSlots
    changes: ChangeTracker
    frozen: FrozenSlots

    @property
    def tier(self) -> StorageTier: ...

    def synchronize(self) -> None: ...


class DiskSpill:
    """A store's moves between host memory and its spill file (see the module docstring).

    Args:
        store: the store.
        residency: the store's residency (its disk states are these moves' to change).
    """

    def __init__(self, store: SpillOwner, residency: ShardResidency) -> None:
        self._store = store
        self._residency = residency
        self.loading = False  # a read is under way (a promotion waiting for it counts it)

    def spill(self) -> bool:
        """Free the state's host memory if nobody is using it, never waiting for the
        store's lock (see ``ShardStore.try_spill``)."""
        lock = self._store.lock
        if not lock.acquire(blocking=False):
            return False
        try:
            return self._spill()
        finally:
            lock.release()

    def load(self, *, speculative: bool) -> bool:
        """Read the state back if it is on disk (see ``ShardStore.load``); ``speculative``:
        never waiting for the store's lock."""
        lock = self._store.lock
        if not lock.acquire(blocking=not speculative):
            return False
        try:
            if self._residency.state is not Residency.DISK:
                return False
            return self.read(speculative=speculative)
        finally:
            lock.release()

    def _spill(self) -> bool:
        store = self._store
        host, file, tier = store.host, store.spill_file, store.tier
        assert host is not None and file is not None
        state = self._residency.state
        if state is Residency.DISK:
            return False
        if state is Residency.DEVICE:  # computing on its device copy: drop the stale one
            if not tier.nbytes():
                return False
            store.synchronize()
            tier.clear()
            store.changes.forget_home()
            host.release(store)
            return True
        if host.busy(store):  # a device computes with the host tensors themselves
            return False
        if state is Residency.IN_PLACE:
            store.changes.settle()
        store.synchronize()
        live = list(store.slots.items())
        if not store.changes.file_valid:
            start = time.perf_counter()
            nbytes = file.write(live)
            host.note_io(store, "to_disk", nbytes, start)
        views = file.views()
        store.slots.point_at(views)
        tier.clear()
        store.changes.forget_home()
        self._residency.spill()
        store.changes.spilled()
        host.release(store)
        return True

    def read(self, *, speculative: bool, model_only: bool = False) -> bool:
        """Read the state back from its file into the tier's buffers; the caller holds the
        store's lock. Returns whether it was read.

        Args:
            speculative: only if room can be made by spilling colder states.
            model_only: the optimizer's state is dropped, not read (see
                ``ShardStore.retire(load=True)``).

        Raises:
            SpillReadError: the file cannot be read (the state stays on disk).
        """
        store = self._store
        host, file, tier = store.host, store.spill_file, store.tier
        assert host is not None and file is not None
        templates = file.templates()
        if model_only:
            dropped = [key for key in templates if key[0] == "o"]
            templates = {k: t for k, t in templates.items() if k[0] != "o"}
        nbytes = sum(t.numel() * t.element_size() for t in templates.values())
        # The frozen pool counts its own.
        charge = max(store.state_bytes - store.frozen.nbytes(), nbytes)
        if not host.reserve(store, charge, speculative=speculative):
            return False
        self.loading = True
        try:
            start = time.perf_counter()
            bufs = {}
            # Read through the file's descriptor (no mapping, no name: the spill folder may
            # have been deleted under the engine).
            try:
                for key, like in templates.items():
                    buf = tier.put(key, like)
                    file.read_into(key, buf)
                    bufs[key] = buf
            except BaseException:
                tier.clear()  # the state stays on disk, its views untouched
                store.changes.forget_home()
                host.release(store)
                raise
            tier.flush()
            store.slots.point_at(bufs)
            store.changes.mark_home()
            optimizer = store.slots.optimizer
            if model_only and optimizer is not None:
                for key in dropped:
                    param = store.slots.params[key[1]]  # type: ignore[call-overload]
                    optimizer.state[param].pop(key[2], None)
            self._residency.load()
            host.note_io(store, "from_disk", nbytes, start)
        finally:
            self.loading = False
        return True

    def read_for(self, owner: object) -> None:
        """:meth:`read` for a promotion by ``owner`` (a worker), which waits for it."""
        start = time.perf_counter()
        self.read(speculative=False)
        host = self._store.host
        if host is not None:
            host.note_wait(self._store, owner, start)

    def drop_to_disk(self) -> bool:
        """A device copy unchanged, its host copy dropped meanwhile: back to disk without
        a write (the file holds these values). False if the file cannot be mapped (the
        caller copies the state home instead)."""
        store = self._store
        host, file, tier = store.host, store.spill_file, store.tier
        assert host is not None and file is not None
        try:
            views = file.views()
        except SpillReadError:
            return False
        store.slots.point_at(views)
        if tier.nbytes():  # stale buffers (none expected: they were dropped)
            store.synchronize()
            tier.clear()
            host.release(store)
        store.changes.forget_home()
        self._residency.drop_to_disk()
        return True
