"""A task's program: the order of its shard operations, as data.

A task of ``n`` shards trains each batch as ``F0 .. F(n-2), L(n-1), B(n-2) .. B0`` (one
``L0`` when ``n == 1``); an eval batch is ``E0 .. E(n-1)``, and an ``S`` op applies an
optimizer step left pending at an iteration's end. :class:`Program` gives a batch's ops
(the scheduling simulator's tasks) and looks ahead in that cycle (a scripted task's
:class:`~tune_hydra.engine.protocol.OpOrder`); :func:`starts_batch`, :func:`in_batch`
and :func:`ends_batch` place an op in its batch (kept graphs, records, traces).

Example:
    >>> " ".join(map(str, Program("a", 2).batch_ops(0, 0)))
    'a:F0[0] a:L1[0] a:B0[0]'
"""

from __future__ import annotations

from dataclasses import dataclass

from tune_hydra.core.ops import Op, OpKind

BATCH_KINDS = frozenset((OpKind.FORWARD, OpKind.LAST, OpKind.BACKWARD))
"""The kinds of a training batch's ops."""


def is_batch_kind(kind: OpKind) -> bool:
    """Whether ops of ``kind`` belong to a training batch (``F``, ``L``, ``B``)."""
    return kind in BATCH_KINDS


def starts_batch(op: Op) -> bool:
    """Whether ``op`` is a task's first op of a batch (its first shard's forward)."""
    return op.shard == 0 and (op.kind is OpKind.FORWARD or op.kind is OpKind.LAST)


def ends_batch(op: Op) -> bool:
    """Whether ``op`` is a batch's last op (its first shard's backward; ``L0`` with one
    shard, which also starts it)."""
    return op.shard == 0 and (op.kind is OpKind.LAST or op.kind is OpKind.BACKWARD)


def in_batch(op: Op | None) -> bool:
    """Whether ``op`` continues a batch (a later shard's forward, or a backward)."""
    return op is not None and not starts_batch(op) and op.kind in BATCH_KINDS


@dataclass(frozen=True, slots=True)
class Program:
    """The order of one task's shard operations.

    Attributes:
        task: the task's name (its ops carry it).
        shards: number of shards.
    """

    task: str
    shards: int

    @property
    def ops_per_batch(self) -> int:
        """Ops of one training batch: ``F`` and ``B`` per shard but the last, one ``L``."""
        return 2 * self.shards - 1

    def batch_ops(self, iteration: int, batch: int, count: int = 1) -> list[Op]:
        """The ops of one training batch (``count`` micro-batches from ``batch``):
        ``F0 .. F(n-2), L(n-1), B(n-2) .. B0``."""
        n, name = self.shards, self.task
        ops = [Op(name, OpKind.FORWARD, i, iteration, batch, count) for i in range(n - 1)]
        ops.append(Op(name, OpKind.LAST, n - 1, iteration, batch, count))
        ops += [Op(name, OpKind.BACKWARD, i, iteration, batch, count) for i in range(n - 2, -1, -1)]
        return ops

    def next_shard(self, op: Op) -> int | None:
        """The shard the op after ``op`` most likely uses (what to prefetch while ``op``
        runs); ``None`` when that is ``op``'s own shard or unknown."""
        n = self.shards
        if op.kind is OpKind.FORWARD or (op.kind is OpKind.EVAL and op.shard < n - 1):
            return op.shard + 1
        if op.kind is OpKind.LAST and n > 1:
            return n - 2
        if op.kind is OpKind.BACKWARD and op.shard > 0:
            return op.shard - 1
        return None  # B0 is followed by F0 (the same shard) or the iteration's end

    def ops_until(self, op: Op | None, shard: int) -> int:
        """How many of the task's ops from ``op`` (0: ``op`` itself) until one visits
        ``shard``, following the batch cycle ``F0 .. L(n-1) .. B0`` (eval and step ops
        count at their shard's forward position; ``None``: a batch's start). An estimate
        for the disk tier: the furthest next visit goes to disk first.

        Example:
            >>> from tune_hydra.core.ops import Op
            >>> p = Program("a", 3)
            >>> [p.ops_until(Op.parse("a:L2[0]"), s) for s in range(3)]
            [2, 1, 0]
        """
        n = self.ops_per_batch
        if op is None:
            at = 0
        elif op.kind is OpKind.BACKWARD:
            at = n - 1 - op.shard
        else:
            at = op.shard
        ahead = (shard - at) % n
        back = (n - 1 - shard - at) % n
        return min(ahead, back)
