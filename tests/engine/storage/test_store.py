"""Shard store: promote/demote round trips are bitwise exact for every tensor; its residency
and its tier, seen through training."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.engine.storage.counting_tier import CountingTier
from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.trace import Trace
from tune_hydra.engine.dispatch.workers import Assignment, DeviceWorker, default_clock
from tune_hydra.engine.storage import HostTier, Residency, ShardStore


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


def test_residency_follows_promote_demote_and_retire() -> None:
    mod, opt = _trained_shard()
    store = ShardStore([mod], opt)
    cpu, worker, other = torch.device("cpu"), object(), object()
    assert store.residency is Residency.HOST and store.device == cpu and store.owner is None
    assert store.promote(cpu, copy=False, owner=worker) == 0  # host memory used in place
    assert store.residency is Residency.IN_PLACE and store.owner is worker
    assert not store.copied
    assert store.demote(only_owner=other) == 0 and store.owner is worker  # not other's
    assert store.try_promote(cpu, copy=True, owner=other) == store.nbytes()
    assert store.residency is Residency.DEVICE and store.owner is other and store.copied
    assert store.demote(only_owner=worker) == 0 and store.copied  # other's copy stays
    assert store.retire() > 0
    assert store.residency is Residency.RETIRED and store.retired and store.owner is None
    assert store.demote() == 0 and store.retired  # home already: stays retired
    assert store.promote(cpu, copy=False, owner=worker) == 0
    assert store.residency is Residency.IN_PLACE and not store.retired


def test_host_tensors_are_the_params_and_buffers_at_home() -> None:
    mod, opt = _trained_shard()
    store = ShardStore([mod], opt)
    params = {id(p): p for p in mod.parameters()}

    def pairs() -> dict[Any, torch.Tensor]:
        out: dict[Any, torch.Tensor] = {}
        for holder, t in store.host_tensors():
            out[holder if isinstance(holder, tuple) else id(holder)] = t
        return out

    home = pairs()
    assert home.keys() == set(params) | {(mod[1], n) for n in mod[1]._buffers}
    assert all(home[i].data_ptr() == p.data_ptr() for i, p in params.items())
    store.promote(torch.device("cpu"), copy=True)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(1.0)  # on the device copy: the host tensors keep the demoted values
    away = pairs()
    assert all(away[i] is home[i] for i in params)
    assert all(not torch.equal(away[i], p) for i, p in params.items())
    store.demote()
    assert all(torch.equal(home[i], p) for i, p in params.items())


def test_a_given_tier_holds_the_host_buffers() -> None:
    mod, opt = _trained_shard()
    tier = CountingTier()
    store = ShardStore([mod], opt, pin=True, tier=tier)  # the tier decides, not pin
    assert store.tier is tier and not tier.pinned
    assert tier.written_bytes == tier.nbytes() == store.nbytes()  # kept at construction
    ptrs = [p.data_ptr() for p in mod.parameters()]
    assert ptrs == [tier.get(("p", i)).data_ptr() for i in range(len(ptrs))]
    assert isinstance(ShardStore([nn.Linear(2, 2)]).tier, HostTier)


# -- the seam: a counting tier under the engine's device worker, training two tasks --------


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _batches(seed: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(6, 5, generator=g, dtype=torch.float64),
            torch.randn(6, 3, generator=g, dtype=torch.float64),
        )
        for _ in range(n)
    ]


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


class _SplitTask:
    """A two-shard model whose stores keep their host state in counting tiers; each batch
    runs as three worker ops (forward of shard 0, shard 1 with the loss, then shard 0's
    backward, recomputing its forward), each shard stepping its own optimizer."""

    def __init__(self, name: str, model: nn.Sequential) -> None:
        self.name = name
        self.shards = [model[:2], model[2:]]
        self.opts = [_adam(s.parameters()) for s in self.shards]
        self.tiers = [CountingTier(), CountingTier()]
        self.stores = [
            ShardStore([s], o, name=(name, i), tier=t)
            for i, (s, o, t) in enumerate(zip(self.shards, self.opts, self.tiers, strict=True))
        ]
        self.kept = [t.written_bytes for t in self.tiers]  # at construction, not traffic
        self.losses: list[float] = []

    def ops(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[int, OpKind, Any]]:
        carry: dict[str, torch.Tensor] = {}

        def forward(device: torch.device) -> None:
            self.opts[0].zero_grad()
            with torch.no_grad():
                carry["h"] = self.shards[0](x)

        def last(device: torch.device) -> None:
            self.opts[1].zero_grad()
            h = carry["h"].requires_grad_()
            loss = nn.functional.mse_loss(self.shards[1](h), y)
            loss.backward()
            self.losses.append(loss.item())
            assert h.grad is not None
            carry["g"] = h.grad
            self.opts[1].step()

        def backward(device: torch.device) -> None:
            self.shards[0](x).backward(carry["g"])
            self.opts[0].step()

        return [
            (0, OpKind.FORWARD, forward),
            (1, OpKind.BACKWARD, last),
            (0, OpKind.BACKWARD, backward),
        ]


def _run(worker: DeviceWorker, task: _SplitTask, shard: int, kind: OpKind, run: Any) -> None:
    finished = threading.Event()
    errors: list[BaseException] = []

    def done(a: Assignment, err: BaseException | None) -> None:
        worker.assigned.remove(a)  # what the engine does when an op ends
        if err is not None:
            errors.append(err)
        finished.set()

    worker.submit(Assignment(Op(task.name, kind, shard), task.stores[shard], run=run, done=done))
    assert finished.wait(10)
    assert not errors, errors


def test_a_counting_tier_under_a_device_worker_trains_two_tasks_exactly() -> None:
    """Two tasks' four shards take turns on one copying device (two resident at a time),
    their host state in a toy tier: training equals plain training on deep copies, and the
    tier's traffic is exactly the trace's copies."""
    models = {"a": _net(0), "b": _net(1)}
    data = {"a": _batches(2), "b": _batches(3)}
    refs = {
        n: th.ModelTask(copy.deepcopy(m), nn.MSELoss(), _adam, data[n]) for n, m in models.items()
    }
    tasks = {n: _SplitTask(n, m) for n, m in models.items()}
    worker = DeviceWorker(
        0, torch.device("cpu"), "dev", Trace(["dev"]), default_clock(), prefetch=True, copy=True
    )
    try:
        for _epoch in range(2):
            for b in range(len(data["a"])):
                for name, task in tasks.items():
                    for shard, kind, run in task.ops(*data[name][b]):
                        _run(worker, task, shard, kind, run)
        for task in tasks.values():  # as the engine offloads a leaving task
            for store in task.stores:
                with store.lock:
                    if isinstance(store.owner, DeviceWorker):
                        store.owner.evict(store)
                    store.retire()
    finally:
        worker.close()
        worker.join(5.0)
    events = worker.trace.events
    for name, task in tasks.items():
        want = th.train_plain(refs[name], 2, seed=0)
        n = len(data[name])
        got = [sum(task.losses[i : i + n]) / n for i in range(0, 2 * n, n)]
        assert got == [e["loss"] for e in want]
        ref = refs[name].model
        assert isinstance(ref, nn.Module)
        for p, q in zip(models[name].parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert p.device.type == "cpu" and torch.equal(p, q) and torch.equal(p.grad, q.grad)
        copied_out = sum(e.bytes_moved for e in events if e.task == name and e.op == "copy_out")
        copied_in = sum(e.bytes_moved for e in events if e.task == name and e.op == "copy_in")
        # A visit that changed nothing would end with a copy_out of 0 bytes (its copy
        # dropped, the tier's values kept); here every visit ends after a backward.
        dropped, last_in = 0, {}
        for e in events:
            if e.task == name and e.op == "copy_in":
                last_in[e.shard] = e.bytes_moved
            elif e.task == name and e.op == "copy_out" and not e.bytes_moved:
                dropped += last_in[e.shard]
        written = sum(t.written_bytes - k for t, k in zip(task.tiers, task.kept, strict=True))
        assert copied_out > 0 and written == copied_out  # every write-back went to the tier
        assert sum(s.moved_total for s in task.stores) == copied_in + copied_out
        # Live slots point back at it: what was written, and the values a drop kept.
        assert sum(t.read_bytes for t in task.tiers) == written + dropped
        for store, tier in zip(task.stores, task.tiers, strict=True):
            assert store.residency is Residency.RETIRED
            assert tier.nbytes() == store.nbytes()  # grads and moments are at home, too
            for holder, t in store.host_tensors():  # no buffers here: parameters only
                assert isinstance(holder, nn.Parameter) and t.data_ptr() == holder.data_ptr()
