"""Per-task random streams: installed around each op, replayable, lock only when needed."""

from __future__ import annotations

import threading

import torch

import tune_hydra as th
from tests.conftest import make_task, mlp
from tune_hydra.engine import Engine
from tune_hydra.engine.runtime import rng
from tune_hydra.frontends.task_loop import TaskLoop


def _seeded(seed: int) -> rng.RngState:
    """A stream where ``torch.manual_seed(seed)`` starts the CPU generator."""
    return rng.RngState(torch.Generator().manual_seed(seed).get_state())


def test_task_stream_advances_and_replays() -> None:
    stream = _seeded(1)
    outside = torch.get_rng_state()
    with rng.task_stream(stream, torch.device("cpu"), 1) as scope:
        first = torch.rand(3)
    assert scope.drew_cpu
    with rng.task_stream(stream, torch.device("cpu"), 1, replay=scope.entry):
        again = torch.rand(3)
    assert torch.equal(first, again)  # replay gives the same draws (recompute's dropout)
    with rng.task_stream(stream, torch.device("cpu"), 1):
        second = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # one continuous stream
    assert outside is not None


def test_cpu_false_neither_touches_the_generator_nor_takes_the_lock() -> None:
    stream = _seeded(2)
    before = torch.get_rng_state()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with rng.CPU_RNG_LOCK:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        with rng.task_stream(stream, torch.device("cpu"), 2, cpu=False) as scope:
            pass  # would deadlock here if the lock were taken
    finally:
        release.set()
        t.join()
    assert not scope.drew_cpu
    assert torch.equal(before, torch.get_rng_state())


def test_shards_learn_whether_they_draw() -> None:
    with Engine(["cpu"], 24_000) as eng:
        loop = TaskLoop("a", make_task(mlp()), eng, seed=0)
        loop.start().result(timeout=60)
        shards = loop.runner.shards
        has_dropout = [
            any(isinstance(m, torch.nn.Dropout) for m in s.module.modules()) for s in shards
        ]
        # What each shard's ops drew, training and evaluating (dropout draws only in train)
        assert [s.draws.get(True) for s in shards] == has_dropout
        assert [s.draws.get(False) for s in shards] == [False] * len(shards)
        assert any(has_dropout) and not all(has_dropout)
    assert th.ModelTask is not None
