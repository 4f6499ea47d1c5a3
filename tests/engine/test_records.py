"""The engine's per-task record: the remaining-work estimate the policy sees."""

from __future__ import annotations

import math

from tune_hydra.engine.dispatch.scripted import ScriptedRunner
from tune_hydra.engine.records import TaskRecord
from tune_hydra.options import TrainOptions


def _record(granted: int = 2) -> TaskRecord:
    """A record of a 4-shard task whose batch is 2 * 4 - 1 ops (a scripted runner: F0 F1 F2
    L3 B2 B1 B0), on 5 batches an iteration."""
    runner = ScriptedRunner("a", "F0[0] F1[0] F2[0] L3[0] B2[0] B1[0] B0[0]")
    rec = TaskRecord("a", runner.plan, TrainOptions(), 0, runner)
    rec.batches_per_iter = 5.0  # an epoch of 5 batches
    rec.granted = granted
    return rec


def test_running_sum_equals_the_explicit_estimate() -> None:
    rec = _record()
    n = len(rec.plan)
    assert n == 4
    assert rec.remaining_s(0.5) == (2 * n - 1) * 0.5 * 2 * 5  # nothing measured yet
    durations = {("F", 0): 0.1, ("F", 1): 0.2, ("L", 3): 0.5, ("B", 1): 0.3}
    for (kind, shard), d in durations.items():
        rec.record(kind, shard, d)
    rec.record("F", 0, 0.4)  # an EMA update replaces the old estimate in the sum
    rec.record("E", 0, 9.0)  # eval and step visits are not per-batch ops
    ema = 0.7 * 0.1 + 0.3 * 0.4
    known = [ema, 0.2, 0.5, 0.3]
    per_batch = sum(known) + (2 * n - 1 - len(known)) * sum(known) / len(known)
    assert math.isclose(rec.remaining_s(), per_batch * 2 * 5)
    rec.hint = 3  # the front end announced 3 more iterations
    assert math.isclose(rec.remaining_s(), per_batch * 5 * 5)


def test_milestone_s_counts_the_iterations_to_the_milestone_as_remaining_s_does() -> None:
    rec = _record(granted=4)
    assert rec.milestone_s(0.5) is None  # none set
    rec.milestone_at = 2  # the runner has finished 0 iterations: 2 to go
    per_batch = (2 * 4 - 1) * 0.5
    assert rec.milestone_s(0.5) == per_batch * 2 * 5
    assert rec.remaining_s(0.5) == per_batch * 4 * 5
    rec.milestone_at = 0  # reached (or passed): no milestone ahead
    assert rec.milestone_s(0.5) is None


def test_end_iteration_completes_a_grant_with_all_its_results_and_learns_the_epoch() -> None:
    import concurrent.futures

    from tune_hydra.core.ops import Op
    from tune_hydra.engine.records import PendingIterations

    rec = _record(granted=3)
    first: concurrent.futures.Future[list[dict[str, object]]] = concurrent.futures.Future()
    second: concurrent.futures.Future[list[dict[str, object]]] = concurrent.futures.Future()
    rec.pending += [PendingIterations(first, 2), PendingIterations(second, 1)]

    def batches(n: int) -> None:  # each batch ends with its first shard's backward
        for _ in range(n):
            rec.op_done(Op.parse("a:F0[0]"), 0.25)
            rec.op_done(Op.parse("a:B0[0]"), 0.25)

    batches(3)
    rec.end_iteration()
    assert not first.done() and rec.batches_per_iter == 3.0  # an epoch's batches, measured
    rec.end_iteration()  # none counted: the estimate stays
    assert [r["iteration"] for r in first.result(0)] == [1, 2] and rec.batches_per_iter == 3.0
    assert not second.done() and rec.pending == [PendingIterations(second, 1)]
    batches(3)
    rec.end_iteration()
    assert second.result(0) == [{"iteration": 3, "batches": 3}] and rec.pending == []
    assert rec.granted == 0 and rec.iteration == 3 and rec.device_time == 3.0


def test_hint_and_milestone_drop_the_last_offer() -> None:
    rec = _record()
    rec.candidate = object()  # type: ignore[assignment]
    rec.set_hint(-2)
    assert rec.hint == 0 and rec.candidate is None
    rec.candidate = object()  # type: ignore[assignment]
    rec.set_milestone(3)
    assert rec.milestone_at == rec.iteration + 3 and rec.candidate is None
    rec.set_milestone(None)
    assert rec.milestone_at is None
