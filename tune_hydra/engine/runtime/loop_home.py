"""A ``th.shard`` loop's states at home, for the user's thread.

Between ops a loop's states may be on the engine's devices (or being prefetched there).
The user's thread reads and writes the model's parameters, gradients and buffers, and
the optimizers' state, at home: the loop's ``sync`` brings every state home first
(:func:`bring_home`), and what the user's thread then writes there is noted
(:func:`touched`; :func:`before_load` and :func:`after_load` around a
``load_state_dict``, for the frozen tensors the loop shares with other tasks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.core.ops import OpKind

if TYPE_CHECKING:
    from tune_hydra.engine.dispatch.workers import DeviceWorker
    from tune_hydra.engine.runtime.loop import LoopShard
    from tune_hydra.engine.storage import ShardStore


def apply_pending(
    shards: list[LoopShard], run: Callable[[OpKind, int, Callable[[torch.device], Any]], Any]
) -> Exception | None:
    """Apply what each shard has pending as a step op (``run``: the loop's, whose
    ``execute`` applies it).

    Returns:
        The first error a pending step raised (the other shards' steps still apply), or
        ``None``.
    """
    error: Exception | None = None
    for s in shards:
        if s.pending:
            try:
                run(OpKind.STEP, s.index, lambda dev: None)  # execute applies them
            except Exception as err:  # the other shards' steps still apply
                error = error or err
    return error


def bring_home(shards: list[LoopShard], workers: list[DeviceWorker]) -> None:
    """Bring every shard's state home from ``workers``."""
    for s in shards:
        store = s.store
        for part in store.parts():
            with part.lock:  # a prefetch may be bringing it in right now: after it
                owner = part.owner
                if owner in workers:
                    owner.evict(part)
                part.retire()
        for w in workers:
            for part in store.parts():
                w.release(part)


class HomeWindow:
    """The user's thread's time with a loop's state at home: from a sync (the state
    brought home, see :func:`bring_home`) to the loop's next op. The user's thread may
    read and write the model's and optimizers' tensors then (``clip_grad_norm_`` scales
    the gradients in place), so the window holds every store in use in host memory: no
    spill writes, drops or reads back a state while the user's thread may change it. A
    write is announced (:meth:`wrote`) before it is made, which voids the host copies and
    spill files; the hold keeps a spill from making them valid again before it is made.

    Design note: the hold is the one of ops (``HostMemory.use``), so a store of the
    window is never a victim; the window ends before the loop's next op marks it in use
    itself.

    Args:
        shards: the loop's shards.
        host: the engine's host memory (``use``).
    """

    def __init__(self, shards: list[LoopShard], host: Any) -> None:
        self._shards = shards
        self._host = host
        self.now = True  # every state is home, nothing pending (registered at home)
        self._held: list[Any] = []  # the stores held in use, while open

    def enter(self) -> None:
        """The state is coming home: hold it there until :meth:`leave`."""
        if not self._held:
            self._held = [p for s in self._shards for p in s.store.parts()]
            self._host.use(self._held, 1)

    def wrote(self) -> None:
        """The user's thread is about to write into the state at home: stale copies."""
        touched(self._shards)

    def leave(self) -> None:
        """The loop's next op (or step, or zero_grad) comes: the hold ends."""
        self.now = False
        held, self._held = self._held, []
        if held:
            self._host.use(held, -1)


def touched(shards: list[LoopShard]) -> None:
    """The user's thread wrote into the shards' model or optimizer tensors at home:
    their host copies and spill files are stale (see ``ShardStore.begin_op``)."""
    for s in shards:
        for part in s.store.parts():
            part.begin_op(OpKind.STEP)  # a step "changes" the state
            part.end_op()


def before_load(
    stores: list[ShardStore], model: nn.Module, state_dict: Any
) -> list[tuple[ShardStore, int]]:
    """Before ``load_state_dict(state_dict)`` writes into ``model`` at home: a frozen
    tensor of ``stores`` shared with other tasks (``tune_hydra.engine.storage.frozen``)
    that gets other values becomes the loop's own first, so that the others do not see
    the write.

    Returns:
        The shared ones it writes with their own values (a checkpoint of the same base):
        give them to :func:`after_load`.
    """
    shared = {id(st.params[i]): (st, i) for st in stores for i in st.frozen}
    if not shared or not isinstance(state_dict, Mapping):
        return []
    params = dict(nn.Module.named_parameters(model, remove_duplicate=False))
    same: list[tuple[ShardStore, int]] = []
    for key, value in state_dict.items():
        p = params.get(key)
        slot = None if p is None else shared.get(id(p))
        if p is None or slot is None or slot[1] not in slot[0].frozen:
            continue
        if (
            isinstance(value, torch.Tensor)
            and value.shape == p.shape
            and value.dtype == p.dtype
            and torch.equal(value, p.data)
        ):
            same.append(slot)
        else:
            slot[0].own_frozen(slot[1])
    return same


def after_load(same: list[tuple[ShardStore, int]]) -> None:
    """After ``load_state_dict``: the shared tensors :func:`before_load` found written
    with their own values stay shared."""
    for store, i in same:
        if i in store.frozen:
            store.frozen_rewritten(i)


__all__ = ["after_load", "before_load", "bring_home", "touched"]
