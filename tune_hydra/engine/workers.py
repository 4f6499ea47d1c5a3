"""Device workers: one compute thread per device, plus a copy thread that promotes the
next assigned shard while the current one computes (double buffering).

A worker holds at most two shard states resident when prefetching (the running one and
the next), one otherwise; the least recently used other shard is demoted to make room.
On CUDA, copies run on a dedicated stream and compute waits on an event; on the CPU the
same bookkeeping runs with plain copies (or none, when ``copy=False``).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tune_hydra.engine.ops import Op
from tune_hydra.engine.spill import ShardStore
from tune_hydra.engine.trace import Trace, TraceEvent

_POLL_S = 0.2  # every blocking wait wakes up this often to notice a close


@dataclass
class Assignment:
    """An operation handed to a worker; ``ready`` (only when a copy thread promotes the
    shard) is set once its shard is resident."""

    op: Op
    store: ShardStore
    run: Callable[[torch.device], None]
    done: Callable[[Assignment, BaseException | None], None]
    ready: threading.Event | None = None
    copy_error: BaseException | None = None
    event: Any = None  # CUDA event after the promotion
    moved: int = 0
    duration: float = 0.0


@dataclass
class Prefetch:
    """A speculative promotion: the shard a task will most likely need next here."""

    store: ShardStore
    task: str
    shard: int
    iteration: int


class DeviceWorker:
    """Runs shard operations on one device, in the order they were assigned."""

    def __init__(
        self,
        index: int,
        device: torch.device,
        label: str,
        trace: Trace,
        clock: Callable[[], float],
        *,
        prefetch: bool,
        copy: bool,
        intra_threads: int | None = None,
    ) -> None:
        self.index = index
        self.device = device
        self.label = label
        self.trace = trace
        self.clock = clock
        self.copy = copy or device.type == "cuda"
        # Double buffering overlaps a copy with compute; with nothing to copy a second
        # queued op would only force tasks to alternate (and lose their warm caches).
        self.depth = 2 if prefetch and self.copy else 1
        self.intra_threads = intra_threads
        self.resident: collections.OrderedDict[int, ShardStore] = collections.OrderedDict()
        self.assigned: collections.deque[Assignment] = collections.deque()
        self.busy_s = 0.0
        # The task whose op ran here last: without copies its activations are what this
        # core's caches hold, the CPU's notion of "resident" (set by the engine).
        self.last_task: str | None = None
        self.peak_resident_bytes = 0  # shard state held on the device at once, at most
        self.last_error: BaseException | None = None
        self.last_prefetch_error: BaseException | None = None  # speculative: not fatal
        self._lock = threading.Lock()
        self._copy_q: queue.SimpleQueue[Assignment | Prefetch | None] = queue.SimpleQueue()
        self._run_q: queue.SimpleQueue[Assignment | None] = queue.SimpleQueue()
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.compute_stream = torch.cuda.Stream(device) if cuda else None
        self._threads = [
            threading.Thread(target=self._copy_loop, name=f"hydra-copy-{label}", daemon=True),
            threading.Thread(target=self._run_loop, name=f"hydra-run-{label}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def free_slots(self) -> int:
        return self.depth - len(self.assigned)

    def holds(self, store: ShardStore) -> bool:
        return id(store) in self.resident

    def submit(self, a: Assignment) -> None:
        """Queue ``a`` (called by the dispatcher, under its lock)."""
        self.assigned.append(a)
        if self.copy:
            a.ready = threading.Event()
            self._copy_q.put(a)
        else:  # nothing to copy (a CPU device uses host memory in place): no hand-off
            a.store.promote(self.device, None, copy=False, owner=self)
            with self._lock:
                self.resident[id(a.store)] = a.store
                self.resident.move_to_end(id(a.store))
                while len(self.resident) > self.depth:
                    self.resident.popitem(last=False)
        self._run_q.put(a)

    def prefetch(self, store: ShardStore, task: str, shard: int, iteration: int) -> None:
        """Promote ``store`` ahead of its op if a slot is free by the time the copy thread
        gets to it (called by the dispatcher, under its lock)."""
        if self.copy:
            self._copy_q.put(Prefetch(store, task, shard, iteration))

    def release(self, store: ShardStore) -> None:
        """Forget ``store`` without copying (another device took it, or its task left)."""
        with self._lock:
            self.resident.pop(id(store), None)

    def close(self) -> None:
        self._copy_q.put(None)
        self._run_q.put(None)

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    # -- threads -------------------------------------------------------------------------

    def _copy_loop(self) -> None:
        while True:
            a = self._copy_q.get()
            if a is None:
                return
            if isinstance(a, Prefetch):
                try:
                    self._speculate(a)
                except BaseException as err:  # the op that needs the shard will retry
                    self.last_prefetch_error = err
                continue
            try:
                self._make_room(a.store)
                t0 = self.clock()
                moved = a.store.promote(self.device, self.copy_stream, copy=self.copy, owner=self)
                if self.copy_stream is not None:
                    a.event = torch.cuda.Event()
                    a.event.record(self.copy_stream)
                if moved:
                    self.trace.add(
                        TraceEvent(
                            self.label,
                            a.op.task,
                            a.op.shard,
                            "copy_in",
                            t0,
                            self.clock(),
                            moved,
                            a.op.iteration,
                            a.op.batch,
                        )
                    )
                a.moved = moved
                self._hold(a.store)
            except BaseException as err:  # reported through the op
                a.copy_error = err
            assert a.ready is not None
            a.ready.set()

    def _speculate(self, p: Prefetch) -> None:
        with self._lock:
            if id(p.store) in self.resident:
                return
            busy = {id(x.store) for x in list(self.assigned)}
        if len(busy) + 1 > self.depth:  # both slots taken by assigned ops
            return
        self._make_room(p.store)
        t0 = self.clock()
        moved = p.store.try_promote(self.device, self.copy_stream, copy=self.copy, owner=self)
        if moved is None:  # another device holds it
            return
        if moved:
            self.trace.add(
                TraceEvent(
                    self.label, p.task, p.shard, "copy_in", t0, self.clock(), moved, p.iteration
                )
            )
        self._hold(p.store)

    def _hold(self, store: ShardStore) -> None:
        with self._lock:
            self.resident[id(store)] = store
            self.resident.move_to_end(id(store))
            # Sizes cached at promotion: reading a store's tensors while another
            # thread computes with them (autograd writing .grad) is unsafe.
            store.last_nbytes = store.nbytes()
            held = sum(s.last_nbytes for s in self.resident.values())
            self.peak_resident_bytes = max(self.peak_resident_bytes, held)

    def _make_room(self, incoming: ShardStore) -> None:
        keep = {id(x.store) for x in list(self.assigned)} | {id(incoming)}
        with self._lock:
            victims = [s for k, s in self.resident.items() if k not in keep]
            excess = len(self.resident) + (0 if id(incoming) in self.resident else 1) - self.depth
            victims = victims[: max(0, excess)]
            for s in victims:
                self.resident.pop(id(s), None)
        for s in victims:
            t0 = self.clock()
            moved = s.demote(self.copy_stream, only_owner=self)
            if moved:
                self.trace.add(TraceEvent(self.label, "", -1, "copy_out", t0, self.clock(), moved))

    def _run_loop(self) -> None:
        if self.intra_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(self.intra_threads)
        while True:
            a = self._run_q.get()
            if a is None:
                return
            if a.ready is not None:
                while not a.ready.wait(_POLL_S):
                    pass
            err = a.copy_error
            t0 = self.clock()
            if err is None:
                try:
                    if self.compute_stream is not None:
                        with torch.cuda.stream(self.compute_stream):
                            if a.event is not None:
                                self.compute_stream.wait_event(a.event)
                            a.run(self.device)
                        self.compute_stream.synchronize()
                    else:
                        a.run(self.device)
                except BaseException as e:  # the engine fails that task only
                    err = e
            t1 = self.clock()
            self.busy_s += t1 - t0
            a.duration = t1 - t0
            op = a.op
            self.trace.add(
                TraceEvent(
                    self.label,
                    op.task,
                    op.shard,
                    op.kind.value,
                    t0,
                    t1,
                    a.moved,
                    op.iteration,
                    op.batch,
                )
            )
            try:
                a.done(a, err)
            except BaseException as e:  # keep the worker alive; the engine notices
                self.last_error = e


def default_clock() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
