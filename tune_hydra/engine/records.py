"""The engine's per-task bookkeeping: granted iterations and remaining-work estimates."""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tune_hydra.core.ops import Op
from tune_hydra.core.policies.base import Candidate
from tune_hydra.core.program import BATCH_KINDS, ends_batch
from tune_hydra.engine.protocol import Runner
from tune_hydra.engine.registration.partition import ShardPlan
from tune_hydra.options import TrainOptions

if TYPE_CHECKING:
    from tune_hydra.engine.dispatch.workers import DeviceWorker

_EMA = 0.3  # weight of the newest measurement in per-op time estimates


@dataclass
class PendingIterations:
    """Iterations granted by one ``Engine.train`` call; the future gets their results."""

    future: concurrent.futures.Future[list[dict[str, Any]]]
    count: int
    results: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TaskRecord:
    """The engine's record of one task: its runner, where it runs, its futures, and the
    online estimates of its remaining work (and of its work to its trial's next
    milestone) that the policy sees.
    """

    name: str
    plan: ShardPlan
    options: TrainOptions
    order: int
    runner: Runner
    pending: list[PendingIterations] = field(default_factory=list)
    assigned: DeviceWorker | None = None
    error: BaseException | None = None
    cancelled: bool = False
    hint: int = 0  # iterations still to come after the granted ones
    granted: int = 0  # iterations granted and not finished yet (Engine.get_state needs 0)
    iteration: int = 0  # iterations finished
    batches_done: int = 0  # train batches of the current iteration run so far
    device_time: float = 0.0  # seconds its ops computed (Engine.summary)
    # The iteration count at which its trial's next milestone falls
    # (Engine.set_milestone); None: none known.
    milestone_at: int | None = None
    ready_since: float = 0.0
    op_time: dict[tuple[str, int], float] = field(default_factory=dict)
    batches_per_iter: float = 0.0
    # Running sum of the per-batch ops' estimates, so remaining_s is O(1) per candidate.
    known_sum: float = 0.0
    known_n: int = 0
    candidate: Candidate | None = None  # the last offer to the policy, while still true
    # The engine-wide mean op time that offer was estimated with (it counts for the ops
    # not measured yet).
    offered_s: float = math.nan
    kept_on: DeviceWorker | None = None  # the device holding its batch's kept graphs

    def record(self, kind: str, shard: int, seconds: float) -> None:
        """Fold one measured op duration (per micro-batch) into the estimates."""
        key = (kind, shard)
        old = self.op_time.get(key)
        new = seconds if old is None else (1 - _EMA) * old + _EMA * seconds
        self.op_time[key] = new
        if kind in _BATCH_KINDS:
            self.known_sum += new - (0.0 if old is None else old)
            self.known_n += old is None

    def op_done(self, op: Op, seconds: float) -> None:
        """One of its ops ran for ``seconds`` (counted whether it failed or not)."""
        self.device_time += seconds
        if ends_batch(op):
            self.batches_done += op.count

    def end_iteration(self) -> None:
        """Its runner ended an iteration: the result (``"iteration"``, its number from 1,
        and ``"batches"``, train batches it ran) to its future (all the grant's results
        at once, when its last iteration ends)."""
        self.iteration += 1
        self.granted -= 1
        result: dict[str, Any] = {"iteration": self.iteration, "batches": self.batches_done}
        self.batches_done = 0
        if self.options.iteration_batches is None and result["batches"]:
            self.batches_per_iter = float(result["batches"])
        if self.pending:
            p = self.pending[0]
            p.results.append(result)
            if len(p.results) == p.count:
                self.pending.pop(0)
                p.future.set_result(p.results)

    def set_hint(self, iterations: int) -> None:
        """``Engine.set_remaining``: iterations still to come after the granted ones."""
        self.hint = max(0, int(iterations))
        self.candidate = None

    def set_milestone(self, iterations: int | None) -> None:
        """``Engine.set_milestone``: the next milestone ``iterations`` from now (checked)."""
        self.milestone_at = None if iterations is None else self.iteration + iterations
        self.candidate = None

    def remaining_s(self, default_op_s: float = 1.0) -> float:
        """Estimated seconds of work left; ops not measured yet count as the task's mean
        measured op, or ``default_op_s`` (the engine-wide mean) before the first."""
        return self._work_s(self.granted + self.hint, default_op_s)

    def milestone_s(self, default_op_s: float = 1.0) -> float | None:
        """Estimated seconds of work until its trial's next milestone (the iterations
        :attr:`milestone_at` is away, estimated as :meth:`remaining_s` counts them);
        ``None`` when none is known or the task has reached it."""
        if self.milestone_at is None:
            return None
        iters = self.milestone_at - self.iteration
        return self._work_s(iters, default_op_s) if iters > 0 else None

    def _work_s(self, iters: int, default_op_s: float) -> float:
        """Seconds of ``iters`` iterations from now, less the current one's progress."""
        kinds = self.runner.order.ops_per_batch
        fallback = self.known_sum / self.known_n if self.known_n else default_op_s
        per_batch = self.known_sum + (kinds - self.known_n) * fallback
        per_iter = self.batches_per_iter or 1.0
        return per_batch * max(iters * per_iter - self.batches_done, 1.0)


_BATCH_KINDS = frozenset(kind.value for kind in BATCH_KINDS)  # as ``record`` gets them
