"""Scheduling policies: which ready shard operation a free device runs next."""

from __future__ import annotations

import logging

from tune_hydra.core.policies.base import BasePolicy, Candidate
from tune_hydra.core.policies.fifo import FIFOPolicy
from tune_hydra.core.policies.lrtf import LRTFPolicy
from tune_hydra.core.policies.milestone import MilestonePolicy
from tune_hydra.core.policies.round_robin import RoundRobinPolicy
from tune_hydra.exceptions import UnknownPolicyError

log = logging.getLogger(__name__)

POLICIES: dict[str, type[BasePolicy]] = {
    "lrtf": LRTFPolicy,
    "fifo": FIFOPolicy,
    "round_robin": RoundRobinPolicy,
    "milestone": MilestonePolicy,
}

AUTO = "auto"
"""The policy name that picks one from the run (see :func:`resolve_policy`)."""


def get_policy(policy: str | BasePolicy) -> BasePolicy:
    """A policy instance from a name (``"auto"``, ``"lrtf"``, ``"fifo"``,
    ``"round_robin"``, ``"milestone"``) or an instance (returned as is).

    ``"auto"`` here knows nothing of the run: it is :func:`resolve_policy` with
    ``search_aware=None``.

    Raises:
        UnknownPolicyError: any other name or object (the message lists the names).
    """
    if isinstance(policy, BasePolicy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    if isinstance(policy, str) and policy == AUTO:
        return resolve_policy(AUTO)
    raise UnknownPolicyError(
        f"unknown policy {policy!r}; use {AUTO!r}, one of {sorted(POLICIES)} or an instance "
        f"of tune_hydra.core.policies.BasePolicy"
    )


def resolve_policy(policy: str | BasePolicy, *, search_aware: bool | None = None) -> BasePolicy:
    """The policy a run gets for ``policy``; ``"auto"`` chooses from the run.

    ``"auto"`` is :class:`MilestonePolicy` when the run has an early-stopping scheduler,
    a pruner or an adaptive searcher (``search_aware=True``: results at milestones
    decide what runs next), :class:`LRTFPolicy` when every trial's budget is fixed
    (``False``: makespan is all that counts). With ``None`` (not known: an ``Engine``
    on its own) it is :class:`MilestonePolicy`, which decides exactly as LRTF until a
    front end announces milestones. One log line says what was chosen and why.

    Args:
        policy: ``"auto"``, another policy name or a policy instance (as
            :func:`get_policy`).
        search_aware: whether the run's scheduler, pruner or searcher acts on results
            as they come (see :meth:`tune_hydra.frontends.milestones.Milestones.search_aware`).

    Raises:
        UnknownPolicyError: an unknown name or object.
    """
    if not (isinstance(policy, str) and policy == AUTO):
        return get_policy(policy)
    if search_aware is False:
        log.info("policy='auto': lrtf (every trial's budget is fixed: makespan first)")
        return LRTFPolicy()
    why = (
        "the run stops trials early or adapts its search: results at milestones first"
        if search_aware
        else "no search known yet: decides as lrtf until milestones are announced"
    )
    log.info("policy='auto': milestone (%s)", why)
    return MilestonePolicy()


__all__ = [
    "AUTO",
    "POLICIES",
    "BasePolicy",
    "Candidate",
    "FIFOPolicy",
    "LRTFPolicy",
    "MilestonePolicy",
    "RoundRobinPolicy",
    "get_policy",
    "resolve_policy",
]
