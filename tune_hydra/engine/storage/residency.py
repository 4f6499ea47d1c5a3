"""Where a shard's live tensors are: its residency states and their allowed transitions."""

from __future__ import annotations

import enum

import torch

_HOST_DEVICE = torch.device("cpu")


class Residency(enum.Enum):
    """Where a shard's live tensors (the ones its modules and optimizer point at) are."""

    HOST = "host"
    """The live tensors are the host tensors; no worker holds them."""
    IN_PLACE = "in_place"
    """A worker on a non-copying CPU device computes with the host tensors themselves."""
    DEVICE = "device"
    """The live tensors are device copies made by a worker; the host tensors are stale."""
    RETIRED = "retired"
    """As :attr:`HOST`, for good: a speculative promotion must leave it there."""
    DISK = "disk"
    """The values are in the disk tier's file; the live tensors are read-only views of it
    (memory-mapped: reading them, as a checkpoint does, works; nothing computes with
    them). It must be loaded back into host memory before it goes to a device."""


class ResidencyError(RuntimeError):
    """A transition the residency states do not allow (a bug in the store's caller)."""


# The states each transition may start from.
_FROM: dict[str, frozenset[Residency]] = {
    "lend": frozenset({Residency.HOST, Residency.IN_PLACE, Residency.RETIRED}),
    "arrive": frozenset({Residency.HOST, Residency.IN_PLACE, Residency.RETIRED}),
    "home": frozenset(Residency),
    "retire": frozenset({Residency.HOST, Residency.IN_PLACE, Residency.RETIRED}),
    "spill": frozenset({Residency.HOST, Residency.IN_PLACE, Residency.RETIRED}),
    "load": frozenset({Residency.DISK}),
    "drop": frozenset({Residency.DEVICE}),
}


class ShardResidency:
    """The residency of one shard store, its holder and device, and the allowed moves.

    A device copy must be brought home before it can go elsewhere or be retired: the store
    copies it back first, so ``arrive``, ``lend`` and ``retire`` from
    :attr:`Residency.DEVICE` are errors. A state on :attr:`Residency.DISK` must be loaded
    (``load``, back to :attr:`Residency.HOST`, or :attr:`Residency.RETIRED` if it was
    retired when spilled) before it goes anywhere; ``home`` and ``retire`` leave it there.
    A device copy that changed nothing, whose values are still in the disk tier's file,
    may go straight back there (``drop_to_disk``).
    Not thread-safe on its own: the store changes it only under its lock.

    Example:
        >>> r = ShardResidency()
        >>> worker = object()
        >>> r.arrive(torch.device("cpu"), worker)
        >>> r.state, r.owner is worker, r.may_speculate(object())
        (<Residency.DEVICE: 'device'>, True, False)
        >>> r.home()
        >>> r.retire()
        >>> r.state, r.may_speculate(worker)
        (<Residency.RETIRED: 'retired'>, False)
    """

    def __init__(self) -> None:
        self._state = Residency.HOST
        self._device = _HOST_DEVICE
        # Who holds the live tensors: emulated CPU devices all are torch.device("cpu"), so
        # the device alone cannot tell two workers apart.
        self._owner: object = None
        self._retired_on_disk = False  # spilled while retired: loads back retired

    @property
    def state(self) -> Residency:
        return self._state

    @property
    def device(self) -> torch.device:
        """The device the live tensors are used on (the host's, at home)."""
        return self._device

    @property
    def owner(self) -> object:
        """The worker holding the live tensors (``None`` at home, or if none was named)."""
        return self._owner

    def holds(self, device: torch.device, owner: object) -> bool:
        """Whether ``owner`` already holds a device copy on ``device``."""
        return self._state is Residency.DEVICE and self._device == device and self._owner is owner

    def lends(self, device: torch.device, owner: object) -> bool:
        """Whether ``owner`` already uses the host tensors in place on ``device``."""
        return self._state is Residency.IN_PLACE and self._owner is owner and self._device == device

    def may_speculate(self, owner: object) -> bool:
        """Whether a speculative promotion by ``owner`` may go ahead: not retired, and no
        other owner holds a device copy (it may be computing with it)."""
        if self._state is Residency.RETIRED:
            return False
        if self._state is Residency.DISK:
            return not self._retired_on_disk
        return self._state is not Residency.DEVICE or self._owner is owner

    def lend(self, device: torch.device, owner: object) -> None:
        """The host tensors are used in place on the CPU ``device`` by ``owner``."""
        self._move("lend", Residency.IN_PLACE, device, owner)

    def arrive(self, device: torch.device, owner: object) -> None:
        """The live tensors are now copies on ``device``, held by ``owner``."""
        self._move("arrive", Residency.DEVICE, device, owner)

    def home(self) -> None:
        """The live tensors are the host tensors again (a retired shard stays retired, one
        on disk stays there)."""
        if self._state is Residency.DISK:
            return
        target = Residency.RETIRED if self._state is Residency.RETIRED else Residency.HOST
        self._move("home", target, _HOST_DEVICE, None)

    def retire(self) -> None:
        """At home for good, until the next :meth:`arrive` or :meth:`lend` (on disk: it
        loads back retired)."""
        if self._state is Residency.DISK:
            self._retired_on_disk = True
            return
        self._move("retire", Residency.RETIRED, _HOST_DEVICE, None)

    def spill(self) -> None:
        """The values went to the disk tier; the live tensors are views of its file."""
        retired = self._state is Residency.RETIRED
        self._move("spill", Residency.DISK, _HOST_DEVICE, None)
        self._retired_on_disk = retired

    def drop_to_disk(self) -> None:
        """A device copy that changed nothing was dropped; the values are in the disk
        tier's file (its host copy had been dropped meanwhile), the live tensors views of
        it."""
        self._move("drop", Residency.DISK, _HOST_DEVICE, None)
        self._retired_on_disk = False

    def load(self) -> None:
        """The values are back in host memory (the live tensors are the host tensors)."""
        target = Residency.RETIRED if self._retired_on_disk else Residency.HOST
        self._move("load", target, _HOST_DEVICE, None)
        self._retired_on_disk = False

    def _move(self, name: str, target: Residency, device: torch.device, owner: object) -> None:
        if self._state not in _FROM[name]:
            raise ResidencyError(
                f"cannot {name} a shard store from {self._state.name} (to {target.name})"
            )
        self._state = target
        self._device = device
        self._owner = owner
