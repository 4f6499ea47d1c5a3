"""th.shard: copies of a sharded model or optimizer (``copy.deepcopy``, ``pickle``,
``torch.save``) are the user's plain objects with the current state.

An EMA or best-model snapshot (``ema = copy.deepcopy(model)``) and ``torch.save(model)``
get the user's own class, not sharded, with the weights synced home from the shards and
tensors of their own; the optimizer's copy is its plain class with the shards' state.
Every reference is the same loop on a plain copy (float64, bit-equal), on 2 emulated
copying devices.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tests.conftest import assert_same, assert_same_optimizer, batches, mlp


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any]) -> list[float]:
    out = []
    model.train()
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def pair(engine: th.Engine) -> tuple[Any, Any, nn.Module, torch.optim.Optimizer]:
    """(sharded model, its Adam, plain copy, its Adam), both trained on 2 batches."""
    model = mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    model, opt = th.shard(model, opt, engine=engine)
    data = batches(2)
    torch.manual_seed(1)
    got = train(model, opt, data)
    torch.manual_seed(1)
    assert got == train(ref, ref_opt, data)
    return model, opt, ref, ref_opt


def assert_plain_copy(copied: Any, model: nn.Module) -> None:
    """``copied`` is the user's class, not sharded, equal to ``model``, with tensors of
    its own."""
    assert type(copied) is nn.Sequential
    assert "_th_shard" not in copied.__dict__
    assert_same(copied, model)
    ptrs = {p.data_ptr() for p in nn.Module.parameters(model)}
    assert not ptrs & {p.data_ptr() for p in copied.parameters()}


def test_deepcopy_is_the_users_plain_model_and_the_original_trains_on(
    engine: th.Engine,
) -> None:
    model, opt, ref, ref_opt = pair(engine)
    snap = copy.deepcopy(model)
    assert_plain_copy(snap, model)
    assert "_th_shard" in model.__dict__  # the original stays sharded
    assert len(engine.tasks()) == 1
    before = {k: v.clone() for k, v in snap.state_dict().items()}
    data = batches(3, seed=4)
    torch.manual_seed(2)
    got = train(model, opt, data)
    torch.manual_seed(2)
    assert got == train(ref, ref_opt, data)
    assert_same(model, ref)
    assert_same_optimizer(opt.state_dict(), ref_opt.state_dict())
    for k, v in snap.state_dict().items():  # the copy did not move with the original
        assert torch.equal(v, before[k]), k
    # The copy trains as a plain model of its own.
    snap_opt = torch.optim.SGD(snap.parameters(), lr=0.1)
    train(snap, snap_opt, data[:1])
    assert len(engine.tasks()) == 1


def test_deepcopy_before_the_first_forward(engine: th.Engine) -> None:
    model = th.shard(mlp(), engine=engine)
    snap = copy.deepcopy(model)
    assert_plain_copy(snap, model)
    assert engine.tasks() == []


def test_ema_of_a_sharded_model_equals_plain(engine: th.Engine) -> None:
    def run(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[float], nn.Module]:
        ema = copy.deepcopy(model)
        out = []
        for x, y in batches(4):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.mul_(0.9).add_(p, alpha=0.1)
            out.append(loss.item())
        return out, ema

    model = mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model, opt = th.shard(model, opt, engine=engine)
    torch.manual_seed(3)
    got, ema = run(model, opt)
    torch.manual_seed(3)
    want, ref_ema = run(ref, ref_opt)
    assert got == want
    assert type(ema) is nn.Sequential
    assert_same(ema, ref_ema)
    assert_same(model, ref)


def test_torch_save_and_pickle_round_trip_model_and_optimizer(engine: th.Engine) -> None:
    model, opt, ref, ref_opt = pair(engine)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert_plain_copy(loaded, model)
    unpickled = pickle.loads(pickle.dumps(model))
    assert_plain_copy(unpickled, model)
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded_opt = torch.load(buf, weights_only=False)
    assert type(loaded_opt) is torch.optim.Adam and "_th_shard" not in loaded_opt.__dict__
    assert_same_optimizer(loaded_opt.state_dict(), ref_opt.state_dict())
    copied_opt = copy.deepcopy(opt)
    assert type(copied_opt) is torch.optim.Adam
    assert_same_optimizer(copied_opt.state_dict(), ref_opt.state_dict())
    # Saved together, the two load as a plain pair that trains on as the plain run.
    buf = io.BytesIO()
    torch.save({"model": model, "opt": opt}, buf)
    buf.seek(0)
    both = torch.load(buf, weights_only=False)
    m2, o2 = both["model"], both["opt"]
    assert {id(p) for g in o2.param_groups for p in g["params"]} == {id(p) for p in m2.parameters()}
    data = batches(2, seed=6)
    torch.manual_seed(4)
    want = train(ref, ref_opt, data)
    torch.manual_seed(4)
    assert train(m2, o2, data) == want
    assert_same(m2, ref)
    torch.manual_seed(4)
    assert train(model, opt, data) == want  # and the sharded original too
    assert_same(model, ref)


def test_deepcopy_of_a_model_sharing_frozen_tensors_is_independent(engine: th.Engine) -> None:
    # Two loops with one equal frozen base: the engine's pool holds it once, for both. A
    # copy of one gets tensors of its own; writing them reaches neither loop.
    def frozen_base() -> nn.Module:
        m = mlp()
        for p in m[:4].parameters():
            p.requires_grad_(False)
        return m

    models, refs, opts, ref_opts = [], [], [], []
    for _ in range(2):
        m = frozen_base()
        refs.append(copy.deepcopy(m))
        ref_opts.append(torch.optim.SGD([p for p in refs[-1].parameters() if p.requires_grad], 0.1))
        o = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        m, o = th.shard(m, o, engine=engine)
        models.append(m)
        opts.append(o)
    data = batches(2)
    for i in range(2):
        torch.manual_seed(i)
        train(models[i], opts[i], data[:1])
        torch.manual_seed(i)
        train(refs[i], ref_opts[i], data[:1])
    pool = engine._registry.frozen
    assert pool.entries() and all(len(e.tasks) == 2 for e in pool.entries())
    snap = copy.deepcopy(models[0])
    assert_plain_copy(snap, models[0])
    with torch.no_grad():
        for p in snap.parameters():
            p.add_(1.0)
    for i in range(2):
        torch.manual_seed(10 + i)
        got = train(models[i], opts[i], data)
        torch.manual_seed(10 + i)
        assert got == train(refs[i], ref_opts[i], data)
        assert_same(models[i], refs[i])
