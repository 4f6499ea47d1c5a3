"""Scheduling policies: which ready shard operation a free device runs next."""

from __future__ import annotations

from tune_hydra.core.policies.base import BasePolicy, Candidate
from tune_hydra.core.policies.fifo import FIFOPolicy
from tune_hydra.core.policies.lrtf import LRTFPolicy
from tune_hydra.core.policies.round_robin import RoundRobinPolicy
from tune_hydra.exceptions import UnknownPolicyError

POLICIES: dict[str, type[BasePolicy]] = {
    "lrtf": LRTFPolicy,
    "fifo": FIFOPolicy,
    "round_robin": RoundRobinPolicy,
}


def get_policy(policy: str | BasePolicy) -> BasePolicy:
    """A policy instance from a name (``"lrtf"``, ``"fifo"``, ``"round_robin"``) or an
    instance (returned as is)."""
    if isinstance(policy, BasePolicy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise UnknownPolicyError(
        f"unknown policy {policy!r}; use one of {sorted(POLICIES)} or an instance of "
        f"tune_hydra.core.policies.BasePolicy"
    )


__all__ = [
    "POLICIES",
    "BasePolicy",
    "Candidate",
    "FIFOPolicy",
    "LRTFPolicy",
    "RoundRobinPolicy",
    "get_policy",
]
