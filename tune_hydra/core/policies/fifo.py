"""First in, first out: the operation that has waited longest runs first."""

from __future__ import annotations

from collections.abc import Sequence

from tune_hydra.core.policies.base import BasePolicy, Candidate


class FIFOPolicy(BasePolicy):
    """Run the operation that became ready first (ties: the task registered first)."""

    name = "fifo"

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        if len(candidates) == 1:
            return candidates[0]
        return min(candidates, key=lambda c: (c.ready_since, c.order))
