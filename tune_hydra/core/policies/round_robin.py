"""Round robin over tasks, one operation each in turn."""

from __future__ import annotations

from collections.abc import Sequence

from tune_hydra.core.policies.base import BasePolicy, Candidate


class RoundRobinPolicy(BasePolicy):
    """Serve tasks in registration order, cycling; a task that is not ready is skipped."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last = -1

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        if len(candidates) == 1:
            pick = candidates[0]
        else:
            after = [c for c in candidates if c.order > self._last]
            pick = min(after or candidates, key=lambda c: c.order)
        self._last = pick.order
        return pick
