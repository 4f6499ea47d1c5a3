"""CUDA paths: parity with plain training on the GPU, and peak memory within budget."""

from __future__ import annotations

import logging

import pytest
import torch

import tune_hydra as th
from tests.conftest import assert_same_history, assert_same_model, make_task, mlp, plain_copy
from tune_hydra.frontends.task_loop import TaskLoop

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_cuda_float64_parity(opt: str) -> None:
    task = make_task(mlp(width=64), opt)
    ref = plain_copy(task)
    h = th.train_models(
        {"a": task}, devices=["cuda:0"], device_memory=200_000, epochs=2, seed=3, max_grad_norm=0.5
    )
    want = th.train_plain(ref, 2, seed=3, max_grad_norm=0.5, device="cuda:0")
    ref.model.cpu()
    assert h["a"][0]["num_shards"] >= 2
    assert_same_history(h["a"], want)
    assert_same_model(task.model, ref.model)
    assert all(p.device.type == "cpu" for p in task.model.parameters())


def test_cuda_multitask_parity_and_peak_memory_within_budget() -> None:
    budget = 64 * 2**20
    tasks = {
        k: make_task(mlp(torch.float32, seed=i, width=1024), "adam", dtype=torch.float32)
        for i, k in enumerate("abc")
    }
    refs = {k: plain_copy(t) for k, t in tasks.items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    h = th.train_models(tasks, devices=["cuda:0"], device_memory=budget, epochs=1, seed=0)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget, (peak, budget)
    assert h["a"][0]["bytes_spilled"] > 0
    for k, t in tasks.items():
        want = th.train_plain(refs[k], 1, seed=0, device="cuda:0")
        refs[k].model.cpu()
        assert_same_history(h[k], want, tol=1e-5)
        assert_same_model(t.model, refs[k].model, atol=1e-5, rtol=1e-4)


def test_cuda_single_task_prefetches_its_next_shard_within_budget() -> None:
    """A lone spilled task: the copy stream brings in its next shard while the current one
    computes, the result still equals plain training, and memory stays in budget."""
    budget = 48 * 2**20
    task = make_task(mlp(torch.float32, width=1024), "adam", dtype=torch.float32)
    ref = plain_copy(task)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    h = th.train_models({"a": task}, devices=["cuda:0"], device_memory=budget, epochs=2, seed=0)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget, (peak, budget)
    assert len(h.plans["a"]) >= 2
    compute = [e for e in h.trace.events if e.is_compute]
    copies = [e for e in h.trace.events if e.op == "copy_in" and e.bytes_moved > 0]
    overlapped = [
        c
        for c in copies
        if any(e.shard != c.shard and e.start < c.end and c.start < e.end for e in compute)
    ]
    assert copies and len(overlapped) >= len(copies) // 2, (len(overlapped), len(copies))
    want = th.train_plain(ref, 2, seed=0, device="cuda:0")
    ref.model.cpu()
    assert_same_history(h["a"], want, tol=1e-5)
    assert_same_model(task.model, ref.model, atol=1e-5, rtol=1e-4)


def _activation_heavy_tasks() -> dict[str, th.ModelTask]:
    torch.manual_seed(0)
    width, batch, depth = 64, 4096, 6
    tasks = {}
    for i in range(4):
        layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
        model = torch.nn.Sequential(*layers).double()
        data = [
            (
                torch.randn(batch, width, dtype=torch.float64),
                torch.randn(batch, width, dtype=torch.float64),
            )
            for _ in range(3)
        ]
        tasks[f"t{i}"] = th.ModelTask(
            model, torch.nn.MSELoss(), lambda p: torch.optim.Adam(p, lr=1e-3), data
        )
    return tasks


def test_cuda_waiting_activations_stay_within_budget() -> None:
    """Activation-heavy tasks taking turns on one GPU: a waiting task's boundary tensors
    wait in host memory (its loop's home: a task's loop leaves none on the device between
    its ops); peak memory stays within the budget and float64 training equals plain
    training on the GPU exactly."""
    tasks = _activation_heavy_tasks()
    refs = {k: plain_copy(t) for k, t in tasks.items()}
    budget = 24 * 2**20  # 2 MiB per boundary tensor: 4 tasks' would not fit beside a shard
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    h = th.train_models(
        tasks, devices=["cuda:0"], device_memory=budget, epochs=2, seed=0, policy="round_robin"
    )
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget, (peak, budget)
    for k, t in tasks.items():
        want = th.train_plain(refs[k], 2, seed=0, device="cuda:0")
        refs[k].model.cpu()
        assert_same_history(h[k], want)
        assert_same_model(t.model, refs[k].model)


def test_cuda_inplace_layers_and_saved_inputs_parity() -> None:
    """In-place activations after cuts, on the GPU with recompute (its default): each
    forward's input goes to pinned host memory on a side stream while the forward runs,
    and comes back for the backward; float64 equals plain training on the GPU exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 64),
        torch.nn.ReLU(inplace=True),
        torch.nn.Linear(64, 64),
        torch.nn.LeakyReLU(0.1, inplace=True),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 4),
    ).double()
    task = make_task(model, "adam")
    ref = plain_copy(task)
    h = th.train_models({"a": task}, devices=["cuda:0"], epochs=2, seed=1, max_layers_per_shard=1)
    want = th.train_plain(ref, 2, seed=1, device="cuda:0")
    ref.model.cpu()
    assert h["a"][0]["num_shards"] == 6
    assert_same_history(h["a"], want)
    assert_same_model(task.model, ref.model)


def test_cuda_keeping_graphs_over_budget_recomputes_instead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """recompute=False on a GPU keeps every shard's activations until their backward; a
    task whose kept activations would exceed device_memory recomputes its forwards in
    backward instead (logged, with the figures), and float64 training equals plain
    training on the GPU exactly."""
    task = _activation_heavy_tasks()["t0"]  # a layer fits 8 MiB; its 12 kept do not
    ref = plain_copy(task)
    budget = 8 * 2**20
    with (
        caplog.at_level(logging.INFO, logger="tune_hydra.engine.runtime.loop"),
        th.Engine(
            devices=["cuda:0"], device_memory=budget, recompute=False, max_layers_per_shard=2
        ) as engine,
    ):
        loop = TaskLoop("a", task, engine, seed=0)
        loop.cut()
        assert engine.plan("a").kept_peak_bytes() > budget
        assert not loop.runner.keep
        got = loop.start(1).result(timeout=300)
        loop.close()
    assert "recomputes its forwards in backward" in caplog.text
    want = th.train_plain(ref, 1, seed=0, device="cuda:0")
    ref.model.cpu()
    assert_same_history(got, want)
    assert_same_model(task.model, ref.model)


def test_cuda_kept_graphs_of_several_tasks_stay_within_budget() -> None:
    """recompute=False with four tasks on one GPU: each batch's kept graphs are reserved,
    and a batch starts only where they fit beside those in flight (a budget of 1.6 kept
    batches: one at a time), so peak memory stays within it; float64 parity holds."""
    tasks = _activation_heavy_tasks()
    refs = {k: plain_copy(t) for k, t in tasks.items()}
    with th.Engine(devices=["cuda:0"], recompute=False, max_layers_per_shard=2) as engine:
        probe = TaskLoop("probe", plain_copy(tasks["t0"]), engine, seed=0)
        probe.cut()
        budget = int(1.6 * engine.plan("probe").kept_peak_bytes())
        probe.close()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    h = th.train_models(
        tasks,
        devices=["cuda:0"],
        device_memory=budget,
        epochs=2,
        seed=0,
        recompute=False,
        max_layers_per_shard=2,
        policy="round_robin",
    )
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget, (peak, budget)
    assert h.kept_graphs and len(h.plans["t0"]) >= 3
    h.validate()
    for k, t in tasks.items():
        want = th.train_plain(refs[k], 2, seed=0, device="cuda:0")
        refs[k].model.cpu()
        assert_same_history(h[k], want)
        assert_same_model(t.model, refs[k].model)
