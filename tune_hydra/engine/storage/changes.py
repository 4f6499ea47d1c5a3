"""Did a visit change a shard's state? Whether its host copy and its spill file still hold
the live values.

Whoever computes with a shard's live tensors tells its store first (``begin_op(kind)``):
an eval, or a forward of a shard without buffers, changes nothing; any other op does,
and so does an optimizer step (a step pre-hook) or a live tensor replaced or written in
place (identities and version counters, compared at the op's end and at the demotion).
A visit no op vouched for counts as a change. :class:`ChangeTracker` keeps what follows
from it for one store: whether the tier's host buffers still hold the values of a state
on a device (its demotion then drops the device copy) and whether the disk tier's file
does (a spill then writes nothing).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tune_hydra.core.ops import OpKind
from tune_hydra.engine.storage.slots import LiveSlots


class ChangeTracker:
    """Whether a store's host copy and spill file still hold its live values.

    Not thread-safe on its own: the store calls it under its lock, except ``begin`` and
    :meth:`changed`, which only clear flags (as an op's thread and a step hook do).

    Args:
        slots: the store's live tensors.
    """

    def __init__(self, slots: LiveSlots) -> None:
        self._slots = slots
        self._file_valid = False  # the file holds the current values (loaded, untouched)
        # On a device: the tier's host buffers still hold the values it was copied from,
        # and nothing changed them on the device (see begin): demoting drops the copy.
        self._host_copy = False
        # The live tensors' (key, data pointer, version) when last known unchanged, while
        # a host copy or the file is still valid (None: nothing to keep): a change no op
        # announced (a module writing a buffer in eval) shows here.
        self._sig: tuple[tuple[Any, ...], ...] | None = None
        # An op announced itself read-only since the promotion (begin): a visit no op
        # vouched for (a lease whose user said nothing) counts as a change.
        self._vouched = False
        # The live tensors' identities when they were last pointed at the tier's buffers
        # (None: the tier was cleared since, or a slot changed hands).
        self._home: tuple[tuple[Any, ...], ...] | None = None
        self._tracked = True  # whether the optimizer's steps are seen (see track)
        self._step_hook: Any = None

    @property
    def file_valid(self) -> bool:
        """Whether the disk tier's file holds the live values."""
        return self._file_valid

    @property
    def host_copy(self) -> bool:
        """On a device: whether the tier's host buffers still hold the live values."""
        return self._host_copy

    @property
    def watching(self) -> bool:
        """Whether something is still valid that a change of the live tensors would void."""
        return self._sig is not None

    def track(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Watch ``optimizer``'s steps (a step pre-hook), instead of the last one's; one
        without step hooks makes every visit a change."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        register = getattr(optimizer, "register_step_pre_hook", None)
        self._tracked = optimizer is None or register is not None
        if register is not None:
            self._step_hook = register(_changed_by_step(weakref.ref(self)))
        if not self._tracked:
            self.changed()

    # -- ops -------------------------------------------------------------------------------

    def begin(self, kind: OpKind) -> None:
        """An op of ``kind`` is about to compute with the live tensors: an eval, or a
        forward of a shard without buffers, vouches for the visit; any other op changes
        the state."""
        if kind is OpKind.EVAL or (kind is OpKind.FORWARD and not self._slots.buffer_slots):
            self._vouched = self._sig is not None
            return
        self.changed()

    def recheck(self) -> None:
        """After a read-only op: a live tensor replaced or written in place anyway (a user
        module writing a buffer in eval) makes the state changed."""
        if self._sig is not None and self._slots.signature() != self._sig:
            self.changed()

    def changed(self) -> None:
        """The live values differ from the host copy's and the file's (if any)."""
        self._file_valid = False
        self._host_copy = False
        self._sig = None
        self._vouched = False

    def unchanged(self) -> bool:
        """Whether the visit since the promotion left the state as it was: every op said
        so (at least one did) and no live tensor was replaced or written in place."""
        return self._vouched and self._sig is not None and self._slots.signature() == self._sig

    def settle(self) -> None:
        """The visit (or use in place) ends here: unless it left the state unchanged, it
        changed it."""
        if not self.unchanged():
            self.changed()

    # -- the store's moves -----------------------------------------------------------------

    def mark_home(self) -> None:
        """The live tensors are the tier's buffers now: while they stay live (and the tier
        keeps them), the buffers hold their values."""
        self._home = self._slots.identity()

    def forget_home(self) -> None:
        """The tier's buffers no longer hold the live values (freed, or a slot changed
        hands)."""
        self._home = None
        self._host_copy = False

    def visit(self, copy: bool) -> bool:
        """A promotion starts: returns whether the host buffers it copies from will still
        hold the values (``copy``: the state goes to a device copy; the live tensors are
        the buffers, unless an op in place replaced one)."""
        host_copy = copy and self._tracked and self._home is not None
        host_copy = host_copy and self._slots.identity() == self._home
        if not self._tracked:
            self._file_valid = False
        self._vouched = False
        return host_copy

    def lent(self) -> None:
        """The host tensors are used in place: a valid file stays valid unless changed."""
        self._sig = self._slots.signature() if self._file_valid else None

    def arrived(self, host_copy: bool) -> None:
        """The state is on a device, its host buffers valid if ``host_copy``."""
        self._host_copy = host_copy
        self._sig = self._slots.signature() if host_copy or self._file_valid else None

    def leave(self) -> bool:
        """A device copy goes home: returns whether the host buffers still hold its
        values (the copy is dropped, not copied back)."""
        self.settle()  # an op changed it, or none vouched for the visit
        self._sig = None
        self._vouched = False
        kept = self._host_copy
        self._host_copy = False
        return kept

    def spilled(self) -> None:
        """The disk tier's file holds the live values."""
        self._file_valid = True


def _changed_by_step(ref: weakref.ReferenceType[ChangeTracker]) -> Any:
    """An optimizer step pre-hook: the store's state changes (whichever op steps it)."""

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        tracker = ref()
        if tracker is not None:
            tracker.changed()

    return hook
