"""LoopRunner: a user-driven loop as a Runner (its learnt op pattern, its stores' trips)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tune_hydra as th
from tests.conftest import batches, mlp
from tune_hydra.core.ops import Op, OpKind
from tune_hydra.engine.protocol import check_runner
from tune_hydra.engine.runtime.loop import LoopRunner, in_op


@pytest.fixture
def engine() -> Iterator[th.Engine]:
    threads = torch.get_num_threads()
    eng = th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=3)
    yield eng
    eng.close()
    torch.set_num_threads(threads)


def _loop(engine: th.Engine) -> tuple[LoopRunner, torch.nn.Module, torch.optim.Optimizer]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = th.shard(model, opt, engine=engine)
    for x, y in batches(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    runner = engine.runner(engine.tasks()[0])
    assert isinstance(runner, LoopRunner)
    return runner, model, opt


def test_runner_learns_the_op_pattern_of_a_batch(engine: th.Engine) -> None:
    runner, _, _ = _loop(engine)
    check_runner(runner.name, runner)
    n = len(runner.shards)
    assert n >= 3
    # Forward 0..n-1 then backward n-1..0: one op per shard each way.
    order = runner.order
    assert order.ops_per_batch == 2 * n
    op = Op(runner.name, OpKind.FORWARD, 0)
    assert order.next_shard(op) == 1
    assert order.next_shard(Op(runner.name, OpKind.FORWARD, n - 1)) is None  # B(n-1) next
    assert order.next_shard(Op(runner.name, OpKind.BACKWARD, 1)) == 0
    assert order.ops_until(op, n - 1) == n - 1
    assert order.ops_until(Op(runner.name, OpKind.BACKWARD, n - 1), 0) == n - 1
    # Each op was one granted iteration, all done: nothing is granted or running now.
    assert runner.current is None
    assert engine.summary()["tasks"][runner.name]["iterations"] == runner.iteration == 2 * 2 * n
    assert not in_op()


def test_sync_brings_every_state_home_and_unshard_leaves(engine: th.Engine) -> None:
    runner, model, opt = _loop(engine)
    assert any(s.copied for s in runner.stores)  # resident on the emulated devices
    assert any(s.pending for s in runner.shards)  # the last step waits for the next visit
    params = list(model.parameters())  # the user's view: synchronised
    assert not any(s.copied for s in runner.stores)
    assert not any(s.pending for s in runner.shards)
    assert all(p.grad is not None for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    th.unshard(model)
    assert engine.tasks() == []
    assert not any(s.copied for s in runner.stores)


def test_the_state_at_home_is_held_from_the_disk_tier_until_the_next_op(
    tmp_path: Path,
) -> None:
    """Between a sync and the loop's next op the user's thread may write into the state
    (clip_grad_norm_ scales the gradients in place): no spill may write or drop a store
    then, and what the thread wrote makes the host copy and the spill file stale. (A spill
    of another loop's making in that window once put the unclipped gradients to disk and
    the step read them back: two GPT-2 loops with host_memory trained inexactly.)"""
    with th.Engine(
        devices=["cpu", "cpu"],
        copy_on_cpu=True,
        max_layers_per_shard=3,
        host_memory=10**7,
        spill_dir=tmp_path,
    ) as engine:
        runner, model, opt = _loop(engine)
        parts = [p for s in runner.shards for p in s.store.parts()]
        assert not any(engine.host.busy(p) for p in parts)
        # A list of the parameters: a sync, then writes at home (the generator itself
        # would be clipped shard by shard, the state left where it is).
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.01)
        assert all(engine.host.busy(p) for p in parts)  # held: never a spill's victim
        assert not any(p.changes.file_valid for p in parts)  # written: stale files
        x, y = batches(1)[0]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # the next ops: the hold ended
        assert not any(engine.host.busy(p) for p in parts)
        th.unshard(model)


@pytest.mark.parametrize("recompute", [True, False])
def test_graph_dropped_without_backward_is_freed(recompute: bool) -> None:
    # A forward with grad whose output the user drops without backward (a loss computed
    # for logging only): its shard calls and what they hold (saved inputs, a kept graph on
    # the device) go with it, and a kept batch's reservation ends at the loop's next op.
    import gc

    from tune_hydra.engine.runtime.loop import ShardCall

    def calls() -> int:
        gc.collect()
        return sum(type(o) is ShardCall for o in gc.get_objects())

    with th.Engine(
        devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=3, recompute=recompute
    ) as engine:
        model = th.shard(mlp(), engine=engine)
        (x, y), (x2, _) = batches(2)
        before = calls()
        loss = F.cross_entropy(model(x), y)
        assert calls() > before
        loop = engine.runner(engine.tasks()[0])
        assert isinstance(loop, LoopRunner) and loop.keep is not recompute
        assert (engine.kept_on(loop.name) is None) is recompute
        del loss
        assert calls() == before
        model.eval()
        with torch.no_grad():
            model(x2)
        assert engine.kept_on(loop.name) is None
