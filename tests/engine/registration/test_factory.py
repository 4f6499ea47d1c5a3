"""A task factory runs in its own thread on a private generator: it draws exactly what it
would draw alone, disturbs no other thread's draws, holds no lock, and cannot hang its
caller past a timeout."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, mlp
from tune_hydra.core.trace import COPY_OPS
from tune_hydra.engine import Engine
from tune_hydra.engine.registration.factory import call_factory, private_rng, start_factory
from tune_hydra.engine.runtime.rng import CPU_RNG_LOCK
from tune_hydra.exceptions import TaskFactoryError, TaskFactoryTimeoutError
from tune_hydra.frontends.task_loop import TaskLoop


def _draws(seed: int | None = 3) -> list[torch.Tensor]:
    """What a typical factory draws: seeded data, module init, a shuffling loader."""
    if seed is not None:
        torch.manual_seed(seed)
    out = [torch.randn(5), torch.rand(2, 3), torch.randint(0, 10, (4,)), torch.randperm(7)]
    model = nn.Sequential(nn.Linear(8, 8), nn.Embedding(10, 4), nn.Conv2d(3, 4, 3))
    out += [p.detach().clone() for p in model.parameters()]
    out += [torch.empty(6).normal_(0, 2), torch.empty(6).bernoulli_(0.5)]
    out += [torch.multinomial(torch.ones(5), 3), torch.empty(3, dtype=torch.long).random_(9)]
    out += [nn.functional.dropout(torch.ones(10), 0.5, training=True), torch.randn_like(out[0])]
    out += list(torch.utils.data.DataLoader(list(range(10)), batch_size=3, shuffle=True))
    state = torch.get_rng_state()
    out.append(torch.randn(2))
    torch.set_rng_state(state)
    out.append(torch.randn(2))  # the same two numbers again
    return out


class _Hammer:
    """Another thread that reseeds and draws from the global generator nonstop (what the
    engine's device threads do around every op), checking its own draws stay right."""

    def __init__(self) -> None:
        torch.manual_seed(99)
        self.expected = torch.randn(50)
        self.stop = threading.Event()
        self.wrong = 0
        self.rounds = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            torch.manual_seed(99)
            if not torch.equal(torch.randn(50), self.expected):
                self.wrong += 1
            self.rounds += 1

    def __enter__(self) -> _Hammer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def test_factory_draws_exactly_what_plain_code_draws_while_others_draw() -> None:
    expected = _draws()
    with _Hammer() as hammer:
        got = call_factory(lambda _: _draws(), None, what="test", timeout_s=120)
    assert hammer.rounds > 0 and hammer.wrong == 0  # the other thread was not disturbed
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_private_rng_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with private_rng(seed=11):
        torch.manual_seed(0)
        torch.randn(100)
        assert torch.initial_seed() == 0
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.initial_seed() == 5


def test_unseeded_factory_follows_the_given_seed() -> None:
    a = call_factory(lambda _: _draws(seed=None), None, what="a", seed=7)
    b = call_factory(lambda _: _draws(seed=None), None, what="b", seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    with private_rng(seed=7):
        c = _draws(seed=None)
    assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_factory_error_carries_its_traceback() -> None:
    def broken(config: dict[str, Any]) -> None:
        raise KeyError("no such column")

    with pytest.raises(TaskFactoryError, match=r"(?s)trial x.*Factory traceback.*no such column"):
        call_factory(broken, {}, what="trial x", timeout_s=60)


def test_factory_that_never_returns_times_out() -> None:
    release = threading.Event()
    # The factory waits for ever: that it raised at all is its timeout (no timed bound).
    with pytest.raises(TaskFactoryTimeoutError, match=r"within 0\.5 s") as info:
        call_factory(lambda _: release.wait(), {}, what="trial y", timeout_s=0.5)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, th.TuneHydraError)
    release.set()  # the abandoned call ends later; its result is dropped, not raised


def test_cancelled_start_drops_a_late_result() -> None:
    go = threading.Event()
    future = start_factory(lambda _: go.wait(10) and "late", None, what="z")
    assert future.cancel()
    go.set()
    time.sleep(0.2)
    assert future.cancelled()


class _SlowData:
    """Re-iterable batches that take ``delay`` seconds each to load; those after the first
    (the task's loop is cut on that one) only once ``gate`` (if given) is set."""

    def __init__(
        self, batches: list[Any], delay: float, gate: threading.Event | None = None
    ) -> None:
        self.batches, self.delay, self.gate = batches, delay, gate

    def __iter__(self) -> Any:
        for i, b in enumerate(self.batches):
            if self.gate is not None and i:
                assert self.gate.wait(60), "the gate never opened"
            time.sleep(self.delay)
            yield b


def _task(seed: int, delay: float = 0.0, gate: threading.Event | None = None) -> th.ModelTask:
    torch.manual_seed(seed)
    data = [
        (torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 4, (16,))) for _ in range(10)
    ]
    return th.ModelTask(
        mlp(dtype=torch.float64),
        nn.CrossEntropyLoss(),
        OPTIMIZERS["sgd"],
        _SlowData(data, delay, gate),
        seed=seed,
    )


_WANT_OPS = 20  # task a's ops seen while the factory is held


def _slow_factory_run(hold_lock: bool, wait_s: float = 60.0) -> tuple[float, float, list[Any]]:
    """Task a trains 8 epochs while a factory is held in its call until a has run
    ``_WANT_OPS`` ops since the factory started (or ``wait_s`` passed): no sleep, the
    test releases it. Task a's batches load only once the factory has started, so a
    cannot finish before. Returns when (engine clock) the factory started and was
    released, and a's compute events."""
    started, release = threading.Event(), threading.Event()
    with Engine(devices="cpu") as engine:
        began: list[float] = []

        def slow(_: object) -> th.ModelTask:
            with CPU_RNG_LOCK if hold_lock else contextlib.nullcontext():  # the old behaviour
                began.append(engine.clock())
                started.set()
                assert release.wait(120), "never released"
            return _task(2)

        pending = TaskLoop("a", _task(1, gate=started), engine).start(8)
        future = start_factory(slow, None, what="slow")
        deadline = time.monotonic() + wait_s  # a bound on a wait, not the assertion
        while time.monotonic() < deadline and not pending.done():
            since = [e for e in engine.trace.events if e.task == "a" and e.is_compute]
            if began and sum(e.start > began[0] for e in since) >= _WANT_OPS:
                break
            time.sleep(0.01)
        released = engine.clock()
        release.set()
        TaskLoop("b", future.result(timeout=120), engine).start(1).result(timeout=120)
        pending.result(timeout=120)
        events = [e for e in engine.trace.events if e.task == "a" and e.op not in COPY_OPS]
    return began[0], released, events


def test_a_slow_factory_does_not_hold_up_training() -> None:
    """A factory held in its call while another task trains: that task's ops go on (the
    trace has them between the factory's start and its release). (Holding the CPU RNG
    lock, as factories once did, no longer stops them either: a task's loop draws from
    generators of its own.)"""
    began, released, events = _slow_factory_run(hold_lock=False)
    during = [e for e in events if began < e.start and e.end < released]
    assert len(during) >= _WANT_OPS, f"task a ran {len(during)} ops while the factory ran"


def test_tasks_built_by_a_slow_factory_train_exactly() -> None:
    expected = _task(2)
    th.train_plain(expected, epochs=1, seed=2)
    built = call_factory(lambda _: _task(2), None, what="b", timeout_s=60)
    th.train_models({"b": built}, devices=["cpu"], epochs=1)
    for p, q in zip(built.model.parameters(), expected.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_private_rng_survives_a_rewrapped_manual_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other code re-wraps ``torch.manual_seed`` (importing ``torch._dynamo`` does): the
    factory thread's seeding must still reach its private generator."""
    inner = torch.manual_seed

    def rewrapped(seed: int) -> Any:
        return inner(seed)

    monkeypatch.setattr(torch, "manual_seed", rewrapped)
    with _Hammer() as hammer:
        got = call_factory(lambda _: _draws(), None, what="test", timeout_s=120)
    assert hammer.wrong == 0
    assert all(torch.equal(a, b) for a, b in zip(got, _draws(), strict=True))


def test_use_generator_routes_the_threads_draws_and_tells_whether_it_drew() -> None:
    # What a loop's op runs under on a device thread: every CPU random op without a
    # generator draws from the given one, torch's global generator is left alone, and the
    # mode says whether anything drew (a shard that never draws then skips it).
    from tune_hydra.engine.registration.factory import thread_generator, use_generator

    gen = torch.Generator().manual_seed(3)
    before = torch.get_rng_state()
    assert thread_generator() is None
    with use_generator(gen) as mode:
        assert thread_generator() is gen
        a = torch.nn.functional.dropout(torch.ones(6, dtype=torch.float64), 0.5)
        b = torch.rand(2)
    assert mode.drew and thread_generator() is None
    assert torch.equal(torch.get_rng_state(), before)
    want = torch.Generator().manual_seed(3)
    mask = torch.empty(6, dtype=torch.float64).bernoulli_(0.5, generator=want)
    assert torch.equal(a, mask * 2) and torch.equal(b, torch.rand(2, generator=want))
    with use_generator(gen) as mode:
        _ = torch.ones(3) * 2
    assert not mode.drew
