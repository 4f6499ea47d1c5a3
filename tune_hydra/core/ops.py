"""Shard operations as data: the unit of work the engine schedules.

An :class:`Op` is a small immutable record that prints as a short string, e.g.
``a:F2[5]`` (task ``a``, forward of shard 2, batch 5 of the epoch). A task's operations
run strictly in the order the task produces them; different tasks' operations are
independent, which is what the engine multiplexes.
"""

from __future__ import annotations

import enum
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
        return f"{self.task}:{self.kind.value}{self.shard}[{span}]"
