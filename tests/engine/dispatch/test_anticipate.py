"""Anticipation: a device waits for a loop between two of its ops, briefly, and only for a
loop whose gaps are short (the times are given, never measured here)."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from tune_hydra.engine.dispatch.anticipate import CAP_S, Anticipation
from tune_hydra.engine.dispatch.scripted import ScriptedRunner


def _loop(name: str = "a", comes_back: bool = True) -> Any:
    runner = NS(current=None, comes_back=comes_back)
    return NS(name=name, error=None, cancelled=False, assigned=None, runner=runner)


def _device(index: int, queued: int = 0, copy: bool = True) -> Any:
    return NS(index=index, assigned=[object()] * queued, copy=copy)


def test_a_device_waits_for_a_loop_between_its_ops_and_for_no_other_task() -> None:
    holds, w, other = Anticipation(), _device(0), _device(1)
    a, b = _loop("a"), _loop("b")
    assert holds.after_op(a, w, now=0.0)
    assert holds.holder(w, 0.001) is a
    assert holds.may_take(a, w, a, 0.001) and not holds.may_take(b, w, a, 0.001)
    # a's next op goes to no other device while w waits for it; b's may
    assert not holds.may_take(a, other, None, 0.001) and holds.may_take(b, other, None, 0.001)
    assert holds.timeout(0.05, now=0.001) == CAP_S - 0.001
    holds.release(w)  # a's op was assigned to w
    assert holds.holder(w, 0.001) is None and holds.timeout(0.05, now=0.001) == 0.05


def test_no_wait_for_a_scripted_runner_a_ready_loop_a_busy_or_a_host_device() -> None:
    holds = Anticipation()
    # A runner whose next op no thread of its own issues (a ScriptedRunner's comes from
    # its script as the op before ends): nothing to wait for.
    scripted = _loop("s")
    scripted.runner = ScriptedRunner("s", "L0[0]")
    assert not holds.after_op(scripted, _device(0), now=0.0)
    assert not holds.after_op(_loop(comes_back=False), _device(0), now=0.0)
    ready = _loop()
    ready.runner.current = object()  # its next op is ready already
    assert not holds.after_op(ready, _device(0), now=0.0)
    assert not holds.after_op(_loop(), _device(0, queued=1), now=0.0)  # it has work
    assert not holds.after_op(_loop(), _device(0, copy=False), now=0.0)  # nothing moves
    assert holds.timeout(0.05, now=0.0) == 0.05


def test_a_hold_ends_at_its_deadline_and_when_the_loop_fails_or_runs() -> None:
    holds, w = Anticipation(), _device(0)
    a = _loop()
    until = holds.begin(a, w, now=1.0)
    assert until == 1.0 + CAP_S and holds.holder(w, until) is None  # past it
    holds.begin(a, w, now=2.0)
    a.cancelled = True
    assert holds.holder(w, 2.0) is None
    b = _loop("b")
    holds.begin(b, w, now=3.0)
    b.assigned = _device(1)  # its op went elsewhere after all
    assert holds.holder(w, 3.0) is None
    holds.begin(b, w, now=4.0)
    holds.forget("b")  # it left the engine
    assert holds.holder(w, 4.0) is None


def test_the_wait_follows_the_loops_gaps_and_stops_for_long_ones() -> None:
    holds, w = Anticipation(), _device(0)
    a = _loop()
    now = 0.0
    for _ in range(5):  # gaps of 0.2 ms: a hold of 3 of them
        holds.begin(a, w, now)
        now += 0.0002
        holds.came(a, now)
    until = holds.begin(a, w, now)
    assert until is not None and abs((until - now) - 3 * 0.0002) < 1e-9
    for _ in range(10):  # its gaps grow to 5 ms (a slow data loader): no more waiting
        holds.came(a, now + 0.005)
        now += 0.005
        holds.begin(a, w, now)
    assert holds.begin(a, w, now) is None
    assert not holds.after_op(a, w, now)
    holds.came(a, now + 0.1)  # one long gap (an evaluation) counts as 10 * CAP_S at most
    for _ in range(30):  # short again: the waits come back
        now += 0.2
        holds.begin(a, w, now)
        holds.came(a, now + 0.0002)
    assert holds.begin(a, w, now) is not None
