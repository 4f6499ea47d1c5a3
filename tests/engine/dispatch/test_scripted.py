"""The dispatcher's decisions, driven with scripted tasks (ops written as strings).

Each test registers :class:`ScriptedRunner` s on a real :class:`Engine` with a
:class:`ManualClock` and plays them (:func:`play`): ops end at their scripted times, one
at a time, so the order below is what the dispatcher decided, exactly. A change to a
policy, to the estimates it sees or to the memory checks changes these strings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from tune_hydra.core.policies import BasePolicy, Candidate, MilestonePolicy
from tune_hydra.engine import Engine
from tune_hydra.engine.dispatch.scripted import ManualClock, ScriptedRunner, play
from tune_hydra.exceptions import InvalidTaskError

BATCH = "F0[0] L1[0] B0[0]"  # one batch of a 2-shard task


def _play(
    devices: list[str],
    policy: str | BasePolicy,
    tasks: dict[str, tuple[str, dict[str, Any]]],
    grants: dict[str, int],
    **engine: Any,
) -> Any:
    with Engine(devices, policy=policy, clock=ManualClock(), **engine) as eng:
        for name, (script, sizes) in tasks.items():
            eng.add_runner(name, ScriptedRunner(name, script, **sizes))
        return play(eng, grants)


TWO = {"a": (BATCH, {"durations": {"F": 1, "L": 2, "B": 1}}), "b": ("L0[0]", {"durations": 3.0})}


def test_lrtf_runs_the_longest_task_to_the_end_first() -> None:
    # a: 2 iterations x 3 ops, b: 3 x 1 op. Unmeasured ops count as the engine's mean, so
    # a stays longest; once a is measured and done with iteration 0, a (4 s left) ties
    # b (3 ops x the 4/3 s mean): a ran there last (resident) and goes on.
    got = _play(["cpu"], "lrtf", TWO, {"a": 2, "b": 3})
    assert got.order == (
        "a:F0[0] a:L1[0] a:B0[0] a:F0[0]@1 a:L1[0]@1 a:B0[0]@1 b:L0[0] b:L0[0]@1 b:L0[0]@2"
    )
    assert got.makespan == 17.0
    assert [r["iteration"] for r in got.results["b"]] == [1, 2, 3]


def test_fifo_alternates_by_readiness() -> None:
    got = _play(["cpu"], "fifo", TWO, {"a": 2, "b": 3})
    assert got.order == (
        "a:F0[0] b:L0[0] a:L1[0] b:L0[0]@1 a:B0[0] b:L0[0]@2 a:F0[0]@1 a:L1[0]@1 a:B0[0]@1"
    )
    assert got.makespan == 17.0  # one device: the same work, in another order


def test_two_devices() -> None:
    tasks = {
        "a": (BATCH, {"durations": 1.0}),
        "b": (BATCH, {"durations": 2.0}),
        "c": ("L0[0]", {"durations": 4.0}),
    }
    grants = {"a": 2, "b": 1, "c": 2}
    lrtf = _play(["cpu", "cpu"], "lrtf", tasks, grants)
    assert lrtf.on("cpu#0") == (
        "a:F0[0] a:L1[0] a:B0[0] a:F0[0]@1 a:L1[0]@1 a:B0[0]@1 c:L0[0] c:L0[0]@1"
    )
    assert lrtf.on("cpu#1") == "b:F0[0] b:L1[0] b:B0[0]"
    assert lrtf.makespan == 14.0  # c's 8 s waited for a (LRTF saw it as the shortest)
    fifo = _play(["cpu", "cpu"], "fifo", tasks, grants)
    # a task's next op goes to whichever device is free: a's batch spans both
    assert fifo.on("cpu#0") == "a:F0[0] c:L0[0] a:B0[0] c:L0[0]@1"
    assert fifo.on("cpu#1") == "b:F0[0] a:L1[0] b:L1[0] b:B0[0] a:F0[0]@1 a:L1[0]@1 a:B0[0]@1"
    assert fifo.makespan == 10.0


def test_kept_graphs_keep_a_batch_on_its_device() -> None:
    # recompute=False on devices that copy: a batch's graph stays where it started, so
    # a:L1 waits for cpu#0 (FIFO would send it to cpu#1 at t=2; b:L1 goes there instead).
    tasks = {
        "a": (BATCH, {"durations": 1.0, "activation_bytes": 10}),
        "b": (BATCH, {"durations": 2.0, "activation_bytes": 10}),
        "c": ("L0[0]", {"durations": 4.0}),
    }
    grants = {"a": 2, "b": 1, "c": 2}
    opts = {"copy_on_cpu": True, "prefetch": False}
    free = _play(["cpu", "cpu"], "fifo", tasks, grants, recompute=True, **opts)
    assert free.on("cpu#1") == "b:F0[0] a:L1[0] b:L1[0] b:B0[0] a:F0[0]@1 a:L1[0]@1 a:B0[0]@1"
    kept = _play(["cpu", "cpu"], "fifo", tasks, grants, recompute=False, **opts)
    assert kept.on("cpu#0") == (
        "a:F0[0] c:L0[0] a:L1[0] c:L0[0]@1 a:B0[0] a:F0[0]@1 a:L1[0]@1 a:B0[0]@1"
    )
    assert kept.on("cpu#1") == "b:F0[0] b:L1[0] b:B0[0]"


@pytest.mark.parametrize(
    ("budget", "order"),
    [
        # 60 + 60 bytes of state do not fit 100: nothing is queued behind a running op,
        # so each decision waits for the device and sees a's next op ready.
        (100, "a:F0[0] a:L1[0] a:B0[0] b:F0[0] b:L1[0] b:B0[0]"),
        # they fit 1000: the second slot is filled while a's next op is not ready yet.
        (1000, "a:F0[0] b:F0[0] a:L1[0] b:L1[0] a:B0[0] b:B0[0]"),
    ],
)
def test_a_shard_that_does_not_fit_waits(budget: int, order: str) -> None:
    tasks = {"a": (BATCH, {"state_bytes": 60}), "b": (BATCH, {"state_bytes": 60})}
    got = _play(["cpu"], "lrtf", tasks, {"a": 1, "b": 1}, copy_on_cpu=True, device_memory=budget)
    assert got.order == order


class _Recording(BasePolicy):
    """LRTF's choice, recording every candidate it is offered."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[Candidate] = []

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        self.seen.extend(candidates)
        return max(candidates, key=lambda c: (c.remaining_s, -c.order))


def test_set_milestone_reaches_the_policy_and_counts_down() -> None:
    policy = _Recording()
    with Engine(["cpu"], policy=policy, clock=ManualClock()) as eng:
        eng.add_runner("a", ScriptedRunner("a", "L0[0]", durations=2.0))
        eng.add_runner("b", ScriptedRunner("b", "L0[0]", durations=1.0))
        eng.set_milestone("a", 3)
        play(eng, {"a": 4, "b": 1})
        eng.set_milestone("a", 1)  # the next rung, one iteration on
        eng.set_milestone("b", None)
        play(eng, {"a": 1})
    a = [c.milestone_s for c in policy.seen if c.op.task == "a"]
    # 3 iterations to go, each estimated at the engine's mean op before a is measured
    # (1.0 s) then at its own 2.0 s; None from the milestone on, until the next is set.
    assert a == [3.0, 4.0, 2.0, None, 2.0]
    assert {c.milestone_s for c in policy.seen if c.op.task == "b"} == {None}


def test_set_remaining_counts_down_as_iterations_are_granted() -> None:
    """A loop is granted one iteration (an op, or a chain of them) at a time: the work
    its front end announced goes down with each grant, so the policy sees its remaining
    work shrink between announcements (LRTF evens out the tasks' ends with it)."""
    policy = _Recording()
    with Engine(["cpu"], policy=policy, clock=ManualClock()) as eng:
        eng.add_runner("a", ScriptedRunner("a", "L0[0]", durations=1.0))
        eng.set_remaining("a", 3)  # 3 more after the ones granted
        for _ in range(4):
            play(eng, {"a": 1})
    assert [c.remaining_s for c in policy.seen] == [3.0, 2.0, 1.0, 1.0]


def test_set_milestone_refuses_bad_counts() -> None:
    with Engine(["cpu"], clock=ManualClock()) as eng:
        eng.add_runner("a", ScriptedRunner("a", "L0[0]"))
        for bad in (-1, 1.5, "2", True):
            with pytest.raises(InvalidTaskError, match="int >= 0, or None"):
                eng.set_milestone("a", bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidTaskError, match="no task named 'x'"):
            eng.set_milestone("x", 1)


def test_add_runner_refuses_what_is_no_runner() -> None:
    with Engine(["cpu"], clock=ManualClock()) as eng:
        with pytest.raises(InvalidTaskError, match=r"not a tune_hydra Runner: it has no current"):
            eng.add_runner("a", object())  # type: ignore[arg-type]
        with pytest.raises(InvalidTaskError, match="runner 'b' registered as 'a'"):
            eng.add_runner("a", ScriptedRunner("b", "L0[0]"))
        eng.add_runner("a", ScriptedRunner("a", "L0[0]"))
        with pytest.raises(InvalidTaskError, match="already registered"):
            eng.add_runner("a", ScriptedRunner("a", "L0[0]"))


@pytest.mark.parametrize(
    ("script", "kw", "message"),
    [
        ("", {}, "the script has no op"),
        ("F0[0] X1", {}, "not an op"),
        ("b:F0[0]", {}, "not an op of this task's iteration"),
        ("F0[0]@1", {}, "without @iteration"),
        ("L0[0] L0[0]", {}, "L0\\[0\\] is written twice"),
        ("F0[0] L1[0]", {"state_bytes": [1]}, "one per shard \\(2\\)"),
        ("L0[0]", {"durations": {"L": -1}}, "seconds >= 0"),
    ],
)
def test_scripts_are_checked(script: str, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTaskError, match=message):
        ScriptedRunner("a", script, **kw)


def test_play_needs_a_manual_clock_and_scripted_tasks() -> None:
    with Engine(["cpu"]) as eng:
        eng.add_runner("a", ScriptedRunner("a", "L0[0]"))
        with pytest.raises(InvalidTaskError, match="ManualClock"):
            play(eng, {"a": 1})


def test_scripted_tasks_train_without_play_too() -> None:
    # On the engine's own threads and clock (no gate): each task runs its script once per
    # granted iteration, in order, wherever the dispatcher sends its ops.
    with Engine(["cpu", "cpu"]) as eng:
        runners = {n: ScriptedRunner(n, BATCH if n != "c" else "L0[0]") for n in "abc"}
        for name, runner in runners.items():
            eng.add_runner(name, runner)
        futures = {name: eng.train(name, 2) for name in runners}
        results = {name: f.result(timeout=60) for name, f in futures.items()}
    for name, runner in runners.items():
        assert [r["iteration"] for r in results[name]] == [1, 2]
        script = "F0[0] L1[0] B0[0]" if name != "c" else "L0[0]"
        want = [f"{name}:{w}" for w in script.split()]
        assert [str(op) for op in runner.executed] == want + [f"{w}@1" for w in want]


# --- the milestone policy: no trial stalls waiting for admission (#21) ------------------


def test_milestone_admission_never_idles_the_device_while_a_trial_waits() -> None:
    # One slot: a is admitted, reaches its milestone and waits for its search (no grant
    # left), still holding the slot. b and c, waiting for admission, run meanwhile (each
    # as soon as the device frees): no second of idle time (makespan = the 4 s of work).
    policy = MilestonePolicy(slots_per_device=1)
    with Engine(["cpu"], policy=policy, clock=ManualClock()) as eng:
        for name in "abc":
            eng.add_runner(name, ScriptedRunner(name, "L0[0]", durations=1.0))
            eng.set_milestone(name, 1)
        got = play(eng, {"a": 1, "b": 2, "c": 1})
    # b past its milestone (committed) after its first iteration: c's first comes first.
    assert got.order == "a:L0[0] b:L0[0] c:L0[0] b:L0[0]@1"
    assert got.makespan == 4.0
    assert policy.admitted == ["a"]


class _Reporting(ScriptedRunner):
    """A runner whose ops never show progress (all of iteration 0; ``batch`` counts them;
    each op is an engine iteration of its own, as a th.shard loop's), whose front end
    moves the milestone on at each result (every ``every`` ops, to ``every`` ops ahead):
    the milestone it was admitted for never comes."""

    def __init__(self, name: str, engine: Engine, every: int) -> None:
        super().__init__(name, "L0[0]", durations=1.0)
        self.engine, self.every = engine, every
        engine.add_runner(name, self)
        engine.set_milestone(name, every)

    def advance(self) -> Any:
        op = super().advance()
        if op is not None:
            op = self.current = dataclasses.replace(op, iteration=0, batch=self.iteration)
        elif self.iteration % self.every == 0:  # trial.report: the next step announced
            # (the engine counts the iteration that just ended after this: one more)
            self.engine.set_milestone(self.name, self.every + 1)
        return op


@pytest.mark.parametrize(
    ("slack", "order"),
    [
        # a holds its slot for the 2 ops it was admitted for (+25%): it counts only its
        # milestone_s going down (1 op of 2 each report), so 5 ops; then b, waiting, is
        # admitted, then c (a, overdue, after the waiting ones): c's first report at 12 s.
        # c then keeps its slot (as a trial waiting for its search would); a and b are
        # lent the device: the least work to its milestone, then the resident one.
        (0.25, "a0 a1 a2 a3 a4 b0 b1 b2 b3 b4 c0 c1 a5 b5 b6 b7 b8 b9 b10 b11 a6 a7 a8 a9 a10 a11"),
        # Without the tenure the first admitted loop keeps its slot to its end (26 s).
        (
            float("inf"),
            "a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 a10 a11 b0 b1 b2 b3 b4 b5 b6 b7 b8 b9 b10 b11 c0 c1",
        ),
    ],
)  # fmt: skip
def test_milestone_a_trial_whose_milestone_never_comes_leaves_admission(
    monkeypatch: pytest.MonkeyPatch, slack: float, order: str
) -> None:
    import tune_hydra.core.policies.milestone as milestone

    monkeypatch.setattr(milestone, "TENURE_SLACK", slack)
    with Engine(["cpu"], policy=MilestonePolicy(slots_per_device=1), clock=ManualClock()) as eng:
        for name in "abc":
            _Reporting(name, eng, every=2)
        got = play(eng, {"a": 12, "b": 12, "c": 2})
    assert " ".join(f"{op.task}{op.batch}" for _, _, op, _ in got.ops) == order
    assert got.makespan == 26.0


class _LateLoop(ScriptedRunner):
    """A th.shard loop under th.optimize: each op an engine iteration of its own, its ops'
    iteration the reports before them; announced ``ahead`` ops to its next report, it
    reports every ``every`` ops (later than announced), then announces ``ahead`` again."""

    def __init__(self, name: str, engine: Engine, every: int, ahead: int) -> None:
        super().__init__(name, "L0[0]", durations=1.0)
        self.engine, self.every, self.ahead, self.reports = engine, every, ahead, 0
        engine.add_runner(name, self)
        engine.set_milestone(name, ahead)

    def advance(self) -> Any:
        op = super().advance()
        if op is not None:
            op = self.current = dataclasses.replace(
                op, iteration=self.reports, batch=self.iteration
            )
        elif self.iteration % self.every == 0:  # trial.report, then the next step announced
            self.reports += 1
            # (the engine counts the iteration that just ended after this: one more)
            self.engine.set_milestone(self.name, self.ahead + 1)
        return op


def test_milestone_a_loop_reporting_later_than_announced_is_still_served() -> None:
    # a announced its report 2 ops ahead but reports after 4: past the 2 ops its
    # milestone_s is None at the same iteration (no result yet). It is due, not
    # committed: it keeps its slot and reaches its report at 4 s; then b and c, lent the
    # device (a, done, keeps the one slot): b, nearer its milestone after its first
    # iteration, before c. (Taken for committed, a would wait behind b and c: its
    # report at 8 s.)
    with Engine(["cpu"], policy=MilestonePolicy(slots_per_device=1), clock=ManualClock()) as eng:
        _LateLoop("a", eng, every=4, ahead=2)
        for name in "bc":
            eng.add_runner(name, ScriptedRunner(name, "L0[0]", durations=1.0))
            eng.set_milestone(name, 2)
        got = play(eng, {"a": 4, "b": 2, "c": 2})
    assert " ".join(f"{op.task}{op.batch}" for _, _, op, _ in got.ops) == (
        "a0 a1 a2 a3 b0 b0 c0 c0"
    )
    assert [op.iteration for _, _, op, _ in got.ops[:4]] == [0, 0, 0, 0]
