"""A device worker on its own: slots, copies waiting for room within the budget, prefetches
that do not fit skipped."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.trace import Trace
from tune_hydra.engine.dispatch.workers import Assignment, DeviceWorker, default_clock
from tune_hydra.engine.storage import ShardStore

CPU = torch.device("cpu")


def _store(name: str, state: int, act: int) -> ShardStore:
    layer = nn.Linear(4, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    return ShardStore([layer], opt, name=(name, 0), footprint=(state, act))


def _wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` (the worker's threads act asynchronously) until true or timeout."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def _worker(budget: int | None, copy: bool = True) -> DeviceWorker:
    return DeviceWorker(
        0, CPU, "dev", Trace(["dev"]), default_clock(), prefetch=True, copy=copy, budget=budget
    )


def _assignment(w: DeviceWorker, store: ShardStore, run, log: list[str]) -> Assignment:  # type: ignore[no-untyped-def]
    def done(a: Assignment, err: BaseException | None) -> None:
        assert err is None, err
        w.assigned.remove(a)  # what the engine does when an op ends
        log.append(f"done {store.name[0]}")

    return Assignment(Op(store.name[0], OpKind.FORWARD, 0), store, run=run, done=done)


def test_a_queued_shard_that_does_not_fit_waits_for_the_running_op() -> None:
    w = _worker(budget=100)
    log: list[str] = []
    release = threading.Event()
    running, big = _store("running", state=50, act=30), _store("big", state=40, act=10)
    try:
        assert w.fits(big)  # nothing assigned yet: alone it fits
        w.submit(_assignment(w, running, lambda dev: release.wait(10), log))
        assert not w.fits(big)  # 50 + 40 + 30 > 100
        second = _assignment(w, big, lambda dev: log.append("run big"), log)
        w.submit(second)
        time.sleep(0.3)
        assert second.ready is not None and not second.ready.is_set()  # waiting for room
        assert w.holds(running) and not w.holds(big)
        release.set()
        assert second.ready.wait(5)
        _wait_until(lambda: "done big" in log)
        assert log == ["done running", "run big", "done big"]
        assert w.holds(big)
    finally:
        release.set()
        w.close()
        w.join(5.0)


def test_a_prefetch_that_does_not_fit_is_skipped() -> None:
    w = _worker(budget=100)
    log: list[str] = []
    release = threading.Event()
    running = _store("running", state=50, act=30)
    fits, too_big = _store("fits", state=20, act=10), _store("too_big", state=21, act=10)
    try:
        w.submit(_assignment(w, running, lambda dev: release.wait(10), log))
        w.prefetch(too_big, "too_big", 0, 0)
        w.prefetch(fits, "fits", 0, 0)
        _wait_until(lambda: w.holds(fits))
        assert w.holds(fits) and not w.holds(too_big)
        copied = {e.task for e in w.trace.events if e.op == "copy_in"}
        assert copied == {"running", "fits"}
    finally:
        release.set()
        w.close()
        w.join(5.0)


def test_no_second_slot_without_copies() -> None:
    """A CPU device that copies nothing has nothing to prefetch: one op queued at a time."""
    cpu = CPU
    kinds = {"copy": True, "no copy": False}
    workers = {
        name: DeviceWorker(0, cpu, name, Trace([name]), default_clock(), prefetch=True, copy=c)
        for name, c in kinds.items()
    }
    try:
        assert workers["copy"].depth == 2
        assert workers["no copy"].depth == 1
    finally:
        for w in workers.values():
            w.close()
            w.join(5.0)


# -- leases: the copy thread's path, shared with callers' leases ---------------------------


def test_an_assigned_op_runs_under_a_lease_released_as_it_ends() -> None:
    w = _worker(budget=None)
    log: list[str] = []
    store = _store("a", state=10, act=5)
    seen: list[list[tuple[str, int]]] = []
    try:
        a = _assignment(
            w, store, lambda dev: seen.append([(x.task, x.shard) for x in w.leases()]), log
        )
        w.submit(a)
        _wait_until(lambda: "done a" in log)
        assert seen == [[("a", 0)]]  # held while it computed
        assert a.lease is not None and not a.lease.active and w.leases() == []
        assert w.holds(store)  # released: still resident (LRU)
    finally:
        w.close()
        w.join(5.0)


def test_a_leased_state_is_not_evicted_and_an_op_waits_for_its_room() -> None:
    """Budget 100: the caller's lease (50 + 30) leaves no room for the op's shard
    (40 + 20): the op waits for the release, not evicting the leased state; then the
    released state is evicted (50 + 40 + 20 > 100)."""
    w = _worker(budget=100)
    log: list[str] = []
    leased, op_store = _store("leased", state=50, act=30), _store("op", state=40, act=20)
    try:
        lease = w.lease(leased, deadline=time.monotonic() + 5)
        assert lease is not None and w.leases() == [lease] and w.holds(leased)
        a = _assignment(w, op_store, lambda dev: log.append("run op"), log)
        w.submit(a)
        time.sleep(0.4)
        assert a.ready is not None and not a.ready.is_set()
        assert w.holds(leased) and not w.holds(op_store)
        lease.release()
        _wait_until(lambda: "done op" in log)
        assert log == ["run op", "done op"]
        assert not w.holds(leased) and w.holds(op_store)  # evicted once released
    finally:
        w.close()
        w.join(5.0)


def test_an_op_on_a_leased_shard_waits_for_the_lease() -> None:
    w = _worker(budget=None)
    log: list[str] = []
    store = _store("a", state=10, act=5)
    try:
        lease = w.lease(store)
        assert lease is not None
        assert w.lease(store, blocking=False) is None  # one lease per state at a time
        w.submit(_assignment(w, store, lambda dev: log.append("run a"), log))
        time.sleep(0.4)
        assert log == []
        lease.release()
        _wait_until(lambda: "done a" in log)
        assert log == ["run a", "done a"]
    finally:
        w.close()
        w.join(5.0)


def test_a_prefetch_leaves_a_state_leased_on_another_device_alone() -> None:
    """A device computing in host memory leases the state in place (a prefetch may take
    an unleased one from there, not a leased one)."""
    w0, w1 = _worker(budget=None, copy=False), _worker(budget=None)
    store = _store("a", state=10, act=5)
    try:
        lease = w0.lease(store)
        assert lease is not None and store.owner is w0
        w1.prefetch(store, "a", 0, 0)
        time.sleep(0.4)
        assert store.owner is w0 and not w1.holds(store)
        lease.release()
        w1.prefetch(store, "a", 0, 0)  # free again: taken
        _wait_until(lambda: w1.holds(store))
        assert store.owner is w1
    finally:
        for w in (w0, w1):
            w.close()
            w.join(5.0)
