"""A task's program (tune_hydra.core.program): op sequences written as strings, and the
walk that gives them from a run's facts."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tune_hydra.core.ops import Op, OpKind, parse_schedule
from tune_hydra.core.program import (
    Mark,
    Program,
    Script,
    ends_batch,
    in_batch,
    is_batch_kind,
    starts_batch,
)
from tune_hydra.exceptions import EmptyDataError


def ops(text: str) -> list[Op]:
    return parse_schedule(text)


def shown(schedule: list[Op]) -> str:
    return " ".join(map(str, schedule))


# -- Op strings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["a:F2[5]", "a:L0[4:6]", "a:B1[0]", "a:S1[-1]", "a:E0[3]", "a:F0[0]@2", "a:S0[-1]@11"],
)
def test_op_parse_round_trips_every_kind(text: str) -> None:
    op = Op.parse(text)
    assert str(op) == text
    assert Op.parse(str(op)) == op


def test_op_parse_reads_the_fields() -> None:
    assert Op.parse("a:L0[4:6]") == Op("a", OpKind.LAST, 0, 0, 4, 2)
    assert Op.parse("a:S1[-1]@3") == Op("a", OpKind.STEP, 1, 3, -1, 1)
    assert Op.parse("a:E0[3]").kind is OpKind.EVAL
    # A task name may hold ':' (and look like an op): the op is read from the right.
    assert Op.parse("x:F0[1]:B2[7]@1") == Op("x:F0[1]", OpKind.BACKWARD, 2, 1, 7)
    assert str(Op("t:1", OpKind.FORWARD, 3, 0, 2, 3)) == "t:1:F3[2:5]"


@pytest.mark.parametrize("text", ["a", "a:X0[1]", "F0[1]", "a:F0[1", "a:F0[3:3]", "a:F[1]"])
def test_op_parse_refuses_what_is_not_an_op(text: str) -> None:
    with pytest.raises(ValueError, match="not an op"):
        Op.parse(text)


def test_parse_schedule_splits_on_spaces_and_commas() -> None:
    assert parse_schedule(" a:F0[0], a:L1[0]\n a:B0[0] ") == [
        Op("a", OpKind.FORWARD, 0, 0, 0),
        Op("a", OpKind.LAST, 1, 0, 0),
        Op("a", OpKind.BACKWARD, 0, 0, 0),
    ]
    assert parse_schedule("") == []


# -- one batch, and the tables ----------------------------------------------------------


def test_batch_and_eval_ops() -> None:
    p = Program("a", 3)
    assert p.batch_ops(0, 0) == ops("a:F0[0] a:F1[0] a:L2[0] a:B1[0] a:B0[0]")
    assert p.batch_ops(1, 4, 2) == ops(
        "a:F0[4:6]@1 a:F1[4:6]@1 a:L2[4:6]@1 a:B1[4:6]@1 a:B0[4:6]@1"
    )
    assert p.eval_ops(0, 1) == ops("a:E0[1] a:E1[1] a:E2[1]")
    assert Program("b", 1).batch_ops(0, 3) == ops("b:L0[3]")
    for n in (1, 2, 5):
        assert len(Program("c", n).batch_ops(0, 0)) == Program("c", n).ops_per_batch == 2 * n - 1


def test_next_shard_table() -> None:
    p = Program("a", 3)
    table = {
        "a:F0[0]": 1, "a:F1[0]": 2, "a:L2[0]": 1, "a:B1[0]": 0, "a:B0[0]": None,
        "a:E0[0]": 1, "a:E1[0]": 2, "a:E2[0]": None, "a:S1[-1]": None,
    }  # fmt: skip
    assert {t: p.next_shard(Op.parse(t)) for t in table} == table
    one = Program("b", 1)
    assert [one.next_shard(Op.parse(t)) for t in ("b:L0[0]", "b:E0[0]", "b:S0[-1]")] == [None] * 3


def test_batch_membership_tables() -> None:
    rows = {
        #          starts, in,    ends
        "a:F0[0]": (True, False, False),
        "a:F1[0]": (False, True, False),
        "a:L2[0]": (False, True, False),
        "a:B1[0]": (False, True, False),
        "a:B0[0]": (False, True, True),
        "a:L0[0]": (True, False, True),  # one shard: the batch's only op
        "a:E0[0]": (False, False, False),
        "a:S0[-1]": (False, False, False),
    }
    for text, want in rows.items():
        op = Op.parse(text)
        assert (starts_batch(op), in_batch(op), ends_batch(op)) == want, text
    assert not in_batch(None)
    assert [k.value for k in OpKind if is_batch_kind(k)] == ["F", "L", "B"]


def test_group_count() -> None:
    p = Program("a", 2, accumulate_steps=3)
    assert [p.group_count(b) for b in range(7)] == [3, 2, 1, 3, 2, 1, 3]
    assert p.group_count(0, left=2) == 2 and p.group_count(4, left=0) == 1


# -- whole schedules --------------------------------------------------------------------


def test_three_shards_two_batches_and_an_eval_batch() -> None:
    got = Program("a", 3, has_eval=True).schedule(Script(2, eval_batches=1))
    # F0[2] finds the epoch's data ended; E0[1] finds the eval data ended.
    assert got == ops("""
        a:F0[0] a:F1[0] a:L2[0] a:B1[0] a:B0[0]
        a:F0[1] a:F1[1] a:L2[1] a:B1[1] a:B0[1]
        a:F0[2]
        a:E0[0] a:E1[0] a:E2[0] a:E0[1]
    """)


def test_clipping_defers_steps_to_the_next_visit_or_a_step_op() -> None:
    got = Program("a", 3).schedule(Script(2, iterations=2, clip=True))
    assert got == ops("""
        a:F0[0] a:F1[0] a:L2[0] a:B1[0] a:B0[0]
        a:F0[1] a:F1[1] a:L2[1] a:B1[1] a:B0[1] a:F0[2] a:S1[-1] a:S2[-1]
        a:F0[0]@1 a:F1[0]@1 a:L2[0]@1 a:B1[0]@1 a:B0[0]@1
        a:F0[1]@1 a:F1[1]@1 a:L2[1]@1 a:B1[1]@1 a:B0[1]@1 a:F0[2]@1 a:S1[-1]@1 a:S2[-1]@1
    """)
    # The eval pass visits every shard, which runs its deferred step: no step op.
    with_eval = Program("a", 3, has_eval=True).schedule(Script(1, eval_batches=1, clip=True))
    assert shown(with_eval) == "a:F0[0] a:F1[0] a:L2[0] a:B1[0] a:B0[0] a:F0[1] " + (
        "a:E0[0] a:E1[0] a:E2[0] a:E0[1]"
    )
    # One shard steps at once: nothing is deferred.
    assert shown(Program("b", 1).schedule(Script(2, clip=True))) == "b:L0[0] b:L0[1] b:L0[2]"


def test_accumulation_groups_and_the_partial_last_group() -> None:
    p = Program("a", 3, accumulate_steps=2)
    # Batch 0 runs alone (the first visits tell whether a shard draws random numbers),
    # batch 1 ends its group; then whole groups, the last one partial (batch 4 only).
    # Its step is pending on every shard when the epoch ends: step ops.
    assert p.schedule(Script(5)) == ops("""
        a:F0[0] a:F1[0] a:L2[0] a:B1[0] a:B0[0]
        a:F0[1] a:F1[1] a:L2[1] a:B1[1] a:B0[1]
        a:F0[2:4] a:F1[2:4] a:L2[2:4] a:B1[2:4] a:B0[2:4]
        a:F0[4:6] a:F1[4] a:L2[4] a:B1[4] a:B0[4]
        a:F0[5] a:S0[-1] a:S1[-1] a:S2[-1]
    """)
    ungrouped = p.schedule(Script(5, grouped=False))
    assert all(op.count == 1 for op in ungrouped)
    assert shown(ungrouped[20:]) == "a:F0[4] a:F1[4] a:L2[4] a:B1[4] a:B0[4] " + (
        "a:F0[5] a:S0[-1] a:S1[-1] a:S2[-1]"
    )


def test_iteration_batches_run_on_into_the_next_epoch() -> None:
    got = Program("a", 2, iteration_batches=3).schedule(Script(2, iterations=2))
    assert got == ops("""
        a:F0[0] a:L1[0] a:B0[0] a:F0[1] a:L1[1] a:B0[1] a:F0[2]
        a:F0[0] a:L1[0] a:B0[0]
        a:F0[1]@1 a:L1[1]@1 a:B0[1]@1 a:F0[2]@1
        a:F0[0]@1 a:L1[0]@1 a:B0[0]@1 a:F0[1]@1 a:L1[1]@1 a:B0[1]@1
    """)


def test_iteration_batches_cut_accumulation_groups() -> None:
    p = Program("a", 1, accumulate_steps=2, iteration_batches=3)
    got = p.schedule(Script(10, iterations=3))
    # Batch 2 and batch 8 end their iterations: a group visit stops there.
    assert got == ops("a:L0[0] a:L0[1] a:L0[2] a:L0[3]@1 a:L0[4:6]@1 a:L0[6:8]@2 a:L0[8]@2")


def test_one_shard() -> None:
    got = Program("a", 1, has_eval=True).schedule(Script(2, iterations=2, eval_batches=2))
    assert got == ops("""
        a:L0[0] a:L0[1] a:L0[2] a:E0[0] a:E0[1] a:E0[2]
        a:L0[0]@1 a:L0[1]@1 a:L0[2]@1 a:E0[0]@1 a:E0[1]@1 a:E0[2]@1
    """)


def test_no_batch_in_the_epoch() -> None:
    with pytest.raises(EmptyDataError, match="no batch"):
        Program("a", 2).schedule(Script(0))
    assert Program("a", 2).schedule(Script(0, iterations=0)) == []


def test_the_walk_asks_and_marks_in_order() -> None:
    """The protocol a run follows: questions answered by send, actions acted on."""

    def trace(walk: Generator[Op | Mark, int, None], answers: dict[Mark, list[int]]) -> str:
        out, step = [], next(walk)
        while True:
            out.append(str(step) if isinstance(step, Op) else step.name)
            if step is Mark.ITERATION and not answers[Mark.ITERATION]:
                return " ".join(out)
            queue = answers.get(step) if isinstance(step, Mark) else None
            try:
                step = walk.send(queue.pop(0) if queue else 0)
            except StopIteration:
                return " ".join(out)

    walk = Program("a", 2, has_eval=True).walk()
    answers = {
        Mark.ITERATION: [0],
        Mark.BATCH: [0, 1],
        Mark.FETCHED: [1, 0],
        Mark.EVAL_ENDED: [1],
        Mark.PENDING: [0b10],
    }
    assert trace(walk, answers) == (
        "ITERATION BATCH a:F0[0] FETCHED a:L1[0] a:B0[0] BATCH_END "
        "BATCH a:F0[1] FETCHED EPOCH_END EVAL a:E0[0] EVAL_ENDED "
        "PENDING a:S1[-1] ITERATION_END ITERATION"
    )
    grouped = Program("b", 1, accumulate_steps=2).walk()
    got = trace(
        grouped, {Mark.ITERATION: [0], Mark.GROUPED: [1], Mark.BATCH: [0], Mark.FETCHED: [0]}
    )
    assert got == "ITERATION BATCH GROUPED b:L0[0:2] FETCHED NO_DATA"
