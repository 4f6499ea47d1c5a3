"""A shard that shares parameters with other shards: its own store, linked to theirs.

GPT-2 ties ``lm_head.weight`` to the input embeddings: the first and the last shard use
one parameter. It has one home, a :class:`ShardStore` of the shared parameters (their
gradients and, for the shard that steps them, their optimizer state), and every shard
that uses it promotes that store with its own: whichever of them runs, the parameter is
on its device. Two of the task's ops never run at once, so the shared store is in one
place at a time; a shard resident on one device whose shared part another device took
meanwhile gets it back at its next promotion (the promotion copies only what is not
there yet).

Locks: a linked store's ``lock`` is its own store's; the shared store's lock is always
taken after it (never the other way round), so two linked stores of one task cannot
deadlock.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import torch
from torch import nn

from tune_hydra.core.ops import OpKind
from tune_hydra.engine.storage.frozen import shared_parts
from tune_hydra.engine.storage.residency import Residency
from tune_hydra.engine.storage.store import ShardStore


class LinkedStore:
    """A shard's own :class:`ShardStore` plus the shared stores it uses, moved together.

    It has the store's interface (what the device workers, the engine and the runner
    use); promotions, demotions and retirement go to all of them, residency questions to
    the shard's own store.

    Args:
        own: the store of the parameters and buffers only this shard uses.
        shared: the stores of parameters this shard shares with others.
    """

    def __init__(self, own: ShardStore, shared: Sequence[ShardStore]) -> None:
        self.own = own
        self.shared = list(shared)
        self.last_nbytes = 0  # nbytes() at the last promotion (set by the workers)

    def parts(self) -> list[ShardStore]:
        """The shard stores it moves together: its own first, then the shared ones."""
        return [self.own, *self.shared]

    # -- what the workers read -----------------------------------------------------------

    @property
    def name(self) -> tuple[str, int]:
        return self.own.name

    @property
    def state_bytes(self) -> int:
        # The plan counts a shared parameter in every shard that uses it: conservative
        # while both are resident, exact when only one is.
        return self.own.state_bytes

    @property
    def shared_parts(self) -> tuple[tuple[object, int], ...]:
        """The frozen pool's tensors its parts use (see ``ShardStore.shared_parts``)."""
        return shared_parts([p.frozen for p in self.parts()], self.own.state_bytes)

    @property
    def activation_bytes(self) -> int:
        return self.own.activation_bytes

    @property
    def lock(self) -> Any:
        return self.own.lock

    @property
    def owner(self) -> object:
        return self.own.owner

    @property
    def device(self) -> torch.device:
        return self.own.device

    @property
    def copied(self) -> bool:
        return self.own.copied

    @property
    def retired(self) -> bool:
        return self.own.retired

    @property
    def residency(self) -> Residency:
        return self.own.residency

    @property
    def on_disk(self) -> bool:
        """Whether its state, or a shared part, is in the disk tier."""
        return self.own.on_disk or any(s.on_disk for s in self.shared)

    @property
    def moved_total(self) -> int:
        return self.own.moved_total + sum(s.moved_total for s in self.shared)

    @property
    def params(self) -> list[nn.Parameter]:
        """Every parameter the shard uses: its own, then the shared ones."""
        return [*self.own.params, *(p for s in self.shared for p in s.params)]

    @property
    def buffer_slots(self) -> list[tuple[nn.Module, str]]:
        return self.own.buffer_slots

    def nbytes(self) -> int:
        return self.own.nbytes() + sum(s.nbytes() for s in self.shared)

    def host_tensors(self) -> list[tuple[nn.Parameter | tuple[nn.Module, str], torch.Tensor]]:
        return [*self.own.host_tensors(), *(t for s in self.shared for t in s.host_tensors())]

    def begin_op(self, kind: OpKind) -> None:
        self.own.begin_op(kind)
        for s in self.shared:
            s.begin_op(kind)

    def end_op(self, failed: bool = False) -> None:
        self.own.end_op(failed)
        for s in self.shared:
            s.end_op(failed)

    # -- moving ------------------------------------------------------------------------

    def promote(
        self, device: torch.device, stream: Any = None, *, copy: bool = True, owner: object = None
    ) -> int:
        with self.own.lock:
            moved = self.own.promote(device, stream, copy=copy, owner=owner)
            for s in self.shared:
                moved += s.promote(device, stream, copy=copy, owner=owner)
            return moved

    def try_promote(
        self, device: torch.device, stream: Any = None, *, copy: bool = True, owner: object
    ) -> int | None:
        with self.own.lock:
            moved = self.own.try_promote(device, stream, copy=copy, owner=owner)
            if moved is None:
                return None
            for s in self.shared:  # one held elsewhere comes at the real promotion
                moved += s.try_promote(device, stream, copy=copy, owner=owner) or 0
            return moved

    def demote(
        self, stream: Any = None, *, only_owner: object = None, keep: Container[int] = ()
    ) -> int:
        """Demote its own store and its shared parts, but those in ``keep`` (ids of parts
        another state on the device lists: a shard using one may be computing right now,
        and the part stays while it is there)."""
        with self.own.lock:
            moved = self.own.demote(stream, only_owner=only_owner)
            for s in self.shared:
                # Without an owner to check, the caller wants the state home for good
                # (the task leaves or is checkpointed): the shared part too.
                if id(s) not in keep:
                    moved += s.demote(stream, only_owner=only_owner)
            return moved

    def retire(self, *, load: bool = False) -> int:
        with self.own.lock:
            moved = self.own.retire(load=load)
            for s in self.shared:
                moved += s.retire(load=load)
            return moved

    def synchronize(self) -> None:
        with self.own.lock:
            self.own.synchronize()
            for s in self.shared:
                s.synchronize()
