"""Device memory accounting: one ledger per device, asked by its worker and by the trace.

A :class:`DeviceLedger` holds a device's budget and what occupies the device:

- resident shard states (least recently used first), each with its plan's state bytes
  (a part several shards share, listed by their ``shared_parts``, counted once: see
  :func:`state_of`);
- reservations for the kept graphs of batches in flight (``recompute=False``): a batch's
  activations and boundary tensors are inside its reservation, not counted again.

The running and queued ops are not stored here: the worker's queue owns them (the
dispatcher changes it under its own lock), so the questions that involve them take the
queued shards as an argument. The first of them is the one that runs next.

The rules, shared by :class:`~tune_hydra.engine.dispatch.room.DeviceRoom` at run time and by
:meth:`~tune_hydra.core.trace.Trace.validate` when it replays a trace:

- while a shard's op runs, the device holds the shard states, the op's activations
  (none if its task has a reservation here) and every reservation;
- a task may start a batch (or run an op outside one) only beside the reservations, the
  activations of the ops queued here and room for shard states, except on an idle device,
  which always admits (each plan fits the budget on its own);
- to make room, resident states are evicted least recently used first, until the device
  holds at most ``depth`` of them and what must stay fits.

It also counts the shard state the device's evictions send to host memory (with CUDA, to
pinned buffers), per task. These are totals of bytes moved, not what the host holds now:
a state one device spilled may be taken back by another. What host memory holds now, and
its budget, is the engine's :class:`~tune_hydra.core.host.HostLedger`.

Design note: the ledger is plain data with no lock and no threads of its own. A device's
room reads and changes it only while holding the room's lock (the one that guarded the
same fields before the ledger existed); the trace replay is single-threaded. It knows shards
through :class:`Footprint` (``ShardStore`` is one), so it imports no torch.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Shard:
    ...     name: tuple[str, int]
    ...     state_bytes: int
    ...     activation_bytes: int
    >>> ledger = DeviceLedger(100)
    >>> a, b = Shard(("a", 0), 50, 30), Shard(("b", 0), 40, 10)
    >>> ledger.need([a, b])  # 90 of state, then the larger op's 30 of activations
    20
    >>> ledger.hold(a)
    >>> ledger.usage(a).total
    80
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Footprint(Protocol):
    """What the ledger reads of a shard: its name and its plan's sizes."""

    @property
    def name(self) -> tuple[str, int]:
        """``(task, shard index)``."""
        ...

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients, buffers and optimizer state on the device."""
        ...

    @property
    def activation_bytes(self) -> int:
        """The most bytes beside its state while one of its ops runs."""
        ...


def state_of(shards: Iterable[Footprint]) -> int:
    """The state bytes of ``shards`` resident together: a part several of them share (a
    frozen tensor held once per device for every task using it, listed by a shard's
    optional ``shared_parts`` attribute as ``(key, bytes)`` pairs inside its ``state_bytes``)
    counted once."""
    total = 0
    parts: dict[object, int] = {}
    for s in shards:
        shared = getattr(s, "shared_parts", ())
        total += s.state_bytes
        for key, nbytes in shared:
            total -= nbytes
            parts[key] = nbytes
    return total + sum(parts.values())


S = TypeVar("S", bound=Footprint)


@dataclass(frozen=True)
class Usage:
    """Device bytes at one moment, by kind.

    Attributes:
        state: shard states.
        activations: the running op's activations (0 inside its task's reservation).
        kept: reservations for batches' kept graphs.
    """

    state: int
    activations: int
    kept: int

    @property
    def total(self) -> int:
        """All of them."""
        return self.state + self.activations + self.kept


class DeviceLedger(Generic[S]):
    """The memory of one device: budget, resident states, reservations.

    Args:
        budget: device bytes for all of it (``None``: no limit).
    """

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        # Least recently used first; keyed by identity (two shards may share a name
        # across a task's re-registration).
        self.resident: collections.OrderedDict[int, S] = collections.OrderedDict()
        self._measured: dict[int, int] = {}  # bytes found on the device as each arrived
        self.reserved: dict[str, int] = {}  # task -> its batch's kept graphs
        # A batched pass -> the activations of the ops run along with its own (held from
        # the first one queued along to its end; tune_hydra.engine.dispatch.batched).
        self.along: dict[object, int] = {}
        self.peak_resident_bytes = 0  # measured shard state held at once, at most
        # Host side: shard state sent to host memory from this device (totals, see the module).
        self.spilled_by_task: dict[str, int] = {}

    # -- what occupies the device --------------------------------------------------------

    def holds(self, shard: S) -> bool:
        """Whether ``shard``'s state is resident here."""
        return id(shard) in self.resident

    def hold(self, shard: S, measured: int | None = None) -> None:
        """Count ``shard``'s state as resident and most recently used; ``measured``: the
        bytes it really occupies (updates the peak), if known."""
        self.resident[id(shard)] = shard
        self.resident.move_to_end(id(shard))
        if measured is not None:
            self._measured[id(shard)] = measured
            held = sum(self._measured.get(k, 0) for k in self.resident)
            self.peak_resident_bytes = max(self.peak_resident_bytes, held)

    def release(self, shard: S) -> None:
        """Stop counting ``shard``'s state here (no-op if it is not)."""
        self.resident.pop(id(shard), None)
        self._measured.pop(id(shard), None)

    def trim(self, depth: int) -> None:
        """Forget the least recently used states beyond ``depth`` (nothing to copy)."""
        while len(self.resident) > depth:
            key, _ = self.resident.popitem(last=False)
            self._measured.pop(key, None)

    def reserve(self, task: str, nbytes: int | None) -> None:
        """Hold ``nbytes`` for ``task``'s batch in flight here (``None``: release it)."""
        if nbytes is None:
            self.reserved.pop(task, None)
        else:
            self.reserved[task] = nbytes

    def hold_along(self, key: object, nbytes: int | None) -> None:
        """Hold ``nbytes`` for the activations of the ops run along in batched pass
        ``key`` (``None``: release them)."""
        if nbytes is None:
            self.along.pop(key, None)
        else:
            self.along[key] = nbytes

    # -- questions ------------------------------------------------------------------------

    def usage(self, running: S | None = None) -> Usage:
        """What the device holds now while ``running``'s op runs (``None``: none runs)."""
        state = state_of(self.resident.values())
        if running is None:
            return self._usage(state, None, 0)
        return self._usage(state, running.name[0], running.activation_bytes)

    def peak(self, shards: Iterable[S]) -> int:
        """The most bytes beside shard state while one of ``shards`` runs: its activations
        (unless inside its task's reservation) and every reservation."""
        return max(self._usage(0, s.name[0], s.activation_bytes).total for s in shards)

    def need(self, keep: Sequence[S], extra: int = 0) -> int | None:
        """Bytes over budget if ``keep`` were resident while each of them runs (plus
        ``extra`` bytes); None if they fit."""
        if self.budget is None:
            return None
        unique = {id(s): s for s in keep}.values()
        need = state_of(unique) + self.peak(unique) + extra
        return None if need <= self.budget else need - self.budget

    def admits(self, nbytes: int, room: int, queued: Sequence[S]) -> bool:
        """Whether a task may start a batch (or run an op outside one) needing ``nbytes``
        beside the reservations, the activations of the ``queued`` ops (those outside a
        reservation) and ``room`` bytes of shard state. Always on an idle device."""
        if self.budget is None:
            return True
        held = sum(self.reserved.values()) + sum(self.along.values())
        held += sum(s.activation_bytes for s in queued if s.name[0] not in self.reserved)
        return (not held and not queued) or held + nbytes + room <= self.budget

    def victims(self, keep: Sequence[S], depth: int) -> list[S]:
        """Resident states to evict, least recently used first, so that ``keep`` (the ops
        that run before, then the incoming shard) is resident with at most ``depth``
        states here and within the budget."""
        keep_ids = {id(s) for s in keep}
        beside = self.peak(keep)
        others = [s for k, s in self.resident.items() if k not in keep_ids]
        staying = {id(s): s for s in [*keep, *others]}
        count = len(keep_ids | set(self.resident))
        state = state_of(staying.values())
        out = []
        for s in others:
            over = self.budget is not None and state + beside > self.budget
            if count <= depth and not over:
                break
            out.append(s)
            count -= 1
            del staying[id(s)]
            # A shared part stays while another staying shard lists it.
            state = state_of(staying.values())
        return out

    # -- host side ------------------------------------------------------------------------

    def note_spilled(self, task: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``task``'s shard state copied from here to host memory."""
        self.spilled_by_task[task] = self.spilled_by_task.get(task, 0) + nbytes

    # -- internals ------------------------------------------------------------------------

    def _usage(self, state: int, task: str | None, activations: int) -> Usage:
        """``state`` bytes of shard state plus what sits beside it while an op of ``task``
        with ``activations`` runs (``task=None``: no op)."""
        reserved = self.reserved
        return Usage(
            state,
            0 if task is not None and task in reserved else activations,
            sum(reserved.values()) + sum(self.along.values()),
        )


__all__ = ["DeviceLedger", "Footprint", "Usage", "state_of"]
