"""The engine's timeline: one record per shard operation or copy.

A :class:`Trace` is plain data: it can be validated (:meth:`Trace.validate`), printed as a
table (``print(trace)``), summarised (:meth:`Trace.summary`), written as a Chrome trace
(:func:`save_trace`, opens in Perfetto or ``chrome://tracing``) and drawn as a Gantt chart
(:func:`plot_timeline`).

Example:
    >>> from tune_hydra.core.trace import Trace, TraceEvent
    >>> trace = Trace(["cpu#0", "cpu#1"])
    >>> trace.add(TraceEvent("cpu#0", "a", 0, "F", 0.0, 1.0))
    >>> trace.add(TraceEvent("cpu#1", "b", 0, "F", 0.0, 0.5))
    >>> trace.utilization()
    {'cpu#0': 1.0, 'cpu#1': 0.5}
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tune_hydra.core.ledger import DeviceLedger
from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.program import ends_batch, is_batch_kind, starts_batch
from tune_hydra.exceptions import ScheduleError

COMPUTE_OPS = frozenset({"F", "L", "B", "S", "E"})
"""Operations that occupy a device's compute stream."""
COPY_OPS = frozenset({"copy_in", "copy_out", "carry_out"})
"""Spill traffic; runs on a copy stream and may overlap compute. ``carry_out`` parks a
waiting task's boundary tensors (the input of its next op on ``shard``) in host memory."""
DISK_OPS = frozenset({"to_disk", "from_disk"})
"""Disk tier traffic (device label ``"disk"``): a shard state written to or read from its
spill file. ``disk_wait`` (on a device's label) is the time an op waited for a read."""
HOST_OPS = frozenset({"host_take", "host_give"})
"""The engine's host memory account (device label ``"host"``, instantaneous): bytes of a
state (``shard`` >= 0) or of parked boundary tensors (``shard`` -1) taken or given back."""
TIER_LABELS = ("host", "disk")
"""Labels of events that are not on a device."""
_TIER_OPS = DISK_OPS | HOST_OPS | {"disk_wait"}


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One operation that ran on one device.

    Attributes:
        device: the device's label, e.g. ``"cuda:0"`` or ``"cpu#1"``.
        task: the task's name.
        shard: shard index.
        op: ``"F"``, ``"L"``, ``"B"``, ``"S"``, ``"E"`` (compute) or ``"copy_in"`` /
            ``"copy_out"`` / ``"carry_out"`` (spill traffic, see ``COPY_OPS``).
        start: seconds since the engine started.
        end: seconds since the engine started.
        bytes_moved: host<->device bytes this operation copied.
        iteration: the task's iteration.
        batch: batch index in the epoch (-1 where not applicable).
        carry_bytes: for a compute operation on a device that copies, the bytes of
            boundary tensors it left there for the task's next operation.
    """

    device: str
    task: str
    shard: int
    op: str
    start: float
    end: float
    bytes_moved: int = 0
    iteration: int = 0
    batch: int = -1
    carry_bytes: int = 0

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start

    @property
    def is_compute(self) -> bool:
        """True for compute operations (not copies)."""
        return self.op in COMPUTE_OPS

    @property
    def label(self) -> str:
        """Short operation label: ``"F2"`` for compute, ``"copy_in:2"`` for a copy."""
        return f"{self.op}{self.shard}" if self.is_compute else f"{self.op}:{self.shard}"

    def __str__(self) -> str:
        return f"{self.task}:{self.label}[{self.batch}]@{self.device}"


class Trace:
    """A thread-safe, append-only list of :class:`TraceEvent` plus the device labels.

    Args:
        devices: device labels, in the engine's order (rows of the table and the plot).
    """

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(devices)
        self._events: list[TraceEvent] = []
        self._lock = threading.Lock()

    @classmethod
    def from_events(cls, events: Iterable[TraceEvent], devices: Sequence[str] = ()) -> Trace:
        """A trace holding ``events``; devices not in ``devices`` are appended in order of
        first appearance."""
        events = list(events)
        labels = list(devices)
        for event in events:
            if event.device not in labels and event.device not in TIER_LABELS:
                labels.append(event.device)
        trace = cls(labels)
        trace._events.extend(events)
        return trace

    def add(self, event: TraceEvent) -> None:
        """Append one event (safe from any thread)."""
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[TraceEvent]:
        """A snapshot of the events, in the order they were added."""
        with self._lock:
            return list(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def _all_devices(self, events: Sequence[TraceEvent]) -> list[str]:
        labels = list(self.devices)
        for event in events:
            if event.device not in labels and event.device not in TIER_LABELS:
                labels.append(event.device)
        return labels

    def wall_s(self) -> float:
        """Seconds from the first start to the last end (0.0 for an empty trace)."""
        events = self.events
        if not events:
            return 0.0
        return max(e.end for e in events) - min(e.start for e in events)

    def busy_s(self) -> dict[str, float]:
        """Per device, seconds during which a compute operation ran (copies excluded)."""
        events = self.events
        out: dict[str, float] = {}
        for device in self._all_devices(events):
            spans = sorted((e.start, e.end) for e in events if e.device == device and e.is_compute)
            out[device] = _union_length(spans)
        return out

    def utilization(self) -> dict[str, float]:
        """Per device, compute busy time / wall time of the whole trace (0.0 when empty)."""
        wall = self.wall_s()
        return {d: (b / wall if wall > 0 else 0.0) for d, b in self.busy_s().items()}

    def summary(self) -> dict[str, Any]:
        """Headline numbers.

        Returns:
            ``{"wall_s", "ops", "copies", "bytes_moved", "devices": {label: {"busy_s",
            "utilization", "ops", "bytes_moved"}}, "tasks": {name: busy_s}}``.
        """
        events = self.events
        wall = self.wall_s()
        busy = self.busy_s()
        devices: dict[str, dict[str, float]] = {}
        for device in self._all_devices(events):
            mine = [e for e in events if e.device == device]
            devices[device] = {
                "busy_s": busy[device],
                "utilization": busy[device] / wall if wall > 0 else 0.0,
                "ops": sum(1 for e in mine if e.is_compute),
                "bytes_moved": sum(e.bytes_moved for e in mine if e.op not in _TIER_OPS),
            }
        tasks: dict[str, float] = {}
        for e in events:
            if e.is_compute:
                tasks[e.task] = tasks.get(e.task, 0.0) + e.duration
        # Device traffic: the disk tier's and the host account's events have their own.
        moves = [e for e in events if e.op not in _TIER_OPS]
        return {
            "wall_s": wall,
            "ops": sum(1 for e in events if e.is_compute),
            "copies": sum(1 for e in moves if not e.is_compute),
            "bytes_moved": sum(e.bytes_moved for e in moves),
            "devices": devices,
            "tasks": tasks,
            "disk": {
                "read_bytes": sum(e.bytes_moved for e in events if e.op == "from_disk"),
                "written_bytes": sum(e.bytes_moved for e in events if e.op == "to_disk"),
                "wait_s": sum(e.duration for e in events if e.op == "disk_wait"),
            },
        }

    def validate(
        self,
        tolerance: float = 0.0,
        state_budget: int | Mapping[str, int] | None = None,
        activation_bytes: Mapping[tuple[str, int], int] | None = None,
        kept_bytes: Mapping[str, int] | None = None,
        host_budget: int | None = None,
    ) -> None:
        """Check the schedule's rules.

        Args:
            tolerance: seconds two operations may overlap before it counts (clock jitter).
            state_budget: if given, also replay the copies and check that the shard state
                held on each device never exceeds this many bytes (one number for every
                device, or one per device label). A state counts from the start of its
                ``copy_in`` to the end of its ``copy_out``; a shard is on one device at a
                time, so a ``copy_in`` elsewhere ends its stay on the previous one.
            activation_bytes: with ``state_budget``, each ``(task, shard)``'s activation
                bytes (``ShardSpec.activation_bytes``): while an op computes, the state
                held on its device plus the op's activations must fit the budget.
                Boundary tensors ops left waiting (``carry_bytes``) count from the op's
                end until their task's next op starts (it takes them to its device, as
                part of its activations) or a ``carry_out`` parks them.
            kept_bytes: with ``state_budget``, for tasks that kept their forward graphs
                (``recompute=False`` on a device that copies), the bytes one batch holds:
                counted on the device of its first forward from that op's start to the end
                of its first shard's backward, its ops' activations and boundary tensors
                inside it.

            host_budget: if given, also replay the engine's host memory account (the
                ``host_take`` / ``host_give`` events, in the order the engine made them)
                and check that it never holds more than this many bytes.

            The replay feeds the events to one
            :class:`~tune_hydra.core.ledger.DeviceLedger` per device, the same arithmetic
            the device workers keep the budget with (a task's waiting boundary tensors
            inside its batch's reservation are not counted again).

        Raises:
            ScheduleError: an event ends before it starts, two compute operations overlap on
                one device, two compute operations of one task overlap (a task's
                operations are strictly sequential), or a device holds more state than
                ``state_budget``, or host memory holds more than ``host_budget``. The
                message shows the offending rows.
        """
        events = self.events
        for e in events:
            if e.end < e.start:
                raise ScheduleError(
                    f"event ends before it starts ({e.end:.6f} < {e.start:.6f}):\n" + _rows([e])
                )
        compute = [e for e in events if e.is_compute]
        _check_sequential(compute, lambda e: e.device, "device", tolerance)
        _check_sequential(compute, lambda e: e.task, "task", tolerance)
        if state_budget is not None:
            _check_memory(events, state_budget, activation_bytes or {}, kept_bytes or {})
        if host_budget is not None:
            _check_host(events, host_budget)

    def table(self, limit: int | None = None) -> str:
        """A fixed-width table of the events sorted by start time.

        Args:
            limit: show at most this many rows (a last line counts the rest).
        """
        events = sorted(self.events, key=lambda e: (e.start, e.end, e.device))
        shown = events if limit is None else events[:limit]
        text = _rows(shown)
        if len(shown) < len(events):
            text += f"\n... {len(events) - len(shown)} more events"
        return text

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"Trace(devices={self.devices!r}, events={len(self)})"


def _union_length(spans: Sequence[tuple[float, float]]) -> float:
    """Total length covered by sorted ``(start, end)`` spans."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def _check_sequential(events: list[TraceEvent], key: Any, what: str, tolerance: float) -> None:
    groups: dict[str, list[TraceEvent]] = {}
    for e in events:
        groups.setdefault(key(e), []).append(e)
    for name, group in groups.items():
        group.sort(key=lambda e: (e.start, e.end))
        latest = group[0]  # the event with the latest end so far
        for e in group[1:]:
            if e.start < latest.end - tolerance:
                raise ScheduleError(
                    f"{what} {name!r} runs two operations at once "
                    f"(overlap {latest.end - e.start:.6f} s):\n" + _rows([latest, e])
                )
            if e.end > latest.end:
                latest = e


def _batches(
    events: list[TraceEvent], kept: Mapping[str, int]
) -> list[tuple[float, float, TraceEvent]]:
    """Each kept-graph batch as ``(start, end, its first op)``: from its first shard's
    forward to the end of the last op of the batch (its first shard's backward)."""
    out = []
    ops = sorted((e for e in events if e.is_compute and e.task in kept), key=lambda e: e.start)
    first: dict[str, TraceEvent] = {}
    last: dict[str, float] = {}
    for e in ops:
        op = Op(e.task, OpKind(e.op), e.shard)
        opening = starts_batch(op)
        if e.task in first and (opening or not is_batch_kind(op.kind)):
            out.append((first[e.task].start, last[e.task], first.pop(e.task)))
        if opening:
            first[e.task] = e
        if e.task in first:
            last[e.task] = e.end
            if ends_batch(op):
                out.append((first[e.task].start, e.end, first.pop(e.task)))
    out.extend((e.start, last[t], e) for t, e in first.items())
    return out


@dataclass(frozen=True, slots=True)
class _Held:
    """A shard state (or, with ``state_bytes=0``, a running op) as the replay counts it."""

    name: tuple[str, int]
    state_bytes: int
    activation_bytes: int
    event: TraceEvent


@dataclass(frozen=True, slots=True)
class _Left:
    """Boundary tensors an op left waiting on its device."""

    nbytes: int
    event: TraceEvent


def _check_memory(
    events: list[TraceEvent],
    budget: int | Mapping[str, int],
    acts: Mapping[tuple[str, int], int],
    kept: Mapping[str, int],
) -> None:
    """Replay ``events`` through one :class:`DeviceLedger` per device (the workers'
    arithmetic) and raise at the first allocation that leaves a device over budget."""
    # Replay in time order; at equal times frees (end of a copy_out or carry_out, end of
    # an op or a batch) come before allocations (start of a copy_in, an op, a batch).
    steps = []
    for i, e in enumerate(events):
        if e.op in ("copy_out", "carry_out"):
            steps.append((e.end, 0, i, e, "free"))
        elif e.op == "copy_in":
            steps.append((e.start, 1, i, e, "hold"))
        elif e.is_compute:
            steps.append((e.end, 0, i, e, "done"))
            steps.append((e.start, 1, i, e, "run"))
    for j, (start, end, e) in enumerate(_batches(events, kept), 1):
        steps.append((end, 0, len(events) + j, e, "unreserve"))
        steps.append((start, 1, -j, e, "reserve"))  # before its first op starts
    steps.sort(key=lambda step: step[:3])
    ledgers: dict[str, DeviceLedger[_Held, _Left]] = {}
    where: dict[tuple[str, int], tuple[str, _Held]] = {}  # each state's device
    running: dict[str, _Held] = {}
    for _, _, _, e, what in steps:
        key = (e.task, e.shard)
        ledger = ledgers.get(e.device)
        if ledger is None:
            limit = budget if isinstance(budget, int) else budget.get(e.device)
            ledger = ledgers[e.device] = DeviceLedger(limit)
        if what == "unreserve":
            ledger.reserve(e.task, None)
            continue
        if what == "free":
            if e.op == "carry_out":
                ledger.set_carry(e.task, None)
            elif key in where and where[key][0] == e.device:
                ledger.release(where.pop(key)[1])
            continue
        if what == "done":
            op = running.get(e.device)
            if op is not None and op.event is e:
                del running[e.device]
            if e.carry_bytes:
                ledger.set_carry(e.task, _Left(e.carry_bytes, e))
            continue
        if what == "reserve":
            ledger.reserve(e.task, kept[e.task])
        elif what == "run":
            running[e.device] = _Held(key, 0, acts.get(key, 0), e)
            for other in ledgers.values():  # its input moves to the op: its activations
                other.set_carry(e.task, None)
        else:
            if key in where:  # a shard is on one device at a time
                old, held = where[key]
                ledgers[old].release(held)
            where[key] = (e.device, _Held(key, e.bytes_moved, 0, e))
            ledger.hold(where[key][1])
        op = running.get(e.device)
        used = ledger.usage(op)
        if ledger.budget is not None and used.total > ledger.budget:
            rows = sorted(
                [
                    *(x.event for x in ledger.resident.values()),
                    *([op.event] if op is not None else []),
                    *(x.event for x in ledger.carries.values()),
                ],
                key=lambda x: x.start,
            )
            raise ScheduleError(
                f"device {e.device!r} holds {used.total} bytes (shard state"
                + (
                    f" + {used.activations} bytes of the running op's activations"
                    if used.activations
                    else ""
                )
                + (f" + {used.kept} bytes of batches' kept graphs" if used.kept else "")
                + (f" + {used.carried} bytes other tasks' ops left waiting" if used.carried else "")
                + f"), over its budget of {ledger.budget} bytes, at {e.start:.6f} s:\n"
                + _rows(rows)
            )


def _check_host(events: list[TraceEvent], budget: int) -> None:
    """Replay the host memory account in the order it was kept and raise at the first
    take that leaves it over ``budget``."""
    held = 0
    recent: list[TraceEvent] = []
    for e in events:
        if e.op not in HOST_OPS:
            continue
        held += e.bytes_moved if e.op == "host_take" else -e.bytes_moved
        recent = [*recent[-7:], e]
        if held > budget:
            raise ScheduleError(
                f"host memory holds {held} bytes, over its budget of {budget} bytes, at "
                f"{e.start:.6f} s (the last account events):\n" + _rows(recent)
            )


_HEADER = ("device", "start", "end", "dur_ms", "task", "op", "batch", "iter", "bytes")


def _rows(events: Sequence[TraceEvent]) -> str:
    cells = [
        (
            e.device,
            f"{e.start:.6f}",
            f"{e.end:.6f}",
            f"{e.duration * 1e3:.3f}",
            e.task,
            e.label,
            str(e.batch),
            str(e.iteration),
            str(e.bytes_moved),
        )
        for e in events
    ]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(_HEADER)]
    numeric = {1, 2, 3, 6, 7, 8}

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt(_HEADER)] + [fmt(row) for row in cells])


def _as_trace(trace: Trace | Iterable[TraceEvent]) -> Trace:
    return trace if isinstance(trace, Trace) else Trace.from_events(trace)


def save_trace(trace: Trace | Iterable[TraceEvent], path: str | Path) -> Path:
    """Write a Chrome-trace JSON file (opens in https://ui.perfetto.dev or chrome://tracing).

    Each device is a thread row of one process; copies go to a second row per device
    (``"<device> copy"``) since they overlap compute. Times are microseconds.

    Args:
        trace: a :class:`Trace` or a list of :class:`TraceEvent`.
        path: the file to write (parent folders are created).

    Returns:
        The path written.
    """
    trace = _as_trace(trace)
    events = trace.events
    devices = trace._all_devices(events)
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "tune_hydra"}}
    ]
    tids: dict[tuple[str, bool], int] = {}
    for i, device in enumerate(devices):
        for copy in (False, True):
            tid = 2 * i + 1 + int(copy)
            tids[(device, copy)] = tid
            name = f"{device} copy" if copy else device
            out.append(
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
            )
            sort = {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid}
            out.append({**sort, "args": {"sort_index": tid}})
    for e in sorted(events, key=lambda e: e.start):
        out.append(
            {
                "name": f"{e.task}:{e.label}[{e.batch}]",
                "cat": "compute" if e.is_compute else "copy",
                "ph": "X",
                "pid": 1,
                "tid": tids[(e.device, not e.is_compute)],
                "ts": e.start * 1e6,
                "dur": e.duration * 1e6,
                "args": {
                    "task": e.task,
                    "shard": e.shard,
                    "op": e.op,
                    "batch": e.batch,
                    "iteration": e.iteration,
                    "bytes": e.bytes_moved,
                    "carry_bytes": e.carry_bytes,
                    "device": e.device,
                },
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    return path


def plot_timeline(
    trace: Trace | Iterable[TraceEvent], path: str | Path, title: str | None = None
) -> Path:
    """Draw a Gantt chart PNG: one row per device, one colour per task.

    Compute operations are full-height bars; copies, if any, are thin hatched bars at the
    bottom of their device's row. Each row label shows the device's utilization.

    Args:
        trace: a :class:`Trace` or a list of :class:`TraceEvent`.
        path: the PNG to write (parent folders are created).
        title: the chart's title (default: wall time and mean utilization).

    Returns:
        The path written.

    Raises:
        MissingDependencyError: matplotlib is not installed (also an ``ImportError``).
    """
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:  # pragma: no cover - depends on the environment
        from tune_hydra.exceptions import MissingDependencyError

        raise MissingDependencyError(
            "plot_timeline needs matplotlib: pip install matplotlib (or use save_trace and "
            "open the JSON in https://ui.perfetto.dev)"
        ) from err

    trace = _as_trace(trace)
    events = trace.events
    devices = trace._all_devices(events)
    util = trace.utilization()
    tasks = list(dict.fromkeys(e.task for e in events))
    cmap = matplotlib.colormaps["tab20"]
    colour = {t: cmap((2 * i) % 20 + (i // 10) % 2) for i, t in enumerate(tasks)}
    row = {d: i for i, d in enumerate(devices)}
    wall = trace.wall_s()
    groups: dict[tuple[str, str, bool], list[tuple[float, float]]] = {}
    for e in events:
        groups.setdefault((e.task, e.device, e.is_compute), []).append((e.start, e.duration))

    edge = 0.3 if len(events) <= 2000 else 0.0  # dense timelines: edges would hide colours
    fig = Figure(figsize=(12, max(2.5, 0.6 * len(devices) + 1.5)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (task, device, compute), spans in groups.items():
        y, height = (row[device] - 0.22, 0.62) if compute else (row[device] - 0.4, 0.15)
        ax.broken_barh(
            spans, (y, height), facecolors=colour[task], edgecolor="black", linewidth=edge,
            alpha=1.0 if compute else 0.6, hatch=None if compute else "////",
        )  # fmt: skip
    if len(events) <= 400 and wall > 0:
        for e in events:
            if e.is_compute and e.duration > wall / 40:
                ax.text(
                    e.start + e.duration / 2, row[e.device] + 0.09, e.label, ha="center",
                    va="center", fontsize=6,
                )  # fmt: skip
    ax.set_yticks(range(len(devices)))
    ax.set_yticklabels([f"{d} ({util.get(d, 0.0):.0%})" for d in devices])
    ax.set_ylim(len(devices) - 0.5, -0.5)
    ax.set_xlabel("seconds")
    if events:
        ax.set_xlim(min(e.start for e in events), max(e.end for e in events))
    mean = sum(util.values()) / len(util) if util else 0.0
    ax.set_title(title or f"{len(tasks)} tasks, wall {wall:.3f} s, mean utilization {mean:.0%}")
    handles = [Patch(facecolor=colour[t], label=t) for t in tasks[:30]]
    if any(not e.is_compute for e in events):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="copy"))
    if handles:
        ax.legend(
            handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
            title="task" if len(tasks) <= 30 else f"task (30 of {len(tasks)})",
        )  # fmt: skip
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


__all__ = ["COMPUTE_OPS", "COPY_OPS", "Trace", "TraceEvent", "plot_timeline", "save_trace"]
