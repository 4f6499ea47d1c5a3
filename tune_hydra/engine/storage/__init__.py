"""Shard storage: where a shard's state lives between its visits to a device.

Design:

* **Residency** (:mod:`.residency`). A :class:`ShardStore`'s live tensors (those its
  modules and optimizer point at, :mod:`.slots`: a :class:`LiveSlots` addressing them
  by stable keys) are in one of these states, owned by one :class:`ShardResidency` that
  only the store changes (its disk moves through its :class:`DiskSpill`):

  - ``HOST``: the live tensors are the tier's host tensors; nobody holds them.
  - ``IN_PLACE``: a worker on a non-copying CPU device computes with the host tensors
    themselves (``promote(copy=False)``); nothing is copied, but the worker is recorded
    as the owner, so that an eviction by it (``demote(only_owner=...)``) still applies.
  - ``DEVICE``: the live tensors are copies on a device, held by one owner.
  - ``RETIRED``: ``HOST`` for good (the task left, or is checkpointed): a speculative
    ``try_promote`` returns ``None`` until a real ``promote``.
  - ``DISK``: the values are in the disk tier's file (:mod:`.disk`); the live tensors are
    memory-mapped views of it, readable (a checkpoint reads them) but never computed
    with: ``promote`` first reads the state back into host memory (``load``).

  Transitions: ``promote`` goes to ``DEVICE`` (or ``IN_PLACE``) from any state; from
  ``DEVICE`` elsewhere it first copies home. ``demote`` goes home (``RETIRED`` stays
  ``RETIRED``); ``retire`` demotes, then goes to ``RETIRED``. ``try_promote`` is
  ``promote`` unless the store is ``RETIRED`` or another owner holds a ``DEVICE`` copy.
  Going to a device or retiring straight from ``DEVICE`` raises :class:`ResidencyError`.
  ``try_spill`` goes to ``DISK`` from ``HOST``, ``IN_PLACE`` or ``RETIRED`` (on ``DEVICE``
  it only drops the stale host copy); ``load`` comes back (to ``RETIRED`` if it was).
  ``demote`` of a visit that changed nothing (see below) goes from ``DEVICE`` straight to
  ``DISK`` when its host copy was dropped meanwhile and the file still holds its values.
  There are no in-between states: each transition, copies included, runs under
  ``store.lock``. The one thing in flight after a transition is an asynchronous copy home
  on a CUDA copy stream; its event is a data fence (``synchronize()``), not a residency.

* **Locking.** ``store.lock`` (re-entrant) is held by every promote, demote, retire and
  synchronize, and by ``host_tensors()``; callers hold it across a ``try_promote`` and
  their own bookkeeping (a prefetch is counted before its task may leave) and across an
  eviction plus ``retire`` (a task leaving the engine). ``nbytes()`` reads the live tensors
  without it (workers cache it at promotion).

* **Unchanged visits** (:mod:`.changes`: the store's :class:`ChangeTracker`). Whoever
  computes with the live tensors tells the store first
  (``begin_op(kind)``): an eval, or a forward of a shard without buffers, changes nothing;
  any other op does, and so does an optimizer step (a step pre-hook) or a live tensor
  replaced or written in place (identities and version counters, compared at the op's end
  and at the demotion). A visit no op vouched for counts as a change. ``demote`` drops the
  device copy of a visit that changed nothing (the tier's buffers still hold the values)
  and a later ``try_spill`` of a state whose file is still valid writes nothing.

* **Tiers** (:mod:`.tiers`). The host side is a :class:`StorageTier`, a mapping from the
  store's keys to host tensors that owns their allocation (once per key, reused) and
  their accounting (``nbytes()``). The store only asks it for a buffer to copy into
  (``put``), for the tensor to point the live slot at (``get``), and tells it when copies
  have landed (``flush``), and frees them all (``clear``) when the state goes to disk.

* **Disk** (:mod:`.disk`, :mod:`.spill`). With a host budget, a store has a
  :class:`SpillFile` in its engine's :class:`SpillFolder` and the engine's host memory
  manager (``tune_hydra.engine.storage.host``) as its ``host``: it reserves host memory before its
  buffers are filled and spills or loads when asked (its :class:`DiskSpill` makes those
  moves). The disk is a level below the host
  tier, not a :class:`StorageTier` (``docs/engine.md`` says why).

* **Shared parameters** (:mod:`.linked`). A parameter several shards use (tied weights)
  has a store of its own, promoted with each of them by a :class:`LinkedStore`; a
  store's ``parts()`` are the shard stores it moves together (a :class:`ShardStore`:
  itself; a :class:`LinkedStore`: its own, then the shared ones).

* **Frozen tensors shared across tasks** (``tune_hydra.engine.storage.frozen``). A store's
  parameters pointed at the engine's frozen pool are its ``frozen`` slots (a
  ``FrozenSlots``), outside its live slots: never counted, copied back or spilled with
  its own state.
"""

from __future__ import annotations

from tune_hydra.engine.storage.changes import ChangeTracker
from tune_hydra.engine.storage.disk import SpillFile, SpillFolder
from tune_hydra.engine.storage.linked import LinkedStore
from tune_hydra.engine.storage.residency import Residency, ResidencyError, ShardResidency
from tune_hydra.engine.storage.slots import LiveSlots
from tune_hydra.engine.storage.spill import DiskSpill
from tune_hydra.engine.storage.store import ShardStore
from tune_hydra.engine.storage.tiers import HostTier, PinnedHostTier, StorageTier

Store = ShardStore | LinkedStore
"""What a shard runs from: its store, or its store linked to shared ones."""

__all__ = [
    "ChangeTracker",
    "DiskSpill",
    "HostTier",
    "LinkedStore",
    "LiveSlots",
    "PinnedHostTier",
    "Residency",
    "ResidencyError",
    "ShardResidency",
    "ShardStore",
    "SpillFile",
    "SpillFolder",
    "StorageTier",
    "Store",
]
