"""Tensors that cross shard boundaries: batches, activations handed forward, gradients
handed back, shard inputs saved for the backward, and parking them in host memory while
their task waits."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tune_hydra.exceptions import InvalidTaskError


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (a tensor or a nest of them) on ``device``; tensors already there as is."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, obj)


def detach(obj: Any, requires_grad: bool) -> Any:
    """Cut the graph at a shard's input; floating tensors become leaves that collect the
    gradient to hand back (with ``requires_grad``)."""

    def f(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        if requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    return f(obj) if isinstance(obj, torch.Tensor) else tree_map(f, obj)


def clone(obj: Any) -> Any:
    """A copy of every tensor in ``obj``, still in the graph (gradients flow back through
    it): the argument for a shard whose first layer writes into its input in place, which
    torch refuses on a leaf that requires grad, and which must not change the saved one."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, obj)


def versions(obj: Any) -> tuple[int, ...]:
    """The version counters of the tensors in ``obj`` (bumped by in-place writes)."""
    if isinstance(obj, torch.Tensor):
        return (obj._version,)
    return tuple(t._version for t in leaves([obj]))


def grads_of(inputs: Any) -> Any:
    """The gradients collected by :func:`detach`'s leaves, in the same structure."""
    if isinstance(inputs, torch.Tensor):
        return inputs.grad
    return tree_map(lambda t: t.grad if isinstance(t, torch.Tensor) else None, inputs)


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


def leaves(objs: list[Any]) -> list[torch.Tensor]:
    """Every tensor in ``objs`` (tensors, ``None`` or nests)."""
    out: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif obj is not None:
            out.extend(t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))
    return out


def park(objs: list[Any], device: torch.device, stream: Any = None) -> tuple[list[Any], int]:
    """Copies of ``objs`` with every tensor on ``device`` moved to host memory; returns
    them and the bytes moved.

    From a GPU the copies go to pinned memory on ``stream`` (when given), and return only
    once done, so the caller may drop the device tensors at once. On the CPU (a device that
    only emulates copies) the copy is a clone.
    """
    moved = 0

    def off(t: Any) -> Any:
        nonlocal moved
        if not isinstance(t, torch.Tensor) or t.device != device:
            return t
        moved += t.numel() * t.element_size()
        if device.type != "cuda":
            return t.clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    scope = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with scope:
        out = [
            obj
            if obj is None
            else off(obj)
            if isinstance(obj, torch.Tensor)
            else tree_map(off, obj)
            for obj in objs
        ]
    if moved and device.type == "cuda":
        # The device tensors may be freed (and their memory reused) once this returns.
        (stream or torch.cuda.current_stream(device)).synchronize()
    return out, moved


_SIDE: dict[torch.device, Any] = {}
_SIDE_LOCK = threading.Lock()


def side_stream(device: torch.device) -> Any:
    """One stream per GPU for saved inputs' copies to the host (apart from the workers'
    copy streams, which bring shard state in: the two directions overlap on PCIe)."""
    with _SIDE_LOCK:
        stream = _SIDE.get(device)
        if stream is None:
            stream = _SIDE[device] = torch.cuda.Stream(device)
        return stream


class SavedInput:
    """A shard's input kept for its backward's recompute, in host memory.

    From a GPU the copy goes to pinned memory on :func:`side_stream`, issued before the
    forward's kernels so that it overlaps them (a plain ``.cpu()`` would wait for the
    forward and then copy, on every forward op); :meth:`get` orders the compute stream
    after it. On the CPU the input is kept as is: it is host memory already.
    """

    __slots__ = ("event", "value")

    def __init__(self, obj: Any, device: torch.device) -> None:
        self.event: Any = None
        if device.type != "cuda":
            self.value = obj
            return
        stream = side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the input is made there

        def off(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # not reused by the compute stream before the copy
            return host

        with torch.cuda.stream(stream):
            self.value = off(obj) if isinstance(obj, torch.Tensor) else tree_map(off, obj)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def get(self, device: torch.device) -> Any:
        """The input on ``device`` (ordered after the copy to the host, from a GPU)."""
        if self.event is None:
            return to_device(self.value, device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self.event)
            return tree_map(
                lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t,
                self.value,
            )
        self.event.synchronize()
        return to_device(self.value, device)


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
