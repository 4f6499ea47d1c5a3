"""Dispatch decisions as data (``tune_hydra.core.dispatch``), without threads or sleeps:
the one candidate builder, the policy offered every ready op, non-fitting choices refused,
and the engine's dispatcher deciding as the simulator does."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any, cast

import pytest

from tune_hydra.core import simulate as sim
from tune_hydra.core.dispatch import decide, offer
from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.policies import (
    POLICIES,
    BasePolicy,
    Candidate,
    LRTFPolicy,
    RoundRobinPolicy,
    get_policy,
)
from tune_hydra.exceptions import ScheduleError


def op(task: str, shard: int = 0) -> Op:
    return Op(task, OpKind.FORWARD, shard, 0, 0)


def cand(order: int, remaining: float = 1.0, fits: bool = True, **facts: Any) -> Candidate:
    return offer(op(f"t{order}"), remaining, ready_since=0.0, order=order, fits=fits, **facts)


class Greedy(BasePolicy):
    """Sees every ready op (fitting or not) and takes the longest: a policy bug."""

    name = "greedy"

    def __init__(self) -> None:
        self.seen: list[Candidate] = []

    def select(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        self.seen = list(candidates)
        return self.choose(device, candidates)

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        return max(candidates, key=lambda c: c.remaining_s)


class Patient(Greedy):
    """Waits for the longest op when it does not fit yet (what the filter could not do)."""

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        longest = max(candidates, key=lambda c: c.remaining_s)
        return longest if longest.fits else None


# --- the builder ------------------------------------------------------------------------


def test_offer_fills_every_fact_with_defaults_for_no_device() -> None:
    c = offer(op("a"), 3.0, ready_since=1.5, order=2)
    assert c == Candidate(op("a"), 3.0, False, 1.5, 2, True, True, 0, None)
    assert (c.resident, c.in_host, c.fits, c.bring_in_bytes, c.milestone_s) == (
        False,
        True,
        True,
        0,
        None,
    )
    full = offer(
        op("a"),
        3.0,
        ready_since=0.0,
        order=0,
        resident=True,
        in_host=False,
        fits=False,
        bring_in_bytes=1 << 20,
        milestone_s=4.0,
    )
    assert (full.resident, full.in_host, full.fits, full.bring_in_bytes, full.milestone_s) == (
        True,
        False,
        False,
        1 << 20,
        4.0,
    )


def test_candidate_keeps_its_positional_fields() -> None:
    """Policies written against the five-field candidate still build it the same way."""
    c = Candidate(op("a"), 2.0, True, 0.5, 3)
    assert (c.op, c.remaining_s, c.resident, c.ready_since, c.order) == (op("a"), 2.0, True, 0.5, 3)
    assert c.fits and c.in_host and c.bring_in_bytes == 0 and c.milestone_s is None


# --- offer -> choose -> validate ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_default_policies_decide_as_the_old_prefilter_did(name: str) -> None:
    """Every built-in policy, offered every ready op, picks what it picked when the
    dispatcher dropped the ops that did not fit before asking it (stateful ones too)."""
    rng = random.Random(0)
    new, old = get_policy(name), get_policy(name)
    for _ in range(300):
        cands = [
            cand(
                k,
                rng.choice([1.0, 5.0, 5.1, 9.0, rng.uniform(0, 10)]),
                fits=rng.random() < 0.7,
                resident=rng.random() < 0.3,
                in_host=rng.random() < 0.8,
            )
            for k in rng.sample(range(12), rng.randint(1, 6))
        ]
        fitting = [c for c in cands if c.fits]
        want = old.choose(0, fitting) if fitting else None
        got = decide(new, 0, cands)
        assert (None if got is None else cands[got]) is want


def test_lrtf_offered_a_longer_op_that_does_not_fit_runs_one_that_does() -> None:
    cands = [cand(0, 100.0, fits=False), cand(1, 10.0), cand(2, 5.0)]
    assert decide(LRTFPolicy(), 0, cands) == 1


def test_nothing_fits_leaves_the_device_idle_without_asking_choose() -> None:
    rr = RoundRobinPolicy()
    assert decide(rr, 0, [cand(0, fits=False), cand(1, fits=False)]) is None
    assert rr._last == -1  # choose never ran: its state is untouched


def test_a_policy_may_see_every_op_and_wait_for_one_that_does_not_fit() -> None:
    patient = Patient()
    cands = [cand(0, 100.0, fits=False, bring_in_bytes=4096), cand(1, 10.0)]
    assert decide(patient, 0, cands) is None
    assert patient.seen == cands  # offered both, with the memory facts
    assert decide(patient, 0, [dataclasses.replace(cands[0], fits=True), cands[1]]) == 0


def test_choosing_an_op_that_does_not_fit_is_a_clear_error() -> None:
    with pytest.raises(ScheduleError, match=r"t0:F0\[0\] for device 3, where it does not fit"):
        decide(Greedy(), 3, [cand(0, 100.0, fits=False), cand(1, 10.0)])


def test_choosing_something_not_offered_is_a_clear_error() -> None:
    class Stale(BasePolicy):
        def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
            return dataclasses.replace(candidates[0])  # equal, but not the one offered

    with pytest.raises(ScheduleError, match="not offered"):
        decide(Stale(), 0, [cand(0)])


# --- the engine's dispatcher, on stub records (no threads) ------------------------------


@dataclasses.dataclass
class Store:
    state_bytes: int = 1000
    on_disk: bool = False
    resident: bool = False  # the stub device holds it
    too_big: bool = False  # would not fit beside the op queued on the stub device


@dataclasses.dataclass
class Shard:
    store: Store


@dataclasses.dataclass
class Runner:
    current: Op | None
    shards: list[Shard]

    def store_of(self, shard: int) -> Store:  # the Runner protocol's (engine/protocol.py)
        return self.shards[shard].store


@dataclasses.dataclass
class Entry:
    name: str
    order: int
    runner: Runner
    remaining: float
    ready_since: float = 0.0
    assigned: Any = None
    error: BaseException | None = None
    cancelled: bool = False
    candidate: Candidate | None = None
    known_n: int = 1
    offered_s: float = 0.0

    def remaining_s(self, default_op_s: float = 1.0) -> float:
        return self.remaining

    def milestone_s(self, default_op_s: float = 1.0) -> float | None:
        return None


@dataclasses.dataclass
class Worker:
    index: int = 0
    copy: bool = True
    last_task: str | None = None
    assigned: list[Any] = dataclasses.field(default_factory=list)

    def holds(self, store: Store) -> bool:
        return store.resident

    def fits(self, store: Store) -> bool:
        return not store.too_big


@dataclasses.dataclass
class Flag:
    active: bool = False
    blocked: set[str] = dataclasses.field(default_factory=set)

    def blocks(self, e: Entry, op: Op, w: Worker) -> bool:
        return e.name in self.blocked


class EngineStub:
    """Just what ``Dispatcher._fill`` / ``Dispatcher._offer`` read, and an ``_assign`` that
    records its decision instead of handing the op to a worker thread."""

    def __init__(self, policy: BasePolicy, entries: list[Entry], kept: Flag | None = None):
        from tune_hydra.engine.dispatch.dispatcher import Dispatcher

        self._fill = lambda w: Dispatcher._fill(cast(Any, self), w)
        self._offer = lambda e, op, w, d: Dispatcher._offer(cast(Any, self), e, op, w, d)
        self.policy = policy
        self._tasks = {e.name: e for e in entries}
        self._op_sum, self._op_n = 0.0, 0
        self._kept = kept or Flag()
        self.host = Flag()
        self.batcher = None  # Engine(batch_shared=False)
        self.assigned: list[Op] = []
        self.clock = lambda: 0.0
        from tune_hydra.engine.dispatch.anticipate import Anticipation

        self._waits = Anticipation()  # no device waits for a loop here

    def _assign(self, w: Worker, entry: Entry, op: Op) -> None:
        self.assigned.append(op)


def entry(order: int, remaining: float, **store: Any) -> Entry:
    name = f"t{order}"
    return Entry(name, order, Runner(op(name), [Shard(Store(**store))]), remaining)


def test_engine_offers_every_ready_op_with_its_memory_facts() -> None:
    big = entry(0, 100.0, state_bytes=4096, too_big=True)
    small = entry(1, 10.0, resident=True)
    w = Worker(assigned=[object()])  # an op queued there: t0's shard would not fit beside it
    policy = Patient()
    engine = EngineStub(policy, [big, small])
    assert engine._fill(w) is True  # a task was ready: the dispatch goes on
    assert engine.assigned == []  # the patient policy waits for the big one
    seen = {c.op.task: c for c in policy.seen}
    assert (seen["t0"].fits, seen["t0"].resident, seen["t0"].bring_in_bytes) == (False, False, 4096)
    assert (seen["t1"].fits, seen["t1"].resident, seen["t1"].bring_in_bytes) == (True, True, 0)

    default = EngineStub(LRTFPolicy(), [big, small])
    default._fill(w)
    assert default.assigned == [op("t1")]  # as the old pre-filter: the one that fits
    with pytest.raises(ScheduleError, match="does not fit"):
        EngineStub(Greedy(), [big, small])._fill(w)


def test_engine_kept_graph_block_is_a_fact_not_a_filter() -> None:
    a, b = entry(0, 100.0), entry(1, 10.0)
    engine = EngineStub(Greedy(), [a, b], kept=Flag(active=True, blocked={"t0"}))
    with pytest.raises(ScheduleError, match="does not fit"):
        engine._fill(Worker())
    assert [c.fits for c in cast(Greedy, engine.policy).seen] == [False, True]
    lrtf = EngineStub(LRTFPolicy(), [a, b], kept=Flag(active=True, blocked={"t0"}))
    lrtf._fill(Worker())
    assert lrtf.assigned == [op("t1")]


def test_engine_with_no_ready_task_stops_the_dispatch() -> None:
    a = entry(0, 1.0)
    a.runner.current = None
    assert EngineStub(LRTFPolicy(), [a])._fill(Worker()) is False


def test_engine_builds_one_candidate_and_reuses_it_while_true() -> None:
    a = entry(0, 5.0)
    engine = EngineStub(LRTFPolicy(), [a])
    w = Worker(copy=False, last_task="t0")
    first = engine._offer(a, a.runner.current, w, 1.0)
    assert first.resident and first.fits and first.bring_in_bytes == 0  # CPU: computes in place
    assert engine._offer(a, a.runner.current, w, 1.0) is first
    w.last_task = "other"
    assert not engine._offer(a, a.runner.current, w, 1.0).resident  # rebuilt: a fact changed
    ranking = engine._offer(a, a.runner.current, None, 1.0)  # for no device
    assert (ranking.resident, ranking.fits, ranking.bring_in_bytes) == (False, True, 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("devices", [1, 3])
def test_engine_and_simulator_decide_alike(name: str, devices: int) -> None:
    """Every decision of a simulated run, replayed through the engine's dispatcher with
    the same facts (a device that "holds" a task's shard where the simulator calls it
    resident), picks the same op, with the policy's state evolving alike."""
    log: list[tuple[int, list[Candidate], Candidate | None]] = []

    class Recording(BasePolicy):
        def __init__(self, inner: BasePolicy) -> None:
            self.inner, self.name = inner, inner.name

        def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
            pick = self.inner.choose(device, candidates)
            log.append((device, list(candidates), pick))
            return pick

    tasks = sim.make_tasks(6, seed=3, shards=(2, 4), epochs=(1, 2), batches=(1, 2))
    result = sim.simulate(Recording(get_policy(name)), devices, tasks)
    sim.validate_schedule(tasks, result)
    assert len(log) == result.decisions and log
    replay = get_policy(name)
    for device, cands, pick in log:
        entries = []
        for c in cands:
            e = entry(c.order, c.remaining_s, resident=c.resident)
            e.runner.current, e.name, e.ready_since = c.op, c.op.task, c.ready_since
            e.runner.shards *= c.op.shard + 1  # the op's shard, index c.op.shard
            entries.append(e)
        engine = EngineStub(replay, entries)
        engine._fill(Worker(index=device))
        assert engine.assigned == ([] if pick is None else [pick.op])
