"""The Engine API a task's loop trains on: iterations, resume states, cancel, remove.

Each task is a :class:`~tune_hydra.frontends.task_loop.TaskLoop` (a ``th.shard`` loop on
the engine); its iterations run on a thread of its own (``start``) or the caller's.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import (
    assert_same_history,
    assert_same_model,
    make_task,
    mlp,
    plain_copy,
    shards_3,
)
from tune_hydra.engine import Engine
from tune_hydra.engine.runtime.kept import kept_bytes
from tune_hydra.exceptions import InvalidTaskError, TaskFailedError
from tune_hydra.frontends.task_loop import TaskLoop


def _cancelled(future: concurrent.futures.Future[Any]) -> bool:
    """Whether a loop's ``start`` future ended with its task's cancellation: the op in
    flight cancelled, or the next one refused as the task's was."""
    err = future.exception(timeout=120)
    if isinstance(err, TaskFailedError):
        return "cancelled" in str(err)
    return isinstance(err, concurrent.futures.CancelledError)


@pytest.mark.parametrize("recompute", [True, False])
def test_resume_from_state_equals_straight_run(recompute: bool) -> None:
    straight = make_task(mlp(), "adamw")
    resumed = plain_copy(straight)
    with Engine(["cpu"], 24_000, recompute=recompute) as eng:
        loop = TaskLoop("s", straight, eng, seed=4, max_grad_norm=0.5)
        want = loop.start(4).result(timeout=120)
        loop.close()  # the model back on the CPU, unsharded
    with Engine(["cpu"], 24_000, recompute=recompute) as eng:
        loop = TaskLoop("r", resumed, eng, seed=4, max_grad_norm=0.5)
        first = loop.start(2).result(timeout=120)
        state = loop.state()
    fresh = plain_copy(straight)  # an untrained model, as a restarted trial would build
    with Engine(["cpu"], 24_000, recompute=recompute) as eng:
        # the stream comes from the state
        loop = TaskLoop("r2", fresh, eng, seed=123, max_grad_norm=0.5)
        loop.load_state(state)
        second = loop.start(2).result(timeout=120)
        loop.close()
    assert_same_history(first + second, want)
    assert [r["iteration"] for r in second] == [3, 4]
    assert_same_model(fresh.model, straight.model)


def test_resume_mid_epoch_with_iteration_batches() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(
        torch.randn(30, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (30,), generator=g),
    )

    def make(m: torch.nn.Module) -> th.ModelTask:
        loader = DataLoader(ds, 6, shuffle=True)
        return th.ModelTask(m, torch.nn.CrossEntropyLoss(), torch.optim.Adam, loader)

    straight, resumed = make(mlp()), make(mlp())
    with Engine(["cpu"], 24_000) as eng:
        s = TaskLoop("s", straight, eng, seed=1, iteration_batches=2)
        want = s.start(5).result(timeout=120)  # 10 batches = 2 epochs
        r = TaskLoop("r", resumed, eng, seed=1, iteration_batches=2)
        first = r.start(2).result(timeout=120)  # stops after batch 4 of epoch 0
        state = r.state()
        r.close()
        s.close()
    again = make(mlp(seed=99))
    with Engine(["cpu"], 24_000) as eng:
        r = TaskLoop("r", again, eng, seed=1, iteration_batches=2)
        r.load_state(state)
        rest = r.start(3).result(timeout=120)
        r.close()
    assert_same_history(first + rest, want)
    assert [r["batches"] for r in want] == [2, 2, 2, 2, 2]
    assert [r["epoch"] for r in want] == [0, 0, 1, 1, 1]  # epoch ends show at the next fetch
    assert_same_model(again.model, straight.model)


def test_iterations_resolve_one_future_each() -> None:
    with Engine(["cpu", "cpu"], 24_000) as eng:
        a = TaskLoop("a", make_task(mlp(), "sgd"), eng, seed=0)
        b = TaskLoop("b", make_task(mlp(seed=2), "sgd"), eng, seed=0)
        a.cut()  # registered now: the engine takes its remaining work
        fa, fb = a.start(), b.start(2)
        eng.set_remaining("a", 3)
        assert len(fa.result(timeout=60)) == 1 and len(fb.result(timeout=60)) == 2
        assert a.start().result(timeout=60)[0]["iteration"] == 2
        summary = eng.summary()
        assert set(summary["devices"]) == {"cpu#0", "cpu#1"}
        # The engine counts a loop's ops (one a train batch, one per shard an eval batch).
        per_iteration = a.ops_per_iteration()
        assert per_iteration is not None
        assert summary["tasks"]["a"]["iterations"] == 2 * per_iteration


def test_cancel_and_remove_leave_the_others_alone() -> None:
    other = make_task(mlp(seed=3), "adam", n=40)
    ref = plain_copy(other)
    with Engine(["cpu"], 24_000) as eng:
        stop = TaskLoop("stop", make_task(mlp(), "sgd", n=200), eng, seed=0)
        keep = TaskLoop("other", other, eng, seed=0)
        stop.cut()  # registered now: cancel finds it
        keep.cut()
        doomed = stop.start(5)
        kept = keep.start(1)
        eng.cancel("stop")
        assert _cancelled(doomed)
        stop.close()
        assert eng.tasks() == ["other"]
        assert len(kept.result(timeout=120)) == 1
        keep.close()
    th.train_plain(ref, 1, seed=0)
    assert_same_model(other.model, ref.model)


def test_closing_the_engine_first_keeps_a_loops_last_step() -> None:
    """A loop's optimizer step waits for its next op; an engine closed before the loop
    (a ``with Engine`` block left without ``loop.close()``) lets the loop leave first,
    so the model keeps that step: as plain training."""
    task = make_task(mlp(), "adam", eval_data=False)  # no eval op after the last step
    ref = plain_copy(task)
    with Engine(["cpu"], 24_000) as eng:
        loop = TaskLoop("a", task, eng, seed=0)
        loop.start(1).result(timeout=60)
    assert eng.tasks() == []
    loop.close()  # left already: nothing more to do
    th.train_plain(ref, 1, seed=0)
    assert_same_model(task.model, ref.model)


def test_a_loop_trains_on_one_thread_at_a_time() -> None:
    """Training, reading and loading its state: one thread at a time."""
    task = make_task(mlp(), "sgd")
    gate = threading.Event()
    task.train_data = _Gated(task.train_data, gate)  # its first iteration waits at batch 1
    with Engine(["cpu"]) as eng:
        loop = TaskLoop("a", task, eng, seed=0)
        fut = loop.start(2)
        deadline = time.monotonic() + 60
        while loop.runner is None and time.monotonic() < deadline:
            time.sleep(0.001)  # its first iteration cuts it: that thread is training it
        try:
            for call in (loop.train_iteration, loop.state, lambda: loop.load_state({})):
                with pytest.raises(InvalidTaskError, match="another thread is training it"):
                    call()
        finally:
            gate.set()
        assert [r["iteration"] for r in fut.result(timeout=120)] == [1, 2]


class _Gated:
    """Re-iterable batches; the second of each pass only once ``gate`` is set."""

    def __init__(self, batches: Any, gate: threading.Event) -> None:
        self.batches, self.gate = batches, gate

    def __iter__(self) -> Any:
        for i, batch in enumerate(self.batches):
            if i == 1:
                assert self.gate.wait(60), "the gate never opened"
            yield batch


def test_duplicate_name_rejected() -> None:
    with Engine(["cpu"]) as eng:
        first = TaskLoop("a", make_task(mlp()), eng, seed=0)
        first.cut()
        second = TaskLoop("a", make_task(mlp()), eng, seed=0)
        with pytest.raises(InvalidTaskError, match="already registered"):
            second.cut()  # registering it under the name
        assert eng.runner("a") is first.runner


def test_engine_api_works_without_ray() -> None:
    code = textwrap.dedent("""
        import sys
        class NoRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("ray is not installed here")
        sys.meta_path.insert(0, NoRay())
        import torch
        import tune_hydra as th
        data = [(torch.ones(1, 2), torch.ones(1, 1))]
        t = th.ModelTask(torch.nn.Sequential(torch.nn.Linear(2, 1)), torch.nn.MSELoss(),
                         lambda p: torch.optim.SGD(p, lr=0.1), data)
        print(th.train_models({"a": t}, devices="cpu")["a"][0]["num_shards"])
        assert "ray" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_a_task_removed_mid_run_leaves_the_device_within_budget() -> None:
    """On a copying device, a removed (or checkpointed) task's shards are copied out where
    they are and traced, so the trace replay stays within the budget, and its model ends
    on the host; the task that stays trains exactly as plain PyTorch."""
    other = make_task(mlp(seed=3), "adam", n=40)
    ref = plain_copy(other)
    stop = make_task(mlp(), "sgd", n=200)
    with Engine(["cpu"], 24_000, copy_on_cpu=True) as eng:
        loops = {"stop": TaskLoop("stop", stop, eng, seed=0)}
        loops["other"] = TaskLoop("other", other, eng, seed=0)
        for loop in loops.values():
            loop.cut()
        plans = {n: eng.plan(n) for n in ("stop", "other")}
        stores = [s.store for s in loops["stop"].runner.shards]
        loops["stop"].start(1).result(timeout=120)  # its shards have been on the device
        doomed = loops["stop"].start(5)
        keep = loops["other"].start(2)
        eng.cancel("stop")
        assert _cancelled(doomed)
        loops["stop"].close()
        assert not any(s.copied for s in stores) and all(s.retired for s in stores)
        keep.result(timeout=120)
        state = loops["other"].state()  # brings "other"'s states home the same way
        loops["other"].close()
        trace = eng.trace
    acts = {(n, s.index): s.activation_bytes for n, p in plans.items() for s in p.shards}
    trace.validate(state_budget=24_000, activation_bytes=acts)
    last: dict[int, str] = {}  # every shard copied in was copied out again, and traced
    for e in sorted(trace.events, key=lambda e: e.end):
        # (a copy that changed nothing is dropped: a copy_out of 0 bytes)
        if e.task == "stop" and (e.op == "copy_out" or (e.op == "copy_in" and e.bytes_moved)):
            last[e.shard] = e.op
    assert last and set(last.values()) == {"copy_out"}, last
    th.train_plain(ref, 2, seed=0)
    assert_same_model(other.model, ref.model)
    assert state["iteration"] == 2


@pytest.mark.parametrize("how", ["cancel", "remove", "fail"])
def test_a_task_leaving_mid_batch_releases_its_kept_graphs(how: str) -> None:
    """recompute=False on a copying device: a task cancelled, removed or failing while its
    batch's graphs are reserved lets them go (its batch's tensors dropped), so the tasks
    that stay are admitted and train exactly as plain PyTorch; nothing stays reserved."""
    others = {k: make_task(mlp(seed=i), "adam", n=12) for i, k in enumerate(("b", "c"), 1)}
    refs = {k: plain_copy(t) for k, t in others.items()}
    stop = make_task(mlp(), "sgd", n=400)
    if how == "fail":
        stop.loss_fn = _fails_later(stop.loss_fn, after=30)
    with _keeping_engine(policy="round_robin") as eng:
        assert eng.keeps_graphs
        loops = {n: TaskLoop(n, t, eng, seed=0) for n, t in {"stop": stop, **others}.items()}
        for loop in loops.values():
            loop.cut()
            assert loop.runner.keep  # its forwards keep their graphs
        plans = {n: eng.plan(n) for n in eng.tasks()}
        doomed = loops["stop"].start(1)
        futures = {k: loops[k].start(2) for k in others}
        if how != "fail":
            _until_in_batch(eng, "stop")
            (eng.cancel if how == "cancel" else eng.remove_task)("stop")
        concurrent.futures.wait(futures.values(), timeout=120)
        assert all(f.done() for f in futures.values()), (
            f"the tasks that stay were never admitted: {eng.workers[0].reserved} reserved"
        )
        for fut in futures.values():
            fut.result()
        assert eng.workers[0].reserved == {}
        if how != "remove":
            assert eng.kept_on("stop") is None
            assert not loops["stop"].runner.keeps_batch  # its batch's graphs dropped
        for k in others:
            loops[k].close()
        trace = eng.trace
    assert doomed.exception(timeout=120) is not None
    acts = {(n, s.index): s.activation_bytes for n, p in plans.items() for s in p.shards}
    kept = {n: kept_bytes(p) for n, p in plans.items()}
    budget = shards_3(False)["device_memory"]
    trace.validate(state_budget=budget, activation_bytes=acts, kept_bytes=kept)
    for k, t in others.items():
        th.train_plain(refs[k], 2, seed=0)
        assert_same_model(t.model, refs[k].model)


def test_a_recomputing_loop_waits_for_room_beside_kept_graphs() -> None:
    """recompute=False on a copying device: a loop whose batch would not fit kept
    recomputes, and its ops are admitted beside the other loop's kept batch, not queued
    ahead of that batch's next op waiting for room only that batch frees (which failed
    as "nothing ahead of it will free room"). Both train as plain PyTorch."""

    def task(batch: int, n: int) -> th.ModelTask:
        torch.manual_seed(0)
        net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())])
        g = torch.Generator().manual_seed(1)
        data = [
            (torch.randn(batch, 32, generator=g), torch.randn(batch, 32, generator=g))
            for _ in range(n)
        ]
        opt = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
        return th.ModelTask(
            net.double(), nn.MSELoss(), opt, [(x.double(), y.double()) for x, y in data]
        )

    tasks = {"keep": task(64, 40), "big": task(256, 8)}
    refs = {k: plain_copy(t) for k, t in tasks.items()}
    # 300 kB: a 64-row batch's kept graphs (262 kB) fit, a 256-row batch's (1 MB) do
    # not; one shard's recompute of the 256-row batch (262 kB) fits only on its own.
    with Engine(["cpu"], 300_000, copy_on_cpu=True, recompute=False, max_layers_per_shard=2) as eng:
        loops = {n: TaskLoop(n, t, eng, seed=0) for n, t in tasks.items()}
        for loop in loops.values():
            loop.cut()
        assert loops["keep"].runner.keep and not loops["big"].runner.keep
        futures = [loop.start(1) for loop in loops.values()]
        for fut in futures:
            fut.result(timeout=120)
        for loop in loops.values():
            loop.close()
    for k, t in tasks.items():
        th.train_plain(refs[k], 1, seed=0)
        assert_same_model(t.model, refs[k].model, atol=0.0)


def _keeping_engine(**kw: Any) -> Engine:
    """One copying CPU device keeping graphs, under a budget that fits one mlp() batch."""
    opts = shards_3(False)
    return Engine(
        ["cpu"],
        opts["device_memory"],
        copy_on_cpu=True,
        recompute=False,
        max_layers_per_shard=opts["max_layers_per_shard"],
        **kw,
    )


def _until_in_batch(eng: Engine, name: str) -> None:
    deadline = time.monotonic() + 60
    while eng.kept_on(name) is None and time.monotonic() < deadline:
        time.sleep(0.001)


def _fails_later(loss_fn: Any, after: int) -> Any:
    calls = [0]

    def fn(out: Any, target: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("boom")
        return loss_fn(out, target)

    return fn


def test_a_leaked_kept_graph_reservation_is_reported_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If a reservation outlived its batch (a bug: here a cancel that forgets to release
    it), the other tasks could never be admitted; the dispatcher reports it to every
    waiting caller instead of letting them wait forever."""
    from tune_hydra.engine.runtime.kept import KeptGraphs

    real_end = KeptGraphs.end

    def leaky_end(self: KeptGraphs, entry: Any, *, drop: bool = False) -> None:
        if not drop:
            real_end(self, entry)

    monkeypatch.setattr(KeptGraphs, "end", leaky_end)
    with _keeping_engine() as eng:
        stop = TaskLoop("stop", make_task(mlp(), "sgd", n=400), eng, seed=0)
        other = TaskLoop("other", make_task(mlp(seed=1), "adam", n=12), eng, seed=0)
        stop.cut()
        other.cut()
        doomed = stop.start(1)
        _until_in_batch(eng, "stop")
        eng.cancel("stop")
        with pytest.raises(th.exceptions.ScheduleError, match="no batch in flight"):
            other.start(2).result(timeout=60)
        assert _cancelled(doomed)
