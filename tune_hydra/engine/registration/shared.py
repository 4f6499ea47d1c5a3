"""Parameters several shards use: tied weights, or a module ``forward`` calls at two places.

GPT-2's ``lm_head`` is its input embedding (one parameter in the first and the last
shard); a module called twice puts its parameters in two stages. Plain training keeps
one tensor, adds the gradients of every use into its ``.grad`` (autograd reaches the
last shard's use first), and steps it once. The engine does the same:

- one home: a store of the shared parameters, promoted with every shard that uses them
  (:class:`~tune_hydra.engine.storage.LinkedStore`);
- the shard that back-propagates into a shared parameter first in a batch (the highest
  index: backward runs from the last shard down) sets its gradient to ``None`` when an
  accumulation group starts, as ``zero_grad()`` would; the others add to it;
- the shard that back-propagates into it last (the lowest index) steps and clips it: its
  optimizer holds it, the others' do not;
- autograd sums one batch's uses first and then adds the sum to the gradient of earlier
  micro-batches of the group; so the first use of each batch sets the accumulated
  gradient aside and the last adds it back (``ShardStore.stash_grad``), which rounds as
  plain training does.

Buffers are not shared this way: a module with buffers (BatchNorm) called in two shards
is refused, with the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tune_hydra.engine.storage import ShardStore
from tune_hydra.exceptions import InvalidModelError

Group = tuple[int, ...]
"""The shards using a set of shared parameters, in order."""


class SharedParams:
    """Which of a task's parameters several shards use, and each shard's part in them.

    Args:
        modules: the shards' modules, in order.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        users: dict[int, list[int]] = {}
        params: dict[int, nn.Parameter] = {}
        for i, module in enumerate(modules):
            for p in _unique(module.parameters()):
                users.setdefault(id(p), []).append(i)
                params[id(p)] = p
        self._users = {k: tuple(v) for k, v in users.items() if len(v) > 1}
        self._groups: dict[Group, list[nn.Parameter]] = {}
        for k, group in self._users.items():
            self._groups.setdefault(group, []).append(params[k])
        _refuse_shared_buffers(modules)

    def __bool__(self) -> bool:
        return bool(self._users)

    def own(self, module: nn.Module) -> list[nn.Parameter]:
        """The parameters of ``module`` no other shard uses."""
        return [p for p in _unique(module.parameters()) if id(p) not in self._users]

    def steps(self, index: int, module: nn.Module) -> list[nn.Parameter]:
        """What shard ``index``'s optimizer steps: its own parameters and the shared ones
        it back-propagates into last (it is their lowest-index user), in module order."""
        return [
            p
            for p in _unique(module.parameters())
            if id(p) not in self._users or self._users[id(p)][0] == index
        ]

    def zeroes(self, index: int, module: nn.Module) -> list[nn.Parameter]:
        """The gradients shard ``index`` sets to ``None`` when a group starts: its own
        parameters' and the shared ones' it back-propagates into first (highest user)."""
        return [
            p
            for p in _unique(module.parameters())
            if id(p) not in self._users or self._users[id(p)][-1] == index
        ]

    def first_uses(
        self, index: int, stores: dict[Group, ShardStore]
    ) -> list[tuple[ShardStore, int]]:
        """The shared parameters shard ``index`` back-propagates into first (as ``(store,
        index in the store)``): before its backward, their gradients are set aside."""
        return self._uses(index, stores, -1)

    def last_uses(
        self, index: int, stores: dict[Group, ShardStore]
    ) -> list[tuple[ShardStore, int]]:
        """The shared parameters shard ``index`` back-propagates into last: after its
        backward, the set-aside gradient is added to this batch's sum."""
        return self._uses(index, stores, 0)

    def _uses(
        self, index: int, stores: dict[Group, ShardStore], end: int
    ) -> list[tuple[ShardStore, int]]:
        return [
            (stores[g], i)
            for g, params in self._groups.items()
            if g[end] == index
            for i in range(len(params))
        ]

    def groups_of(self, index: int) -> list[Group]:
        """The groups of shared parameters shard ``index`` uses."""
        return [g for g in self._groups if index in g]

    def stores(
        self,
        optimizers: Sequence[torch.optim.Optimizer | None],
        *,
        pin: bool,
        task: str,
        spill: Callable[[tuple[str, int]], dict[str, Any]] | None = None,
    ) -> dict[Group, ShardStore]:
        """One store per group, with the optimizer that steps it (its first shard's);
        ``spill(name)``: the disk-tier keywords of a store (see ``ShardStore``)."""
        return {
            g: ShardStore(
                [],
                optimizers[g[0]],
                pin=pin,
                name=(task, g[0]),
                params=params,
                **(spill((task, g[0])) if spill is not None else {}),
            )
            for g, params in self._groups.items()
        }


def _unique(params: object) -> list[nn.Parameter]:
    return list(dict.fromkeys(params))  # type: ignore[call-overload]


def _refuse_shared_buffers(modules: Sequence[nn.Module]) -> None:
    seen: dict[tuple[int, str], int] = {}
    for i, module in enumerate(modules):
        for sub in module.modules():
            for name, b in sub._buffers.items():
                key = (id(sub), name)
                if b is None or seen.setdefault(key, i) == i:
                    continue
                raise InvalidModelError(
                    f"a {type(sub).__name__} with buffers ({name!r}) is used in shards "
                    f"{seen[key]} and {i}: a module with running statistics called at two "
                    f"places cannot be split between them. Raise device_memory (or "
                    f"max_layers_per_shard) so that both calls share a shard, or use two "
                    f"modules"
                )
