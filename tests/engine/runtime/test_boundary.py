"""Boundary tensors: parking them in host memory while their task waits."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

import tune_hydra as th
from tune_hydra.engine.runtime.boundary import leaves, park

CPU = torch.device("cpu")


def test_park_copies_the_tensors_on_the_device_and_counts_their_bytes() -> None:
    a, b = torch.randn(3, 4), torch.randn(5, dtype=torch.float64)
    nest = {"x": a, "y": [b, 7]}
    out, moved = park([a, None, nest], CPU)
    assert moved == 2 * (a.numel() * 4) + b.numel() * 8
    assert out[1] is None and out[2]["y"][1] == 7
    for new, old in zip(leaves(out), [a, a, b], strict=True):
        assert new.data_ptr() != old.data_ptr()  # a real copy (the CPU stands in for a GPU)
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    other = torch.device("meta")
    out, moved = park([a], other)  # nothing waits on that device
    assert moved == 0 and out[0] is a


def _task() -> th.ModelTask:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )
    data = [
        (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
        for _ in range(3)
    ]
    return th.ModelTask(model.double(), nn.MSELoss(), lambda p: torch.optim.Adam(p, lr=1e-2), data)


def test_a_task_parked_after_every_op_trains_exactly_like_plain_pytorch() -> None:
    """Parking between every two ops (activations forward, gradients back) changes
    nothing: float64 parameters equal plain training bit for bit."""
    task = _task()
    ref = th.ModelTask(copy.deepcopy(task.model), task.loss_fn, task.optimizer, task.train_data)
    th.train_plain(ref, 2, seed=0)
    with th.Engine(devices="cpu", max_layers_per_shard=1) as engine:
        engine.add_task("a", task, seed=0)
        runner = engine.runner("a")
    runner.granted = 2
    parked = 0
    op = runner.advance()
    while runner.granted:
        assert op is not None
        runner.execute(op, CPU)
        waiting = runner.carry_bytes(CPU)
        moved = runner.park_carries(CPU)
        assert moved == waiting
        assert runner.carry_bytes(CPU) == 0  # parked: nothing waits on the device
        parked += moved > 0
        op = runner.advance()
    assert parked >= 2 * 3 * 6  # forward and backward boundaries of every batch
    for p, q in zip(task.model.parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_running_task_is_not_parked() -> None:
    """Parking comes from another thread; while the task's op runs its inputs are in use,
    so parking declines (0 bytes) instead of waiting."""
    task = _task()
    with th.Engine(devices="cpu", max_layers_per_shard=1) as engine:
        engine.add_task("a", task, seed=0)
        runner = engine.runner("a")
    runner.granted = 1
    runner.execute(runner.advance(), CPU)  # type: ignore[arg-type]
    op = runner.advance()
    assert op is not None and runner.carry_bytes(CPU) > 0
    inside = threading.Event()
    release = threading.Event()
    seen: list[int] = []
    module = runner.shards[op.shard].module

    def hold(*_: object) -> None:  # the op is inside its compute until released
        inside.set()
        release.wait(5)

    hook = module.register_forward_pre_hook(hold)
    worker = threading.Thread(target=runner.execute, args=(op, CPU))
    worker.start()
    try:
        assert inside.wait(5)
        seen.append(runner.park_carries(CPU))
    finally:
        release.set()
        worker.join(5)
        hook.remove()
    assert seen == [0]
    assert runner.park_carries(CPU) > 0  # waiting again: now it parks


def test_a_late_park_leaves_the_next_ops_boundary_tensors_alone() -> None:
    """A worker that read a task's carry and parks it only after the task's next op ran
    (elsewhere) must not park what that op left: the device it ran on counts those, and
    on emulated CPU devices every tensor is on ``cpu``."""
    task = _task()
    with th.Engine(devices="cpu", max_layers_per_shard=1) as engine:
        engine.add_task("a", task, seed=0)
        runner = engine.runner("a")
    runner.granted = 1
    runner.execute(runner.advance(), CPU)  # type: ignore[arg-type]
    stale = runner.carry_parker()  # the carry of the first op, as a worker reads it
    runner.execute(runner.advance(), CPU)  # type: ignore[arg-type]
    waiting = runner.carry_bytes(CPU)
    assert waiting > 0
    assert stale(CPU) == 0  # the tensors it was for are consumed
    assert runner.carry_bytes(CPU) == waiting  # still waiting on the device
    assert runner.carry_parker()(CPU) == waiting  # the current carry parks them
