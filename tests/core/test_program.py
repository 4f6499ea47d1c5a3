"""A task's program (tune_hydra.core.program): ops written as strings, a batch's ops and
the look-ahead in its cycle."""

from __future__ import annotations

import pytest

from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.program import Program, ends_batch, in_batch, is_batch_kind, starts_batch


def ops(text: str) -> list[Op]:
    return [Op.parse(word) for word in text.split()]


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


# -- one batch, and the tables ----------------------------------------------------------


def test_batch_ops() -> None:
    p = Program("a", 3)
    assert p.batch_ops(0, 0) == ops("a:F0[0] a:F1[0] a:L2[0] a:B1[0] a:B0[0]")
    assert p.batch_ops(1, 4, 2) == ops(
        "a:F0[4:6]@1 a:F1[4:6]@1 a:L2[4:6]@1 a:B1[4:6]@1 a:B0[4:6]@1"
    )
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
