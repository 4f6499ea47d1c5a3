"""Storage tiers: where a shard's spilled tensors live while it is not on a device.

A tier maps the store's stable keys (``("p", i)``, ``("g", i)``, ``("b", j)``,
``("o", i, name)``) to host tensors. The store copies into what :meth:`StorageTier.put`
hands out and, once the copies have landed, calls :meth:`StorageTier.flush`; it reads back
through :meth:`StorageTier.get`. A tier that keeps its tensors elsewhere (on disk) would
materialize a host tensor in ``get`` and write its staging buffers through in ``flush``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch

Key = tuple[Any, ...]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


class StorageTier(abc.ABC):
    """A mapping from keys to host tensors, allocated once per key and reused.

    A tier owns its buffers and their accounting (:meth:`nbytes`). The store uses it only
    under its own lock, so implementations need no locking of their own.
    """

    pinned = False
    """Whether the host tensors are page-locked (copies to and from a GPU may then be
    asynchronous)."""

    @abc.abstractmethod
    def get(self, key: Key) -> torch.Tensor:
        """The host tensor holding ``key``'s value (raises ``KeyError`` if absent)."""

    @abc.abstractmethod
    def put(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like ``like`` for the caller to copy ``key``'s value into:
        the same one on every call while shape and dtype stay the same. Its content counts
        once :meth:`flush` is called."""

    @abc.abstractmethod
    def keys(self) -> Iterator[Key]:
        """The keys held."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Host bytes the tier's tensors occupy."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Free every buffer (the values went elsewhere, or are stale)."""

    def flush(self) -> None:  # noqa: B027 (a hook: host tiers have nothing to do)
        """The buffers :meth:`put` handed out now hold their values. Host tiers already
        hold them where they belong; a tier storing elsewhere writes them through here."""

    def keep(self, key: Key, tensor: torch.Tensor) -> torch.Tensor:
        """Store ``tensor``'s value under ``key``; returns the host tensor that now holds
        it (the live tensor should point at it). Call :meth:`flush` afterwards."""
        buf = self.put(key, tensor)
        buf.copy_(tensor)
        return buf

    def fill(self, live: list[tuple[Key, torch.Tensor]], *, non_blocking: bool, stream: Any) -> int:
        """Copy each ``(key, tensor)`` of ``live`` (a device copy) into its buffer
        (:meth:`put`); returns the bytes copied. ``stream``: the CUDA stream the copies are
        issued on (``None``: the current one). Call :meth:`flush` once they have landed."""
        moved = 0
        for key, dev in live:
            host = self.put(key, dev)
            host.copy_(dev, non_blocking=non_blocking)
            if stream is not None and dev.is_cuda:
                # Gradients and optimizer moments were allocated by the compute stream:
                # without this the allocator could hand their memory to a compute kernel
                # while this copy still reads it.
                dev.record_stream(stream)
            moved += tensor_bytes(dev)
        return moved

    def drop(self, key: Key) -> None:
        """Forget ``key``'s tensor (its value is kept elsewhere from now on: a frozen
        tensor shared across tasks). Tiers that cannot forget one key raise."""
        raise NotImplementedError(f"{type(self).__name__} cannot drop one key")

    def __contains__(self, key: object) -> bool:
        return any(k == key for k in self.keys())

    def items(self) -> list[tuple[Key, torch.Tensor]]:
        """``(key, host tensor)`` pairs, one per key held."""
        return [(k, self.get(k)) for k in list(self.keys())]


class HostTier(StorageTier):
    """Plain host tensors in a dict; :meth:`keep` adopts the given tensor as the buffer
    (no copy: the user's own tensors are the host buffers until a shape change)."""

    def __init__(self) -> None:
        self._tensors: dict[Key, torch.Tensor] = {}

    def get(self, key: Key) -> torch.Tensor:
        return self._tensors[key]

    def put(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        buf = self._tensors.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self._allocate(like)
            self._tensors[key] = buf
        return buf

    def keep(self, key: Key, tensor: torch.Tensor) -> torch.Tensor:
        self._tensors[key] = tensor
        return tensor

    def keys(self) -> Iterator[Key]:
        return iter(self._tensors)

    def drop(self, key: Key) -> None:
        self._tensors.pop(key, None)

    def clear(self) -> None:
        self._tensors.clear()

    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for t in self._tensors.values())

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def items(self) -> list[tuple[Key, torch.Tensor]]:
        return list(self._tensors.items())

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")


class PinnedHostTier(HostTier):
    """Page-locked host tensors (CUDA only): :meth:`keep` copies into a pinned buffer."""

    pinned = True

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("pinned host memory needs CUDA; use HostTier without it")
        super().__init__()

    def keep(self, key: Key, tensor: torch.Tensor) -> torch.Tensor:
        return StorageTier.keep(self, key, tensor)

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)
