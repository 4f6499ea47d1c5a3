"""A ``ModelTask``'s training batch as one chain of a loop's shard ops: :func:`train_batch`.

A user's loop hands each op to the engine from its own thread and waits for it (each
shard's forward, then each of autograd's backward nodes): a thread round trip per op,
during which the device may take another task's op and evict this one's state. A canned
loop (:class:`~tune_hydra.frontends.task_loop.TaskLoop`) knows its batch in advance, as a
``ModelTask``'s program does: the forward of every shard but the last, one ``L`` op of the
last shard (its forward, the loss and ``(loss / k).backward()``), then the backward of the
shards before, in reverse. :func:`train_batch` asks for them as one chain
(:meth:`~tune_hydra.engine.runtime.loop.LoopRunner.run_chain`): each op's result is the
next op's input, and the engine starts each op as the one before ends. The ops are the
loop's own (a recomputing or graph-keeping forward, the recomputing backward), so the
stepping, random streams, shared parameters, autocast and kept-graph reservations are a
``th.shard`` loop's; the gradients are those of ``(loss / k).backward()`` after the loop's
forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tune_hydra.core.ops import OpKind
from tune_hydra.engine.runtime import amp
from tune_hydra.engine.runtime.loop import (
    BackwardOp,
    ChainStep,
    ForwardOp,
    ShardCall,
    clone_tensors,
    input_leaves,
    moved,
)

if TYPE_CHECKING:
    from tune_hydra.engine.runtime.loop import LoopRunner, LoopShard

LossOf = Callable[[Any, torch.device], torch.Tensor]


def train_batch(loop: LoopRunner, inputs: Any, loss_of: LossOf, k: int = 1) -> torch.Tensor:
    """Train one batch of ``loop``'s model on ``inputs`` (at home, or anywhere on the
    CPU): ``loss = loss_of(output, device)`` on the last shard's device, and
    ``(loss / k).backward()`` through every shard, as one chain of ops. Returns the loss,
    detached, at home.

    Raises:
        BatchTooLargeError: from ``LoopSizing.fit``.
        Exception: what an op raised (the chain ends there; graphs it kept are dropped).
    """
    loop.sizing.fit(inputs)
    *head, last = loop.shards
    calls = [ShardCall(loop, shard) for shard in head]
    autocast = amp.current()  # the forward's and the loss's; backward runs outside it
    losses: list[torch.Tensor] = []
    steps: list[ChainStep] = []
    before: ShardCall | None = None  # the forward whose output a step takes
    for call in calls:
        loop.graph.track(call)
        step = _ForwardStep(call, before, autocast)
        steps.append((OpKind.FORWARD, call.shard.index, step, autocast))
        before = call
    loss_step = _LossStep(loop, last, before, loss_of, k, losses)
    steps.append((OpKind.LAST, last.index, loss_step, autocast))
    steps.extend((OpKind.BACKWARD, c.shard.index, _BackwardStep(c), None) for c in reversed(calls))
    try:
        loop.run_chain(steps, moved(inputs, loop.home))
    except BaseException:
        loop.graph.drop()
        raise
    return losses[0]


class _ForwardStep:
    """A forward op of the chain, on the output of the forward before it (the batch's
    inputs for the first): the shard recomputing (a :class:`ForwardOp`, which a batched
    pass may compute) or keeping its graph, as the loop does."""

    def __init__(
        self, call: ShardCall, before: ShardCall | None, autocast: amp.Autocast | None
    ) -> None:
        self.call, self.before, self.autocast = call, before, autocast

    def bind(self, x: Any) -> Callable[[torch.device], Any]:
        call = self.call
        if self.before is not None:
            self.before.take_output(x)
        tensors = call.begin(x, self.before is None, self.autocast)
        if call.loop.keep:
            return lambda device: call.keep_forward(tensors, call.need, device)
        return ForwardOp(call, call.inputs(tensors))


class _LossStep:
    """The ``L`` op: the last shard's forward with grad, the loss and
    ``(loss / k).backward()`` into its parameters and its inputs; its result is the
    inputs' gradients (the loss goes to ``losses``)."""

    def __init__(
        self,
        loop: LoopRunner,
        shard: LoopShard,
        before: ShardCall | None,
        loss_of: LossOf,
        k: int,
        losses: list[Any],
    ) -> None:
        self.loop, self.shard, self.before = loop, shard, before
        self.loss_of, self.k = loss_of, k
        self.losses = losses

    def bind(self, x: Any) -> Callable[[torch.device], Any]:
        if self.before is not None:
            self.before.take_output(x)
        return lambda device: self._compute(device, x)

    def _compute(self, device: torch.device, x: Any) -> list[torch.Tensor | None]:
        loop, shard = self.loop, self.shard
        leaves, spec = tree_flatten(x)
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        tensors = [leaves[i] for i in at]
        first = self.before is None  # the batch's inputs: no gradient flows into them
        inp = input_leaves(tensors, [not first for _ in tensors], device)
        for i, t in zip(at, inp, strict=True):
            leaves[i] = clone_tensors(t) if shard.writes_input is not False else t
        arg = tree_unflatten(leaves, spec)
        for store, j in shard.first_uses:
            store.stash_grad(j)
        with loop.random.drawing(shard, device, loop.model.training), torch.enable_grad():
            loss = self.loss_of(shard.module(arg), device)
        # Outside autocast, as plain training calls backward; on this thread, not
        # autograd's per-device one.
        with amp.entered(None), torch.autograd.set_multithreading_enabled(False):
            (loss / self.k).backward()
        for store, j in shard.last_uses:
            store.unstash_grad(j)
        self.losses.append(loss.detach().to(loop.home))
        return [None if t.grad is None else t.grad.to(loop.home) for t in inp]


class _BackwardStep:
    """A backward op of the chain, from its output's gradients (the op before's
    result): through the graph its forward kept, or recomputing it (a
    :class:`BackwardOp`, which a batched pass may compute); its result is its inputs'
    gradients."""

    def __init__(self, call: ShardCall) -> None:
        self.call = call

    def bind(self, grads: list[Any]) -> Callable[[torch.device], Any]:
        call = self.call
        compute = BackwardOp(call, call.saved, tuple(grads), call.need, False)
        if call.loop.keep and call.kept is not None:
            g = tuple(grads)
            return lambda device: call.kept_backward(g, call.need, False, device, compute)
        return compute


__all__ = ["train_batch"]
