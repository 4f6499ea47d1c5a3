"""Spill store: promote/demote round trips are bitwise exact for every tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tune_hydra.engine.spill import ShardStore


def _trained_shard() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2)).double()
    opt = torch.optim.Adam(mod.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        mod(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
        opt.step()
    return mod, opt


def _snapshot(mod: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"sd.{k}": v.detach().clone() for k, v in mod.state_dict().items()}
    for i, p in enumerate(mod.parameters()):
        out[f"grad.{i}"] = p.grad.clone()
        for k, v in opt.state[p].items():
            out[f"opt.{i}.{k}"] = v.clone()
    return out


def _devices() -> list[torch.device]:
    devs = [torch.device("cpu")]
    if torch.cuda.is_available():
        devs.append(torch.device("cuda", 0))
    return devs


@pytest.mark.parametrize("device", _devices(), ids=str)
@pytest.mark.parametrize("pin", [False, True])
def test_round_trip_is_bitwise(device: torch.device, pin: bool) -> None:
    mod, opt = _trained_shard()
    before = _snapshot(mod, opt)
    store = ShardStore([mod], opt, pin=pin)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    for _ in range(3):
        moved_in = store.promote(device, stream, copy=True)
        assert moved_in == store.nbytes() > 0
        assert all(p.device == device for p in mod.parameters())
        assert all(p.grad.device == device for p in mod.parameters())
        moved_out = store.demote(stream)
        store.synchronize()
        assert moved_out == moved_in
    assert all(p.device.type == "cpu" for p in mod.parameters())
    after = _snapshot(mod, opt)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
        assert before[k].dtype == after[k].dtype
    # Adam's step counter stays a host scalar, as torch keeps it.
    assert all(opt.state[p]["step"].device.type == "cpu" for p in mod.parameters())


def test_host_buffers_are_reused_not_reallocated() -> None:
    mod, opt = _trained_shard()
    store = ShardStore([mod], opt)
    store.promote(torch.device("cpu"), copy=True)
    store.demote()
    ptrs = [p.data_ptr() for p in mod.parameters()]
    for _ in range(3):
        store.promote(torch.device("cpu"), copy=True)
        assert [p.data_ptr() for p in mod.parameters()] != ptrs  # really a copy
        store.demote()
        assert [p.data_ptr() for p in mod.parameters()] == ptrs  # same host buffers


def test_training_continues_on_promoted_copy() -> None:
    mod, opt = _trained_shard()
    ref_mod, ref_opt = _trained_shard()
    store = ShardStore([mod], opt)
    x = torch.randn(4, 6, dtype=torch.float64)
    for m, o, spill in ((mod, opt, True), (ref_mod, ref_opt, False)):
        if spill:
            store.promote(torch.device("cpu"), copy=True)
        o.zero_grad()
        m(x).sum().backward()
        o.step()
        if spill:
            store.demote()
    for a, b in zip(mod.state_dict().values(), ref_mod.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_speculative_promote_never_takes_state_another_owner_holds() -> None:
    """A prefetch must not demote a copy another device may be computing with; a real
    promotion (the op is assigned there) takes it over."""
    mod, opt = _trained_shard()
    before = _snapshot(mod, opt)
    store = ShardStore([mod], opt)
    cpu = torch.device("cpu")
    first, second = object(), object()
    assert store.promote(cpu, copy=True, owner=first) > 0
    held = [p.data_ptr() for p in mod.parameters()]
    assert store.try_promote(cpu, copy=True, owner=second) is None
    assert store.owner is first and [p.data_ptr() for p in mod.parameters()] == held
    assert store.try_promote(cpu, copy=True, owner=first) == 0  # already there
    assert store.promote(cpu, copy=True, owner=second) > 0
    assert store.owner is second
    store.demote()
    assert store.try_promote(cpu, copy=True, owner=first) is not None  # at home: free
    store.demote()
    after = _snapshot(mod, opt)
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k


def test_a_retired_store_is_not_prefetched_back() -> None:
    """A task leaving the engine (or checkpointed) brings its state home for good: a
    speculative prefetch still queued leaves it there; the next real promotion ends it."""
    mod, opt = _trained_shard()
    store = ShardStore([mod], opt)
    cpu, worker = torch.device("cpu"), object()
    assert store.promote(cpu, copy=True, owner=worker) > 0
    assert store.retire() > 0
    assert not store.copied and store.owner is None
    assert store.try_promote(cpu, copy=True, owner=worker) is None
    assert not store.copied
    assert store.promote(cpu, copy=True, owner=worker) > 0
    assert store.try_promote(cpu, copy=True, owner=worker) == 0  # live again: already there
    store.demote()


def test_nbytes_counts_params_grads_buffers_and_moments() -> None:
    mod, opt = _trained_shard()
    store = ShardStore([mod], opt)
    p = sum(t.numel() * 8 for t in mod.parameters())
    b = sum(t.numel() * t.element_size() for t in mod.buffers())
    assert store.nbytes() == p * 4 + b  # params + grads + exp_avg + exp_avg_sq


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_drops_and_rises() -> None:
    mod, opt = _trained_shard()
    store = ShardStore([mod], opt, pin=True)
    dev = torch.device("cuda", 0)
    base = torch.cuda.memory_allocated(dev)
    store.promote(dev, copy=True)
    up = torch.cuda.memory_allocated(dev)
    store.demote()
    store.synchronize()
    assert up > base
    assert torch.cuda.memory_allocated(dev) <= base
