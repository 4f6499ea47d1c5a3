"""th.shard's checks: two sharded models sharing a trainable submodule, th.configure's and
Engine's options, and a training batch larger than the one the cut was sized on.

On 2 emulated copying CPU devices; float64 and bit-equal where a run is compared with
its plain PyTorch twin.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tests.conftest import batches, mlp
from tune_hydra.engine.registration.partition import layer_costs
from tune_hydra.engine.task import model_layers
from tune_hydra.exceptions import (
    BatchTooLargeError,
    ModelChangedError,
    ShardError,
    SharedModelError,
    UnknownDeviceError,
    UnknownOptionError,
)
from tune_hydra.frontends import shard as shard_mod


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


# -- two sharded models sharing a submodule -------------------------------------------------


def test_two_sharded_models_sharing_a_trainable_submodule_are_refused(engine: th.Engine) -> None:
    a, b = mlp(), mlp(seed=1)
    b[4] = a[4]  # the same Linear, trained by both
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    x, y = batches(1)[0]
    step(b, ob, x, y)  # b's optimizer has state before th.shard
    momentum = {id(p): s["momentum_buffer"].clone() for p, s in ob.state.items()}
    a, oa = th.shard(a, oa, engine=engine)
    b, ob = th.shard(b, ob, engine=engine)
    step(a, oa, x, y)
    with pytest.raises(SharedModelError, match=r"'4\.weight', '4\.bias'") as info:
        b(x)
    assert isinstance(info.value, ShardError)
    text = str(info.value)
    assert "module(s) '4'" in text and "copy.deepcopy" in text and "th.shard it once" in text
    assert engine.tasks() == [a.__dict__["_th_shard"].loop.name]
    # Nothing of b's optimizer was lost to the refused cut.
    assert {id(p): s["momentum_buffer"] for p, s in ob.state.items()}.keys() == momentum.keys()
    for p, s in ob.state.items():
        assert torch.equal(s["momentum_buffer"], momentum[id(p)])
    with pytest.raises(SharedModelError):  # and again at the next forward
        b(x)
    step(a, oa, x, y)  # a trains on


def test_the_fix_deepcopy_of_the_shared_module_trains_as_plain(engine: th.Engine) -> None:
    a, b = mlp(), mlp(seed=1)
    b[4] = copy.deepcopy(a[4])
    refs = copy.deepcopy([a, b])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in refs]
    a, oa = th.shard(a, opts[0], engine=engine)
    b, ob = th.shard(b, opts[1], engine=engine)
    data = batches(3)
    torch.manual_seed(0)
    got = [step(m, o, x, y) for x, y in data for m, o in ((a, oa), (b, ob))]
    torch.manual_seed(0)
    want = [step(m, o, x, y) for x, y in data for m, o in zip(refs, ref_opts, strict=True)]
    assert got == want


@pytest.mark.parametrize("change", ["share", "replace", "delete", "nested"])
def test_a_submodule_replaced_after_the_cut_is_refused(engine: th.Engine, change: str) -> None:
    """#29: sharing a submodule after both models were cut (``b[4] = a[4]``), or replacing
    or removing one, was accepted and trained the modules of the cut: the model silently
    trained something else than the user's code said. Now the next forward raises, naming
    the submodule; nothing of it reaches the engine, and th.unshard gives the model back
    (with the change) to train plainly or shard again."""
    a, b = mlp(), mlp(seed=1)
    if change == "nested":
        b = nn.Sequential(nn.Identity(), b)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    a, oa = th.shard(a, oa, engine=engine)
    b, ob = th.shard(b, ob, engine=engine)
    x, y = batches(1)[0]
    step(a, oa, x, y)
    step(b, ob, x, y)
    ops = engine.runner(engine.tasks()[1]).iteration
    inner = b[1] if change == "nested" else b
    if change == "share":
        inner[4] = a[4]
    elif change in ("replace", "nested"):
        inner[4] = nn.Linear(16, 10)
    else:  # the last one (a Sequential renumbers the ones after a deleted one)
        del inner[len(inner) - 1]
    path = {"nested": "1.4", "delete": str(len(inner))}.get(change, "4")
    what = "removed" if change == "delete" else "replaced by a Linear"
    with pytest.raises(ModelChangedError, match=rf"submodule '{path}' \(Linear\) .* {what}"):
        b(x)
    assert engine.runner(engine.tasks()[1]).iteration == ops  # nothing ran
    step(a, oa, x, y)  # a trains on
    plain = th.unshard(b)
    assert (plain[1] if change == "nested" else plain) is inner


def frozen_base(seed: int = 0) -> nn.Sequential:
    m = mlp(seed=seed)
    for p in m[:4].parameters():
        p.requires_grad_(False)
    return m


def trainable(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)


def test_frozen_tensors_shared_with_another_loop_are_not_refused(engine: th.Engine) -> None:
    # A frozen submodule both models use (the same object), equal frozen bases the engine
    # pools by value, and a model unsharded (its frozen tensors copy-on-write views of the
    # pool's) sharded again: none of them trains a tensor another loop trains.
    a, b, c = frozen_base(), frozen_base(), frozen_base()
    b[0] = a[0]
    models = []
    x, y = batches(1)[0]
    for m in (a, b, c):
        m, o = th.shard(m, trainable(m), engine=engine)
        step(m, o, x, y)
        models.append(m)
    assert len(engine.tasks()) == 3
    assert all(len(e.tasks) == 3 for e in engine._registry.frozen.entries())
    th.unshard(c)
    c, oc = th.shard(c, trainable(c), engine=engine)
    step(c, oc, x, y)
    assert len(engine.tasks()) == 3


# -- options --------------------------------------------------------------------------------


@pytest.fixture
def fresh_config(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No embedded engine and no th.configure options, for the test."""
    monkeypatch.setattr(shard_mod, "_ENGINE", None)
    monkeypatch.setattr(shard_mod, "_CONFIG", {})
    yield


def test_configure_refuses_a_device_this_machine_lacks(fresh_config: None) -> None:
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(UnknownDeviceError, match="not available"):
        th.configure(devices=[missing])
    assert shard_mod._CONFIG == {}
    th.configure(devices=["cpu", "cpu"], copy_on_cpu=True)
    assert shard_mod._CONFIG["devices"] == ["cpu", "cpu"]


def test_unknown_option_names_the_closest_one(fresh_config: None) -> None:
    with pytest.raises(UnknownOptionError, match=r"'polcy' \(did you mean 'policy'\?\)"):
        th.configure(polcy="fifo")
    assert shard_mod._CONFIG == {}
    with pytest.raises(UnknownOptionError, match=r"'polcy' \(did you mean 'policy'\?\)"):
        th.Engine(devices="cpu", polcy="fifo")
    with pytest.raises(UnknownOptionError, match=r"'batch_shard' \(did you mean 'batch_shared'"):
        th.Engine(devices="cpu", batch_shard=True)
    assert issubclass(UnknownOptionError, TypeError)  # what Python raised before


# -- a batch larger than the probe's ------------------------------------------------------


def wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 4),
    ).double()


def data(*sizes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,)))
        for n in sizes
    ]


def real_activations(name: str, plan: Any, x: torch.Tensor) -> dict[tuple[str, int], int]:
    """Each shard's activation bytes measured by the probe on the batch ``x`` itself."""
    costs = layer_costs(model_layers(wide()), lambda p: torch.optim.SGD(p, lr=0.1), x)
    return {
        (name, s.index): sum(c.activation_bytes for c in costs[s.start : s.stop])
        for s in plan.shards
    }


def test_a_larger_batch_is_accounted_at_its_size() -> None:
    # The cut (2 layers a shard) holds a batch 8x the first one's: the plan's and the
    # ledger's activations grow with the batch, and the schedule replayed with the real
    # sizes stays within device_memory; training is exact.
    budget = 400 * 1024
    batches_ = data(16, 128, 128)
    with th.Engine(
        devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2, device_memory=budget
    ) as eng:
        model, ref = wide(), wide()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        model, opt = th.shard(model, opt, engine=eng)
        got = [step(model, opt, x, y) for x, y in batches_]
        loop = model.__dict__["_th_shard"].loop
        plan = eng.plan(loop.name)
        real = real_activations(loop.name, plan, batches_[1][0])
        assert [s.activation_bytes for s in plan.shards] == list(real.values())
        assert loop.plan is plan
        for s, spec in zip(loop.shards, plan.shards, strict=True):
            assert s.store.activation_bytes == spec.activation_bytes
        eng.trace.validate(state_budget=budget, activation_bytes=real)
    assert got == [step(ref, ref_opt, x, y) for x, y in batches_]


@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_a_larger_batch_the_cut_cannot_hold_is_refused_before_it_runs(kept: bool) -> None:
    # Cut on 16 samples to fill 300 KiB, the model cannot take 128 without a new cut (or,
    # keeping graphs, 128 samples' graphs of every shard do not fit 700 KiB): a clear
    # error before any of that batch's ops; the loop trains on at the first size.
    budget = (700 if kept else 300) * 1024
    small, big, small2 = data(16, 128, 16)
    options: dict[str, Any] = {"recompute": False, "max_layers_per_shard": 2} if kept else {}
    with th.Engine(
        devices=["cpu", "cpu"], copy_on_cpu=True, device_memory=budget, **options
    ) as eng:
        model = wide()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = th.shard(model, opt, engine=eng)
        step(model, opt, *small)
        loop = model.__dict__["_th_shard"].loop
        assert loop.keep is kept
        ops = len(eng.trace.events)
        with pytest.raises(BatchTooLargeError, match="first forward") as info:
            step(model, opt, *big)
        assert isinstance(info.value, ShardError) and isinstance(info.value, MemoryError)
        assert "device_memory" in str(info.value)
        assert ("recompute=False" in str(info.value)) is kept
        assert not [e for e in eng.trace.events[ops:] if e.is_compute and e.batch == 1]
        step(model, opt, *small2)
        real = real_activations(loop.name, eng.plan(loop.name), small[0])
        eng.trace.validate(state_budget=budget, activation_bytes=real)
