"""The Engine API the Tune front end uses: iterations, checkpoints, cancel, remove."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

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


@pytest.mark.parametrize("recompute", [True, False])
def test_resume_from_state_equals_straight_run(recompute: bool) -> None:
    straight = make_task(mlp(), "adamw")
    resumed = plain_copy(straight)
    with Engine(["cpu"], 24_000, recompute=recompute) as eng:
        eng.add_task("s", straight, seed=4, max_grad_norm=0.5)
        want = eng.train("s", 4).result(timeout=120)
    with Engine(["cpu"], 24_000, recompute=recompute) as eng:
        eng.add_task("r", resumed, seed=4, max_grad_norm=0.5)
        first = eng.train("r", 2).result(timeout=120)
        state = eng.get_state("r")
    fresh = plain_copy(straight)  # an untrained model, as a restarted trial would build
    with Engine(["cpu"], 24_000, recompute=recompute) as eng:
        eng.add_task("r2", fresh, seed=123, max_grad_norm=0.5)  # the stream comes from the state
        eng.set_state("r2", state)
        second = eng.train("r2", 2).result(timeout=120)
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
        eng.add_task("s", straight, seed=1, iteration_batches=2)
        want = eng.train("s", 5).result(timeout=120)  # 10 batches = 2 epochs
        eng.add_task("r", resumed, seed=1, iteration_batches=2)
        first = eng.train("r", 2).result(timeout=120)  # stops after batch 4 of epoch 0
        state = eng.get_state("r")
        eng.remove_task("r")
    again = make(mlp(seed=99))
    with Engine(["cpu"], 24_000) as eng:
        eng.add_task("r", again, seed=1, iteration_batches=2)
        eng.set_state("r", state)
        rest = eng.train("r", 3).result(timeout=120)
    assert_same_history(first + rest, want)
    assert [r["batches"] for r in want] == [2, 2, 2, 2, 2]
    assert [r["epoch"] for r in want] == [0, 0, 1, 1, 1]  # epoch ends show at the next fetch
    assert_same_model(again.model, straight.model)


def test_iterations_resolve_one_future_each() -> None:
    with Engine(["cpu", "cpu"], 24_000) as eng:
        eng.add_task("a", make_task(mlp(), "sgd"), seed=0)
        eng.add_task("b", make_task(mlp(seed=2), "sgd"), seed=0)
        fa, fb = eng.train("a"), eng.train("b", 2)
        eng.set_remaining("a", 3)
        assert len(fa.result(timeout=60)) == 1 and len(fb.result(timeout=60)) == 2
        assert eng.train("a").result(timeout=60)[0]["iteration"] == 2
        summary = eng.summary()
        assert set(summary["devices"]) == {"cpu#0", "cpu#1"}
        assert summary["tasks"]["a"]["iterations"] == 2


def test_cancel_and_remove_leave_the_others_alone() -> None:
    other = make_task(mlp(seed=3), "adam", n=40)
    ref = plain_copy(other)
    with Engine(["cpu"], 24_000) as eng:
        eng.add_task("stop", make_task(mlp(), "sgd", n=200), seed=0)
        eng.add_task("other", other, seed=0)
        doomed = eng.train("stop", 5)
        keep = eng.train("other", 1)
        eng.cancel("stop")
        eng.remove_task("stop")
        assert eng.tasks() == ["other"]
        assert len(keep.result(timeout=120)) == 1
        assert doomed.cancelled()
    th.train_plain(ref, 1, seed=0)
    assert_same_model(other.model, ref.model)


def test_get_state_while_training_is_refused() -> None:
    with Engine(["cpu"]) as eng:
        eng.add_task("a", make_task(mlp(), "sgd", n=100), seed=0)
        fut = eng.train("a", 2)
        with pytest.raises(th.TuneHydraError, match="idle"):
            eng.get_state("a")
        fut.result(timeout=120)


def test_duplicate_name_rejected() -> None:
    with Engine(["cpu"]) as eng:
        eng.add_task("a", make_task(mlp()), seed=0)
        with pytest.raises(th.exceptions.InvalidTaskError, match="already registered"):
            eng.add_task("a", make_task(mlp()), seed=0)


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
        eng.add_task("stop", stop, seed=0)
        eng.add_task("other", other, seed=0)
        plans = {n: eng.plan(n) for n in ("stop", "other")}
        stores = [s.store for s in eng.runner("stop").shards]
        eng.train("stop", 1).result(timeout=120)  # its shards have been on the device
        doomed = eng.train("stop", 5)
        keep = eng.train("other", 2)
        eng.cancel("stop")
        eng.remove_task("stop")
        assert not any(s.copied for s in stores) and all(s.retired for s in stores)
        keep.result(timeout=120)
        state = eng.get_state("other")  # offloads "other" the same way
        trace = eng.trace
    assert doomed.cancelled()
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
        for name, task in {"stop": stop, **others}.items():
            eng.add_task(name, task, seed=0)
        plans = {n: eng.plan(n) for n in eng.tasks()}
        doomed = eng.train("stop", 1)
        futures = {k: eng.train(k, 2) for k in others}
        if how != "fail":
            _until_in_batch(eng, "stop")
            (eng.cancel if how == "cancel" else eng.remove_task)("stop")
        for fut in futures.values():
            fut.result(timeout=120)
        assert eng.workers[0].reserved == {}
        if how != "remove":
            assert eng.kept_on("stop") is None
            assert eng.runner("stop").stage.outputs == {}
        trace = eng.trace
    assert doomed.cancelled() or doomed.exception() is not None
    acts = {(n, s.index): s.activation_bytes for n, p in plans.items() for s in p.shards}
    kept = {n: kept_bytes(p) for n, p in plans.items()}
    budget = shards_3(False)["device_memory"]
    trace.validate(state_budget=budget, activation_bytes=acts, kept_bytes=kept)
    for k, t in others.items():
        th.train_plain(refs[k], 2, seed=0)
        assert_same_model(t.model, refs[k].model)


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
        eng.add_task("stop", make_task(mlp(), "sgd", n=400), seed=0)
        eng.add_task("other", make_task(mlp(seed=1), "adam", n=12), seed=0)
        eng.train("stop", 1)
        _until_in_batch(eng, "stop")
        eng.cancel("stop")
        other = eng.train("other", 2)
        with pytest.raises(th.exceptions.ScheduleError, match="no batch in flight"):
            other.result(timeout=60)
