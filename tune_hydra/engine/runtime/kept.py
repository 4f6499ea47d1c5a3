"""Device memory for the autograd graphs that ``recompute=False`` keeps through a batch.

Without recompute, every shard's forward keeps its graph (its saved activations) on the
device until that shard's backward, so one batch of a task holds all its shards'
activations at once (``ShardPlan.kept_peak_bytes``), and those of several tasks add up.
On a device that copies (a GPU, or ``copy_on_cpu``) the engine therefore

- refuses a task whose batch alone would not fit the budget (:meth:`KeptGraphs.check`);
- *reserves* a task's kept bytes on the device where its batch starts (its first forward)
  until its first shard's backward ends, and keeps every op of that batch on that device
  (the graph cannot move);
- starts a batch, or runs an op outside one (eval, a deferred step), on a device only if
  it fits beside the batches in flight there, the other queued ops' activations and room
  for the resident shard states (:meth:`DeviceWorker.admits`, answered by the device's
  :class:`~tune_hydra.core.ledger.DeviceLedger`, where reservations are recorded too); an
  idle device always admits, so every task makes progress.

The boundary tensors of a batch in flight are inside its reservation (the forward's are
views of kept outputs).

A task registered with ``TrainOptions(recompute=True)`` keeps nothing and reserves
nothing; its ops, like eval ops, are admitted beside the reservations. A runner whose
batch goes on while it has no op ready (a user-driven loop, whose next op is the user's
next call: ``tune_hydra.engine.runtime.loop``) says so with a ``keeps_batch`` property
(optional; ``False`` when absent): its reservation holds until that is false after one
of its ops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tune_hydra.core.ops import Op
from tune_hydra.core.program import in_batch, starts_batch
from tune_hydra.engine.registration.partition import ShardPlan
from tune_hydra.exceptions import InvalidTaskError, ScheduleError, format_bytes

if TYPE_CHECKING:
    from tune_hydra.engine.dispatch.workers import DeviceWorker
    from tune_hydra.engine.records import TaskRecord


def kept_bytes(plan: ShardPlan) -> int:
    """The activations one batch keeps on its device at most: every shard's at once."""
    return sum(s.activation_bytes for s in plan.shards)


class KeptGraphs:
    """The engine's reservations for kept graphs (active with ``recompute=False``)."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._max_state = 0  # the largest shard state of any task seen (room to keep)

    def check(self, name: str, plan: ShardPlan, *, keeps: bool = True) -> None:
        """Count a task's largest shard state (the room batches in flight leave for the
        states resident beside them: every task's, those of tasks that recompute too);
        refuse a task that ``keeps`` graphs whose one batch would not fit
        ``device_memory`` on its own."""
        if not self.active:
            return
        if keeps and plan.budget is not None and plan.kept_peak_bytes() > plan.budget:
            raise InvalidTaskError(
                f"task {name!r}: recompute=False keeps all {len(plan)} shards' activations "
                f"on the device until their backward: {format_bytes(plan.kept_peak_bytes())} "
                f"at once, over device_memory={format_bytes(plan.budget)}; use "
                f"recompute=True (the default on GPUs) or raise device_memory"
            )
        self._max_state = max(self._max_state, *(s.state_bytes for s in plan.shards))

    def blocks(self, entry: TaskRecord, op: Op, w: DeviceWorker) -> bool:
        """Whether ``entry``'s ``op`` may not go to ``w`` now: its batch's graph is on
        another device, or it would not fit beside the batches in flight on ``w``."""
        if entry.kept_on is not None:
            return entry.kept_on is not w
        if not self.active or not w.copy:
            return False
        if starts_batch(op) and not entry.options.recompute:
            need = kept_bytes(entry.plan)
        else:
            # Outside any reservation (an eval or step op, a recomputing task's op): its
            # activations, as the device's room counts them, beside the batches in
            # flight. Queued ahead of a kept batch's next op, it would otherwise wait for
            # room that only that batch frees.
            need = entry.plan.shards[op.shard].activation_bytes
        return not w.admits(need, w.depth * self._max_state)

    def begin(self, entry: TaskRecord, op: Op, w: DeviceWorker) -> None:
        """Reserve the batch ``op`` starts on ``w`` (called as it is assigned there)."""
        if self.active and w.copy and starts_batch(op) and not entry.options.recompute:
            entry.kept_on = w
            w.reserve(entry.name, kept_bytes(entry.plan))

    def audit(self, tasks: Mapping[str, TaskRecord], workers: Sequence[DeviceWorker]) -> None:
        """Raise if a device holds a reservation no batch in flight owns (a task gone,
        elsewhere, or failed or cancelled with no op left to run): its room would never
        come back and the other tasks would wait for it forever. Called under the
        engine's lock."""
        for w in workers:
            for name in list(w.reserved):
                e = tasks.get(name)
                dead = e is not None and e.assigned is None and (e.cancelled or e.error)
                if e is None or e.kept_on is not w or dead:
                    raise ScheduleError(
                        f"device {w.label} holds device memory for the kept graphs of task "
                        f"{name!r}, which has no batch in flight there; this is a tune_hydra "
                        f"bug, please report it"
                    )

    def end(self, entry: TaskRecord, *, drop: bool = False) -> None:
        """Release the task's reservation once its batch is over: its next op is outside
        it, or ``drop`` (the task failed, was cancelled or leaves: its batch's tensors
        are dropped here first)."""
        w = entry.kept_on
        if w is None:
            return
        runner = entry.runner
        if not drop and (in_batch(runner.current) or getattr(runner, "keeps_batch", False)):
            return
        w.reserve(entry.name, None)
        entry.kept_on = None
