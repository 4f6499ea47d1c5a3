"""The scheduling simulation (tune_hydra.core.simulate, run by benchmarks/simulate.py)
drives the real policy classes."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Sequence
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
