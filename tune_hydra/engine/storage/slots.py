"""A shard's live tensors, addressed by stable keys.

The live tensors are the ones the shard's modules and optimizer point at: parameters
(``("p", i)``), their gradients (``("g", i)``), buffers (``("b", j)``), the optimizer's
param-shaped state (``("o", i, name)``) and gradients set aside over a batch
(``("s", i)``). A store reads them (to copy, count or compare them) and points them at
device copies, at its tier's buffers or at views of its spill file, through
:class:`LiveSlots`.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

import torch
from torch import nn

from tune_hydra.engine.storage.tiers import Key


def _param_shaped(value: Any) -> bool:
    # Optimizer scalars (Adam's "step") stay on the host, as torch keeps them there unless
    # the optimizer is capturable/fused.
    return isinstance(value, torch.Tensor) and value.dim() > 0


def held_params(modules: list[nn.Module], params: list[nn.Parameter] | None) -> list[nn.Parameter]:
    """``params``, or every parameter of ``modules``, each once (in order)."""
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for p in params if params is not None else (p for m in modules for p in m.parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class LiveSlots:
    """The live tensors of one shard, by key (see the module docstring). Not thread-safe
    on its own: its store uses it under its lock (or reads it, as ``nbytes()``).

    Args:
        modules: the shard's modules (their buffers are slots).
        params: the parameters held (see :func:`held_params`).
        skip: parameter indices left out (the frozen pool's: no gradient, no optimizer
            state; see ``tune_hydra.engine.storage.frozen.FrozenSlots``).
    """

    def __init__(
        self, modules: list[nn.Module], params: list[nn.Parameter], skip: Container[int]
    ) -> None:
        self.params = params
        self.buffer_slots: list[tuple[nn.Module, str]] = [
            (sub, name)
            for m in modules
            for sub in m.modules()
            for name, b in sub._buffers.items()
            if b is not None
        ]
        self.optimizer: torch.optim.Optimizer | None = None
        self._skip = skip
        # Gradients set aside while a shared parameter's uses in other shards add up theirs
        # (see stash_grad): moved with the rest of the state.
        self._stash: dict[int, torch.Tensor] = {}

    def items(self) -> Iterator[tuple[Key, torch.Tensor]]:
        """Every live ``(key, tensor)``."""
        skip = self._skip
        for i, p in enumerate(self.params):
            if i in skip:
                continue
            yield ("p", i), p.data
            if p.grad is not None:
                yield ("g", i), p.grad
        for j, (mod, name) in enumerate(self.buffer_slots):
            yield ("b", j), mod._buffers[name]  # type: ignore[misc]
        if self.optimizer is not None:
            for i, p in enumerate(self.params):
                if i in skip:
                    continue
                for k, v in self.optimizer.state.get(p, {}).items():
                    if _param_shaped(v):
                        yield ("o", i, k), v
        for i, t in self._stash.items():
            yield ("s", i), t

    def set(self, key: Key, t: torch.Tensor) -> None:
        """Point slot ``key`` at ``t`` (a parameter's gradient stays only on its device)."""
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
        elif kind == "s":
            self._stash[key[1]] = t
        else:
            assert self.optimizer is not None
            self.optimizer.state[self.params[key[1]]][key[2]] = t

    def point_at(self, tensors: dict[Key, torch.Tensor]) -> None:
        """Point every slot at ``tensors[key]`` (gradients last: a parameter's data
        change detaches its gradient)."""
        for key, t in tensors.items():
            if key[0] != "g":
                self.set(key, t)
        for key, t in tensors.items():
            if key[0] == "g":
                self.set(key, t)

    def copy_to(self, device: torch.device, *, non_blocking: bool) -> int:
        """Point every slot at a copy of its tensor on ``device``; returns the bytes
        copied."""
        # Every live tensor read first, gradients set last: setting a parameter's data
        # detaches its gradient.
        live = list(self.items())
        grads = [(key, t) for key, t in live if key[0] == "g"]
        moved = 0
        for key, t in [*((key, t) for key, t in live if key[0] != "g"), *grads]:
            dev = torch.empty(t.shape, dtype=t.dtype, device=device)
            dev.copy_(t, non_blocking=non_blocking)
            moved += t.numel() * t.element_size()
            self.set(key, dev)
        return moved

    def named(
        self, items: list[tuple[Key, torch.Tensor]]
    ) -> list[tuple[nn.Parameter | tuple[nn.Module, str], torch.Tensor]]:
        """The parameters' and buffers' tensors among ``items`` (``(key, tensor)``, as
        :meth:`items` gives or the store's tier holds), as ``(parameter, tensor)`` and
        ``((module, buffer name), tensor)``."""
        out: list[tuple[nn.Parameter | tuple[nn.Module, str], torch.Tensor]] = []
        for key, t in items:
            if key[0] == "p":
                out.append((self.params[key[1]], t))
            elif key[0] == "b":
                out.append((self.buffer_slots[key[1]], t))
        return out

    def nbytes(self) -> int:
        """Bytes the live tensors occupy."""
        return sum(t.numel() * t.element_size() for _, t in self.items())

    def signature(self) -> tuple[tuple[Any, ...], ...]:
        """Which tensors are live, with their version counters (an in-place write moves
        one)."""
        # A parameter's .data is a new tensor with a version counter of its own: the
        # parameter's counts its in-place writes.
        return tuple(
            (key, t.data_ptr(), t.shape, (self.params[key[1]] if key[0] == "p" else t)._version)
            for key, t in self.items()
        )

    def identity(self) -> tuple[tuple[Any, ...], ...]:
        """Which tensors are live (not their versions)."""
        return tuple((key, t.data_ptr(), t.shape) for key, t in self.items())

    # -- a shared parameter's gradient over one batch ----------------------------------

    def stash_grad(self, index: int) -> None:
        """Set parameter ``index``'s gradient aside (``.grad`` becomes ``None``)."""
        p = self.params[index]
        if p.grad is not None:
            self._stash[index] = p.grad
            p.grad = None

    def unstash_grad(self, index: int) -> None:
        """The set-aside gradient plus the one accumulated since (see :meth:`stash_grad`)."""
        old = self._stash.pop(index, None)
        if old is None:
            return
        p = self.params[index]
        new = p.grad
        if new is None:
            p.grad = old.to(p.device)
        else:
            p.grad = old.to(new.device).add_(new)
