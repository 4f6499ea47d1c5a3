"""A task's program: the order of its shard operations, as data.

A task of ``n`` shards trains each batch as ``F0 .. F(n-2), L(n-1), B(n-2) .. B0`` (one
``L0`` when ``n == 1``), runs an eval pass ``E0 .. E(n-1)`` per eval batch after the
iteration's batches, and ends the iteration with the ``S`` ops of the optimizer steps
still pending. Which ops come next depends on facts only the run knows (did the data end
at this batch, how many micro-batches did the first visit fetch, which shards still owe
a step), so :meth:`Program.walk` is a coroutine: it yields the ops in order, and
:class:`Mark` points where the run answers a question (sent back into the walk) or acts
(ends an epoch, finishes an iteration). It runs nothing and keeps no state but its
position, so the engine's runner, the scheduling simulator and tests all follow the same
program; :meth:`Program.schedule` walks it through facts written down in advance
(:class:`Script`), which gives a task's whole op sequence as a list.

Example:
    >>> from tune_hydra.core.ops import parse_schedule
    >>> ops = Program("a", 2).schedule(Script(epoch_batches=1))
    >>> " ".join(map(str, ops))
    'a:F0[0] a:L1[0] a:B0[0] a:F0[1]'
    >>> ops == parse_schedule("a:F0[0] a:L1[0] a:B0[0] a:F0[1]")
    True

The last ``a:F0[1]`` is the visit that finds the epoch's data at its end.
"""

from __future__ import annotations

import enum
from collections.abc import Generator
from dataclasses import dataclass

from tune_hydra.core.ops import Op, OpKind
from tune_hydra.exceptions import EmptyDataError

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


class Mark(enum.Enum):
    """A point of :meth:`Program.walk` that is not an op.

    A question wants an ``int`` sent back into the walk; after an action (and after an
    op) whatever is sent is ignored.
    """

    ITERATION = "iteration"
    """Question: wait until an iteration is granted and begin it; its number."""
    BATCH = "batch"
    """Question: the batch of the epoch the next batch is."""
    GROUPED = "grouped"
    """Question (only with ``accumulate_steps > 1``): 1 if the next visits may run the
    rest of the accumulation group at once, else 0."""
    FETCHED = "fetched"
    """Question, after a batch's first op: the micro-batches it fetched; 0 when the
    epoch's data had ended."""
    EVAL_ENDED = "eval_ended"
    """Question, after an eval pass's first op: 1 if the eval data had ended, else 0."""
    PENDING = "pending"
    """Question: the shards with an optimizer step still pending, as a bit mask (bit
    ``i`` for shard ``i``)."""
    NO_DATA = "no_data"
    """Action: the data ended at batch 0, so the epoch has no batch (an error); the
    walk ends here."""
    EPOCH_END = "epoch_end"
    """Action: the data ended; the epoch is over (the next batch is batch 0)."""
    BATCH_END = "batch_end"
    """Action: the batch's ops ran; the epoch is the fetched micro-batches further."""
    EVAL = "eval"
    """Action: the eval pass begins."""
    ITERATION_END = "iteration_end"
    """Action: the iteration's ops all ran."""


@dataclass(frozen=True, slots=True)
class Program:
    """The order of one task's shard operations.

    Attributes:
        task: the task's name (its ops carry it).
        shards: number of shards.
        accumulate_steps: micro-batches per optimizer step; a visit may run the rest of a
            group (the ops' ``count``).
        iteration_batches: batches per iteration (running on into the next epoch), or
            ``None``: an iteration is an epoch.
        has_eval: whether each iteration ends with an eval pass.
    """

    task: str
    shards: int
    accumulate_steps: int = 1
    iteration_batches: int | None = None
    has_eval: bool = False

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

    def eval_ops(self, iteration: int, batch: int) -> list[Op]:
        """The ops of one eval batch: ``E0 .. E(n-1)``."""
        return [Op(self.task, OpKind.EVAL, i, iteration, batch) for i in range(self.shards)]

    def group_count(self, batch: int, left: int | None = None) -> int:
        """Micro-batches from ``batch`` to the end of its accumulation group, at most
        ``left`` (the iteration's batches still to run; ``None``: no limit)."""
        count = self.accumulate_steps - batch % self.accumulate_steps
        return count if left is None else max(1, min(count, left))

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

    def walk(self) -> Generator[Op | Mark, int, None]:
        """The task's ops in order, for ever (iteration after iteration), with the
        :class:`Mark` points where the run answers or acts (see there).

        An iteration runs batches until the data ends (an epoch) or, with
        ``iteration_batches``, that many batches, going on into the next epoch when the
        data ends first; every batch begins with its first shard's forward, which finds
        out whether the data ended. Then the eval pass, one eval batch after another
        until ``E0`` finds the eval data ended, and a step op per shard whose step is
        still pending (the batch -1).
        """
        limit = self.iteration_batches
        while True:
            it = yield Mark.ITERATION
            done = 0
            while limit is None or done < limit:
                b = yield Mark.BATCH
                want = 1
                if self.accumulate_steps > 1 and (yield Mark.GROUPED):
                    want = self.group_count(b, None if limit is None else limit - done)
                kind = OpKind.LAST if self.shards == 1 else OpKind.FORWARD
                yield Op(self.task, kind, 0, it, b, want)  # batch_ops(it, b, want)[0]
                m = yield Mark.FETCHED
                if m == 0:
                    if b == 0:
                        yield Mark.NO_DATA
                        return
                    yield Mark.EPOCH_END
                    if limit is None:
                        break
                    continue
                for op in self.batch_ops(it, b, m)[1:]:
                    yield op
                yield Mark.BATCH_END
                done += m
            if self.has_eval:
                yield Mark.EVAL
                e = 0
                while True:
                    first, *rest = self.eval_ops(it, e)
                    yield first
                    if (yield Mark.EVAL_ENDED):
                        break
                    for op in rest:
                        yield op
                    e += 1
            pending = yield Mark.PENDING
            for i in range(self.shards):
                if pending >> i & 1:
                    yield Op(self.task, OpKind.STEP, i, it, -1)
            yield Mark.ITERATION_END

    def schedule(self, script: Script) -> list[Op]:
        """The ops the task runs given facts written down in advance (see
        :class:`Script`), for ``script.iterations`` iterations.

        Raises:
            EmptyDataError: ``script.epoch_batches`` is 0.
        """
        return _Replay(self, script).run()


@dataclass(frozen=True, slots=True)
class Script:
    """The facts of a run fixed in advance, as a task on plain data has them.

    Attributes:
        epoch_batches: batches of ``train_data`` (every epoch).
        iterations: iterations granted.
        eval_batches: batches of ``eval_data`` (with ``Program.has_eval``).
        clip: whether the task clips gradients (``max_grad_norm``): the global norm is
            known only after a group's last ``B0``, so the other shards' steps wait for
            their next visit (or an ``S`` op at the iteration's end).
        grouped: whether visits run the rest of an accumulation group at once once
            every shard has run an op (the engine does when no shard draws random
            numbers, which it learns at a shard's first op, and no graphs are kept).
    """

    epoch_batches: int
    iterations: int = 1
    eval_batches: int = 0
    clip: bool = False
    grouped: bool = True


class _Replay:
    """Walks a program answering from a :class:`Script`, keeping a run's bookkeeping:
    the position in the epoch and which shards owe an optimizer step."""

    def __init__(self, program: Program, script: Script) -> None:
        self.program = program
        self.script = script
        self.iteration = 0
        self.batch = 0  # of the epoch
        self.fetched = 0
        self.pending: set[int] = set()
        self.visited: set[int] = set()
        self.ops: list[Op] = []

    def run(self) -> list[Op]:
        walk = self.program.walk()
        step = next(walk)
        while True:
            if step is Mark.ITERATION and self.iteration == self.script.iterations:
                return self.ops
            step = walk.send(self.answer(step))

    def answer(self, step: Op | Mark) -> int:
        script, k = self.script, self.program.accumulate_steps
        if isinstance(step, Op):
            self.ops.append(step)
            self.visited.add(step.shard)
            self.pending.discard(step.shard)  # a deferred step runs at the shard's next op
            if starts_batch(step):
                self.fetched = min(step.count, script.epoch_batches - self.batch)
            if ends_batch(step):
                for b in range(step.batch, step.batch + step.count):
                    if script.clip and (b + 1) % k == 0:  # B0 stepped; the others wait
                        self.pending = set(range(1, self.program.shards))
            return 0
        if step is Mark.ITERATION:
            return self.iteration
        if step is Mark.BATCH:
            return self.batch
        if step is Mark.GROUPED:
            return int(script.grouped and len(self.visited) == self.program.shards)
        if step is Mark.FETCHED:
            return self.fetched
        if step is Mark.NO_DATA:
            raise EmptyDataError(f"task {self.program.task!r}: the script's epoch has no batch")
        if step is Mark.EPOCH_END:
            if self.batch % k != 0:  # a partial last group steps every shard
                self.pending = set(range(self.program.shards))
            self.batch = 0
        elif step is Mark.BATCH_END:
            self.batch += self.fetched
        elif step is Mark.EVAL_ENDED:
            return int(self.ops[-1].batch >= script.eval_batches)
        elif step is Mark.PENDING:
            return sum(1 << i for i in self.pending)
        elif step is Mark.ITERATION_END:
            self.iteration += 1
        return 0
