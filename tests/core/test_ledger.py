"""The device ledger: its answers on their own, and the trace's replay through it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tune_hydra.core.ledger import DeviceLedger
from tune_hydra.core.trace import Trace, TraceEvent
from tune_hydra.exceptions import ScheduleError


@dataclass(frozen=True)
class Shard:
    name: tuple[str, int]
    state_bytes: int
    activation_bytes: int


def _shard(task: str, state: int, act: int, index: int = 0) -> Shard:
    return Shard((task, index), state, act)


# -- answers -----------------------------------------------------------------------------


def test_an_idle_device_always_admits() -> None:
    ledger: DeviceLedger[Shard] = DeviceLedger(100)
    assert ledger.admits(500, 500, [])  # nothing reserved, nothing queued: each plan fits
    ledger.reserve("a", 10)
    assert not ledger.admits(50, 50, [])  # 10 + 50 + 50 > 100
    assert ledger.admits(40, 50, [])
    ledger.reserve("a", None)
    busy = [_shard("b", 30, 20)]
    assert not ledger.admits(50, 40, busy)  # the queued op's 20 of activations
    assert ledger.admits(40, 40, busy)
    assert DeviceLedger[Shard](None).admits(10**12, 10**12, busy)


def test_activations_inside_a_reservation_are_not_counted_twice() -> None:
    ledger: DeviceLedger[Shard] = DeviceLedger(100)
    ledger.reserve("a", 60)
    queued = [_shard("a", 10, 50)]
    assert ledger.admits(0, 40, queued)  # 60 reserved + 40 room; a's 50 are inside
    assert ledger.need(queued) is None  # 10 + 60
    assert ledger.need([_shard("b", 10, 50)]) == 20  # 10 + 50 + 60 reserved


def test_eviction_is_least_recently_used_first_by_count_then_bytes() -> None:
    ledger: DeviceLedger[Shard] = DeviceLedger(None)
    a, b, c, d = (_shard(t, 10, 1) for t in "abcd")
    for s in (a, b, c):
        ledger.hold(s)
    assert ledger.victims([d], depth=2) == [a, b]  # 4 states, room for 2
    ledger.hold(a)  # used again: now the most recent
    assert ledger.victims([d], depth=2) == [b, c]
    assert ledger.victims([c, d], depth=2) == [b, a]  # c is kept
    assert ledger.victims([b], depth=3) == []

    ledger = DeviceLedger(100)
    old, new = _shard("old", 40, 0), _shard("new", 40, 0)
    ledger.hold(old)
    ledger.hold(new)
    incoming = _shard("in", 30, 20)
    # 3 states fit the depth, but 110 + 20 do not fit the budget; without old, 90 do.
    assert ledger.victims([incoming], depth=3) == [old]


def test_usage_and_totals() -> None:
    ledger: DeviceLedger[Shard] = DeviceLedger(100)
    a, b = _shard("a", 30, 10), _shard("b", 20, 25)
    ledger.hold(a, measured=32)
    ledger.hold(b, measured=21)
    assert ledger.peak_resident_bytes == 53
    ledger.release(a)
    ledger.hold(a, measured=31)
    assert ledger.peak_resident_bytes == 53  # the peak stays
    used = ledger.usage(b)
    assert (used.state, used.activations, used.kept) == (50, 25, 0)
    assert used.total == 75
    ledger.note_spilled("a", 30)
    assert ledger.spilled_by_task == {"a": 30}


# -- replaying a trace -------------------------------------------------------------------


def _ev(task: str, shard: int, op: str, start: float, end: float, **kw: int) -> TraceEvent:
    return TraceEvent("d0", task, shard, op, start, end, **kw)


ACTS = {("a", 0): 30, ("a", 1): 10, ("b", 0): 20}


def test_a_replay_over_budget_names_the_device_and_the_bytes() -> None:
    trace = Trace.from_events(
        [
            _ev("a", 0, "copy_in", 0.0, 1.0, bytes_moved=60),
            _ev("a", 0, "F", 1.0, 2.0),
            _ev("b", 0, "copy_in", 1.5, 1.8, bytes_moved=50),  # 60 + 50 + a's 30
        ]
    )
    with pytest.raises(ScheduleError) as info:
        trace.validate(state_budget=100, activation_bytes=ACTS)
    text = str(info.value)
    assert "device 'd0' holds 140 bytes" in text and "over its budget of 100 bytes" in text
    assert "30 bytes of the running op's activations" in text
    assert "copy_in:0" in text and "F0" in text  # the offending rows
    trace.validate(state_budget={"d0": 140}, activation_bytes=ACTS)
    trace.validate(state_budget={"other": 1}, activation_bytes=ACTS)  # no budget on d0


def test_a_replay_within_budget_passes() -> None:
    trace = Trace.from_events(
        [
            _ev("a", 0, "copy_in", 0.0, 1.0, bytes_moved=60),
            _ev("a", 0, "F", 1.0, 2.0),
            _ev("a", 0, "copy_out", 2.0, 2.5, bytes_moved=60),
            _ev("b", 0, "copy_in", 2.5, 3.0, bytes_moved=50),  # a's state gone
            _ev("b", 0, "F", 3.0, 4.0),
        ]
    )
    trace.validate(state_budget=100, activation_bytes=ACTS)


def _kept_batch() -> list[TraceEvent]:
    return [
        _ev("a", 0, "copy_in", 0.0, 0.5, bytes_moved=10),
        _ev("a", 0, "F", 1.0, 2.0),
        _ev("a", 1, "L", 2.0, 3.0),
        _ev("a", 0, "B", 3.0, 4.0),  # the batch ends here
    ]


def test_a_replay_counts_kept_graphs_and_nothing_inside_them_twice() -> None:
    kept = {"a": 70}
    within = Trace.from_events(_kept_batch())
    within.validate(state_budget=80, activation_bytes=ACTS, kept_bytes=kept)
    with pytest.raises(ScheduleError, match="activations"):  # without the reservation
        within.validate(state_budget=35, activation_bytes=ACTS)
    beside = Trace.from_events([*_kept_batch(), _ev("b", 0, "copy_in", 2.5, 2.6, bytes_moved=15)])
    with pytest.raises(ScheduleError) as info:
        beside.validate(state_budget=90, activation_bytes=ACTS, kept_bytes=kept)
    assert "holds 95 bytes" in str(info.value) and "70 bytes of batches' kept graphs" in str(
        info.value
    )
    after = Trace.from_events([*_kept_batch(), _ev("b", 0, "copy_in", 4.0, 4.5, bytes_moved=15)])
    after.validate(state_budget=80, activation_bytes=ACTS, kept_bytes=kept)
