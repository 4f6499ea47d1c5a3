"""The engine's timeline: one record per shard operation or copy.

A :class:`Trace` is plain data: it can be validated (:meth:`Trace.validate`), printed as a
table (``print(trace)``), summarised (:meth:`Trace.summary`), written as a Chrome trace
(:func:`save_trace`, opens in Perfetto or ``chrome://tracing``) and drawn as a Gantt chart
(:func:`plot_timeline`).

A trace keeps the most recent ``window`` events (default :data:`DEFAULT_WINDOW`): older
ones are folded into running totals, so its figures and its validation still cover the
whole run while its memory stays bounded on a days-long search.

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
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tune_hydra.core.ledger import DeviceLedger
from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.program import ends_batch, is_batch_kind, starts_batch
from tune_hydra.exceptions import InvalidOptionError, ScheduleError

COMPUTE_OPS = frozenset({"F", "L", "B", "S", "E"})
"""Operations that occupy a device's compute stream."""
COPY_OPS = frozenset({"copy_in", "copy_out"})
"""Spill traffic; runs on a copy stream and may overlap compute."""
DISK_OPS = frozenset({"to_disk", "from_disk"})
"""Disk tier traffic (device label ``"disk"``): a shard state written to or read from its
spill file. ``disk_wait`` (on a device's label) is the time an op waited for a read."""
HOST_OPS = frozenset({"host_take", "host_give"})
"""The engine's host memory account (device label ``"host"``, instantaneous): bytes of a
state (``shard`` >= 0) or of a frozen pool entry (``shard`` -1) taken or given back."""
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
            ``"copy_out"`` (spill traffic, see ``COPY_OPS``).
        start: seconds since the engine started.
        end: seconds since the engine started.
        bytes_moved: host<->device bytes this operation copied.
        iteration: the task's iteration.
        batch: batch index in the epoch (-1 where not applicable).
        ahead: for a ``copy_in``, whether the copy thread made it ahead of its op, while
            another op held the device: a prefetch of a task's next shard, or the copy
            of an op queued behind another one (the copies double buffering hides
            behind compute). ``False`` for the copy of the op next in line.
        along: for a compute operation, whether it ran along with the one that started
            on its device just before it, as one batched pass (``Engine(batch_shared=
            True)``): part of that op, not a second op at once; its activations add to
            that op's.
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
    ahead: bool = False
    along: bool = False

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


DEFAULT_WINDOW = 200_000
"""Events a :class:`Trace` keeps by default (the most recent ones; 35-55 MiB at 180-280
bytes an event). Older events are folded into running totals (:class:`_Folded`)."""


@dataclass(slots=True)
class _DeviceSum:
    """A device's figures over the dropped events."""

    busy_s: float = 0.0
    frontier: float = float("-inf")  # the latest end of its dropped compute events
    ops: int = 0
    bytes_moved: int = 0


_CHUNK = 4096
"""The most events a bounded trace folds at once."""
_FREE, _RUN, _HOLD = range(3)  # steps of the memory replay
_NO_PEAK: tuple[int, list[TraceEvent]] = (0, [])


class _Folded:
    """What the events dropped from a bounded trace leave behind: the running totals its
    figures need and the checkpoint its validation of the kept events starts from.

    Events are folded in chunks, oldest first, in the order they were added; inside a
    chunk, compute events are taken in time order (busy time is their union, continued
    from each device's ``frontier``) and the memory replay steps in the order
    :func:`_check_memory` uses. Nothing here depends on ``validate``'s arguments: budgets
    are compared with the peaks kept here when ``validate`` is called.
    """

    def __init__(self) -> None:
        self.count = 0
        self.first_start = float("inf")
        self.last_end = float("-inf")
        self.ops = 0
        self.copies = 0
        self.bytes_moved = 0
        self.read_bytes = 0
        self.written_bytes = 0
        self.wait_s = 0.0
        self.devices: dict[str, _DeviceSum] = {}
        self.tasks: dict[str, float] = {}
        # Validation checkpoint.
        self.backwards: TraceEvent | None = None  # the first event that ended before it began
        self.latest_device: dict[str, TraceEvent] = {}  # the latest-ending compute event
        self.latest_task: dict[str, TraceEvent] = {}
        self.overlap: tuple[float, str, str, TraceEvent, TraceEvent] | None = None  # worst
        self.host_held = 0
        self.host_recent: list[TraceEvent] = []
        self.host_peak = 0
        self.host_peak_rows: list[TraceEvent] = []
        self.resident: dict[tuple[str, int], tuple[str, int, TraceEvent]] = {}
        self.state_held: dict[str, int] = {}
        self.state_peak: dict[str, tuple[int, list[TraceEvent]]] = {}

    def copy(self) -> _Folded:
        """A snapshot (containers copied; events are immutable)."""
        out = _Folded.__new__(_Folded)
        out.__dict__.update(self.__dict__)
        out.devices = {
            k: _DeviceSum(v.busy_s, v.frontier, v.ops, v.bytes_moved)
            for k, v in self.devices.items()
        }
        for name in (
            "tasks",
            "latest_device",
            "latest_task",
            "resident",
            "state_held",
            "state_peak",
        ):
            setattr(out, name, dict(getattr(self, name)))
        return out

    def _device(self, label: str) -> _DeviceSum:
        d = self.devices.get(label)
        if d is None:
            d = self.devices[label] = _DeviceSum()
        return d

    def fold(self, chunk: Sequence[TraceEvent]) -> None:
        """Fold ``chunk`` (the oldest kept events, in the order they were added)."""
        if not chunk:
            return
        self.count += len(chunk)
        self.first_start = min(self.first_start, min(e.start for e in chunk))
        self.last_end = max(self.last_end, max(e.end for e in chunk))
        if self.backwards is None:
            self.backwards = next((e for e in chunk if e.end < e.start), None)
        compute: list[tuple[float, float, int, TraceEvent]] = []
        tasks, device_of = self.tasks, self._device
        for i, e in enumerate(chunk):
            op = e.op
            if op in COMPUTE_OPS:
                compute.append((e.start, e.end, i, e))
                self.ops += 1
                self.bytes_moved += e.bytes_moved
                tasks[e.task] = tasks.get(e.task, 0.0) + (e.end - e.start)
                d = device_of(e.device)
                d.ops += 1
                d.bytes_moved += e.bytes_moved
            elif op in _TIER_OPS:
                if op == "from_disk":
                    self.read_bytes += e.bytes_moved
                elif op == "to_disk":
                    self.written_bytes += e.bytes_moved
                elif op == "disk_wait":
                    self.wait_s += e.end - e.start
                else:  # the host account, in the order it was kept
                    self.host_held += e.bytes_moved if op == "host_take" else -e.bytes_moved
                    self.host_recent = [*self.host_recent[-7:], e]
                    if self.host_held > self.host_peak:
                        self.host_peak = self.host_held
                        self.host_peak_rows = self.host_recent
            else:
                self.copies += 1
                self.bytes_moved += e.bytes_moved
                device_of(e.device).bytes_moved += e.bytes_moved
        compute.sort()  # by (start, end, order added)
        devices, latest_device, latest_task = self.devices, self.latest_device, self.latest_task
        for start, end, _, e in compute:
            d = devices[e.device]
            begin = start if start > d.frontier else d.frontier
            if end > begin:
                d.busy_s += end - begin
                d.frontier = end
            latest = latest_device.get(e.device)
            if latest is None or end > latest.end:
                latest_device[e.device] = e
            if latest is not None and latest.end > start and not e.along:
                self._overlap("device", e.device, latest, e)
            latest = latest_task.get(e.task)
            if latest is None or end > latest.end:
                latest_task[e.task] = e
            if latest is not None and latest.end > start:
                self._overlap("task", e.task, latest, e)
        self._fold_memory(chunk)

    def _overlap(self, what: str, name: str, latest: TraceEvent, e: TraceEvent) -> None:
        if self.overlap is None or latest.end - e.start > self.overlap[0]:
            self.overlap = (latest.end - e.start, what, name, latest, e)

    def _fold_memory(self, chunk: Sequence[TraceEvent]) -> None:
        """Replay the shard states' copies (the part of :func:`_check_memory` that needs
        no budget, activations or kept graphs), keeping each device's peak at the steps
        where that replay compares with the budget."""
        steps: list[tuple[float, int, int, TraceEvent, int]] = []
        add = steps.append
        for i, e in enumerate(chunk):
            op = e.op
            if op in COMPUTE_OPS:
                add((e.start, 1, i, e, _RUN))
            elif op == "copy_in":
                add((e.start, 1, i, e, _HOLD))
            elif op == "copy_out":
                add((e.end, 0, i, e, _FREE))
        steps.sort()  # (time, frees first, order added): the index is unique
        resident, held_of, state_peak = self.resident, self.state_held, self.state_peak
        for _, _, _, e, what in steps:
            if what == _FREE:
                key = (e.task, e.shard)
                here = resident.get(key)
                if here is not None and here[0] == e.device:
                    del resident[key]
                    held_of[e.device] -= here[1]
                continue
            device = e.device
            if what == _HOLD:
                key = (e.task, e.shard)
                old = resident.pop(key, None)
                if old is not None:  # a shard is on one device at a time
                    held_of[old[0]] -= old[1]
                resident[key] = (device, e.bytes_moved, e)
                held_of[device] = held_of.get(device, 0) + e.bytes_moved
            states = held_of.get(device, 0)
            if states > state_peak.get(device, _NO_PEAK)[0]:
                state_peak[device] = (states, self._rows_on(e))

    def _rows_on(self, e: TraceEvent) -> list[TraceEvent]:
        """The events behind what ``e``'s device holds (for a message)."""
        rows = [x[2] for x in self.resident.values() if x[0] == e.device]
        return sorted({id(x): x for x in [*rows, e]}.values(), key=lambda x: x.start)


class Trace:
    """A thread-safe list of the most recent :class:`TraceEvent` (at most ``window``),
    plus running totals of the older ones, and the device labels.

    Every figure (:meth:`wall_s`, :meth:`busy_s`, :meth:`utilization`, :meth:`summary`)
    covers the whole run: events dropped from the window were folded into running totals
    first. :attr:`events`, the table, :func:`save_trace` and :func:`plot_timeline` show the
    window. :meth:`validate` checks the whole run where it can (see there).

    Args:
        devices: device labels, in the engine's order (rows of the table and the plot).
        window: the most events kept (``None``: all, never trimmed). Past it the oldest
            tenth (at most 4096 events) is folded into the totals at once, so between 90%
            and 100% of ``window`` are kept.

    Raises:
        InvalidOptionError: ``window`` is not an int >= 1 or ``None``.
    """

    def __init__(self, devices: Sequence[str], window: int | None = DEFAULT_WINDOW) -> None:
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise InvalidOptionError(
                "trace_window", window, "give an int >= 1 (events kept) or None (all)", "Trace"
            )
        self.devices = list(devices)
        self.window = window
        self._limit = sys.maxsize if window is None else window
        # Past the window, fold a tenth of it (at most _CHUNK events) at once.
        self._keep = 0 if window is None else window - min(window // 10, _CHUNK)
        self._events: list[TraceEvent] = []
        self._folded = _Folded()
        self._lock = threading.Lock()
        self._fold_lock = threading.Lock()  # taken before _lock; folds outside it

    @classmethod
    def from_events(
        cls, events: Iterable[TraceEvent], devices: Sequence[str] = (), window: int | None = None
    ) -> Trace:
        """A trace holding ``events`` (all of them, unless ``window`` is given); devices
        not in ``devices`` are appended in order of first appearance."""
        events = list(events)
        labels = list(devices)
        for event in events:
            if event.device not in labels and event.device not in TIER_LABELS:
                labels.append(event.device)
        trace = cls(labels, window)
        trace._events.extend(events)
        if len(trace._events) > trace._limit:
            trace._trim()
        return trace

    def add(self, event: TraceEvent) -> None:
        """Append one event (safe from any thread); past the window, fold the oldest."""
        with self._lock:
            self._events.append(event)
            if len(self._events) <= self._limit:
                return
        self._trim()

    def _trim(self) -> None:
        """Fold the oldest events into the totals, keeping the newest ``_keep``. Adding
        goes on meanwhile (the fold holds only ``_fold_lock``; readers wait for it)."""
        with self._fold_lock:
            with self._lock:
                if len(self._events) <= self._limit:
                    return  # another thread folded them
                n = len(self._events) - self._keep
                chunk = self._events[:n]
                del self._events[:n]
            self._folded.fold(chunk)

    @property
    def events(self) -> list[TraceEvent]:
        """A snapshot of the kept events (the window), in the order they were added."""
        with self._lock:
            return list(self._events)

    @property
    def dropped(self) -> int:
        """How many events were folded into the totals and are no longer kept."""
        return self._folded.count

    def __len__(self) -> int:
        return len(self._events)

    def _snapshot(self) -> tuple[list[TraceEvent], _Folded]:
        with self._fold_lock, self._lock:
            return list(self._events), self._folded.copy()

    def _all_devices(
        self, events: Sequence[TraceEvent], folded: _Folded | None = None
    ) -> list[str]:
        labels = list(self.devices)
        for label in folded.devices if folded is not None else ():
            if label not in labels:
                labels.append(label)
        for event in events:
            if event.device not in labels and event.device not in TIER_LABELS:
                labels.append(event.device)
        return labels

    @staticmethod
    def _wall(events: Sequence[TraceEvent], folded: _Folded) -> float:
        if not events and not folded.count:
            return 0.0
        first = min((e.start for e in events), default=folded.first_start)
        last = max((e.end for e in events), default=folded.last_end)
        return max(last, folded.last_end) - min(first, folded.first_start)

    def _busy(self, events: Sequence[TraceEvent], folded: _Folded) -> dict[str, float]:
        spans: dict[str, list[tuple[float, float]]] = {}
        for e in events:
            if e.op in COMPUTE_OPS:
                spans.setdefault(e.device, []).append((e.start, e.end))
        out: dict[str, float] = {}
        for device in self._all_devices(events, folded):
            total = _DeviceSum()
            if device in folded.devices:
                total = folded.devices[device]
            out[device] = total.busy_s + _union_length(
                sorted(spans.get(device, ())), total.frontier
            )
        return out

    def wall_s(self) -> float:
        """Seconds from the first start to the last end of the whole run (0.0 for an
        empty trace)."""
        return self._wall(*self._snapshot())

    def busy_s(self) -> dict[str, float]:
        """Per device, seconds during which a compute operation ran (copies excluded)."""
        return self._busy(*self._snapshot())

    def utilization(self) -> dict[str, float]:
        """Per device, compute busy time / wall time of the whole run (0.0 when empty)."""
        events, folded = self._snapshot()
        wall = self._wall(events, folded)
        busy = self._busy(events, folded)
        return {d: (b / wall if wall > 0 else 0.0) for d, b in busy.items()}

    def summary(self) -> dict[str, Any]:
        """Headline numbers of the whole run (dropped events included, from the totals).

        Returns:
            ``{"wall_s", "ops", "copies", "bytes_moved", "devices": {label: {"busy_s",
            "utilization", "ops", "bytes_moved"}}, "tasks": {name: busy_s}, "disk":
            {"read_bytes", "written_bytes", "wait_s"}, "events", "dropped"}`` (``events``:
            all events of the run; ``dropped``: those no longer kept).
        """
        events, folded = self._snapshot()
        wall = self._wall(events, folded)
        busy = self._busy(events, folded)
        devices: dict[str, dict[str, float]] = {}
        for device in self._all_devices(events, folded):
            past = folded.devices.get(device, _DeviceSum())
            mine = [e for e in events if e.device == device]
            devices[device] = {
                "busy_s": busy[device],
                "utilization": busy[device] / wall if wall > 0 else 0.0,
                "ops": past.ops + sum(1 for e in mine if e.is_compute),
                "bytes_moved": past.bytes_moved
                + sum(e.bytes_moved for e in mine if e.op not in _TIER_OPS),
            }
        tasks = dict(folded.tasks)
        for e in events:
            if e.is_compute:
                tasks[e.task] = tasks.get(e.task, 0.0) + e.duration
        # Device traffic: the disk tier's and the host account's events have their own.
        moves = [e for e in events if e.op not in _TIER_OPS]
        return {
            "wall_s": wall,
            "ops": folded.ops + sum(1 for e in events if e.is_compute),
            "copies": folded.copies + sum(1 for e in moves if not e.is_compute),
            "bytes_moved": folded.bytes_moved + sum(e.bytes_moved for e in moves),
            "devices": devices,
            "tasks": tasks,
            "disk": {
                "read_bytes": folded.read_bytes
                + sum(e.bytes_moved for e in events if e.op == "from_disk"),
                "written_bytes": folded.written_bytes
                + sum(e.bytes_moved for e in events if e.op == "to_disk"),
                "wait_s": folded.wait_s + sum(e.duration for e in events if e.op == "disk_wait"),
            },
            "events": folded.count + len(events),
            "dropped": folded.count,
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
            the device workers keep the budget with.

        Events no longer kept (a trace past its ``window``, see :attr:`dropped`) were
        checked as they were folded, against figures that need no argument, so that the
        check still covers the whole run: every event's end after its start; the
        sequential rules over all compute events (each device's and each task's events
        taken in time order within each folded chunk and continued from the latest one
        before it: exact when, as in the engine, they are added when they end; the worst
        overlap is kept and compared with ``tolerance`` here); the host account replayed
        over the whole run (its peak compared with ``host_budget``; the kept events
        replay from the account's value when the window starts); for ``state_budget``,
        the replay of the dropped events' copies (their peak per device, at the steps
        where this replay compares, is compared with the budget), and the kept events
        replay from the states each device held when the window starts. The folded
        replay steps in time order within each chunk, so at the cuts between chunks it
        may take two steps in the order they were added (a tiny ``window`` folds one
        event at a time). Not re-checked for dropped events: the running ops'
        activations and the kept graphs (``activation_bytes``, ``kept_bytes`` are only
        given here); a batch whose first forward was dropped is not reserved in the
        replay of the kept events.

        Raises:
            ScheduleError: an event ends before it starts, two compute operations overlap on
                one device, two compute operations of one task overlap (a task's
                operations are strictly sequential), or a device holds more state than
                ``state_budget``, or host memory holds more than ``host_budget``. The
                message shows the offending rows.
        """
        events, folded = self._snapshot()
        kept = f" (an event no longer kept: the trace keeps the last {self.window})"
        first_bad = folded.backwards or next((e for e in events if e.end < e.start), None)
        if first_bad is not None:
            raise ScheduleError(
                f"event ends before it starts ({first_bad.end:.6f} < {first_bad.start:.6f})"
                + (kept if first_bad is folded.backwards else "")
                + ":\n"
                + _rows([first_bad])
            )
        if folded.overlap is not None and folded.overlap[0] > tolerance:
            gap, what, name, a, b = folded.overlap
            raise ScheduleError(
                f"{what} {name!r} runs two operations at once (overlap {gap:.6f} s)"
                f"{kept}:\n" + _rows([a, b])
            )
        compute = [e for e in events if e.is_compute]
        alone = [e for e in compute if not e.along]  # an op run along is part of another
        _check_sequential(alone, lambda e: e.device, "device", tolerance, folded.latest_device)
        _check_sequential(compute, lambda e: e.task, "task", tolerance, folded.latest_task)
        if state_budget is not None:
            for device, (peak, rows) in folded.state_peak.items():
                limit = state_budget if isinstance(state_budget, int) else state_budget.get(device)
                if limit is not None and peak > limit:
                    raise ScheduleError(
                        f"device {device!r} holds {peak} bytes of shard state, over its "
                        f"budget of {limit} bytes{kept}:\n" + _rows(rows)
                    )
            _check_memory(events, state_budget, activation_bytes or {}, kept_bytes or {}, folded)
        if host_budget is not None:
            if folded.host_peak > host_budget:
                raise ScheduleError(
                    f"host memory holds {folded.host_peak} bytes, over its budget of "
                    f"{host_budget} bytes{kept} (the last account events):\n"
                    + _rows(folded.host_peak_rows)
                )
            _check_host(events, host_budget, folded.host_held, folded.host_recent)

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
        if self.dropped:
            text += (
                f"\n({self.dropped} earlier events dropped: the trace keeps the last {self.window})"
            )
        return text

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        dropped = f", dropped={self.dropped}" if self.dropped else ""
        return f"Trace(devices={self.devices!r}, events={len(self)}{dropped})"


def _union_length(spans: Sequence[tuple[float, float]], frontier: float = float("-inf")) -> float:
    """Total length covered by sorted ``(start, end)`` spans after ``frontier`` (the end
    of earlier spans already counted)."""
    total = 0.0
    for start, end in spans:
        begin = start if start > frontier else frontier
        if end > begin:
            total += end - begin
            frontier = end
    return total


def _check_sequential(
    events: list[TraceEvent],
    key: Any,
    what: str,
    tolerance: float,
    seed: Mapping[str, TraceEvent] | None = None,
) -> None:
    """Raise at the first overlap within a group; ``seed``: per group, the latest-ending
    event before these (dropped from a bounded trace)."""
    groups: dict[str, list[TraceEvent]] = {}
    for e in events:
        groups.setdefault(key(e), []).append(e)
    for name, group in groups.items():
        group.sort(key=lambda e: (e.start, e.end))
        latest = (seed or {}).get(name)  # the event with the latest end so far
        if latest is None:
            latest, group = group[0], group[1:]
        for e in group:
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


def _check_memory(
    events: list[TraceEvent],
    budget: int | Mapping[str, int],
    acts: Mapping[tuple[str, int], int],
    kept: Mapping[str, int],
    folded: _Folded | None = None,
) -> None:
    """Replay ``events`` through one :class:`DeviceLedger` per device (the workers'
    arithmetic) and raise at the first allocation that leaves a device over budget;
    ``folded``: start from the states it left on devices."""
    # Replay in time order; at equal times frees (end of a copy_out, end of an op or a
    # batch) come before allocations (start of a copy_in, an op, a batch).
    steps = []
    for i, e in enumerate(events):
        if e.op == "copy_out":
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
    ledgers: dict[str, DeviceLedger[_Held]] = {}
    where: dict[tuple[str, int], tuple[str, _Held]] = {}  # each state's device
    running: dict[str, _Held] = {}

    def ledger_of(device: str) -> DeviceLedger[_Held]:
        ledger = ledgers.get(device)
        if ledger is None:
            limit = budget if isinstance(budget, int) else budget.get(device)
            ledger = ledgers[device] = DeviceLedger(limit)
        return ledger

    if folded is not None:
        for name, (device, nbytes, event) in folded.resident.items():
            where[name] = (device, _Held(name, nbytes, 0, event))
            ledger_of(device).hold(where[name][1])
    for _, _, _, e, what in steps:
        key = (e.task, e.shard)
        ledger = ledger_of(e.device)
        if what == "unreserve":
            ledger.reserve(e.task, None)
            continue
        if what == "free":
            if key in where and where[key][0] == e.device:
                ledger.release(where.pop(key)[1])
            continue
        if what == "done":
            op = running.get(e.device)
            if op is not None and op.event is e:
                del running[e.device]
            continue
        if what == "reserve":
            ledger.reserve(e.task, kept[e.task])
        elif what == "run":
            op = running.get(e.device)
            if e.along and op is not None:  # one batched pass: the activations of both
                both = op.activation_bytes + acts.get(key, 0)
                running[e.device] = _Held(op.name, 0, both, op.event)
            else:
                running[e.device] = _Held(key, 0, acts.get(key, 0), e)
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
                + f"), over its budget of {ledger.budget} bytes, at {e.start:.6f} s:\n"
                + _rows(rows)
            )


def _check_host(
    events: list[TraceEvent], budget: int, held: int = 0, recent: Sequence[TraceEvent] = ()
) -> None:
    """Replay the host memory account in the order it was kept and raise at the first
    take that leaves it over ``budget``; ``held``: the account when ``events`` begin
    (``recent``: its last events before them)."""
    recent = list(recent)
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
    dropped = trace.dropped
    trace = Trace.from_events(events, devices)  # the figures of the events drawn
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
    shown = f" (the last {len(events)} events)" if dropped else ""
    ax.set_title(
        title or f"{len(tasks)} tasks, wall {wall:.3f} s{shown}, mean utilization {mean:.0%}"
    )
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


__all__ = [
    "COMPUTE_OPS",
    "COPY_OPS",
    "DEFAULT_WINDOW",
    "Trace",
    "TraceEvent",
    "plot_timeline",
    "save_trace",
]
