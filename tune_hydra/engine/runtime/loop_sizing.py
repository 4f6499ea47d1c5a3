"""The batch size a ``th.shard`` loop's plan is counted at: :class:`LoopSizing`.

A loop's cut is sized on its first forward's batch (the probe). A later training batch
that is larger scales every layer's probed activations by its input bytes over the
probe's; the cut stays, and the plan, the engine's record of it and each store's
footprint take the larger figures, or the batch is refused if the cut cannot hold it
within the budget.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from tune_hydra.engine.registration.partition import ShardPlan, plan_shards, tensor_bytes
from tune_hydra.engine.storage import LinkedStore
from tune_hydra.exceptions import BatchTooLargeError, ShardTooLargeError, format_bytes

if TYPE_CHECKING:
    from tune_hydra.engine.engine import Engine
    from tune_hydra.engine.runtime.loop import LoopShard

# The loop module's logger, by which a loop's records are filtered.
log = logging.getLogger("tune_hydra.engine.runtime.loop")


class LoopSizing:
    """The plan of one loop, sized for the largest training batch so far.

    Args:
        name: the loop's task name on ``engine``.
        engine: the engine the loop is registered with (its record of the plan).
        model: the user's model (weakly, as the loop holds it), named in errors.
        shards: the loop's shards (their stores' footprints follow the plan).
        plan: the loop's cut, sized on the probe.
        keep: the loop keeps its forwards' graphs (a batch of them all must fit too).
        probe_bytes: the probe's input bytes (the first forward's batch).

    Attributes:
        plan: the plan as sized now.
    """

    def __init__(
        self,
        name: str,
        engine: Engine,
        model: weakref.ref[nn.Module],
        shards: list[LoopShard],
        plan: ShardPlan,
        *,
        keep: bool,
        probe_bytes: int = 0,
    ) -> None:
        self._name = name
        self._engine = engine
        self._model = model
        self._shards = shards
        self._keep = keep
        self.plan = plan
        # The probe's layer costs and input bytes (the first forward's batch), and the
        # largest training batch's input bytes the plan is sized for.
        self._probe_costs = plan.layers
        self._probe_bytes = probe_bytes
        self._sized_bytes = probe_bytes

    def fit(self, inputs: Any) -> None:
        """Size the plan for a training batch larger than any before it, before any of
        its ops: every layer's probed activations scaled by the batch's input bytes over
        the probe's (linear in the batch size and, for sequences, in their length); if
        each shard of the cut (and, keeping graphs, a batch of them all) still fits the
        budget, the plan, the engine's record of it and each store's footprint (what the
        device ledgers count) take the larger figures.

        Raises:
            BatchTooLargeError: the cut does not hold that batch within the budget.
        """
        nbytes = tensor_bytes(inputs)
        if nbytes <= self._sized_bytes or not self._probe_bytes:
            return
        scale = nbytes / self._probe_bytes
        costs = [
            dataclasses.replace(c, activation_bytes=math.ceil(c.activation_bytes * scale))
            for c in self._probe_costs
        ]
        old = self.plan
        cut = [(s.start, s.stop) for s in old.shards]
        try:
            plan: ShardPlan | None = plan_shards(
                costs,
                old.budget,
                prefetch=old.prefetch,
                max_layers_per_shard=self._engine.max_layers_per_shard,
                prefer=[cut],
                kept=self._keep,
            )
        except ShardTooLargeError:
            plan = None
        if (
            plan is None
            or [(s.start, s.stop) for s in plan.shards] != cut
            or (self._keep and old.budget is not None and plan.kept_peak_bytes() > old.budget)
        ):
            raise BatchTooLargeError(self._too_large(costs, nbytes, scale))
        self._engine.update_plan(self._name, plan)
        for s, spec in zip(self._shards, plan.shards, strict=True):
            own = s.store.own if isinstance(s.store, LinkedStore) else s.store
            own.activation_bytes = spec.activation_bytes
        self.plan = plan
        self._sized_bytes = nbytes
        log.info(
            "%s: a training batch %.1fx the first one's: its activations are counted at "
            "that size (%s)",
            self._name,
            scale,
            ", ".join(format_bytes(s.activation_bytes) for s in plan.shards),
        )

    def _too_large(self, costs: list[Any], nbytes: int, scale: float) -> str:
        """Why :meth:`fit` refuses a batch, and what to do."""
        old = self.plan
        budget = old.budget or 0
        states = [s.state_bytes for s in old.shards]
        room = max(states) if old.prefetch and len(old.shards) > 1 else 0
        acts = [sum(c.activation_bytes for c in costs[s.start : s.stop]) for s in old.shards]
        over = [
            i for i, (st, a) in enumerate(zip(states, acts, strict=True)) if st + a + room > budget
        ]
        if over:
            i = over[0]
            spec = old.shards[i]
            need = format_bytes(states[i] + acts[i] + room)
            why = (
                f"shard {i} (layers {spec.layer_names[0]}..{spec.layer_names[-1]}) would "
                f"need {need} ({format_bytes(states[i])} of state, {format_bytes(acts[i])} "
                f"of activations"
                + (f", {format_bytes(room)} of room for the prefetched shard" if room else "")
                + ")"
            )
        else:
            why = (
                f"keeping every shard's graph (recompute=False) would need "
                f"{format_bytes(sum(acts) + max(states) + room)} for one batch"
            )
        return (
            f"{type(self._model()).__name__}: this training batch ({format_bytes(nbytes)} of "
            f"inputs) is {scale:.1f}x the one th.shard cut the model for (its first "
            f"forward's); at this size {why}, over device_memory={format_bytes(budget)}. "
            f"th.shard sizes the cut from the first forward: run the first forward on a "
            f"batch of the largest size, or keep batches at most that size, or raise "
            f"device_memory"
        )


__all__ = ["LoopSizing"]
