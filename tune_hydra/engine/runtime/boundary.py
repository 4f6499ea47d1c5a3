"""Tensors that cross shard boundaries: batches split into inputs and targets, moved to
a device, gradients handed back, and what a shard op computed outside its loop starts
from (:class:`OpStart`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tune_hydra.engine.runtime import rng
from tune_hydra.exceptions import InvalidTaskError


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (a tensor or a nest of them) on ``device``; tensors already there as is."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, obj)


def backward(outputs: Any, grads: Any) -> None:
    """Backward from a shard's outputs with the gradients the next shard handed back."""
    if isinstance(outputs, torch.Tensor):  # the common case, without pytree's cost
        if outputs.requires_grad and isinstance(grads, torch.Tensor):
            torch.autograd.backward(outputs, grads)
        return
    outs, _ = tree_flatten(outputs)
    gs, _ = tree_flatten(grads)
    pairs = [
        (o, g)
        for o, g in zip(outs, gs, strict=True)
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def split_batch(batch: Any, name: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of one batch of task ``name``: an ``(x, y)`` pair, a dict
    ``{"inputs": x, "targets": y}``, or any other dict (a Hugging Face collator's), which
    is the model's keyword inputs as a whole, with ``batch.get("labels")`` the target."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        if {"inputs", "targets"} <= set(batch):
            return batch["inputs"], batch["targets"]
        return batch, batch.get("labels")
    raise InvalidTaskError(
        f"task {name!r}: each batch must be an (inputs, targets) pair or a dict of the "
        f"model's keyword inputs, got {type(batch).__name__}; make the data yield (x, y) "
        f"tuples"
    )


@dataclass
class OpStart:
    """What a forward or recomputing backward through a loop's shard starts from, for
    computing it outside the loop (a batched pass: :mod:`~tune_hydra.engine.dispatch.batched`)
    and handing the result back (``LoopRunner.take_forward`` / ``take_backward``). Making
    it changes nothing of the task."""

    input: Any  # on the device; for a backward of a shard after the first, leaves needing grad
    stream: rng.RngState  # the task's RNG stream at the op's start (replayed by a backward)
    grad: Any = None  # a backward's gradient of the shard's output, on the device
    # A backward's: the shard's trainable parameters and input leaves, whose gradients
    # it hands back (in this order).
    wrt: list[torch.Tensor] = field(default_factory=list)


def accumulate_grad(t: torch.Tensor, g: torch.Tensor | None) -> None:
    """Add ``g`` into ``t.grad`` as autograd's accumulation does (the first gradient is
    taken as it is, a later one added in place), so the result is bit for bit what a
    ``backward`` would have left; None (not reached) leaves it as it is."""
    if g is None:
        return
    if t.grad is None:
        t.grad = g
    else:
        with torch.no_grad():
            t.grad += g
