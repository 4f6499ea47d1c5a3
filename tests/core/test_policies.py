"""Unit tests of the scheduling policies against mock candidates."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest

from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.policies import (
    POLICIES,
    BasePolicy,
    Candidate,
    FIFOPolicy,
    LRTFPolicy,
    RoundRobinPolicy,
    get_policy,
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
    assert {"lrtf": LRTFPolicy, "fifo": FIFOPolicy, "round_robin": RoundRobinPolicy} == POLICIES


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
