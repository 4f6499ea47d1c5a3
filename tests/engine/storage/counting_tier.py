"""A toy storage tier for tests: in memory, counting what goes through it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tune_hydra.engine.storage.tiers import Key, StorageTier, tensor_bytes


class CountingTier(StorageTier):
    """Host tensors in a dict, built only on the base class's defaults (``keep``,
    ``items``, ``__contains__``), counting reads (``get``) and writes: a buffer handed
    out by ``put`` counts as written once the store says its copy landed (``flush``)."""

    def __init__(self) -> None:
        self._tensors: dict[Key, torch.Tensor] = {}
        self._pending: dict[Key, int] = {}
        self.reads = 0
        self.read_bytes = 0
        self.writes = 0
        self.written_bytes = 0
        self.allocations = 0

    def get(self, key: Key) -> torch.Tensor:
        t = self._tensors[key]
        self.reads += 1
        self.read_bytes += tensor_bytes(t)
        return t

    def put(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        buf = self._tensors.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu")
            self._tensors[key] = buf
            self.allocations += 1
        self._pending[key] = tensor_bytes(buf)
        return buf

    def flush(self) -> None:
        self.writes += len(self._pending)
        self.written_bytes += sum(self._pending.values())
        self._pending.clear()

    def keys(self) -> Iterator[Key]:
        return iter(self._tensors)

    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for t in self._tensors.values())

    def clear(self) -> None:
        self._tensors.clear()
        self._pending.clear()
