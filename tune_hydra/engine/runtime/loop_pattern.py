"""The order of a ``th.shard`` loop's ops, learnt as they run: :class:`OpPattern`.

It also numbers them: an op's ``batch`` is how many training forwards of shard 0 came
before it.

A loop (a user's, or a ``TaskLoop``'s) has no program the engine could read ahead: its
ops come as its code calls the model, steps and syncs. What
followed each op last time is what the engine reads as the loop's next ops (the
:class:`~tune_hydra.engine.protocol.Runner`'s ``next_shard``, ``ops_until`` and
``ops_per_batch``): which shard to prefetch, and how far off a shard's next op is.
"""

from __future__ import annotations

import torch

from tune_hydra.core.ops import Op, OpKind


class OpPattern:
    """What followed each op of one loop (its kind and shard) the last time it ran.

    Args:
        n_shards: how many shards the loop has.

    Attributes:
        ops_per_batch: the ops from one forward of shard 0 to the next, as last seen
            (three per shard before that).
    """

    def __init__(self, n_shards: int) -> None:
        self._n_shards = n_shards
        self._batches = 0  # training forwards of shard 0 so far
        self._next: dict[tuple[OpKind, int], tuple[OpKind, int]] = {}
        self._last_key: tuple[OpKind, int] | None = None
        self._ops_since_batch = 0
        self.ops_per_batch = 3 * n_shards

    def next_op(self, task: str, kind: OpKind, shard: int, iteration: int) -> Op:
        """The loop's next op, ``kind`` of ``shard`` (``task``'s, at ``iteration``): its
        batch is how many training forwards of shard 0 came before it; learnt as
        following the op before."""
        batch = self._batches
        starts = kind is OpKind.FORWARD or kind is OpKind.LAST  # L0: one shard's batch
        if starts and shard == 0 and torch.is_grad_enabled():
            self._batches += 1
        op = Op(task, kind, shard, iteration, batch)
        self.learn((kind, shard))
        return op

    def learn(self, key: tuple[OpKind, int]) -> None:
        """Op ``key`` (its kind and shard) comes next: it follows the one before."""
        if self._last_key is not None:
            self._next[self._last_key] = key
        self._last_key = key
        if key == (OpKind.FORWARD, 0) or key == (OpKind.LAST, 0):
            if self._ops_since_batch:
                self.ops_per_batch = self._ops_since_batch
            self._ops_since_batch = 0
        self._ops_since_batch += 1

    def next_shard(self, op: Op) -> int | None:
        """The shard of the op that followed ``op`` last time (``None``: unknown, or
        ``op``'s own)."""
        nxt = self._next.get((op.kind, op.shard))
        return None if nxt is None or nxt[1] == op.shard else nxt[1]

    def ops_until(self, op: Op | None, shard: int) -> int:
        """How many ops from ``op`` (``None``: none in flight) until one of ``shard``, as
        the pattern goes (at most ``4 * n_shards + 2``)."""
        if op is None:
            return self._n_shards
        key: tuple[OpKind, int] | None = (op.kind, op.shard)
        for n in range(4 * self._n_shards + 2):
            if key is None:
                break
            if key[1] == shard:
                return n
            key = self._next.get(key)
        return 4 * self._n_shards + 2


__all__ = ["OpPattern"]
