"""Shard operations as data: the unit of work the engine schedules.

An :class:`Op` is a small immutable record that prints as a short string, e.g.
``a:F2[5]`` (task ``a``, forward of shard 2, batch 5 of the epoch), ``a:L2[4:6]`` (a
visit that runs batches 4 and 5) or ``a:B1[0]@2`` (iteration 2; iteration 0 is not
printed), and :meth:`Op.parse` reads back. A task's operations run strictly in the order
the task produces them (:mod:`tune_hydra.core.program`); different tasks' operations are
independent, which is what the engine multiplexes.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class OpKind(str, enum.Enum):
    """What an operation does to its shard."""

    FORWARD = "F"
    """Forward of a non-last shard; keeps only its input (or its graph when not recomputing)."""
    LAST = "L"
    """Forward of the last shard, the loss, and that shard's backward, in one visit."""
    BACKWARD = "B"
    """Re-run the shard's forward from its saved input, back-propagate, maybe step."""
    STEP = "S"
    """Apply an optimizer step left pending at the end of an iteration."""
    EVAL = "E"
    """Forward under ``no_grad`` in eval mode, for ``eval_data``."""


@dataclass(frozen=True, slots=True)
class Op:
    """One shard operation of one task.

    Attributes:
        task: the task's name.
        kind: what the operation does.
        shard: index of the shard it runs.
        iteration: the task's iteration (0-based) the operation belongs to.
        batch: index of the batch within the epoch (eval batches count separately; -1 for
            a step flush); the first one when the op runs several.
        count: how many consecutive micro-batches the visit runs (gradient accumulation
            lets one promotion serve a whole group).
    """

    task: str
    kind: OpKind
    shard: int
    iteration: int = 0
    batch: int = -1
    count: int = 1

    def __str__(self) -> str:
        span = f"{self.batch}" if self.count == 1 else f"{self.batch}:{self.batch + self.count}"
        at = f"@{self.iteration}" if self.iteration else ""
        return f"{self.task}:{self.kind.value}{self.shard}[{span}]{at}"

    @classmethod
    def parse(cls, text: str) -> Op:
        """The op that prints as ``text`` (the inverse of ``str(op)``).

        The task's name may itself contain ``:``: the op is read from the right.

        Raises:
            ValueError: ``text`` is not an op's string.
        """
        found = _OP_TEXT.fullmatch(text.strip())
        if found is None:
            raise ValueError(f"not an op: {text!r} (expected e.g. 'a:F2[5]', 'a:L0[4:6]@1')")
        task, kind, shard, batch, stop, iteration = found.groups()
        first = int(batch)
        count = 1 if stop is None else int(stop) - first
        if count < 1:
            raise ValueError(f"not an op: {text!r} (an empty batch span)")
        return cls(task, OpKind(kind), int(shard), int(iteration or 0), first, count)


# Greedy ``task``: the last ``:`` before the kind letter separates it from the op.
_OP_TEXT = re.compile(r"(.+):([FLBSE])(\d+)\[(-?\d+)(?::(-?\d+))?\](?:@(\d+))?")
