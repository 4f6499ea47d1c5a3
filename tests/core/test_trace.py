"""The timeline: utilization, validation, table, Chrome-trace JSON and Gantt PNG."""

from __future__ import annotations

import json
import random
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tune_hydra.core.trace import (
    DEFAULT_WINDOW,
    Trace,
    TraceEvent,
    plot_timeline,
    save_trace,
)
from tune_hydra.exceptions import InvalidOptionError, ScheduleError, TuneHydraError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ev(device: str, task: str, op: str, start: float, end: float, **kw: int) -> TraceEvent:
    return TraceEvent(device, task, kw.pop("shard", 0), op, start, end, **kw)


@pytest.fixture
def trace() -> Trace:
    """Two devices, two tasks, one copy; wall 0..4 s."""
    t = Trace(["d0", "d1", "d2"])
    t.add(ev("d0", "a", "F", 0.0, 1.0, batch=0))
    t.add(ev("d0", "a", "L", 1.0, 3.0, shard=1, batch=0))
    t.add(ev("d1", "b", "F", 1.0, 2.0, batch=0))
    t.add(ev("d1", "b", "copy_in", 0.0, 4.0, shard=1, bytes_moved=4096, batch=0))
    t.add(ev("d1", "a", "B", 3.0, 3.5, batch=0))
    return t


def test_utilization_counts_compute_only_over_whole_wall(trace: Trace) -> None:
    assert trace.wall_s() == pytest.approx(4.0)
    assert trace.utilization() == pytest.approx({"d0": 0.75, "d1": 0.375, "d2": 0.0})
    assert trace.busy_s() == pytest.approx({"d0": 3.0, "d1": 1.5, "d2": 0.0})


def test_empty_trace() -> None:
    t = Trace(["cpu#0"])
    assert len(t) == 0
    assert t.wall_s() == 0.0
    assert t.utilization() == {"cpu#0": 0.0}
    assert t.summary()["ops"] == 0
    t.validate()


def test_summary(trace: Trace) -> None:
    s = trace.summary()
    assert s["wall_s"] == pytest.approx(4.0)
    assert s["ops"] == 4
    assert s["copies"] == 1
    assert s["bytes_moved"] == 4096
    assert s["devices"]["d0"] == pytest.approx(
        {"busy_s": 3.0, "utilization": 0.75, "ops": 2, "bytes_moved": 0}
    )
    assert s["devices"]["d1"]["bytes_moved"] == 4096
    assert s["tasks"] == pytest.approx({"a": 3.5, "b": 1.0})


def test_event_properties() -> None:
    e = ev("d0", "a", "F", 1.0, 1.25, shard=2, batch=5)
    assert e.duration == pytest.approx(0.25)
    assert e.is_compute and e.label == "F2"
    assert str(e) == "a:F2[5]@d0"
    c = ev("d0", "a", "copy_out", 1.0, 2.0, shard=3)
    assert not c.is_compute and c.label == "copy_out:3"


def test_validate_accepts_a_good_schedule(trace: Trace) -> None:
    trace.validate()  # the copy overlaps compute on d1: allowed (copy stream)


def test_validate_catches_two_ops_on_one_device(trace: Trace) -> None:
    trace.add(ev("d0", "c", "F", 2.5, 3.5, shard=4, batch=7))
    with pytest.raises(ScheduleError, match="device 'd0'") as info:
        trace.validate()
    message = str(info.value)
    assert "F4" in message and "L1" in message  # both rows, as a table
    assert isinstance(info.value, TuneHydraError)


def test_validate_catches_overlapping_ops_of_one_task_on_two_devices() -> None:
    t = Trace(["d0", "d1"])
    t.add(ev("d0", "a", "F", 0.0, 1.0))
    t.add(ev("d1", "a", "F", 0.9, 1.5, shard=1))
    with pytest.raises(ScheduleError, match="task 'a'"):
        t.validate()
    t.validate(tolerance=0.2)


def test_validate_catches_an_op_nested_inside_a_long_one() -> None:
    t = Trace(["d0"])
    t.add(ev("d0", "a", "F", 0.0, 10.0))
    t.add(ev("d0", "b", "F", 1.0, 2.0))
    t.add(ev("d0", "c", "F", 5.0, 6.0))
    with pytest.raises(ScheduleError, match="overlap"):
        t.validate()


def test_validate_catches_end_before_start() -> None:
    t = Trace(["d0"])
    t.add(ev("d0", "a", "F", 2.0, 1.0))
    with pytest.raises(ScheduleError, match="ends before it starts"):
        t.validate()


def test_touching_ops_are_fine() -> None:
    t = Trace(["d0"])
    t.add(ev("d0", "a", "F", 0.0, 1.0))
    t.add(ev("d0", "a", "F", 1.0, 2.0, shard=1))
    t.validate()


def test_table_sorted_by_start_with_limit(trace: Trace) -> None:
    lines = trace.table().splitlines()
    assert lines[0].split() == [
        "device", "start", "end", "dur_ms", "task", "op", "batch", "iter", "bytes",
    ]  # fmt: skip
    assert len(lines) == 1 + len(trace)
    starts = [float(line.split()[1]) for line in lines[1:]]
    assert starts == sorted(starts)
    assert "copy_in:1" in trace.table() and "4096" in trace.table()
    short = trace.table(limit=2).splitlines()
    assert len(short) == 4 and short[-1] == "... 3 more events"
    assert str(trace) == trace.table()
    assert repr(trace) == "Trace(devices=['d0', 'd1', 'd2'], events=5)"


def test_add_is_thread_safe() -> None:
    t = Trace(["d0"])

    def work(k: int) -> None:
        for i in range(500):
            t.add(ev("d0", f"t{k}", "F", float(i), float(i)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(t) == len(t.events) == 2000


def test_from_events_adds_unknown_devices() -> None:
    t = Trace.from_events([ev("x", "a", "F", 0, 1), ev("y", "a", "F", 1, 2)], devices=["y"])
    assert t.devices == ["y", "x"]
    assert len(t) == 2


def test_save_trace_writes_chrome_trace_json(trace: Trace, tmp_path: Path) -> None:
    path = save_trace(trace, tmp_path / "sub" / "trace.json")
    assert isinstance(path, Path) and path.exists()
    data = json.loads(path.read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(trace)
    first = min(complete, key=lambda e: (e["ts"], e["name"]))
    by_name = {e["name"]: e for e in complete}
    lb = by_name["a:L1[0]"]
    assert lb["ts"] == pytest.approx(1.0e6) and lb["dur"] == pytest.approx(2.0e6)  # microseconds
    assert lb["args"] == {
        "task": "a", "shard": 1, "op": "L", "batch": 0, "iteration": 0, "bytes": 0,
        "device": "d0",
    }  # fmt: skip
    assert first["ts"] == pytest.approx(0.0)
    copy = by_name["b:copy_in:1[0]"]
    assert copy["cat"] == "copy" and copy["args"]["bytes"] == 4096
    names = {e["args"]["name"]: e["tid"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert {"d0", "d1", "d2"} <= set(names)
    assert by_name["b:F0[0]"]["tid"] == names["d1"]
    assert copy["tid"] == names["d1 copy"] != names["d1"]  # copies overlap compute: own row
    assert by_name["a:F0[0]"]["tid"] == names["d0"]


def test_save_trace_accepts_a_list_of_events(tmp_path: Path) -> None:
    events = [ev("cuda:1", "a", "F", 0.5, 0.75, shard=2, batch=5)]
    data = json.loads(save_trace(events, str(tmp_path / "t.json")).read_text())
    (x,) = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert x["name"] == "a:F2[5]"
    assert (x["ts"], x["dur"]) == pytest.approx((500_000.0, 250_000.0))


def test_plot_timeline_writes_a_png(trace: Trace, tmp_path: Path) -> None:
    path = plot_timeline(trace, tmp_path / "plots" / "timeline.png", title="test")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_plot_timeline_accepts_events_and_empty_traces(tmp_path: Path) -> None:
    events = [ev(f"d{i % 3}", f"t{i}", "F", i * 0.1, i * 0.1 + 0.1) for i in range(40)]
    assert plot_timeline(events, tmp_path / "many.png").read_bytes()[:8] == PNG_MAGIC
    assert plot_timeline(Trace(["d0"]), tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC


def _copy(device: str, task: str, shard: int, op: str, start: float, end: float, n: int):  # type: ignore[no-untyped-def]
    return TraceEvent(device, task, shard, op, start, end, n)


def test_validate_replays_copies_against_a_state_budget() -> None:
    fine = Trace.from_events(
        [
            _copy("cuda:0", "a", 0, "copy_in", 0.0, 1.0, 60),
            TraceEvent("cuda:0", "a", 0, "F", 1.0, 2.0),
            _copy("cuda:0", "a", 0, "copy_out", 2.0, 2.5, 60),
            _copy("cuda:0", "b", 0, "copy_in", 2.5, 3.0, 50),
            _copy("cuda:1", "a", 1, "copy_in", 0.0, 1.0, 90),  # another device's budget
        ]
    )
    fine.validate(state_budget=100, activation_bytes={("a", 0): 30})
    over = Trace.from_events([*fine.events, _copy("cuda:0", "c", 0, "copy_in", 2.6, 3.0, 51)])
    with pytest.raises(ScheduleError, match="over its budget of 100 bytes"):
        over.validate(state_budget=100)
    with pytest.raises(ScheduleError, match="running op's activations"):
        fine.validate(state_budget={"cuda:0": 89, "cuda:1": 90}, activation_bytes={("a", 0): 30})
    fine.validate(state_budget={"cuda:0": 90, "cuda:1": 90}, activation_bytes={("a", 0): 30})


def test_a_copy_in_elsewhere_ends_the_stay_on_the_previous_device() -> None:
    moved = Trace.from_events(
        [
            _copy("cuda:0", "a", 0, "copy_in", 0.0, 1.0, 80),
            _copy("cuda:1", "a", 0, "copy_in", 2.0, 3.0, 80),
            _copy("cuda:0", "b", 0, "copy_in", 4.0, 5.0, 80),
        ]
    )
    moved.validate(state_budget=100)


def test_validate_counts_a_kept_batch_from_its_first_forward_to_its_first_backward() -> None:
    """With ``kept_bytes`` a task's batch holds that many bytes on the device of its first
    forward, from that op's start to the end of its shard-0 backward (or of the op that
    leaves the batch, such as an eval); its own ops' activations are inside it."""

    def op(task: str, kind: str, shard: int, start: float, device: str = "cuda:0") -> TraceEvent:
        return TraceEvent(device, task, shard, kind, start, start + 1.0)

    acts = {(t, s): 50 for t in "ab" for s in (0, 1)}
    a_batch = [op("a", "F", 0, 0.0), op("a", "L", 1, 1.0), op("a", "B", 0, 2.0)]
    b_batch = [op("b", "F", 0, 3.0), op("b", "L", 1, 4.0), op("b", "B", 0, 5.0)]
    one_after_another = Trace.from_events([*a_batch, *b_batch])
    # 70 kept bytes; the running op's 50 are inside them, not on top.
    one_after_another.validate(
        state_budget=70, activation_bytes=acts, kept_bytes={"a": 70, "b": 70}
    )
    with pytest.raises(ScheduleError, match="70 bytes of batches' kept graphs"):
        one_after_another.validate(
            state_budget=69, activation_bytes=acts, kept_bytes={"a": 70, "b": 70}
        )
    # b's batch starts while a's is in flight (a's backward not done yet): 140 at once.
    a_late = [op("a", "F", 0, 0.0), op("a", "L", 1, 1.0), op("a", "B", 0, 4.0)]
    b_early = [op("b", "F", 0, 2.0), op("b", "L", 1, 3.0), op("b", "B", 0, 5.0)]
    overlapping = Trace.from_events([*a_late, *b_early])
    kept = {"a": 70, "b": 70}
    with pytest.raises(ScheduleError, match="140 bytes of batches' kept graphs"):
        overlapping.validate(state_budget=100, activation_bytes=acts, kept_bytes=kept)
    # On another device it does not count here.
    b_elsewhere = [op("b", "F", 0, 2.0, "cuda:1"), op("b", "L", 1, 3.0, "cuda:1")]
    Trace.from_events([*a_late, *b_elsewhere]).validate(
        state_budget=100, activation_bytes=acts, kept_bytes=kept
    )
    # A forward that found no data, then an eval: the batch ends with that forward.
    empty = [op("a", "F", 0, 0.0), op("b", "F", 0, 1.0), op("b", "L", 1, 2.0), op("a", "E", 0, 3.0)]
    Trace.from_events(empty).validate(state_budget=100, activation_bytes=acts, kept_bytes=kept)
    # Without kept_bytes the same trace counts only each running op's activations.
    overlapping.validate(state_budget=50, activation_bytes=acts)


def _host(op: str, task: str, shard: int, nbytes: int, t: float) -> TraceEvent:
    return TraceEvent("host", task, shard, op, t, t, nbytes)


def test_host_budget_replays_the_account_in_order() -> None:
    trace = Trace.from_events(
        [
            TraceEvent("cpu", "a", 0, "F", 0.0, 1.0),
            _host("host_take", "a", 0, 60, 0.1),
            _host("host_take", "b", -1, 30, 0.2),  # a frozen pool entry
            TraceEvent("disk", "a", 0, "to_disk", 0.2, 0.3, 60),
            _host("host_give", "a", 0, 60, 0.3),
            _host("host_take", "c", 1, 70, 0.3),
        ],
        ["cpu"],
    )
    trace.validate(host_budget=100)
    with pytest.raises(ScheduleError, match="host memory holds 100 bytes, over its budget of 99"):
        trace.validate(host_budget=99)
    # The disk and host rows are not devices; the tier traffic is summed apart.
    summary = trace.summary()
    assert list(summary["devices"]) == ["cpu"] and summary["bytes_moved"] == 0
    assert summary["disk"] == {"read_bytes": 0, "written_bytes": 60, "wait_s": 0.0}
    assert set(trace.utilization()) == {"cpu"}


def test_host_budget_catches_a_take_before_its_spill() -> None:
    trace = Trace.from_events(
        [
            _host("host_take", "a", 0, 60, 0.1),
            _host("host_take", "a", 1, 60, 0.2),  # over: counted before a's 0 went to disk
            _host("host_give", "a", 0, 60, 0.2),
        ]
    )
    with pytest.raises(ScheduleError, match="120 bytes"):
        trace.validate(host_budget=100)


# -- a bounded trace (issue 23, item 7): a window of events, whole-run figures ----------


def _run_events(n_ops: int, seed: int = 0) -> list[TraceEvent]:
    """A plausible engine trace of ``n_ops`` shard ops, in the order the engine adds events
    (each when it ends): 2 devices copying 3-shard states of 5 tasks, the host account
    and the disk tier."""
    rng = random.Random(seed)
    devices, tasks = ["d0", "d1"], [f"t{i}" for i in range(5)]
    free = dict.fromkeys(devices, 0.0)
    ready = dict.fromkeys(tasks, 0.0)
    step = dict.fromkeys(tasks, 0)
    out = [_host("host_take", t, s, 1000, 0.0) for t in tasks for s in range(3)]
    for i in range(n_ops):
        d = min(devices, key=lambda x: free[x])
        t = min(tasks, key=lambda x: ready[x])
        shard = step[t] % 3
        step[t] += 1
        t0 = max(free[d], ready[t])
        s, e = t0 + 0.001, t0 + 0.001 + rng.uniform(0.001, 0.01)
        out.append(_host("host_give", t, shard, 1000, t0))
        out.append(TraceEvent(d, t, shard, "copy_in", t0, s, 1000, i, i))
        out.append(TraceEvent(d, t, shard, rng.choice("FB"), s, e, 8, i, i))
        out.append(TraceEvent(d, t, shard, "copy_out", e, e + 0.001, 1000, i, i))
        out.append(_host("host_take", t, shard, 1000, e + 0.001))
        if i % 7 == 0:
            out.append(TraceEvent("disk", t, shard, "to_disk", e, e + 0.002, 1000))
            out.append(TraceEvent("disk", t, shard, "from_disk", e + 0.002, e + 0.003, 1000))
            out.append(TraceEvent(d, t, shard, "disk_wait", e + 0.002, e + 0.003))
        free[d], ready[t] = e + 0.001, e
    out.sort(key=lambda x: x.end)  # stable: the host account keeps its order
    return out


def _fed(events: list[TraceEvent], window: int | None) -> Trace:
    trace = Trace(["d0", "d1"], window=window)
    for e in events:
        trace.add(e)
    return trace


def _close(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _close(a[key], b[key])
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    else:
        assert a == b


def test_a_bounded_trace_keeps_its_window_and_the_whole_runs_figures() -> None:
    events = _run_events(3000)
    full, bounded = _fed(events, None), _fed(events, 100)
    assert len(full) == len(events) and full.dropped == 0
    assert 90 <= len(bounded) <= 100 and bounded.dropped == len(events) - len(bounded)
    assert bounded.events == events[-len(bounded) :]
    expected = full.summary()
    got = bounded.summary()
    assert got["dropped"] == bounded.dropped and expected["dropped"] == 0
    del got["dropped"], expected["dropped"]
    _close(got, expected)
    assert got["events"] == len(events) and got["ops"] == 3000
    _close(bounded.busy_s(), full.busy_s())
    _close(bounded.utilization(), full.utilization())
    assert bounded.wall_s() == full.wall_s()
    # The same run without the bound: the same checks pass over the whole run.
    for trace in (full, bounded):
        trace.validate(state_budget=1000, host_budget=15_000)


def _verdict(trace: Trace, **kw: Any) -> bool:
    try:
        trace.validate(**kw)
    except ScheduleError:
        return False
    return True


@pytest.mark.parametrize("window", [1, 7, 100, 5000])
def test_a_bounded_trace_checks_the_whole_run_against_the_budgets(window: int) -> None:
    events = _run_events(2000)
    full, bounded = _fed(events, None), _fed(events, window)
    assert bounded.dropped > 0
    bounded.validate(state_budget=1000, host_budget=15_000)  # one state per device at a time
    with pytest.raises(ScheduleError, match="over its budget of 999 bytes"):
        bounded.validate(state_budget=999)
    with pytest.raises(ScheduleError, match="host memory holds 15000 bytes"):
        bounded.validate(host_budget=14_999)
    # The same verdicts as the unbounded replay around the states' peak.
    verdicts = [(b, _verdict(full, state_budget=b)) for b in range(936, 1064, 32)]
    assert {v for _, v in verdicts} == {True, False}
    assert [(b, _verdict(bounded, state_budget=b)) for b, _ in verdicts] == verdicts


@pytest.mark.parametrize("at", [40, 3000, -3])
@pytest.mark.parametrize("window", [None, 50])
def test_a_bad_event_is_caught_whether_or_not_it_is_still_kept(at: int, window: int) -> None:
    events = _run_events(1000)
    i = next(j for j in range(at % len(events), len(events)) if events[j].is_compute)
    e = events[i]
    before = [x for x in events[:i] if x.is_compute and x.device == e.device]
    overlapping = replace(e, start=before[-1].end - 0.003)  # 3 ms into the op before
    for bad, message in [
        (replace(e, end=e.start - 0.5), "ends before it starts"),
        (overlapping, "runs two operations at once"),
    ]:
        trace = _fed([*events[:i], bad, *events[i + 1 :]], window)
        with pytest.raises(ScheduleError, match=message) as err:
            trace.validate()
        assert ("no longer kept" in str(err.value)) == (i < trace.dropped)
    trace = _fed([*events[:i], overlapping, *events[i + 1 :]], window)
    trace.validate(tolerance=0.005)  # the overlap is within the tolerance


def test_the_default_trace_is_bounded() -> None:
    trace = Trace(["cpu"])
    for i in range(DEFAULT_WINDOW + 1000):
        trace.add(TraceEvent("cpu", "a", 0, "F", float(i), i + 0.5))
    assert len(trace) <= DEFAULT_WINDOW
    assert trace.window == DEFAULT_WINDOW
    assert trace.dropped == DEFAULT_WINDOW + 1000 - len(trace)
    summary = trace.summary()
    assert summary["ops"] == DEFAULT_WINDOW + 1000 and summary["tasks"]["a"] == pytest.approx(
        (DEFAULT_WINDOW + 1000) * 0.5
    )
    assert trace.wall_s() == DEFAULT_WINDOW + 999.5
    trace.validate()


def test_window_option_and_printing() -> None:
    with pytest.raises(InvalidOptionError, match="trace_window"):
        Trace(["cpu"], window=0)
    with pytest.raises(InvalidOptionError, match="trace_window"):
        Trace(["cpu"], window=1.5)  # type: ignore[arg-type]
    trace = Trace.from_events(_run_events(100), window=20)
    assert len(trace) <= 20 and trace.dropped > 0
    assert f"{trace.dropped} earlier events dropped" in trace.table()
    assert f"dropped={trace.dropped}" in repr(trace)
    assert Trace.from_events(_run_events(100)).dropped == 0  # a given list: all kept
    from tune_hydra.options import EngineOptions

    assert EngineOptions().trace_window == DEFAULT_WINDOW
    assert EngineOptions(trace_window=None).trace_window is None
    with pytest.raises(InvalidOptionError, match="trace_window"):
        EngineOptions(trace_window=0)


def test_an_engines_bounded_trace_holds_its_window_with_whole_run_figures() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    from tune_hydra.engine import Engine
    from tune_hydra.engine.task import ModelTask
    from tune_hydra.frontends.task_loop import TaskLoop

    def task() -> ModelTask:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
        data = [(torch.randn(2, 2), torch.randn(2, 2)) for _ in range(8)]
        return ModelTask(model, nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1), data)

    runs = {}
    for window in (None, 40):
        with Engine(
            devices=["cpu", "cpu"], max_layers_per_shard=1, copy_on_cpu=True, trace_window=window
        ) as engine:
            loops = [TaskLoop(name, task(), engine, seed=0) for name in ("a", "b")]
            futures = [loop.start(3) for loop in loops]
            for f in futures:
                f.result(timeout=120)
        # After the close, which lets the loops leave (their last steps are ops too).
        runs[window] = (engine.trace, engine.summary())
    (full, _), (bounded, figures) = runs[None], runs[40]
    assert full.dropped == 0 and len(bounded) <= 40 < bounded.dropped
    a, b = full.summary(), bounded.summary()
    # The same work (which device ran what depends on timing).
    assert a["ops"] == b["ops"] and a["tasks"].keys() == b["tasks"].keys()
    assert b["events"] == b["dropped"] + len(bounded)
    # From running totals, the bounded trace's figures agree with the workers' own.
    for label, device in figures["devices"].items():
        assert b["devices"][label]["busy_s"] == pytest.approx(device["busy_s"], rel=1e-6)
    assert sum(b["tasks"].values()) == pytest.approx(
        sum(busy for busy in bounded.busy_s().values())
    )
    bounded.validate()


def test_a_bounded_trace_folds_while_threads_add() -> None:
    trace = Trace([f"d{i}" for i in range(4)], window=100)

    def work(i: int) -> None:
        for k in range(5000):
            trace.add(TraceEvent(f"d{i}", f"t{i}", 0, "F", float(k), k + 0.5, bytes_moved=1))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(trace) <= 100 and trace.dropped + len(trace) == 20_000
    summary = trace.summary()
    assert summary["ops"] == 20_000 and summary["bytes_moved"] == 20_000
    assert trace.busy_s() == pytest.approx({f"d{i}": 2500.0 for i in range(4)})
    assert summary["tasks"] == pytest.approx({f"t{i}": 2500.0 for i in range(4)})
    trace.validate()
