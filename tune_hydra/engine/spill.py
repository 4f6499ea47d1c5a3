"""Spill store: a shard's state lives in host memory and visits a device to run.

A :class:`ShardStore` owns one shard's parameters, gradients, buffers and optimizer
state. ``promote(device)`` copies them onto the device and points the live
``nn.Parameter`` objects at the copies (so the optimizer, keyed by parameter, keeps
working); ``demote()`` copies them back into host buffers that were allocated once (and
pinned, with CUDA) and are reused on every visit. Round trips are bitwise exact.

With CUDA, copies run on a caller-supplied copy stream and are ordered against compute
with events; on the CPU they are plain synchronous copies (or skipped entirely when the
"device" is the host itself and ``copy=False``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _param_shaped(value: Any) -> bool:
    # Optimizer scalars (Adam's "step") stay on the host, as torch keeps them there unless
    # the optimizer is capturable/fused.
    return isinstance(value, torch.Tensor) and value.dim() > 0


class ShardStore:
    """Host home of one shard's tensors, with promote/demote to a device.

    Args:
        modules: the shard's modules (their parameters and buffers move).
        optimizer: the shard's optimizer (its param-shaped state moves), may be set later.
        pin: allocate pinned host buffers (CUDA only), once.
        name: ``(task, shard)``, for the trace of its copies.
        footprint: the plan's ``(state_bytes, activation_bytes)`` of the shard, which the
            device workers keep within the device budget.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        pin: bool = False,
        name: tuple[str, int] = ("", -1),
        footprint: tuple[int, int] = (0, 0),
    ) -> None:
        self.name = name
        self.state_bytes, self.activation_bytes = footprint
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
        self.buffer_slots: list[tuple[nn.Module, str]] = [
            (sub, name)
            for m in modules
            for sub in m.modules()
            for name, b in sub._buffers.items()
            if b is not None
        ]
        self.optimizer = optimizer
        self.pin = pin and torch.cuda.is_available()
        self.device: torch.device = torch.device("cpu")
        # Who holds the device copy: emulated CPU devices all are torch.device("cpu"), so
        # the device alone cannot tell two workers apart.
        self.owner: object = None
        self.last_nbytes = 0  # nbytes() at the last promotion
        self.moved_total = 0  # bytes copied host<->device over the store's life
        self._host: dict[tuple[Any, ...], torch.Tensor] = {}
        self._event: Any = None  # CUDA event after the last demote (host buffers valid)
        self.copied = False  # the live tensors are device copies of the host buffers
        # Brought home for good until the next promote(): a speculative prefetch still in
        # a queue must not take it back to a device (the task left, or is checkpointed).
        self.retired = False
        self.lock = threading.RLock()  # promote/demote may come from two devices' threads
        for key, t in list(self._live()):
            if self.pin:
                self._set(key, self._host_buffer(key, t).copy_(t))
            else:
                self._host[key] = t  # the user's own tensors are the host buffers

    # -- the tensors, addressed by stable keys ------------------------------------------

    def _live(self) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
        for i, p in enumerate(self.params):
            yield ("p", i), p.data
            if p.grad is not None:
                yield ("g", i), p.grad
        for j, (mod, name) in enumerate(self.buffer_slots):
            yield ("b", j), mod._buffers[name]  # type: ignore[misc]
        if self.optimizer is not None:
            for i, p in enumerate(self.params):
                for k, v in self.optimizer.state.get(p, {}).items():
                    if _param_shaped(v):
                        yield ("o", i, k), v

    def _set(self, key: tuple[Any, ...], t: torch.Tensor) -> None:
        kind = key[0]
        if kind == "p":
            p = self.params[key[1]]
            grad = p.grad
            p.grad = None  # the grad must follow the data to the new device
            p.data = t
            if grad is not None and grad.device == t.device:
                p.grad = grad
        elif kind == "g":
            self.params[key[1]].grad = t
        elif kind == "b":
            mod, name = self.buffer_slots[key[1]]
            mod._buffers[name] = t
        else:
            assert self.optimizer is not None
            self.optimizer.state[self.params[key[1]]][key[2]] = t

    def _host_buffer(self, key: tuple[Any, ...], like: torch.Tensor) -> torch.Tensor:
        buf = self._host.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
            self._host[key] = buf
        return buf

    def nbytes(self) -> int:
        """Bytes this shard's state occupies now (parameters, grads, buffers, moments)."""
        return sum(t.numel() * t.element_size() for _, t in self._live())

    # -- moving -------------------------------------------------------------------------

    def promote(
        self,
        device: torch.device,
        stream: Any = None,
        *,
        copy: bool = True,
        owner: object = None,
    ) -> int:
        """Copy the shard's state onto ``device``; returns the bytes moved.

        Args:
            device: the target device.
            stream: a CUDA stream to issue the copies on (the caller orders compute after
                it with an event); ``None`` copies on the current stream.
            copy: for a CPU device, whether to really copy (``False``: the host buffers
                are used in place, as the CPU "device" is host memory).
            owner: the worker taking the state (see :meth:`demote`).
        """
        with self.lock:
            moved = self._promote(device, stream, copy, owner)
            self.owner = owner
            self.retired = False
            return moved

    def try_promote(
        self, device: torch.device, stream: Any = None, *, copy: bool = True, owner: object
    ) -> int | None:
        """:meth:`promote`, unless another owner holds the state (it may be computing with
        it) or it was retired: then nothing happens and ``None`` is returned. For
        speculative prefetches."""
        with self.lock:
            if self.retired or (self.copied and self.owner is not owner):
                return None
            moved = self._promote(device, stream, copy, owner)
            self.owner = owner
            return moved

    def _promote(self, device: torch.device, stream: Any, copy: bool, owner: object) -> int:
        if self.copied:
            if device == self.device and owner is self.owner:
                return 0
            # From another GPU: ``stream`` belongs to the new device, and a copy issued
            # under it would still run on the old device's current stream, unordered
            # with the promotion below. Rare (LRTF keeps tasks put), so copy back blocking.
            self._demote(stream if self.device == device else None)
        if device.type == "cpu" and not copy:
            self.device = device
            return 0
        if stream is None:
            self.synchronize()
        moved = 0
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            if self._event is not None and stream is not None:
                stream.wait_event(self._event)
            # Read every live tensor first: _set on a parameter detaches its grad.
            live = list(self._live())
            grads = {key: t for key, t in live if key[0] == "g"}
            for key, host in live:
                if key[0] == "g":
                    continue
                dev = torch.empty(host.shape, dtype=host.dtype, device=device)
                dev.copy_(host, non_blocking=self.pin)
                moved += host.numel() * host.element_size()
                self._set(key, dev)
            for key, host in grads.items():
                dev = torch.empty(host.shape, dtype=host.dtype, device=device)
                dev.copy_(host, non_blocking=self.pin)
                moved += host.numel() * host.element_size()
                self._set(key, dev)
        self.device = device
        self.copied = True
        self.moved_total += moved
        return moved

    def demote(self, stream: Any = None, *, only_owner: object = None) -> int:
        """Copy the shard's state back into its host buffers; returns the bytes moved.

        Args:
            stream: CUDA stream for the copies (``None``: the current stream).
            only_owner: demote only if this owner still holds the state (a worker evicting
                its copy must not demote one another worker took meanwhile and may be
                computing with).
        """
        with self.lock:
            if only_owner is not None and self.owner is not only_owner:
                return 0
            self.owner = None
            return self._demote(stream)

    def _demote(self, stream: Any) -> int:
        if not self.copied:
            self.device = torch.device("cpu")
            return 0
        moved = 0
        # Asynchronous only on a copy stream, whose event tells when the host buffers are
        # complete; without one nothing would (the caller reads them right after).
        asynchronous = self.pin and stream is not None
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            live = list(self._live())
            for key, dev in live:
                host = self._host_buffer(key, dev)
                host.copy_(dev, non_blocking=asynchronous)
                if stream is not None and dev.is_cuda:
                    # Gradients and optimizer moments were allocated by the compute stream:
                    # without this the allocator could hand their memory to a compute
                    # kernel while this copy still reads it.
                    dev.record_stream(stream)
                moved += dev.numel() * dev.element_size()
            for key, _ in [kv for kv in live if kv[0][0] != "g"]:
                self._set(key, self._host[key])
            for key, _ in [kv for kv in live if kv[0][0] == "g"]:
                self._set(key, self._host[key])
            if asynchronous:
                self._event = torch.cuda.Event()
                self._event.record(stream)
        self.device = torch.device("cpu")
        self.copied = False
        self.moved_total += moved
        return moved

    def retire(self) -> int:
        """:meth:`demote` for good: until the next :meth:`promote`, :meth:`try_promote`
        leaves the state on the host. Returns the bytes moved."""
        with self.lock:
            self.owner = None
            self.retired = True
            moved = self._demote(None)
            self.synchronize()  # an earlier asynchronous demote, too
            return moved

    def synchronize(self) -> None:
        """Wait until host buffers hold the demoted values (CUDA non-blocking copies)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
