"""Stepping a task's shard optimizers as plain training steps its one optimizer.

Each shard's gradients are zeroed when an accumulation group starts and its optimizer
steps (then its lr scheduler) after the group's last backward. With ``max_grad_norm``
every shard is clipped by the global norm over all shards, which is known only after the
first shard's backward (the last of the batch): that shard steps at once, the others'
steps are deferred to their next visit (or to a step op at the end of the iteration).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tune_hydra.engine.runtime.runner import ShardRuntime


class Stepper:
    """The accumulation and clipping state of one task's shard optimizers.

    Args:
        shards: how many shards the task has.
        accumulate_steps: backward passes per optimizer step.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
    """

    def __init__(self, shards: int, *, accumulate_steps: int, max_grad_norm: float | None) -> None:
        self._accumulate = accumulate_steps
        self._max_norm = max_grad_norm
        # Per shard: whether its step waits for its next visit, and (with clipping) the
        # norms of its gradients after its last backward.
        self._pending = [False] * shards
        self._norms: list[list[torch.Tensor]] = [[] for _ in range(shards)]
        self._total_norm: torch.Tensor | None = None

    def pending(self, index: int) -> bool:
        """Whether shard ``index``'s optimizer step is deferred to its next visit."""
        return self._pending[index]

    def before_backward(self, shard: ShardRuntime, batch: int) -> None:
        """Before the shard's backward of ``batch``: zero its gradients if that starts an
        accumulation group."""
        if batch % self._accumulate == 0:
            if shard.zeroes is not None:  # shares parameters with other shards
                for p in shard.zeroes:
                    p.grad = None  # as zero_grad() does (set_to_none)
            elif shard.optimizer is not None:
                shard.optimizer.zero_grad()
        for store, i in shard.first_uses:
            store.stash_grad(i)

    def after_backward(self, shard: ShardRuntime, batch: int) -> None:
        """Note the shard's gradients after batch ``batch``'s backward, and step it (or,
        clipping, schedule every shard's step) when that ends an accumulation group."""
        for store, i in shard.last_uses:
            store.unstash_grad(i)
        clip = self._max_norm is not None
        if clip:
            self._measure(shard)
        if (batch + 1) % self._accumulate != 0:
            return
        if not clip:
            self._step(shard)
        elif shard.index == 0:  # the last backward of the batch: the global norm is known
            self.schedule_steps()
            self._step(shard)

    def end_epoch(self, batch_in_epoch: int) -> None:
        """The epoch ended after ``batch_in_epoch`` batches: a partial last accumulation
        group still steps."""
        if batch_in_epoch % self._accumulate != 0:
            self.schedule_steps()

    def schedule_steps(self) -> None:
        """Defer every shard's step to its next visit, clipped by the global norm of the
        gradients as they are now."""
        for i in range(len(self._pending)):
            self._pending[i] = True
        if self._max_norm is not None:
            norms = [n for shard_norms in self._norms for n in shard_norms]
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else None
            self._total_norm = total

    def step_pending(self, shard: ShardRuntime) -> None:
        """Step the shard if its step was deferred (at the start of its visit)."""
        if self._pending[shard.index]:
            self._step(shard)

    def remeasure(self, shards: list[ShardRuntime]) -> None:
        """Take the gradient norms from the shards' gradients as they are (restored from
        a resume state), as their last backward would have (with clipping only)."""
        if self._max_norm is not None:
            for shard in shards:
                self._measure(shard)

    def _measure(self, shard: ShardRuntime) -> None:
        grads = [p.grad for p in shard.params if p.grad is not None]
        self._norms[shard.index] = [torch.linalg.vector_norm(g, 2.0).cpu() for g in grads]

    def _step(self, shard: ShardRuntime) -> None:
        grads = [p for p in shard.params if p.grad is not None]
        if self._max_norm is not None and self._total_norm is not None and grads:
            total = self._total_norm.to(grads[0].device)
            torch.nn.utils.clip_grads_with_norm_(grads, self._max_norm, total)
        if shard.optimizer is not None:
            shard.optimizer.step()
            if shard.scheduler is not None:
                shard.scheduler.step()
        self._pending[shard.index] = False
