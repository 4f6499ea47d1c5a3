"""The timeline: utilization, validation, table, Chrome-trace JSON and Gantt PNG."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tune_hydra.core.trace import Trace, TraceEvent, plot_timeline, save_trace
from tune_hydra.exceptions import ScheduleError, TuneHydraError

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
        "carry_bytes": 0, "device": "d0",
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


def test_validate_counts_waiting_boundary_tensors_until_used_or_parked() -> None:
    """An op's ``carry_bytes`` stay on its device until the task's next op: on that device
    they become the op's input (its activations); elsewhere they go when that op ends; a
    ``carry_out`` parks them in host memory."""

    def op(device: str, task: str, start: float, carry: int = 0) -> TraceEvent:
        return TraceEvent(device, task, 0, "F", start, start + 1.0, carry_bytes=carry)

    held = [
        _copy("cuda:0", "a", 0, "copy_in", 0.0, 0.5, 40),
        _copy("cuda:0", "b", 0, "copy_in", 0.0, 0.5, 40),
    ]
    acts = {("a", 0): 10, ("b", 0): 10}
    base = [*held, op("cuda:0", "a", 1.0, carry=15), op("cuda:0", "b", 2.0, carry=15)]
    # b runs beside a's waiting 15 bytes: 80 + 10 + 15; then a uses its own input.
    Trace.from_events([*base, op("cuda:0", "a", 3.0)]).validate(
        state_budget=105, activation_bytes=acts
    )
    with pytest.raises(ScheduleError, match="15 bytes other tasks' ops left waiting"):
        Trace.from_events(base).validate(state_budget=104, activation_bytes=acts)
    # Parked before b runs: it fits 90.
    parked = [*base, _copy("cuda:0", "a", 1, "carry_out", 2.0, 2.0, 15)]
    Trace.from_events(parked).validate(state_budget=90, activation_bytes=acts)
    # a's next op on another device takes its carry there as it starts.
    moved = [*held, op("cuda:0", "a", 1.0, carry=15), op("cuda:1", "a", 3.0)]
    before = [*moved, _copy("cuda:0", "c", 0, "copy_in", 2.5, 2.6, 20)]  # a's 15 still here
    after = [*moved, _copy("cuda:0", "c", 0, "copy_in", 3.5, 3.6, 20)]  # gone with a's op
    with pytest.raises(ScheduleError, match="other tasks' ops left waiting"):
        Trace.from_events(before).validate(state_budget=110, activation_bytes=acts)
    Trace.from_events(before).validate(state_budget=115, activation_bytes=acts)
    Trace.from_events(after).validate(state_budget=100, activation_bytes=acts)


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
            _host("host_take", "b", -1, 30, 0.2),  # parked boundary tensors
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
