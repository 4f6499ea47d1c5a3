"""The stepper's deferred, globally clipped steps equal one clipped optimizer step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tune_hydra.engine.runtime.optim import Stepper


def _shard(index: int, layer: nn.Linear) -> Any:
    params = list(layer.parameters())
    return SimpleNamespace(
        index=index,
        params=params,
        optimizer=torch.optim.SGD(params, lr=0.5),
        scheduler=None,
        zeroes=None,  # shares no parameter with another shard
        first_uses=[],
        last_uses=[],
    )


def _grads(layers: list[nn.Linear], seed: int) -> None:
    torch.manual_seed(seed)
    for layer in layers:
        for p in layer.parameters():
            g = torch.randn_like(p) * 10
            p.grad = g if p.grad is None else p.grad + g


def test_clipped_steps_wait_for_the_global_norm_and_equal_one_clipped_step() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4).double(), nn.Linear(4, 2).double()]
    ref = [nn.Linear(3, 4).double(), nn.Linear(4, 2).double()]
    for a, b in zip(ref, layers, strict=True):
        a.load_state_dict(b.state_dict())
    shards = [_shard(i, layer) for i, layer in enumerate(layers)]
    stepper = Stepper(2, accumulate_steps=2, max_grad_norm=1.0)

    for batch in (0, 1):  # one accumulation group; backward runs last shard first
        _grads(layers, batch)
        stepper.after_backward(shards[1], batch)
        assert not stepper.pending(1)
        stepper.after_backward(shards[0], batch)
    # The group is over: shard 0 stepped at once, shard 1 waits for its next visit.
    assert not stepper.pending(0) and stepper.pending(1)
    stepper.step_pending(shards[1])
    assert not stepper.pending(1)

    params = [p for layer in ref for p in layer.parameters()]
    _grads(ref, 0)
    _grads(ref, 1)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.optim.SGD(params, lr=0.5).step()
    for a, b in zip(ref, layers, strict=True):
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(pa, pb)


def test_a_partial_group_at_the_end_of_the_epoch_still_steps() -> None:
    layer = nn.Linear(2, 2).double()
    shard = _shard(0, layer)
    stepper = Stepper(1, accumulate_steps=4, max_grad_norm=None)
    _grads([layer], 0)
    stepper.after_backward(shard, 0)
    assert not stepper.pending(0)
    stepper.end_epoch(4)  # a full last group: nothing left to step
    assert not stepper.pending(0)
    stepper.end_epoch(1)
    assert stepper.pending(0)
    before = layer.weight.detach().clone()
    stepper.step_pending(shard)
    assert not stepper.pending(0) and not torch.equal(before, layer.weight)
