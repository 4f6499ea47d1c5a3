"""The scheduling simulation (tune_hydra.core.simulate, run by benchmarks/simulate.py)
drives the real policy classes."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from types import ModuleType

import pytest

from tune_hydra.core import simulate as sim
from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.policies import POLICIES, BasePolicy, Candidate
from tune_hydra.core.program import Program
from tune_hydra.exceptions import ScheduleError

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tune_hydra_bench_simulate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


QUICK = sim.make_tasks(20, seed=0, epochs=(1, 3))


def test_task_ops_are_the_programs_batches() -> None:
    for t in QUICK:
        program = Program(t.name, t.shards)
        per_batch = program.ops_per_batch
        assert len(t.ops) % per_batch == 0
        for j in range(0, len(t.ops), per_batch):
            first = t.ops[j]
            assert list(t.ops[j : j + per_batch]) == program.batch_ops(first.iteration, first.batch)
        seen = [(op.iteration, op.batch) for op in t.ops[::per_batch]]
        epochs = seen[-1][0] + 1
        batches = len(seen) // epochs
        assert seen == [(it, b) for it in range(epochs) for b in range(batches)]


def test_workload_is_seeded_and_mixed() -> None:
    tasks = sim.make_tasks(100, seed=0)
    assert [t.costs for t in tasks] == [t.costs for t in sim.make_tasks(100, seed=0)]
    assert {t.shards for t in tasks} <= set(range(2, 17))
    assert min(t.shards for t in tasks) == 2 and max(t.shards for t in tasks) == 16
    assert all(c > 0 for t in tasks for c in t.costs)
    assert max(t.work for t in tasks) > 20 * min(t.work for t in tasks)


def test_lower_bound() -> None:
    a = sim.SimTask("a", 2, tuple(Program("a", 2).batch_ops(0, 0)), (1.0, 2.0, 3.0))
    b = sim.SimTask("b", 2, tuple(Program("b", 2).batch_ops(0, 0)), (1.0, 1.0, 1.0))
    assert sim.lower_bound([a, b], 1) == pytest.approx(9.0)
    assert sim.lower_bound([a, b], 2) == pytest.approx(6.0)  # the longest task
    result = sim.simulate("lrtf", 2, [a, b])
    assert result.makespan == pytest.approx(6.0)


@pytest.mark.parametrize("devices", [1, 4, 16, 32])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_schedules_are_valid(policy: str, devices: int) -> None:
    result = sim.simulate(policy, devices, QUICK, noise=0.2)
    sim.validate_schedule(QUICK, result)  # order, sequential tasks, one op per device
    assert len(result.schedule) == sum(len(t.ops) for t in QUICK)
    assert {e.device for e in result.schedule} <= set(range(devices))
    assert result.makespan >= sim.lower_bound(QUICK, devices) - 1e-9
    work = sum(t.work for t in QUICK)
    assert sum(e.end - e.start for e in result.schedule) == pytest.approx(work)


@pytest.mark.parametrize("devices", [4, 8, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lrtf_within_5_percent_of_lower_bound(seed: int, devices: int) -> None:
    tasks = sim.make_tasks(20, seed=seed, epochs=(1, 3))
    bound = sim.lower_bound(tasks, devices)
    lrtf = sim.simulate("lrtf", devices, tasks).makespan
    assert lrtf <= 1.05 * bound, f"LRTF {lrtf / bound:.3f}x the lower bound"
    for other in ("fifo", "round_robin"):
        assert lrtf <= sim.simulate(other, devices, tasks).makespan + 1e-9


def test_simulation_is_deterministic() -> None:
    a = sim.simulate("lrtf", 4, QUICK, noise=0.3, seed=5)
    b = sim.simulate("lrtf", 4, QUICK, noise=0.3, seed=5)
    assert a.schedule == b.schedule


def test_lrtf_affinity_keeps_tasks_on_their_device() -> None:
    lrtf = sim.simulate("lrtf", 4, QUICK)
    fifo = sim.simulate("fifo", 4, QUICK)
    assert lrtf.moves < fifo.moves / 4


def test_validate_schedule_catches_errors() -> None:
    result = sim.simulate("fifo", 4, QUICK)
    sched = result.schedule
    # Two operations on one device at once: move an op onto a device that is busy then.
    a, b = next(
        (a, b)
        for a in sched
        for b in sched
        if a.device != b.device and a.op.task != b.op.task and b.start < a.end and a.start < b.end
    )
    moved = [dataclasses.replace(e, device=a.device) if e is b else e for e in sched]
    with pytest.raises(ScheduleError, match="at once"):
        sim.validate_schedule(QUICK, dataclasses.replace(result, schedule=moved))
    # A task's operations out of order.
    first, second = (
        sched[0],
        next(e for e in sched if e.op.task == sched[0].op.task and e != sched[0]),
    )
    swapped = [
        dataclasses.replace(e, op=second.op) if e is first
        else dataclasses.replace(e, op=first.op) if e is second
        else e
        for e in sched
    ]  # fmt: skip
    with pytest.raises(ScheduleError, match="mismatch"):
        sim.validate_schedule(QUICK, dataclasses.replace(result, schedule=swapped))
    # A missing operation.
    with pytest.raises(ScheduleError, match="ran"):
        sim.validate_schedule(QUICK, dataclasses.replace(result, schedule=sched[:-1]))


class ShortestFirst(BasePolicy):
    name = "srtf"

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        return min(candidates, key=lambda c: (c.remaining_s, c.order))

    def forget(self, task: str) -> None:
        self.forgotten.append(task)


def test_custom_policy_instance_runs() -> None:
    policy = ShortestFirst()
    result = sim.simulate(policy, 4, QUICK)
    sim.validate_schedule(QUICK, result)
    assert sorted(policy.forgotten) == sorted(t.name for t in QUICK)
    assert result.policy == "srtf"


class Foreign(BasePolicy):
    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        return Candidate(Op("nobody", OpKind.FORWARD, 0), 1.0, False, 0.0, 99)


class Lazy(BasePolicy):
    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        return None


class Stale(BasePolicy):
    """Returns a candidate for the right task but a different operation."""

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        c = candidates[0]
        return dataclasses.replace(c, op=dataclasses.replace(c.op, shard=c.op.shard + 1))


@pytest.mark.parametrize("policy", [Foreign(), Stale()])
def test_policy_returning_something_not_offered_fails_clearly(policy: BasePolicy) -> None:
    with pytest.raises(ScheduleError, match="not offered"):
        sim.simulate(policy, 2, QUICK)


def test_policy_leaving_every_device_idle_fails_instead_of_hanging() -> None:
    with pytest.raises(ScheduleError, match="idle"):
        sim.simulate(Lazy(), 2, QUICK)


def test_main_quick(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    assert _load().main(["--quick", "--plot", str(png), "--trace", str(js)]) == 0
    out = capsys.readouterr().out
    for word in ("lrtf", "fifo", "round_robin", "/bound", "4 devices", "16 devices"):
        assert word in out
    assert png.read_bytes()[:4] == b"\x89PNG" and js.stat().st_size > 0


# --- a search with early stopping ---------------------------------------------------------

SEARCH_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "search_sim.py"
SEARCH = sim.make_search(16, seed=1, max_t=9)


def _load_search_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tune_hydra_bench_search_sim", SEARCH_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _check_search(trials: Sequence[sim.SearchTrial], result: sim.SearchResult) -> None:
    """Each trial ran a prefix of its ops, in order, one at a time, ending at an
    iteration's end (stopped there) or at max_t; no device ran two ops at once."""
    by_task: dict[str, list[sim.SimEvent]] = {}
    for e in result.schedule:
        by_task.setdefault(e.op.task, []).append(e)
    stopped = 0
    for t in trials:
        mine = sorted(by_task[t.name], key=lambda e: e.start)
        assert tuple(e.op for e in mine) == t.ops[: len(mine)]
        assert len(mine) in t.iteration_ends
        stopped += len(mine) < len(t.ops)
        for a, b in pairwise(mine):
            assert b.start >= a.end
        for e, cost in zip(mine, t.costs, strict=False):
            assert e.end - e.start == pytest.approx(cost)
    assert stopped == result.stopped
    by_device: dict[int, list[sim.SimEvent]] = {}
    for e in result.schedule:
        by_device.setdefault(e.device, []).append(e)
    for events in by_device.values():
        events.sort(key=lambda e: e.start)
        for a, b in pairwise(events):
            assert b.start >= a.end - 1e-12
    assert result.total_work_s == pytest.approx(sum(e.end - e.start for e in result.schedule))
    assert result.makespan == pytest.approx(max(e.end for e in result.schedule))
    rule = sim.RULES[result.rule](len(trials[0].iteration_ends))
    losers = rule.hindsight(trials)
    assert result.loser_work_s == pytest.approx(
        sum(e.end - e.start for e in result.schedule if e.op.task in losers)
    )
    assert result.hindsight_stopped_s == pytest.approx(
        sum(t.costs_to(losers[t.name]) for t in trials if t.name in losers)
    )


def test_search_workload_is_seeded_with_crossing_curves() -> None:
    again = sim.make_search(16, seed=1, max_t=9)
    assert [t.losses for t in again] == [t.losses for t in SEARCH]
    assert all(len(t.losses) == len(t.iteration_ends) == 9 for t in SEARCH)
    first = sorted(SEARCH, key=lambda t: t.losses[0])
    last = sorted(SEARCH, key=lambda t: t.losses[-1])
    assert first != last, "early results only hint at the final ones"
    costs = [t.work for t in SEARCH]
    assert max(costs) > 2 * min(costs)


@pytest.mark.parametrize("rule", sorted(sim.RULES))
@pytest.mark.parametrize("policy", [*sorted(POLICIES), "auto"])
def test_search_schedules_are_valid(policy: str, rule: str) -> None:
    result = sim.simulate_search(policy, 3, SEARCH, sim.RULES[rule](9))
    _check_search(SEARCH, result)
    if rule == "fixed":
        assert result.stopped == 0 and result.stopped_work_s == 0.0
    else:
        assert 0 < result.stopped < len(SEARCH)
    assert result.first_result_s <= result.rung1_s <= result.makespan
    assert result.best_done_s <= result.makespan


def test_asha_rule_is_rays() -> None:
    rule = sim.ASHARule(27, grace=1, eta=3)
    assert rule.rungs == [1, 3, 9]
    assert [rule.next_after(i) for i in (0, 1, 2, 3, 9)] == [1, 3, 3, 9, None]
    assert rule.report("a", 1, 5.0) is False  # nothing recorded: continue
    assert rule.report("b", 1, 6.0) is True  # worse than the best third of {5}
    assert rule.report("c", 1, 4.0) is False
    # The cut is numpy's linear percentile 100/eta of what was recorded: {5, 6, 4} -> 4.667.
    assert rule.report("d", 1, 4.6) is False and rule.report("e", 1, 4.7) is True
    assert rule.report("a", 2, 99.0) is False  # not a rung
    np = pytest.importorskip("numpy")
    values = [0.3, 1.7, 0.2, 5.0, 2.2]
    for q in (0.0, 33.3, 50.0, 100.0):
        assert sim._percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_median_rule_is_rays_on_iterations() -> None:
    rule = sim.MedianRule(9, grace=2, min_samples=2)
    assert [rule.next_after(i) for i in (0, 1, 2, 7, 8)] == [2, 2, 3, 8, None]
    for name, losses in (("a", [1.0, 1.0]), ("b", [3.0, 3.0])):
        for t, loss in enumerate(losses, 1):
            assert rule.report(name, t, loss) is False  # too few others
    # Others' running means at 2: a 1.0, b 3.0 -> median 2.0.
    assert rule.report("c", 1, 2.5) is False  # before the grace period
    assert rule.report("c", 2, 2.4) is True  # best 2.4 > 2.0
    assert rule.report("d", 1, 5.0) is False and rule.report("d", 2, 1.5) is False


def test_hindsight_is_synchronous_halving() -> None:
    rule = sim.ASHARule(9, grace=1, eta=3)
    stop = rule.hindsight(SEARCH)
    kept_after_1 = [t for t in SEARCH if stop.get(t.name) != 1]
    assert len(kept_after_1) == pytest.approx(len(SEARCH) / 3, abs=1)
    assert set(stop.values()) <= {1, 3}


def test_fixed_budget_milestone_and_auto_are_lrtf() -> None:
    lrtf = sim.simulate_search("lrtf", 3, SEARCH, sim.StopRule(9))
    for policy in ("milestone", "auto"):
        got = sim.simulate_search(policy, 3, SEARCH, sim.StopRule(9))
        assert got.schedule == lrtf.schedule


@pytest.mark.parametrize("devices", [2, 8])
def test_search_aware_policy_meets_the_issue_targets(devices: int) -> None:
    """#21's targets for auto over 3 seeds of K=64: ceil(K/3) rung-1 results at
    <= 0.6x LRTF's time, makespan <= 1.10x (early stopping) and 1.00x (fixed budgets);
    work past the hindsight decisions <= 0.6x."""
    table = sim.search_table([64], [devices], seeds=3)
    for rule in ("asha", "median"):
        auto = table[(64, devices, rule, "auto")]
        assert auto["rung1_s"] <= 0.6, (rule, auto["rung1_s"])
        assert auto["misled_work_s"] <= 0.6, (rule, auto["misled_work_s"])
        assert auto["makespan"] <= 1.10, (rule, auto["makespan"])
        # Less spent on the trials full evidence stops (the same trials in each run).
        assert auto["loser_work_s"] < 1.0, (rule, auto["loser_work_s"])
    # Why "stopped work <= 0.6x LRTF's" is out of reach with ASHA: what full-evidence
    # decisions spend on stopped trials (each stopped at its hindsight rung) is already
    # above LRTF's stopped work, which stays low by running trials past rungs unjudged.
    asha = table[(64, devices, "asha", "auto")]
    assert asha["stopped_floor"] > 1.0, asha["stopped_floor"]
    assert asha["stopped_work_s"] <= 1.05 * asha["stopped_floor"]
    assert table[(64, devices, "fixed", "auto")]["makespan"] == pytest.approx(1.0)


def test_search_sim_quick(capsys: pytest.CaptureFixture[str]) -> None:
    rc = _load_search_script().main(["--quick"])
    out = capsys.readouterr().out
    for word in ("fifo", "lrtf", "milestone", "auto", "K/eta@r1", "makespan", "asha", "median"):
        assert word in out
    assert "targets for auto" in out
    assert rc == (1 if "missed:" in out else 0)
