"""th.shard's optimizer beyond plain steps: groups added after the cut, unshard, failing steps.

- ``optimizer.add_param_group`` after ``th.shard`` (gradual unfreezing) steps the new
  group's parameters exactly as plain PyTorch, with or without them frozen at the cut, a
  scheduler iterating ``param_groups`` and the optimizer's ``state_dict`` round trip;
  groups changed in ways the shards cannot follow are refused with the fix.
- ``th.unshard`` hands every shard optimizer's state back to the user's optimizer: plain
  training goes on bit-exact.
- a failing ``optimizer.step()`` (deferred to the shard's next op) reaches the user at
  ``th.unshard`` or at a sync of the user's thread, once, and the loop still leaves the
  engine.

Every reference is the same loop on a ``copy.deepcopy`` of the model without ``th.shard``
(float64, ``torch.equal``), on the shared 2-device ``engine`` fixture and one torch thread.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tests.conftest import assert_same, assert_same_optimizer, batches
from tune_hydra.exceptions import OptimizerMismatchError, UnsupportedCallError


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
}


def net() -> nn.Sequential:
    """Three shards on the ``engine`` fixture (at most 2 layers each): [0, 1], [2, 3], [4]."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    ).double()


def steps(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], sched: Any = None
) -> list[float]:
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        out.append(loss.item())
    return out


# -- add_param_group after th.shard ------------------------------------------------------


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_add_param_group_after_shard_exact(opt: str, frozen: bool, engine: th.Engine) -> None:
    # Gradual unfreezing: layer 0 (its own shard, which has no optimizer at the cut) and
    # layer 2's bias (a shard with one) join in a new group with an lr of its own, under
    # a scheduler made before; its lr set by hand later; then a state_dict round trip.
    data = batches(8, seed=4)

    def run(model: nn.Module, o: torch.optim.Optimizer) -> tuple[list[float], dict[str, Any]]:
        sched = torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)
        out = steps(model, o, data[:2], sched)
        model[0].requires_grad_(True)
        o.add_param_group({"params": [*model[0].parameters(), model[2].bias], "lr": 3e-3})
        out += steps(model, o, data[2:4], sched)
        o.param_groups[-1]["lr"] = 1e-3
        out += steps(model, o, data[4:6], sched)
        sd = copy.deepcopy(o.state_dict())
        o.load_state_dict(copy.deepcopy(sd))
        out += steps(model, o, data[6:], sched)
        return out, sd

    model = net()
    if frozen:
        model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    start = model[0].weight.detach().clone()

    def first(m: nn.Module) -> torch.optim.Optimizer:
        return OPTIMIZERS[opt]([m[2].weight, *m[4].parameters()])

    model, optimizer = th.shard(model, first(model), engine=engine)
    got, got_sd = run(model, optimizer)
    want, want_sd = run(ref, first(ref))
    assert got == want
    assert_same(model, ref)
    assert_same_optimizer(got_sd, want_sd)
    assert len(got_sd["param_groups"]) == 2 and len(got_sd["state"]) == 6
    assert not torch.equal(model[0].weight.detach(), start)  # the added layer trained
    loop = model.__dict__["_th_shard"].loop
    assert len(loop.shards) == 3 and loop.shards[0].optimizer is not None
    th.unshard(model)


def test_add_param_group_before_first_forward_exact(engine: th.Engine) -> None:
    # Added between th.shard and the cut: the cut splits it like the others.
    data = batches(3, seed=5)
    model = net()
    ref = copy.deepcopy(model)

    def run(m: nn.Module, o: torch.optim.Optimizer) -> list[float]:
        o.add_param_group({"params": m[0].parameters(), "lr": 2e-3})
        return steps(m, o, data)

    model, optimizer = th.shard(model, OPTIMIZERS["adam"](model[2:].parameters()), engine=engine)
    assert run(model, optimizer) == run(ref, OPTIMIZERS["adam"](ref[2:].parameters()))
    assert_same(model, ref)


def test_param_groups_changed_unfollowably_are_refused(engine: th.Engine) -> None:
    data = batches(2, seed=6)
    model = net()
    model, optimizer = th.shard(model, OPTIMIZERS["sgd"](model[2:].parameters()), engine=engine)
    steps(model, optimizer, data[:1])
    groups = len(optimizer.param_groups)
    with pytest.raises(OptimizerMismatchError, match="not the model's"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(optimizer.param_groups) == groups  # left as it was
    optimizer.param_groups[0]["params"].append(model[0].weight)
    with pytest.raises(UnsupportedCallError, match="add_param_group"):
        optimizer.step()
    optimizer.param_groups[0]["params"].pop()
    optimizer.param_groups.pop()
    with pytest.raises(UnsupportedCallError, match="removed"):
        optimizer.step()
    th.unshard(model)


# -- unshard hands the optimizer's state back ----------------------------------------------


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_unshard_keeps_optimizer_state_plain_training_goes_on_exact(
    opt: str, engine: th.Engine
) -> None:
    data = batches(6, seed=7)
    model = net()
    ref = copy.deepcopy(model)
    ref_opt = OPTIMIZERS[opt](ref.parameters())
    model, optimizer = th.shard(model, OPTIMIZERS[opt](model.parameters()), engine=engine)
    got = steps(model, optimizer, data[:3])
    th.unshard(model)
    assert engine.tasks() == []
    assert type(optimizer) is type(ref_opt)
    assert len(optimizer.state) == len(list(model.parameters()))
    got += steps(model, optimizer, data[3:])
    assert got == steps(ref, ref_opt, data)
    assert_same(model, ref)
    assert_same_optimizer(optimizer.state_dict(), ref_opt.state_dict())


# -- a failing step ------------------------------------------------------------------------


class NanCheckSGD(torch.optim.SGD):
    """A user's optimizer refusing to step on a non-finite gradient."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    raise FloatingPointError("non-finite gradient: step refused")
        return super().step(closure)


def _nan_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batches(1, seed=8)[0]
    x = x.clone()
    x[0, 0] = float("nan")
    return x, y


def _plain_with_refused_step(data: list[Any]) -> nn.Module:
    ref = net()
    o = NanCheckSGD(ref.parameters(), lr=0.05, momentum=0.9)
    steps(ref, o, data)
    with pytest.raises(FloatingPointError):
        steps(ref, o, [_nan_batch()])
    return ref


def test_failing_last_step_raises_at_unshard_and_leaves(engine: th.Engine) -> None:
    data = batches(2, seed=9)
    model = net()
    optimizer = NanCheckSGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = th.shard(model, optimizer, engine=engine)
    steps(model, optimizer, [*data, _nan_batch()])  # the refused step is deferred
    with pytest.raises(FloatingPointError, match="step refused"):
        th.unshard(model)
    assert engine.tasks() == []
    assert type(model) is nn.Sequential and "_th_shard" not in model.__dict__
    assert type(optimizer) is NanCheckSGD
    assert_same(model, _plain_with_refused_step(data))


def test_failing_step_raises_at_a_sync_once(engine: th.Engine) -> None:
    data = batches(2, seed=9)
    model = net()
    optimizer = NanCheckSGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = th.shard(model, optimizer, engine=engine)
    steps(model, optimizer, [*data, _nan_batch()])
    with pytest.raises(FloatingPointError, match="step refused"):
        model.state_dict()
    assert_same(model, _plain_with_refused_step(data))  # raised once: the step is dropped
    th.unshard(model)
    assert engine.tasks() == []


def test_close_that_must_not_raise_logs_the_step_error(
    engine: th.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    model = net()
    optimizer = NanCheckSGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = th.shard(model, optimizer, engine=engine)
    steps(model, optimizer, [_nan_batch()])
    loop = model.__dict__["_th_shard"].loop
    with caplog.at_level(logging.WARNING, logger="tune_hydra.engine.runtime.loop"):
        loop.close(raise_errors=False)
    assert "step refused" in caplog.text
    assert engine.tasks() == []


# -- step(closure), an optimizer built after th.shard, LBFGS -----------------------------


def closure_steps(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any]) -> list[Any]:
    """The loop as Lightning's automatic optimization runs it: everything in the closure,
    ``step(closure)`` called without grad (torch's optimizers enable it for the closure)."""
    out = []
    for x, y in data:

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        with torch.no_grad():
            out.append(opt.step(closure))
    return out


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_step_with_closure_exact(opt: str, engine: th.Engine) -> None:
    """``step(closure)`` runs the closure with grad, steps every shard and returns the
    closure's loss: per-step losses, weights and optimizer state as plain, float64."""
    data = batches(4, seed=3)
    ref = net()
    ref_opt = OPTIMIZERS[opt](ref.parameters())
    model = copy.deepcopy(ref)
    model, optimizer = th.shard(model, OPTIMIZERS[opt](model.parameters()), engine=engine)
    want = closure_steps(ref, ref_opt, data)
    got = closure_steps(model, optimizer, data)
    assert len(model.__dict__["_th_shard"].loop.shards) == 3
    assert all(isinstance(loss, torch.Tensor) for loss in got)
    assert [loss.item() for loss in got] == [loss.item() for loss in want]
    assert optimizer.step() is None  # without a closure: None, as plain
    ref_opt.step()
    assert_same(model, ref)
    assert_same_optimizer(optimizer.state_dict(), ref_opt.state_dict())
    th.unshard(model)


@pytest.mark.parametrize("cut", [False, True], ids=["before-cut", "after-cut"])
def test_optimizer_built_after_shard_exact(cut: bool, engine: th.Engine) -> None:
    """``th.shard(model)`` first, the optimizer built later over ``model.parameters()`` and
    given with ``th.shard(model, optimizer)`` (Lightning's ``configure_optimizers``):
    trains as plain; after a forward (a cut sized without optimizer state) the loop is
    cut again at the next forward, one loop on the engine."""
    data = batches(4, seed=5)
    ref = net()
    model = th.shard(copy.deepcopy(ref), engine=engine)
    if cut:
        with torch.no_grad():  # an evaluation first (Lightning's sanity check, validate)
            assert torch.equal(model(data[0][0]), ref(data[0][0]))
        assert model.__dict__["_th_shard"].loop is not None
    optimizer = OPTIMIZERS["adam"](model.parameters())
    assert th.shard(model, optimizer) == (model, optimizer)
    assert model.__dict__["_th_shard"].loop is None
    ref_opt = OPTIMIZERS["adam"](ref.parameters())
    assert steps(model, optimizer, data) == steps(ref, ref_opt, data)
    assert_same(model, ref)
    assert_same_optimizer(optimizer.state_dict(), ref_opt.state_dict())
    assert len(engine.tasks()) == 1
    with pytest.raises(th.exceptions.AlreadyShardedError, match="once per model"):
        th.shard(model, OPTIMIZERS["adam"](model.parameters()))
    th.unshard(model)
    assert type(optimizer) is torch.optim.Adam and engine.tasks() == []


class MyLBFGS(torch.optim.LBFGS):
    """A user's LBFGS (another class name)."""


class ClosureRequired(torch.optim.SGD):
    """A user's optimizer whose step needs the closure (no default)."""

    def step(self, closure: Any) -> Any:  # type: ignore[override]
        return super().step(closure)


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, MyLBFGS, ClosureRequired])
def test_optimizers_that_reevaluate_the_closure_are_refused(
    cls: type[torch.optim.Optimizer], engine: th.Engine
) -> None:
    """LBFGS re-runs the closure (the whole model) inside one step and steps every
    parameter together: refused with the fix, at th.shard and for one built later."""
    model = net()
    with pytest.raises(UnsupportedCallError, match=r"shard by shard.*per-parameter optimizer"):
        th.shard(model, cls(model.parameters(), lr=0.1), engine=engine)
    assert type(model) is nn.Sequential  # nothing was sharded
    model = th.shard(model, engine=engine)
    with pytest.raises(UnsupportedCallError, match="re-evaluates the closure"):
        th.shard(model, cls(model.parameters(), lr=0.1))
    th.unshard(model)
