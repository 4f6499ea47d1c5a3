"""Per-task random streams: installed around each op, replayable, lock only when needed."""

from __future__ import annotations

import threading

import torch

import tune_hydra as th
from tests.conftest import make_task, mlp
from tune_hydra.engine import Engine
from tune_hydra.engine.runtime import rng


def test_stream_starts_where_manual_seed_starts_it() -> None:
    state = rng.seeded_state(7)
    torch.manual_seed(7)
    assert torch.equal(state.cpu, torch.get_rng_state())


def test_task_stream_advances_and_replays() -> None:
    stream = rng.seeded_state(1)
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
    stream = rng.seeded_state(2)
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
        eng.add_task("a", make_task(mlp()), seed=0)
        eng.train("a").result(timeout=60)
        shards = eng.runner("a").shards
        has_dropout = [
            any(isinstance(m, torch.nn.Dropout) for m in s.module.modules()) for s in shards
        ]
        assert [s.cpu_rng for s in shards] == has_dropout
        assert any(has_dropout) and not all(has_dropout)
    assert th.ModelTask is not None
