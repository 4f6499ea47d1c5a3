"""Leases (``Engine.acquire``): a caller's own thread pages shards in and out and trains
them itself, exactly as plain PyTorch; the device ledger, waiting for room, the dispatcher
rule and the disk tier."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tune_hydra.core.ops import OpKind
from tune_hydra.engine import Engine
from tune_hydra.exceptions import (
    InvalidOptionError,
    InvalidTaskError,
    LeaseConflictError,
    LeaseEndedError,
    LeaseTimeoutError,
    UnknownDeviceError,
)
from tune_hydra.frontends.task_loop import TaskLoop


def _model(seed: int = 0, width: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width),
        nn.ReLU(),
        nn.BatchNorm1d(width),  # buffers move with the shard, updated by the caller
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, 4),
    ).double()


def _data(n: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(6, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (6,), generator=g),
        )
        for _ in range(n)
    ]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _task(model: nn.Module, data: list[Any] | None = None) -> th.ModelTask:
    return th.ModelTask(model, nn.CrossEntropyLoss(), _sgd, data or _data())


def _register(
    engine: Engine, name: str, model: nn.Module, data: list[Any] | None = None
) -> TaskLoop:
    """A TaskLoop of ``model``, cut now: registered, its shards leasable, nothing trained.
    The caller keeps ``model`` referenced: a loop whose model is collected leaves the
    engine."""
    loop = TaskLoop(name, _task(model, data), engine, seed=0)
    loop.cut()
    return loop


def _layers(model: nn.Module, spec: Any) -> nn.Sequential:
    """The layers of shard ``spec`` as a plain ``Sequential`` (a slice of the sharded model
    would be a sharded model of its own class)."""
    return nn.Sequential(*list(model.children())[spec.start : spec.stop])


def _in_thread(fn: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Run ``fn`` on a thread of its own (the caller's loop), with one intra-op thread;
    its result or its error. (A float64 reduction is bit-equal only with as many
    threads; a new thread's default is what the engine's workers last set.)"""
    out: dict[str, Any] = {}

    def run() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            out["value"] = fn()
        except BaseException as err:
            out["error"] = err
        finally:
            torch.set_num_threads(before)

    t = threading.Thread(target=run, name="user-loop")
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the user loop hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _user_step(
    engine: Engine,
    model: nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    device_of: Callable[[int, bool], int],
) -> float:
    """One batch of plain training, shard by shard under leases: forward with each shard
    leased in turn, backward and the optimizer step in reverse order (shard ``k`` on
    device ``device_of(k, backward)``)."""
    shards = engine.plan("a").shards
    saved = []
    h = x
    for spec in shards:
        with engine.acquire("a", spec.index, device_of(spec.index, False), timeout=30) as lease:
            inp = h.detach().to(lease.device).requires_grad_(spec.index > 0)
            out = _layers(model, spec)(inp)
        saved.append((inp, out))
        h = out
    loss = nn.functional.cross_entropy(h, y.to(h.device))
    (grad,) = torch.autograd.grad(loss, h)
    for spec in reversed(shards):
        with engine.acquire("a", spec.index, device_of(spec.index, True), timeout=30) as lease:
            inp, out = saved[spec.index]
            out.backward(grad.to(lease.device))
            grad = inp.grad if inp.grad is not None else grad
            opt = lease.optimizer
            if opt is not None:
                opt.step()
                opt.zero_grad()
    return float(loss.detach())


@pytest.mark.parametrize(
    "devices,copy_on_cpu",
    [(["cpu", "cpu"], True), (["cpu"], False)],
    ids=["two-copying-devices", "in-place"],
)
def test_a_user_loop_paging_shards_trains_exactly_as_plain_pytorch(
    devices: list[str], copy_on_cpu: bool
) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    data = _data()
    with Engine(devices=devices, copy_on_cpu=copy_on_cpu, max_layers_per_shard=2) as engine:
        loop = _register(engine, "a", model, data)
        assert len(engine.plan("a").shards) >= 3
        workers = len(engine.workers)

        def user() -> list[float]:
            # Forward and backward on alternate devices: each lease takes the state over.
            return [
                _user_step(engine, model, x, y, lambda k, back: (k + back) % workers)
                for _ in range(2)
                for x, y in data
            ]

        losses = _in_thread(user)
        if copy_on_cpu:  # states were copied in, and out as another device took them
            ops = {e.op for e in engine.trace.events if e.task == "a"}
            assert {"copy_in", "copy_out"} <= ops
        loop.close()  # the model's tensors back home

    def plain() -> list[float]:
        opt = _sgd(ref.parameters())
        out = []
        for _ in range(2):
            for x, y in data:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(ref(x), y)
                loss.backward()
                opt.step()
                out.append(loss.item())
        return out

    want = _in_thread(plain)
    assert losses == want
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


@pytest.mark.gpu
def test_a_user_loop_on_a_gpu_trains_as_plain_pytorch_on_it() -> None:
    """On CUDA the caller's stream waits for the copy-in, and the copy-out for the
    caller's stream (``max_layers_per_shard=1`` and 8 states: each lease evicts one)."""
    cuda = torch.device("cuda", 0)
    model = _model()
    ref = copy.deepcopy(model).to(cuda)
    data = _data()
    with Engine(devices=["cuda:0"], max_layers_per_shard=1, device_memory="64MiB") as engine:
        loop = _register(engine, "a", model, data)

        def user() -> list[float]:
            return [_user_step(engine, model, x, y, lambda k, back: 0) for x, y in data]

        losses = _in_thread(user)
        assert {"copy_in", "copy_out"} <= {e.op for e in engine.trace.events}
        loop.close()

    def plain() -> list[float]:
        opt = _sgd(ref.parameters())
        out = []
        for x, y in data:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ref(x.to(cuda)), y.to(cuda))
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    assert losses == _in_thread(plain)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b.cpu())


def test_the_ledger_counts_a_leased_state_and_keeps_it_resident_after_release() -> None:
    model = _model()
    with Engine(devices=["cpu"], copy_on_cpu=True, max_layers_per_shard=2) as engine:
        _register(engine, "a", model)
        specs = engine.plan("a").shards
        (w,) = engine.workers
        assert w.ledger.usage().state == 0 and w.leases() == []
        with engine.acquire("a", 0, "cpu") as lease:
            assert lease.active and lease.nbytes == specs[0].state_bytes
            assert w.leases() == [lease]
            assert w.ledger.usage().state == specs[0].state_bytes
            assert w.peak_resident_bytes > 0
        assert not lease.active and w.leases() == []
        # Released: still resident, evictable least recently used first.
        assert w.ledger.usage().state == specs[0].state_bytes
        with engine.acquire("a", 1, 0):
            assert w.ledger.usage().state == specs[0].state_bytes + specs[1].state_bytes
        with engine.acquire("a", 2, 0):  # two states at most without a budget: 0 leaves
            assert w.ledger.usage().state == specs[1].state_bytes + specs[2].state_bytes
        outs = [e for e in engine.trace.events if e.op == "copy_out" and e.task == "a"]
        assert [e.shard for e in outs] == [0]
        # A leased state is never the one evicted: 1 (least recently used) is pinned.
        with engine.acquire("a", 1, 0), engine.acquire("a", 0, 0):
            assert w.ledger.usage().state == specs[0].state_bytes + specs[1].state_bytes
        assert [e.shard for e in engine.trace.events if e.op == "copy_out"] == [0, 2]


def _tight_engine() -> tuple[Engine, int]:
    """A copying device whose budget holds one of the task's shards at a time."""
    probe = Engine(devices=["cpu"], copy_on_cpu=True, prefetch=False, max_layers_per_shard=2)
    with probe:
        model = _model()
        _register(probe, "a", model)
        specs = probe.plan("a").shards
    budget = max(s.state_bytes + s.activation_bytes for s in specs)
    engine = Engine(
        devices=["cpu"],
        copy_on_cpu=True,
        prefetch=False,
        device_memory=budget,
        max_layers_per_shard=2,
    )
    return engine, budget


def test_a_lease_that_does_not_fit_waits_for_room_then_times_out() -> None:
    engine, budget = _tight_engine()
    model = _model()
    with engine:
        _register(engine, "a", model)
        specs = engine.plan("a").shards
        # The two largest states: both at once would be over the budget.
        big, other = sorted(specs, key=lambda s: s.state_bytes)[-1:-3:-1]
        acts = max(big.activation_bytes, other.activation_bytes)
        assert big.state_bytes + other.state_bytes + acts > budget
        (w,) = engine.workers
        first = engine.acquire("a", big.index, 0)
        t0 = time.monotonic()
        with pytest.raises(LeaseTimeoutError, match="no room within the timeout"):
            engine.acquire("a", other.index, 0, timeout=0.4)
        assert time.monotonic() - t0 >= 0.4
        assert w.leases() == [first]

        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(engine.acquire("a", other.index, 0, timeout=20))
        )
        waiter.start()
        time.sleep(0.5)
        assert not got  # still waiting for room
        first.release()
        waiter.join(20)
        assert len(got) == 1 and got[0].active
        # The released state made room: evicted, only the new lease's state counts.
        assert w.ledger.usage().state == other.state_bytes
        assert w.ledger.usage(None).total <= budget
        got[0].release()
        # The trace's replay of the copies agrees: never more state than the budget.
        engine.trace.validate(state_budget=budget)


def test_a_lease_that_must_not_wait_takes_the_room_there_is_or_none() -> None:
    # An op run along in a batched pass is leased on its device's run thread, whose op is
    # the one running: waiting for room there waited for itself (a full run hung 600 s).
    # room_now takes the room that evicting unheld states makes, and otherwise returns
    # None at once, leaving everything as it was.
    engine, budget = _tight_engine()
    model = _model()
    with engine:
        runner = _register(engine, "a", model).runner
        specs = engine.plan("a").shards
        big, other = sorted(specs, key=lambda s: s.state_bytes)[-1:-3:-1]
        (w,) = engine.workers
        first = engine.acquire("a", big.index, 0)
        assert w.lease(runner.store_of(other.index), room_now=True) is None
        assert w.leases() == [first]
        assert w.ledger.usage().state == big.state_bytes
        first.release()  # resident but unheld: evicting it makes the room
        lease = w.lease(runner.store_of(other.index), room_now=True)
        assert lease is not None and lease.active
        assert w.ledger.usage().state == other.state_bytes
        lease.release()
        engine.trace.validate(state_budget=budget)


def test_one_lease_per_shard_at_a_time() -> None:
    model = _model()
    with Engine(devices=["cpu"], copy_on_cpu=True) as engine:
        _register(engine, "a", model)
        with (
            engine.acquire("a", 0, 0),
            pytest.raises(LeaseTimeoutError, match="another lease held it"),
        ):
            engine.acquire("a", 0, 0, timeout=0.2)
        with engine.acquire("a", 0, 0) as again:  # free once released
            assert again.active


def test_training_waits_for_a_leased_shard_and_leasing_refuses_a_training_task() -> None:
    data = _data(2)
    model = _model()
    ref = copy.deepcopy(model)
    with Engine(devices=["cpu"], copy_on_cpu=True, max_layers_per_shard=2) as engine:
        loop = _register(engine, "a", model, data)
        lease = engine.acquire("a", 0, 0)
        fut = loop.start(1)
        time.sleep(0.5)
        assert not fut.done()  # its first op waits for the lease on shard 0
        with pytest.raises(LeaseConflictError, match="being trained by the engine"):
            engine.acquire("a", 1, 0)
        lease.release()
        (result,) = fut.result(timeout=60)
        with engine.acquire("a", 1, 0):  # idle again: leasable
            pass
        loop.close()
    # The lease changed nothing: the engine's training is plain training.
    want = th.train_plain(th.ModelTask(ref, nn.CrossEntropyLoss(), _sgd, data), 1, seed=0)
    assert result["loss"] == want[0]["loss"]
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_bad_input_and_use_after_the_end_are_clear_errors() -> None:
    model, other = _model(), _model(seed=1)
    with Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2) as engine:
        loop = _register(engine, "a", model)
        n = len(engine.plan("a").shards)
        with pytest.raises(InvalidTaskError, match="no task named 'b'"):
            engine.acquire("b", 0, 0)
        for shard in (n, -1, "0", True):
            with pytest.raises(InvalidTaskError, match=f"has {n} shard"):
                engine.acquire("a", shard, 0)  # type: ignore[arg-type]
        for device in (2, -1, "cuda:3", "gpu", "cpu", object()):
            with pytest.raises(UnknownDeviceError):
                engine.acquire("a", 0, device)  # type: ignore[arg-type]
        for timeout in (-1, float("nan"), "1"):
            with pytest.raises(InvalidOptionError, match="timeout"):
                engine.acquire("a", 0, 0, timeout=timeout)  # type: ignore[arg-type]
        with engine.acquire("a", 0, "cpu#1") as lease:
            assert lease.device == torch.device("cpu") and lease.label == "cpu#1"
            with pytest.raises(LeaseConflictError, match="leased on device cpu#1"):
                engine.acquire("a", 1, 0)  # one device for a task's leases at once
        lease.release()  # twice: a no-op
        for use in (
            lambda: lease.device,
            lambda: lease.optimizer,
            lambda: lease.op(OpKind.EVAL).__enter__(),
            lease.check,
        ):
            with pytest.raises(LeaseEndedError, match="was released"):
                use()
        # The task leaving the engine takes the state back: the lease is revoked.
        held = engine.acquire("a", 1, 0)
        loop.close()
        assert not held.active
        with pytest.raises(LeaseEndedError, match="revoked"):
            held.check()
        held.release()  # ended already: a no-op
        assert engine.workers[0].leases() == []
        _register(engine, "b", other)
    with pytest.raises(LeaseEndedError, match="closed"):
        engine.acquire("b", 0, 0)


def test_an_eval_under_a_lease_drops_the_unchanged_device_copy() -> None:
    model = _model()
    with Engine(devices=["cpu"], copy_on_cpu=True, max_layers_per_shard=2) as engine:
        _register(engine, "a", model)
        specs = engine.plan("a").shards
        assert specs[2].layer_names == ("4", "5")  # ReLU, Linear: no buffers
        layers = _layers(model, specs[2])
        x = torch.randn(3, 16, dtype=torch.float64)
        for evaluated in (True, False):
            with engine.acquire("a", 2, 0) as lease:
                if evaluated:
                    with lease.op(OpKind.EVAL), torch.no_grad():
                        layers(x)
                else:  # a visit nobody vouched for counts as a change
                    with torch.no_grad():
                        layers(x)
            for k in (0, 1):  # two states at most: shard 2 is evicted
                with engine.acquire("a", k, 0):
                    pass
        outs = [e for e in engine.trace.events if e.op == "copy_out" and e.shard == 2]
        assert [e.bytes_moved > 0 for e in outs] == [False, True]


def _host_scenario(tmp_path: Path, leased: bool) -> tuple[bool, int]:
    """Task ``a`` idle (shard 0 leased or not) while task ``b`` trains under a host budget
    that holds b's states and one of a's: whether a's shard 0 stayed in host memory (its
    tensors are the same; on disk they would be views of its spill file), and the
    number of spills."""
    a_model, b_model = _model(seed=0), _model(seed=1)
    with Engine(devices=["cpu"], max_layers_per_shard=2) as probe:
        probed = copy.deepcopy(a_model)
        _register(probe, "a", probed)
        specs = probe.plan("a").shards
    host = sum(s.state_bytes for s in specs) + max(s.state_bytes for s in specs)
    with Engine(
        devices=["cpu"], max_layers_per_shard=2, host_memory=host, spill_dir=str(tmp_path)
    ) as engine:
        a = _register(engine, "a", a_model)
        b = _register(engine, "b", b_model)
        lease = engine.acquire("a", 0, 0) if leased else None
        layers = _layers(a_model, specs[0])
        before = [t.data_ptr() for t in layers.state_dict().values()]
        b.start(2).result(timeout=120)
        kept = [t.data_ptr() for t in layers.state_dict().values()] == before
        if lease is not None:  # still usable: compute with it
            with lease, torch.no_grad():
                layers.eval()(torch.randn(2, 8, dtype=torch.float64).to(lease.device))
        spills = engine.summary()["host"]["spills"]
        a.close()
    return kept, spills


def test_the_disk_tier_leaves_a_leased_state_in_host_memory(tmp_path: Path) -> None:
    (tmp_path / "leased").mkdir()
    (tmp_path / "free").mkdir()
    kept, spills = _host_scenario(tmp_path / "leased", leased=True)
    assert spills > 0 and kept
    # Control: not leased, the same state went to disk to make room for b.
    kept, spills = _host_scenario(tmp_path / "free", leased=False)
    assert spills > 0 and not kept
