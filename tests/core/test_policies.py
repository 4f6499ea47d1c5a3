"""Unit tests of the scheduling policies against mock candidates."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence

import pytest

from tune_hydra.core.dispatch import offer
from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.policies import (
    POLICIES,
    BasePolicy,
    Candidate,
    FIFOPolicy,
    LRTFPolicy,
    MilestonePolicy,
    RoundRobinPolicy,
    get_policy,
    resolve_policy,
)
from tune_hydra.exceptions import TuneHydraError, UnknownPolicyError


def cand(
    order: int,
    remaining: float = 1.0,
    resident: bool = False,
    ready: float = 0.0,
    kind: OpKind = OpKind.FORWARD,
    shard: int = 0,
) -> Candidate:
    """A mock candidate for task ``t<order>``."""
    return Candidate(Op(f"t{order}", kind, shard, 0, 0), remaining, resident, ready, order)


def picked(policy: BasePolicy, candidates: Sequence[Candidate], device: int = 0) -> int:
    choice = policy.choose(device, list(candidates))
    assert choice is not None
    assert any(choice is c for c in candidates), "a policy must return one of its candidates"
    return choice.order


# --- LRTF -------------------------------------------------------------------------------


def test_lrtf_picks_longest_remaining() -> None:
    cands = [cand(0, 3.0), cand(1, 10.0), cand(2, 7.0), cand(3, 0.5)]
    assert picked(LRTFPolicy(), cands) == 1
    random.Random(0).shuffle(cands)
    assert picked(LRTFPolicy(), cands) == 1


def test_lrtf_ties_go_to_first_registered() -> None:
    assert picked(LRTFPolicy(), [cand(2, 5.0), cand(1, 5.0), cand(3, 5.0)]) == 1


def test_lrtf_affinity_prefers_resident_within_5_percent() -> None:
    policy = LRTFPolicy()
    assert policy.affinity == pytest.approx(0.05)
    assert picked(policy, [cand(0, 100.0), cand(1, 96.0, resident=True)]) == 1
    # 6% shorter: outside the affinity band, the longest wins.
    assert picked(policy, [cand(0, 100.0), cand(1, 94.0, resident=True)]) == 0
    # Several resident within the band: the longest of them.
    cands = [cand(0, 100.0), cand(1, 97.0, resident=True), cand(2, 99.0, resident=True)]
    assert picked(policy, cands) == 2
    # The longest is itself resident: it wins.
    assert picked(policy, [cand(0, 100.0, resident=True), cand(1, 99.0, resident=True)]) == 0


def test_lrtf_prefers_a_state_in_host_memory_within_the_band() -> None:
    on_disk = dataclasses.replace(cand(0, 100.0), in_host=False)
    assert picked(LRTFPolicy(), [on_disk, cand(1, 97.0)]) == 1
    # 6% shorter: outside the band, the longest wins though its state is on disk.
    assert picked(LRTFPolicy(), [on_disk, cand(1, 94.0)]) == 0
    # Resident on the device still comes first.
    resident = dataclasses.replace(cand(2, 96.0, resident=True), in_host=False)
    assert picked(LRTFPolicy(), [on_disk, cand(1, 97.0), resident]) == 2


def test_rank_orders_without_deciding() -> None:
    cands = [cand(0, 3.0, ready=2.0), cand(1, 10.0, ready=5.0), cand(2, 7.0, ready=1.0)]
    assert [c.order for c in LRTFPolicy().rank(cands)] == [1, 2, 0]
    assert [c.order for c in FIFOPolicy().rank(cands)] == [2, 0, 1]  # the longest waiting
    robin = RoundRobinPolicy()
    robin.rank(cands)
    assert picked(robin, cands) == 0  # ranking left its turn where it was


def test_lrtf_affinity_zero_only_breaks_exact_ties() -> None:
    policy = LRTFPolicy(affinity=0.0)
    assert picked(policy, [cand(0, 100.0), cand(1, 99.9, resident=True)]) == 0
    assert picked(policy, [cand(0, 100.0), cand(1, 100.0, resident=True)]) == 1


@pytest.mark.parametrize("affinity", [-0.1, 1.0, 2.0])
def test_lrtf_rejects_bad_affinity(affinity: float) -> None:
    with pytest.raises(ValueError, match="affinity"):
        LRTFPolicy(affinity=affinity)


def test_lrtf_single_candidate_and_zero_remaining() -> None:
    assert picked(LRTFPolicy(), [cand(4, 0.0)]) == 4
    assert picked(LRTFPolicy(), [cand(0, 0.0), cand(1, 0.0, resident=True)]) == 1


# --- FIFO -------------------------------------------------------------------------------


def test_fifo_picks_oldest_ready() -> None:
    cands = [cand(0, 9.0, ready=3.0), cand(1, 1.0, ready=1.0), cand(2, 5.0, ready=2.0)]
    assert picked(FIFOPolicy(), cands) == 1


def test_fifo_ties_go_to_first_registered_and_ignore_residency() -> None:
    cands = [cand(3, ready=1.0), cand(2, ready=1.0, resident=True), cand(1, ready=1.0)]
    assert picked(FIFOPolicy(), cands) == 1


# --- round robin ------------------------------------------------------------------------


def test_round_robin_cycles_in_registration_order() -> None:
    policy = RoundRobinPolicy()
    cands = [cand(2), cand(0), cand(1)]
    assert [picked(policy, cands) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_skips_absent_tasks_and_wraps() -> None:
    policy = RoundRobinPolicy()
    assert picked(policy, [cand(0), cand(1), cand(2), cand(3)]) == 0
    assert picked(policy, [cand(0), cand(2), cand(3)]) == 2  # 1 is not ready: skipped
    assert picked(policy, [cand(0), cand(1)]) == 0  # nothing after 2: wrap around
    assert picked(policy, [cand(3)]) == 3
    assert picked(policy, [cand(1), cand(2)]) == 1


def test_round_robin_ignores_remaining_and_residency() -> None:
    policy = RoundRobinPolicy()
    cands = [cand(0, 1.0), cand(1, 100.0, resident=True)]
    assert picked(policy, cands) == 0


def test_round_robin_state_is_per_instance() -> None:
    a, b = RoundRobinPolicy(), RoundRobinPolicy()
    cands = [cand(0), cand(1)]
    assert picked(a, cands) == 0
    assert picked(b, cands) == 0


# --- registry and custom policies -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_get_policy_by_name(name: str) -> None:
    policy = get_policy(name)
    assert isinstance(policy, POLICIES[name])
    assert policy.name == name
    assert get_policy(name) is not policy, "each call builds a fresh (stateful) instance"


def test_get_policy_names_and_classes() -> None:
    assert {
        "lrtf": LRTFPolicy,
        "fifo": FIFOPolicy,
        "round_robin": RoundRobinPolicy,
        "milestone": MilestonePolicy,
    } == POLICIES


@pytest.mark.parametrize("bad", ["LRTF ", "srtf", "", 3, None])
def test_get_policy_unknown_lists_valid_names(bad: object) -> None:
    with pytest.raises(UnknownPolicyError) as info:
        get_policy(bad)  # type: ignore[arg-type]
    message = str(info.value)
    for name in POLICIES:
        assert name in message
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, TuneHydraError)


class ShortestFirst(BasePolicy):
    name = "srtf"

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        return min(candidates, key=lambda c: (c.remaining_s, c.order))

    def forget(self, task: str) -> None:
        self.forgotten.append(task)


def test_custom_policy_instance_is_accepted_as_is() -> None:
    policy = ShortestFirst()
    assert get_policy(policy) is policy
    assert picked(policy, [cand(0, 5.0), cand(1, 2.0)]) == 1
    for builtin in (LRTFPolicy(0.1), FIFOPolicy(), RoundRobinPolicy()):
        assert get_policy(builtin) is builtin


def test_base_policy_is_abstract_and_forget_is_optional() -> None:
    with pytest.raises(TypeError):
        BasePolicy()  # type: ignore[abstract]
    FIFOPolicy().forget("anything")  # default hook: no error
    assert repr(LRTFPolicy(0.1)) == "LRTFPolicy(affinity=0.1)"
    assert repr(FIFOPolicy()) == "FIFOPolicy()"


# --- milestone first, with admission ------------------------------------------------------


def mcand(
    order: int,
    milestone: float | None,
    remaining: float = 100.0,
    iteration: int = 0,
    fits: bool = True,
    resident: bool = False,
    in_host: bool = True,
) -> Candidate:
    """Trial ``t<order>``'s ready op with ``milestone`` seconds to its next milestone."""
    return offer(
        Op(f"t{order}", OpKind.FORWARD, 0, iteration, 0),
        remaining,
        ready_since=0.0,
        order=order,
        resident=resident,
        in_host=in_host,
        fits=fits,
        milestone_s=milestone,
    )


def sel(policy: BasePolicy, candidates: Sequence[Candidate], device: int = 0) -> int | None:
    choice = policy.select(device, list(candidates))
    if choice is None:
        return None
    assert any(choice is c for c in candidates)
    return choice.order


def test_milestone_without_milestones_decides_exactly_as_lrtf() -> None:
    rng = random.Random(3)
    milestone, lrtf = MilestonePolicy(), LRTFPolicy()
    for _ in range(300):
        cands = [
            dataclasses.replace(
                cand(k, rng.uniform(0, 10), resident=rng.random() < 0.3),
                fits=rng.random() < 0.8,
                in_host=rng.random() < 0.7,
            )
            for k in range(rng.randint(1, 6))
        ]
        device = rng.randrange(3)
        assert milestone.select(device, cands) is lrtf.select(device, cands)
        assert milestone.rank(cands) == lrtf.rank(cands)
    assert milestone.admitted == []


def test_milestone_least_work_to_the_milestone_not_to_the_end() -> None:
    # t0 has the most work to its end (LRTF's pick), t1 the least to its milestone.
    cands = [mcand(0, 5.0, remaining=90.0), mcand(1, 1.0, remaining=50.0), mcand(2, 3.0)]
    assert sel(MilestonePolicy(), cands) == 1
    assert picked(LRTFPolicy(), cands) == 2


def test_milestone_admission_keeps_the_admitted_trials_going() -> None:
    policy = MilestonePolicy(slots_per_device=1)
    assert sel(policy, [mcand(k, 4.0) for k in range(4)], device=0) == 0
    assert sel(policy, [mcand(k, 4.0) for k in (1, 2, 3)], device=1) == 1
    assert policy.admitted == ["t0", "t1"] and policy.capacity == 2
    # t0 came back with work done: the others (less work to their milestone than t0
    # had when admitted) wait, though they are as close as t0 now.
    assert sel(policy, [mcand(0, 3.0), mcand(2, 3.0), mcand(3, 1.0)], device=0) == 0
    assert sel(policy, [mcand(1, 2.0), mcand(2, 0.5)], device=1) == 1
    assert policy.admitted == ["t0", "t1"]


def test_milestone_admission_never_idles_a_device() -> None:
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 4.0), mcand(1, 4.0)]) == 0
    # The admitted trial does not fit now: another one runs (the device never idles)...
    assert sel(policy, [mcand(0, 3.0, fits=False), mcand(1, 4.0)]) == 1
    # ... without being admitted, since the one slot is taken.
    assert policy.admitted == ["t0"]
    # Nothing fits: None (the dispatcher's rule).
    assert sel(policy, [mcand(0, 3.0, fits=False), mcand(1, 4.0, fits=False)]) is None
    # The admitted trial not ready at all (waiting for its search): same.
    assert sel(policy, [mcand(1, 4.0), mcand(2, 4.0)]) == 1
    assert policy.admitted == ["t0"]


def test_milestone_lent_slots_go_to_the_trial_nearest_its_milestone() -> None:
    """Every slot taken and the admitted trials not ready: the device is lent to the
    trial with the least work to its milestone (its result comes soonest, and a trial
    lent ops before goes on rather than waiting half-way), not breadth-first as
    admission picks."""
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 4.0), mcand(1, 4.0)]) == 0
    assert sel(policy, [mcand(1, 4.0), mcand(2, 1.0, iteration=2)]) == 2
    assert policy.admitted == ["t0"]
    policy.forget("t0")
    assert sel(policy, [mcand(1, 4.0), mcand(2, 1.0, iteration=2)]) == 1  # admission
    assert policy.admitted == ["t1"]


def test_milestone_trials_bound_for_their_end_finish_nearest_first() -> None:
    """A trial whose next milestone is its end (milestone_s equal to remaining_s: an
    adaptive searcher learns from finished trials) is admitted as a fresh one would be
    (level 0), nearest its end first: a fresh trial does not overtake it."""
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    cands = [mcand(0, 8.0, remaining=8.0), mcand(1, 3.0, remaining=3.0, iteration=2)]
    assert sel(policy, cands) == 1
    # With a rung ahead (less work to it than to its end), breadth-first as before.
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    cands = [mcand(0, 8.0, remaining=20.0), mcand(1, 3.0, remaining=9.0, iteration=2)]
    assert sel(policy, cands) == 0


def test_milestone_trial_leaves_admission_at_its_milestone() -> None:
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 2.0), mcand(1, 2.0)]) == 0
    # A new iteration with less work to the same milestone: still admitted.
    assert sel(policy, [mcand(0, 1.0, iteration=1), mcand(1, 2.0)]) == 0
    assert policy.admitted == ["t0"]
    # The next iteration with more to go: the front end moved its milestone on; t1,
    # fresh, is admitted in its place (the fewest iterations done).
    assert sel(policy, [mcand(0, 2.0, iteration=2), mcand(1, 2.0)]) == 1
    assert policy.admitted == ["t1"]
    # Committed (no milestone left) also leaves admission.
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 2.0), mcand(1, 2.0)]) == 0
    assert sel(policy, [mcand(0, None, iteration=1), mcand(1, 2.0)]) == 1
    assert policy.admitted == ["t1"]


def test_milestone_replaced_estimate_is_a_milestone_reached() -> None:
    """A result later with less than half as much to go: the front end replaced its
    estimate (a th.shard loop's first trial.report measures its steps: its milestone
    was announced far before). With half or more to go it is the same milestone."""
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 100.0), mcand(1, 100.0)]) == 0
    assert sel(policy, [mcand(0, 60.0, iteration=1), mcand(1, 100.0)]) == 0  # on its way
    assert policy.admitted == ["t0"]
    assert sel(policy, [mcand(0, 10.0, iteration=2), mcand(1, 100.0)]) == 1
    assert policy.admitted == ["t1"]


def test_milestone_due_trial_is_no_committed_one() -> None:
    """milestone_s None at the same iteration as its last op run with a milestone ahead:
    the count passed the milestone before the result came (a loop reporting later than
    announced). It is due: served as a trial with a milestone (no work left to it), not
    as committed work; a result later (a new iteration) it is committed (or moved on)."""
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 2.0), mcand(1, 3.0)]) == 0  # t0 admitted
    assert sel(policy, [mcand(1, 3.0), mcand(2, 4.0)]) == 1  # t1 lent the device
    # t0 due: keeps its slot and goes first; t3 (never run with a milestone) committed.
    cands = [mcand(0, None), mcand(2, 4.0), mcand(3, None, remaining=1.0)]
    assert sel(policy, cands) == 0
    assert policy.admitted == ["t0"]
    # t1 due too, not admitted: before the waiting t2 (no work left to its milestone).
    assert sel(policy, [mcand(1, None), mcand(2, 4.0), mcand(3, None, remaining=1.0)]) == 1
    assert [c.order for c in policy.rank([mcand(3, None), mcand(2, 4.0), mcand(1, None)])] == [
        1,
        2,
        3,
    ]
    # A result later with no milestone: committed, and t0 leaves admission.
    assert sel(policy, [mcand(0, None, iteration=1), mcand(2, 4.0)]) == 2
    assert policy.admitted == ["t2"]


def test_milestone_overdue_trial_leaves_admission() -> None:
    """A trial whose milestone never comes (its front end moves the milestone on without
    an iteration ending, as a th.shard loop's trial.report does, or it reports less often
    than announced) keeps its slot only for the work it was admitted for, plus the
    slack: then the waiting trial is admitted."""
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 4.0), mcand(1, 4.0)]) == 0
    for m in (3.0, 2.0, 1.0, 4.0, 3.0):  # 4 s of work done, then moved on to 4.0 again
        assert sel(policy, [mcand(0, m), mcand(1, 4.0)]) == 0
    assert policy.admitted == ["t0"]  # 4 s done of the 4 s (+25%) it was admitted for
    # 6 s done > 5 s: overdue. t1 (waiting) is admitted in its place.
    assert sel(policy, [mcand(0, 1.0), mcand(1, 4.0)]) == 1
    assert policy.admitted == ["t1"]
    # Lent the device while t1 waits for its search, t0 (overdue) runs after t2 (waiting).
    assert sel(policy, [mcand(0, 1.0), mcand(2, 4.0)]) == 2
    assert [c.order for c in policy.rank([mcand(0, 1.0), mcand(2, 4.0)])] == [2, 0]
    # t1 at its milestone: t0 is admitted again (at a lower level than t1's next rung).
    assert sel(policy, [mcand(0, 1.0), mcand(1, 4.0, iteration=1)]) == 0
    assert policy.admitted == ["t0"]


def test_milestone_tenure_counts_only_work_done() -> None:
    # Estimates that go up (measured slower) and back down spend no tenure beyond the
    # work the milestone_s went down by: a trial walking to its milestone stays admitted.
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 4.0), mcand(1, 4.0)]) == 0
    for m in (3.5, 3.8, 3.0, 2.0, 2.2, 1.0, 0.5):
        assert sel(policy, [mcand(0, m), mcand(1, 4.0)]) == 0
    assert policy.admitted == ["t0"]


def test_milestone_forget_frees_the_slot() -> None:
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 2.0), mcand(1, 2.0)]) == 0
    policy.forget("t0")
    policy.forget("never-seen")
    assert policy.admitted == []
    assert sel(policy, [mcand(1, 2.0), mcand(2, 1.0)]) == 2
    assert policy.admitted == ["t2"]


def test_milestone_committed_trials_come_last_by_lrtf() -> None:
    policy = MilestonePolicy(devices=1)
    committed = [mcand(0, None, remaining=5.0), mcand(1, None, remaining=9.0)]
    # With a milestone ahead of t2, the committed ones wait (here t1 is no critical
    # path: 9 s < (5 + 9 + 20) s of ready work on 1 device).
    assert sel(policy, [*committed, mcand(2, 20.0)]) == 2
    # Only committed work left: the longest first.
    assert sel(MilestonePolicy(devices=1), committed) == 1


def test_milestone_committed_trial_on_the_critical_path_runs_first() -> None:
    policy = MilestonePolicy(devices=2)
    # 10 s >= (10 + 5 + 5) / 2 devices: each second t0 waits lengthens the run.
    cands = [mcand(0, None, remaining=10.0), mcand(1, 1.0, 5.0), mcand(2, 1.0, 5.0)]
    assert sel(policy, cands) == 0
    assert policy.admitted == []
    assert sel(MilestonePolicy(devices=2, critical=float("inf")), cands) == 1
    # Counted to their ends, the others' work makes t0 no long pole: milestones first.
    cands = [mcand(0, None, remaining=10.0), mcand(1, 1.0, 6.0), mcand(2, 1.0, 5.0)]
    assert sel(MilestonePolicy(devices=2), cands) == 1


def test_milestone_ties_prefer_resident_then_in_host() -> None:
    policy = MilestonePolicy()
    cands = [mcand(0, 2.0), mcand(1, 2.0, in_host=False, resident=True), mcand(2, 2.0)]
    assert sel(policy, cands) == 1
    policy = MilestonePolicy()
    assert sel(policy, [mcand(0, 2.0, in_host=False), mcand(1, 2.0)]) == 1


def test_milestone_learns_the_devices() -> None:
    policy = MilestonePolicy()
    assert policy.capacity == 2
    policy.select(3, [mcand(0, 1.0)])
    assert policy.capacity == 8
    assert MilestonePolicy(slots_per_device=3, devices=2).capacity == 6


def test_milestone_rank_admitted_then_admission_order_then_committed() -> None:
    policy = MilestonePolicy(slots_per_device=1, devices=1)
    assert sel(policy, [mcand(0, 5.0), mcand(1, 5.0)]) == 0
    cands = [
        mcand(1, 3.0),
        mcand(2, None, remaining=4.0),
        mcand(3, 1.0, iteration=2),
        mcand(0, 4.0),
        mcand(4, None, remaining=8.0),
        mcand(5, 2.0),
    ]
    assert [c.order for c in policy.rank(cands)] == [0, 5, 1, 3, 4, 2]
    assert policy.admitted == ["t0"]
    # A trial past its milestone ranks with the waiting ones, and ranking released nothing.
    moved_on = [mcand(0, 9.0, iteration=1), mcand(1, 3.0)]
    assert [c.order for c in policy.rank(moved_on)] == [1, 0]
    assert policy.admitted == ["t0"]


@pytest.mark.parametrize(
    "kw",
    [
        {"slots_per_device": 0},
        {"slots_per_device": 1.5},
        {"slots_per_device": True},
        {"devices": 0},
        {"devices": "2"},
        {"critical": 0.0},
        {"affinity": 1.0},
    ],
)
def test_milestone_rejects_bad_arguments(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MilestonePolicy(**kw)  # type: ignore[arg-type]


# --- auto ---------------------------------------------------------------------------------


def test_auto_resolves_from_the_run(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tune_hydra.core.policies"):
        assert isinstance(resolve_policy("auto", search_aware=True), MilestonePolicy)
        assert type(resolve_policy("auto", search_aware=False)) is LRTFPolicy
        assert isinstance(resolve_policy("auto"), MilestonePolicy)
        assert isinstance(get_policy("auto"), MilestonePolicy)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all(line.startswith("policy='auto': ") for line in lines)
    assert "lrtf" in lines[1] and "milestone" in lines[0]
    # Anything else is get_policy's: no log line.
    caplog.clear()
    fifo = FIFOPolicy()
    assert resolve_policy(fifo, search_aware=True) is fifo
    assert type(resolve_policy("lrtf", search_aware=True)) is LRTFPolicy
    assert not caplog.records
    with pytest.raises(UnknownPolicyError, match="'auto'"):
        resolve_policy("Auto", search_aware=True)


# --- the contract every registered policy keeps ----------------------------------------


def _random_offers(rng: random.Random, n: int) -> list[Candidate]:
    return [
        offer(
            Op(f"t{k}", OpKind.FORWARD, 0, rng.randint(0, 3), 0),
            rng.uniform(0.0, 20.0),
            ready_since=rng.uniform(0.0, 5.0),
            order=k,
            resident=rng.random() < 0.3,
            in_host=rng.random() < 0.8,
            fits=rng.random() < 0.75,
            milestone_s=None if rng.random() < 0.3 else rng.uniform(0.0, 5.0),
        )
        for k in rng.sample(range(12), n)
    ]


def _builtins() -> list[str]:
    return [*sorted(POLICIES), "auto"]


@pytest.mark.parametrize("name", _builtins())
def test_contract_select_returns_a_fitting_offered_candidate(name: str) -> None:
    policy = get_policy(name)
    rng = random.Random(hash(name) % 1000)
    for _ in range(400):
        cands = _random_offers(rng, rng.randint(1, 8))
        choice = policy.select(rng.randrange(4), cands)
        if any(c.fits for c in cands):
            assert choice is not None, f"{name} idled a device while an op fitting it waited"
            assert any(choice is c for c in cands) and choice.fits
        else:
            assert choice is None
        if rng.random() < 0.2:
            policy.forget(f"t{rng.randrange(12)}")


@pytest.mark.parametrize("name", _builtins())
def test_contract_rank_is_a_permutation_and_changes_nothing(name: str) -> None:
    rng = random.Random(7)
    plain, ranked = get_policy(name), get_policy(name)
    for _ in range(300):
        cands = _random_offers(rng, rng.randint(1, 8))
        order = ranked.rank(cands)
        assert sorted(id(c) for c in order) == sorted(id(c) for c in cands)
        assert ranked.rank(cands) == order, "ranking twice gives the same order"
        device = rng.randrange(3)
        a, b = plain.select(device, cands), ranked.select(device, cands)
        assert (a is None and b is None) or (a is not None and b is not None and a.op == b.op)
        if rng.random() < 0.2:
            task = f"t{rng.randrange(12)}"
            plain.forget(task)
            ranked.forget(task)
    assert repr(plain) == repr(ranked)


@pytest.mark.parametrize("name", _builtins())
def test_contract_forget_unknown_and_known_tasks(name: str) -> None:
    policy = get_policy(name)
    policy.forget("nobody")
    cands = [mcand(0, 1.0), mcand(1, None)]
    first = policy.select(0, cands)
    assert first is not None
    policy.forget(first.op.task)
    policy.forget(first.op.task)  # twice: no error
    assert policy.select(0, cands) is not None
