"""th.shard and autograd beyond one ``loss.backward()``: ``retain_graph``, ``autograd.grad``,
``backward(inputs=...)``, double backward; and the user's intra-op thread count.

Every reference is the same code on a ``copy.deepcopy`` of the model without ``th.shard``
(float64, bit-equal); the sharded runs use 2 emulated copying devices, recomputing (the
default there) or keeping their graphs (``recompute=False``). What a sharded model cannot
do raises an :class:`UnsupportedCallError` that says what to do instead.
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
from tune_hydra.exceptions import UnsupportedCallError

MODES = ["recompute", "kept"]


@pytest.fixture(params=MODES)
def eng(request: pytest.FixtureRequest, one_torch_thread: None) -> Iterator[th.Engine]:
    """2 emulated copying devices, at most 1 layer a shard; recomputing or keeping graphs."""
    e = th.Engine(
        devices=["cpu", "cpu"],
        copy_on_cpu=True,
        max_layers_per_shard=1,
        recompute=request.param == "recompute",
    )
    yield e
    e.close()


def pair(engine: th.Engine, lr: float = 0.05) -> tuple[Any, Any, Any, Any]:
    """(sharded model, its optimizer, plain copy, its optimizer)."""
    model = mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    model, opt = th.shard(model, opt, engine=engine)
    return model, opt, ref, ref_opt


def assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sb:
        assert torch.equal(sa[k], sb[k]), k
    for (k, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            assert p.grad is None and q.grad is None, k
        else:
            assert torch.equal(p.grad, q.grad), k


# -- 8: retain_graph ------------------------------------------------------------------------


def test_retain_graph_second_backward_adds_up(eng: th.Engine) -> None:
    # backward(retain_graph=True) then backward() through the same graph: the gradients
    # of both add up, as in plain PyTorch; then a step, and the next batches train on.
    model, opt, ref, ref_opt = pair(eng)
    data = batches(3)
    hist: list[list[float]] = [[], []]
    for k, (m, o) in enumerate([(model, opt), (ref, ref_opt)]):
        torch.manual_seed(5)
        for x, y in data:
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward(retain_graph=True)
            (2 * loss).backward(retain_graph=True)
            loss.backward()
            hist[k].append(loss.item())
            o.step()
    assert hist[0] == hist[1]
    assert_same(model, ref)
    assert model.__dict__["_th_shard"].loop.keep is (eng.recompute is False)
    assert not model.__dict__["_th_shard"].loop.keeps_batch


def test_second_backward_without_retain_graph_raises_torchs_error(eng: th.Engine) -> None:
    # .sum() saves nothing: the second backward reaches the shards' nodes themselves,
    # which say what plain PyTorch says; the first backward's gradients are plain's.
    model, _, ref, _ = pair(eng)
    x, _ = batches(1)[0]
    errors = []
    for m in (model, ref):
        torch.manual_seed(5)
        loss = m(x).sum()
        loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time") as e:
            loss.backward()
        errors.append(type(e.value))
    assert errors[0] is errors[1]
    assert_same(model, ref)


def test_retained_backward_after_step_raises(eng: th.Engine) -> None:
    # A step between a retained graph's two backward calls changed the weights the forward
    # ran with: plain PyTorch's saved tensors catch it; the shards' recompute would use
    # the new weights, so it refuses.
    model, opt, ref, ref_opt = pair(eng)
    x, y = batches(1)[0]
    for m, o in ((model, opt), (ref, ref_opt)):
        loss = F.cross_entropy(m(x), y)
        loss.backward(retain_graph=True)
        o.step()
        error = UnsupportedCallError if m is model else RuntimeError
        with pytest.raises(error, match="inplace operation"):
            loss.backward()


# -- 10: autograd.grad, backward(inputs=...), double backward ---------------------------------


def test_autograd_grad_wrt_inputs_exact(eng: th.Engine) -> None:
    # torch.autograd.grad w.r.t. the model's input (and backward(inputs=[x])) gives the
    # input's gradient and leaves the parameters' .grad alone, as plain; a retained graph
    # then back-propagates into the parameters as usual.
    model, _, ref, _ = pair(eng)
    x0, y = batches(1)[0]
    got = []
    for m in (model, ref):
        torch.manual_seed(5)
        x = x0.clone().requires_grad_(True)
        loss = F.cross_entropy(m(x), y)
        (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
        assert all(p.grad is None for p in m.parameters())
        loss.backward(inputs=[x], retain_graph=True)
        assert all(p.grad is None for p in m.parameters())
        loss.backward()
        got.append((gx, x.grad))
    assert torch.equal(got[0][0], got[1][0])
    assert torch.equal(got[0][1], got[1][1])
    assert_same(model, ref)


@pytest.mark.parametrize("how", ["grad", "grad_unused", "backward_inputs"])
def test_gradients_wrt_parameters_raise(how: str, eng: th.Engine) -> None:
    # A sharded model's parameters get their gradients on the engine's devices, as .grad
    # after loss.backward(): autograd.grad w.r.t. them (or backward(inputs=params)) would
    # come back empty, so it raises, saying what to do; nothing was accumulated.
    model, _, _, _ = pair(eng)
    x, y = batches(1)[0]
    loss = F.cross_entropy(model(x), y)
    params = list(model.parameters())
    with pytest.raises(UnsupportedCallError, match=r"loss\.backward\(\)"):
        if how == "grad":
            torch.autograd.grad(loss, params)
        elif how == "grad_unused":
            torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        else:
            loss.backward(inputs=params)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_double_backward_raises(eng: th.Engine) -> None:
    # A gradient penalty (autograd.grad(out, x, create_graph=True), then backward of a
    # function of that gradient) needs the backward ops' own graph: unsupported, said so.
    model, _, _, _ = pair(eng)
    x0, y = batches(1)[0]
    x = x0.clone().requires_grad_(True)
    out = model(x)
    with pytest.raises(UnsupportedCallError, match="create_graph"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.cross_entropy(model(x0), y)
    with pytest.raises(UnsupportedCallError, match="create_graph"):
        loss.backward(create_graph=True)


# -- 5: the user's intra-op thread count ------------------------------------------------------


def _generator() -> nn.Module:
    return nn.Sequential(
        nn.ConvTranspose2d(4, 8, 4, 1, 0),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 4, 4, 0),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.ConvTranspose2d(4, 1, 4, 4, 0),
        nn.Tanh(),
    ).double()


def _discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 4, 2, 1),
        nn.BatchNorm2d(8),
        nn.LeakyReLU(0.2),
        nn.Conv2d(8, 16, 4, 2, 1),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 1),
    ).double()


def _gan(g: nn.Module, d: nn.Module, engine: th.Engine | None) -> list[float]:
    """A DCGAN step, twice: the discriminator on real and detached fake 64x64 images, then
    the generator through it (two models, two optimizers)."""
    og = torch.optim.Adam(g.parameters(), lr=1e-3)
    od = torch.optim.Adam(d.parameters(), lr=1e-3)
    if engine is not None:
        g, og = th.shard(g, og, engine=engine)
        d, od = th.shard(d, od, engine=engine)
    gen = torch.Generator().manual_seed(1)
    hist = []
    for _ in range(2):
        real = torch.randn(8, 1, 64, 64, generator=gen, dtype=torch.float64)
        z = torch.randn(8, 4, 1, 1, generator=gen, dtype=torch.float64)
        od.zero_grad()
        fake = g(z)
        ld = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        ld.backward()
        od.step()
        og.zero_grad()
        lg = F.softplus(-d(fake)).mean()
        lg.backward()
        og.step()
        hist += [ld.item(), lg.item()]
    return hist


@pytest.mark.parametrize("made_at", [1, 2])
def test_one_device_engine_computes_at_the_users_thread_count(made_at: int) -> None:
    # A 1-device engine (th.shard's embedded engine on a CPU machine) made while torch had
    # another thread count (th.configure'd early, a test on one thread before): each op
    # runs with the count the user's thread has at that op, so a conv's weight gradient
    # (summed across threads on 64x64 images) rounds as plain's at the user's setting.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(made_at)
        engine = th.Engine(devices=["cpu"], copy_on_cpu=True, max_layers_per_shard=2)
        try:
            torch.set_num_threads(2)
            torch.manual_seed(0)
            g, d = _generator(), _discriminator()
            rg, rd = copy.deepcopy(g), copy.deepcopy(d)
            got = _gan(g, d, engine)
            want = _gan(rg, rd, None)
            assert got == want
            assert_same(g, rg)
            assert_same(d, rd)
        finally:
            engine.close()
    finally:
        torch.set_num_threads(threads)
