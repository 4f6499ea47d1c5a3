"""Pieces the CPU benchmarks share: an MLP family, synthetic data, a budget finder."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tune_hydra.engine.registration.partition import layer_costs, plan_shards
from tune_hydra.engine.task import model_layers
from tune_hydra.exceptions import ShardTooLargeError

Batch = tuple[torch.Tensor, torch.Tensor]


def make_mlp(width: int, depth: int, classes: int = 10) -> nn.Sequential:
    """``depth`` x (Linear + ReLU) and a classifier head; no dropout."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def make_data(width: int, batch: int, batches: int, seed: int = 0) -> list[Batch]:
    """Synthetic classification batches (a fixed list, so every run sees the same data)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(batches)
    ]


def budget_for(
    model: nn.Sequential,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    sample: torch.Tensor,
    min_shards: int,
) -> tuple[int, int]:
    """The largest per-device budget (bytes) that cuts ``model`` into >= ``min_shards``.

    Returns ``(budget, num_shards)``; raises ``ValueError`` if no budget does.
    """
    costs = layer_costs(model_layers(model), optimizer, sample)
    total = sum(c.total_bytes for c in costs) + max(c.state_bytes for c in costs)
    for k in range(64, 0, -1):
        budget = total * k // 64
        try:
            n = len(plan_shards(costs, budget))
        except ShardTooLargeError:
            break
        if n >= min_shards:
            return budget, n
    raise ValueError(f"no budget cuts this model into {min_shards} shards; make it deeper")


def train_by_hand(
    shards: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    data: Iterable[Batch],
) -> None:
    """One epoch of a model cut into ``shards``, without the engine: the torch calls the
    engine's runner makes on the CPU (each shard's input detached, one autograd call and
    one ``zero_grad`` + ``step`` of that shard's optimizer per shard backward)."""
    for x, y in data:
        ins, outs = [], []
        for i, shard in enumerate(shards[:-1]):
            inp = x.detach().requires_grad_(i > 0)
            out = shard(inp)
            ins.append(inp)
            outs.append(out)
            x = out.detach()
        inp = x.detach().requires_grad_()
        loss = loss_fn(shards[-1](inp), y)
        loss.item()
        optimizers[-1].zero_grad()
        loss.backward()
        optimizers[-1].step()
        grad = inp.grad
        for i in range(len(shards) - 2, -1, -1):
            optimizers[i].zero_grad()
            torch.autograd.backward(outs[i], grad)
            grad = ins[i].grad
            optimizers[i].step()
