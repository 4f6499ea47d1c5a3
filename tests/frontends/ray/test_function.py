"""The engine side of function trainables without Ray running
(:mod:`tune_hydra.frontends.ray.function`): Ray's session routed per thread, a working
directory per thread, reports that wait for the proxy, stops, and Tune's hints in ops."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import tune
from ray.train._internal import session as ray_session
from torch import nn

import tune_hydra as th
from tune_hydra.frontends.ray import function
from tune_hydra.frontends.ray.errors import NoShardError, ReportThreadError
from tune_hydra.frontends.ray.function import FunctionRun, own_working_directory


@pytest.fixture
def router() -> Iterator[function.SessionRouter]:
    """Ray's process-global session replaced by the router for the test."""
    old = ray_session._session
    ray_session._session = None
    try:
        yield function.session_router()
    finally:
        ray_session._session = old


def _take(run: FunctionRun, timeout: float = 30.0) -> tuple[str, Any, Any]:
    return run.take().result(timeout)


def counting(config: dict[str, Any]) -> None:
    """A tiny loop with th.shard that reports 3 times, noting how far it got."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = th.shard(model, optimizer)
    x = torch.randn(4, 3)
    for i in range(3):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        config["progress"].append(i)
        tune.report({"i": i, "cwd": os.getcwd(), "id": tune.get_context().get_trial_id()})


def _run(fn: Any, config: dict[str, Any], engine: Any, key: str, **context: Any) -> FunctionRun:
    return FunctionRun(fn, config, key=key, token="tok", engine=engine, context=context)


def test_reports_wait_for_the_proxy_and_the_run_ends(
    router: function.SessionRouter, engine: Any, tmp_path: Path
) -> None:
    """Each report waits until the proxy takes the next item (a paused trial does not run
    ahead); the function runs in its own directory and sees its trial id; after the last
    report comes Tune's duplicate marker, then "done", and its loops left the engine."""
    progress: list[int] = []
    info = ray_session.TrialInfo(
        name="t_0", id="t0", resources={}, logdir=str(tmp_path), driver_ip=None,
        driver_node_id=None, experiment_name="e",
    )  # fmt: skip
    run = _run(
        counting, {"progress": progress}, engine, "t0", cwd=str(tmp_path / "wd"), trial_info=info
    )
    run.start()
    kind, metrics, _ = _take(run)
    assert kind == "report" and metrics["i"] == 0 and metrics["id"] == "t0"
    assert metrics["cwd"] == str(tmp_path / "wd") and os.getcwd() != metrics["cwd"]
    threading.Event().wait(0.3)
    assert progress == [0]  # blocked in its report until the proxy asks again
    assert [_take(run)[1]["i"] for _ in range(2)] == [1, 2]
    kind, metrics, _ = _take(run)
    assert kind == "report" and metrics == {"__duplicate__": True}
    assert _take(run)[0] == "done"
    run.thread.join(10)
    assert not run.thread.is_alive() and engine.tasks() == []


def test_a_stopped_function_ends_at_its_next_report(
    router: function.SessionRouter, engine: Any
) -> None:
    progress: list[int] = []
    run = _run(counting, {"progress": progress}, engine, "t1")
    run.start()
    assert _take(run)[0] == "report"
    run.stop()  # Tune stopped or paused the trial
    run.thread.join(10)
    assert not run.thread.is_alive()
    assert progress == [0] and engine.tasks() == []  # nothing of it stays on the engine
    assert _take(run)[0] == "done"


def plain(config: dict[str, Any]) -> None:
    tune.report({"x": 1.0})


def test_a_function_without_shard_is_a_systematic_error(
    router: function.SessionRouter, engine: Any
) -> None:
    run = _run(plain, {}, engine, "t2")
    run.start()
    kind, text, err = _take(run)
    assert kind == "error" and isinstance(err, NoShardError)
    assert "model, optimizer = th.shard(model, optimizer)" in text
    run.thread.join(10)
    assert not run.thread.is_alive()


def test_report_from_a_thread_the_user_started_is_refused(
    router: function.SessionRouter,
) -> None:
    with pytest.raises(ReportThreadError, match="not a trial's"):
        tune.report({"x": 1.0})
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        pytest.raises(ReportThreadError, match="from the function itself"),
    ):
        pool.submit(tune.get_checkpoint).result()


def test_each_thread_has_its_own_working_directory(tmp_path: Path) -> None:
    before = os.getcwd()
    seen: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def work(name: str) -> None:
        assert own_working_directory(str(tmp_path / name))
        barrier.wait()  # both changed directory before either writes
        Path("same.txt").write_text(name)
        seen[name] = os.getcwd()

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert os.getcwd() == before
    assert seen == {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    assert (tmp_path / "a" / "same.txt").read_text() == "a"
    assert (tmp_path / "b" / "same.txt").read_text() == "b"


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int | None]] = []

    def set_milestone(self, name: str, ops: int | None) -> None:
        self.calls.append(("milestone", name, ops))

    def set_remaining(self, name: str, ops: int) -> None:
        self.calls.append(("remaining", name, ops))


class _Loop:
    name = "loop_0"
    iteration = 0
    reports = 0


def test_tunes_hints_reach_the_loops_in_ops() -> None:
    """Reports to the next milestone become ops of each loop, measured between reports
    (half a report of slack); far before the first measure."""
    eng, loop = _Engine(), _Loop()
    run = _run(plain, {}, eng, "t3")
    run.hint(milestone=2)  # before any loop: kept
    run.add_loop(loop)
    assert eng.calls == [("milestone", "loop_0", function._UNKNOWN_OPS)]
    loop.iteration, run.reports = 6, 1
    run._measure()
    assert loop.reports == 1
    eng.calls.clear()
    run.hint(milestone=2)
    run.hint(remaining=3, milestone=None)
    assert eng.calls == [
        ("milestone", "loop_0", 15),  # (2 + 0.5) reports x 6 ops
        ("milestone", "loop_0", None),
        ("remaining", "loop_0", 24),  # this report's and 3 more
    ]


def test_the_engine_actor_runs_owns_and_stops_functions(
    router: function.SessionRouter, tmp_path: Path
) -> None:
    """The actor's function calls, hosted in-process: the experiment's secret starts a
    function, only its token (or the secret) takes its reports, the driver's milestone
    reaches it, and deregistering it stops it with nothing left on the engine."""
    import asyncio

    from ray import cloudpickle

    from tune_hydra.frontends.ray.actor import EngineActor
    from tune_hydra.frontends.ray.errors import NotOwnerError, TrialNotRegisteredError
    from tune_hydra.options import EngineOptions

    options = EngineOptions(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=1)
    actor = EngineActor(options, {}, factories={"fn": cloudpickle.dumps(counting)}, secret="s")
    progress: list[int] = []
    config = {"progress": progress}

    async def scenario() -> None:
        with pytest.raises(NotOwnerError):
            await actor.fn_start("k", "tok", "fn", config, None, "not-it", {})
        await actor.fn_start("k", "tok", "fn", config, None, "s", {"cwd": str(tmp_path)})
        with pytest.raises(TrialNotRegisteredError, match="a newer copy"):
            await actor.fn_next("k", "other")
        kind, metrics, _ = await actor.fn_next("k", "tok")
        assert kind == "report" and metrics["i"] == 0 and metrics["cwd"] == str(tmp_path)
        await actor.set_milestone("k", "s", 2)
        assert (await actor.summary("s"))["milestones_given"] == 1
        assert await actor.functions("s") == ["k"]
        assert await actor.deregister("k", "s") is True
        for _ in range(100):
            if not await actor.functions("s"):
                break
            await asyncio.sleep(0.1)
        assert await actor.functions("s") == []
        assert actor._engine.tasks() == [] and progress == [0]
        await actor.close("s")

    asyncio.run(scenario())
