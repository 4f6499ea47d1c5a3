"""The engine: tasks, device workers and the dispatcher that multiplexes their shards.

:class:`Engine` is thread-safe and Ray-free. Its tasks are runners (the
``th.shard`` loops of users and of :class:`~tune_hydra.frontends.task_loop.TaskLoop` s,
which issue their ops from their own threads; scripted runners in dispatch tests).

``Engine`` is the public facade: it builds the devices' workers and two owners, and its
methods delegate to them. :class:`~tune_hydra.engine.registration.registry.TaskRegistry` admits the
tasks (checks, probing, plans, runners) and owns the ``name -> TaskRecord`` map;
:class:`~tune_hydra.engine.dispatch.dispatcher.Dispatcher` runs them (grants, every dispatch
decision, what follows each op, cancellation, bringing states home). Both share the
engine's one lock, ``Engine._cv``; the few operations that need both are sequenced here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tune_hydra.core.ops import Op
from tune_hydra.core.policies import get_policy
from tune_hydra.core.trace import Trace
from tune_hydra.engine.dispatch.acquire import acquire as acquire_lease
from tune_hydra.engine.dispatch.batched import SharedBatcher
from tune_hydra.engine.dispatch.dispatcher import Dispatcher
from tune_hydra.engine.dispatch.lease import Lease
from tune_hydra.engine.dispatch.workers import DeviceWorker, default_clock
from tune_hydra.engine.protocol import Runner
from tune_hydra.engine.records import TaskRecord
from tune_hydra.engine.registration.partition import ShardPlan
from tune_hydra.engine.registration.registry import TaskRegistry
from tune_hydra.engine.runtime.kept import KeptGraphs
from tune_hydra.engine.storage.disk import SpillFolder
from tune_hydra.engine.storage.host import HostMemory
from tune_hydra.engine.units import device_budget, resolve_devices
from tune_hydra.exceptions import InvalidOptionError, InvalidTaskError
from tune_hydra.options import (
    POSITIONAL_OPTIONS,
    EngineOptions,
    TrainOptions,
    engine_options,
)


class Engine:
    """Runs the shard ops of many tasks at once, shard by shard, on shared devices.

    Args:
        *positional: ``devices``, ``device_memory`` and ``policy``, by position (or by
            name among the options below).
        **engine_options: the engine options, documented and defaulted once in
            :class:`~tune_hydra.options.EngineOptions`: ``devices`` (``"auto"``,
            ``"cpu"``, ``["cuda:0", "cuda:1"]``; ``"cpu"`` may repeat), ``device_memory``
            (per device, bytes or ``"512MiB"``), ``policy``, ``prefetch``, ``recompute``,
            ``copy_on_cpu``, ``max_layers_per_shard``, ``host_memory`` and ``spill_dir``
            (the disk tier), ``trace_window``, ``share_frozen``, ``batch_shared``
            (``summary()`` counts the batched passes).
        options: the same options as one checked :class:`~tune_hydra.options.EngineOptions`
            (what the front ends build where the user gives them, and hand down as it is),
            instead of the keywords above (``Engine(options=opts)``; giving both is
            refused). The keywords build one; either way ``engine.options`` holds it, the
            one place the engine reads them from.
        clock: the engine's clock, seconds (default: ``time.perf_counter`` from the
            start); it times ops (the estimates policies see), readiness and the trace.
            Tests that script time pass a
            :class:`~tune_hydra.engine.dispatch.scripted.ManualClock`.

    Raises:
        InvalidOptionError: a bad ``prefetch``, ``recompute``, ``copy_on_cpu``,
            ``max_layers_per_shard`` or ``trace_window``, or ``options`` with keywords.
        UnknownOptionError: a keyword the engine does not take (a typo: the message
            names the closest option).
        SpillDirError: ``host_memory`` without ``spill_dir``, or a ``spill_dir`` that is
            missing, not writable or on a full disk.
        UnknownDeviceError, BudgetFormatError, UnknownPolicyError: a bad device, budget or
            policy.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> from tune_hydra.engine import Engine
        >>> from tune_hydra.frontends.task_loop import TaskLoop
        >>> task = th.ModelTask(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), nn.MSELoss(),
        ...                     lambda p: torch.optim.SGD(p, lr=0.1),
        ...                     [(torch.randn(2, 4), torch.randn(2, 1))])
        >>> with Engine(devices="cpu") as engine:
        ...     results = TaskLoop("a", task, engine, seed=0).start(2).result(timeout=60)
        >>> [r["iteration"] for r in results]
        [1, 2]
    """

    def __init__(
        self,
        *positional: Any,
        options: EngineOptions | None = None,
        clock: Callable[[], float] | None = None,
        **engine_options: Any,
    ) -> None:
        options = _engine_options(options, positional, engine_options)
        self.options = options
        self.devices = resolve_devices(options.devices)
        self.policy = get_policy(options.policy)
        self.recompute = _recompute(options, self.devices)
        labels = _labels(self.devices)
        self.trace = Trace(labels, options.trace_window)
        self.clock = default_clock() if clock is None else clock
        self.host = _host_memory(options, self.trace, self.clock)
        self._saved_threads = torch.get_num_threads()  # workers may change it; restored
        # After the checks and the spill folder (which may raise): no thread left running.
        self.workers = _start_workers(self.devices, labels, options, self.trace, self.clock)
        kept = KeptGraphs(not self.recompute and any(w.copy for w in self.workers))
        self._cv = threading.Condition(threading.RLock())  # the engine's one lock
        self._registry = TaskRegistry(self._cv, options, self.recompute, self.host, kept)
        # Engine(batch_shared=True): its counts (passes, ops run in them) for the figures.
        self.batcher = SharedBatcher() if options.batch_shared else None
        self._dispatcher = Dispatcher(
            self._registry.tasks,
            self._cv,
            self.workers,
            self.policy,
            self.host,
            kept,
            self.clock,
            batcher=self.batcher,
        )

    # -- options (read from the one EngineOptions) -----------------------------------------

    @property
    def budget(self) -> int | None:
        """``device_memory`` in bytes, as parsed by :class:`EngineOptions` (``None``: the
        whole device; on a GPU the plans then budget 90% of it)."""
        return self.options.device_bytes

    @property
    def prefetch(self) -> bool:
        return self.options.prefetch

    @property
    def copy_on_cpu(self) -> bool:
        return self.options.copy_on_cpu

    @property
    def max_layers_per_shard(self) -> int | None:
        return self.options.max_layers_per_shard

    # -- context manager ------------------------------------------------------------------

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tasks ------------------------------------------------------------------------------

    def add_runner(self, name: str, runner: Runner, *, options: TrainOptions | None = None) -> int:
        """Register a task whose operations come from ``runner`` (any
        :class:`~tune_hydra.engine.protocol.Runner`: a ``th.shard`` loop's, or a
        :class:`~tune_hydra.engine.dispatch.scripted.ScriptedRunner`); returns its number of
        shards. It is then trained (:meth:`train`), cancelled and removed by name.

        Args:
            name: the task's name (the ``task`` of the runner's ops).
            runner: the runner; its ``plan`` must be checked against this engine's
                budget by whoever built it.
            options: the task's options as the engine reads them (``iteration_batches``:
                an iteration is that many batches rather than an epoch); default
                ``TrainOptions()``.

        Raises:
            InvalidTaskError: ``runner`` lacks a ``Runner`` member, is named otherwise,
                its ``plan`` has no shard, a name in use, or its batch's kept graphs would
                not fit.
            SharedModelError: the runner's ``frozen_model`` (a ``th.shard`` loop's model)
                shares trainable parameters or buffers with another registered task.
        """
        return self._registry.add_runner(name, runner, options)

    # -- read-only views of a task (for callers and tests; none changes anything) ---------

    def runner(self, name: str) -> Runner:
        """Task ``name``'s runner."""
        with self._cv:
            return self._entry(name).runner

    def task_options(self, name: str) -> TrainOptions:
        """Task ``name``'s checked options (its seed resolved)."""
        with self._cv:
            return self._entry(name).options

    def kept_on(self, name: str) -> str | None:
        """The label of the device holding task ``name``'s batch's kept graphs
        (``recompute=False`` on a device that copies), or ``None`` outside a batch."""
        with self._cv:
            w = self._entry(name).kept_on
            return None if w is None else w.label

    def queued(self) -> dict[str, list[Op]]:
        """The ops queued on each device (by label), the running one first."""
        with self._cv:
            return {w.label: [a.op for a in list(w.assigned)] for w in self.workers}

    @contextlib.contextmanager
    def hold_dispatch(self) -> Iterator[None]:
        """Make no dispatch decision inside the ``with`` block (ops already queued run
        on); on leaving it, one dispatch on the caller's thread. Grants made inside (for
        several tasks at once) are then all seen by the first decision, rather than the
        first task's op being dispatched alone."""
        with self._dispatcher.hold():
            yield

    @property
    def keeps_graphs(self) -> bool:
        """Whether batches' forward graphs are kept, and reserved, on devices that copy
        (``recompute=False`` there; see ``tune_hydra.engine.runtime.kept``)."""
        return self._registry.keeps_graphs

    def shared_cuts(self, model: torch.nn.Module, layers: list[str]) -> list[list[tuple[int, int]]]:
        """Where registered tasks likely sharing ``model``'s frozen tensors were cut from
        the same layers (``TaskRegistry.shared_cuts``): a th.shard loop cuts at the first
        of them that fits (``plan_shards(prefer=...)``)."""
        return self._registry.shared_cuts(model, layers)

    def plan(self, name: str) -> ShardPlan:
        """The shard plan of a registered task."""
        return self._entry(name).plan

    def update_plan(self, name: str, plan: ShardPlan) -> None:
        """Replace task ``name``'s plan by ``plan``: the same cut, sized anew (a
        ``th.shard`` loop's batch larger than the one it was cut on needs more activation
        bytes). The kept-graph reservations and :meth:`plan` read it from now on; the
        runner updates its stores' footprints (what the device ledgers read) itself.

        Raises:
            InvalidTaskError: no such task, or ``plan`` cuts the model elsewhere.
        """
        with self._cv:
            entry = self._entry(name)
            cut = [(s.start, s.stop) for s in plan.shards]
            if cut != [(s.start, s.stop) for s in entry.plan.shards]:
                raise InvalidTaskError(
                    f"task {name!r}: update_plan takes the same cut sized anew, not another "
                    f"cut ({cut})"
                )
            entry.plan = plan

    def tasks(self) -> list[str]:
        with self._cv:
            return list(self._tasks)

    def train(
        self, name: str, iterations: int = 1
    ) -> concurrent.futures.Future[list[dict[str, Any]]]:
        """Grant ``iterations`` more iterations to a task; the future gets their results."""
        if iterations < 1:
            raise InvalidTaskError(f"iterations must be >= 1, got {iterations}")
        with self._cv:
            return self._dispatcher.grant(self._entry(name), iterations)

    def set_remaining(self, name: str, iterations: int) -> None:
        """Tell the scheduler how many iterations this task will still be granted (after
        those granted now); each grant from here on counts down from it."""
        with self._cv:
            self._entry(name).set_hint(iterations)

    def set_milestone(self, name: str, iterations: int | None) -> None:
        """Tell the scheduler how many iterations of task ``name``'s work (from now,
        granted or not) remain until its trial's next milestone, such as a
        successive-halving rung; ``None``: unknown, or no more milestones.

        The count goes down as the task finishes iterations; policies see it as
        ``Candidate.milestone_s`` (seconds, estimated as ``remaining_s`` is), ``None``
        once the milestone is reached (until the next is set).

        Raises:
            InvalidTaskError: no such task, or ``iterations`` is not an int >= 0 or None.
        """
        if iterations is not None and (
            isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0
        ):
            raise InvalidTaskError(
                f"set_milestone({name!r}, {iterations!r}): give the iterations until the "
                f"next milestone as an int >= 0, or None when there is none"
            )
        with self._cv:
            self._entry(name).set_milestone(iterations)

    def cancel(self, name: str) -> None:
        """Drop the task's queued work; its futures are cancelled once its running op ends."""
        with self._cv:
            entry = self._tasks.get(name)
            if entry is None:
                return
            self._dispatcher.cancel(entry)

    def remove_task(self, name: str, *, runner: Runner | None = None) -> None:
        """Cancel the task and forget it (its model keeps its current weights, on the CPU).
        ``runner``: only while it is this runner's (a loop leaving late must not take
        the name's next owner with it)."""
        with self._cv:
            entry = self._tasks.get(name)
            if entry is None or (runner is not None and entry.runner is not runner):
                return
            self._dispatcher.retire(entry)
            self._registry.remove(name)

    def acquire(
        self,
        task: str,
        shard: int,
        device: int | str | torch.device,
        *,
        timeout: float | None = None,
    ) -> Lease:
        """Lease shard ``shard`` of ``task`` on ``device``: until the lease is released,
        the shard's state is resident there and the caller may compute with its modules
        and optimizer from any thread (see :mod:`tune_hydra.engine.dispatch.lease`).

        Args:
            task: a registered task.
            shard: the shard's index (``engine.plan(task).shards``).
            device: the device's index, its label (``"cpu#1"``) or a device only one of
                the engine's devices is.
            timeout: seconds to wait for room (and for another lease on the shard to
                end); ``None``: as long as it takes.

        Raises:
            InvalidTaskError: an unknown task or shard.
            UnknownDeviceError: a device this engine does not have.
            LeaseConflictError: the task is being trained (``train()`` not done), or has
                a lease on another device.
            LeaseTimeoutError: no room within ``timeout``.
            LeaseEndedError: the engine is closed (or closes while it waits).
        """
        return acquire_lease(
            task,
            shard,
            device,
            timeout=timeout,
            workers=self.workers,
            host=self.host,
            lock=self._cv,
            lookup=self._leasable,
        )

    def summary(self) -> dict[str, Any]:
        """Per-device busy time and utilization, bytes moved, per-task figures, the
        batched passes (``"batched_passes"``, 0 without ``batch_shared``), and host memory
        (``"host"``: ``budget``, ``held_bytes``, ``peak_held_bytes``, ``over_bytes``, disk
        ``written_bytes`` / ``read_bytes``, ``spills``, ``loads``, ``disk_wait_s``,
        ``spill_dir``; see ``tune_hydra.engine.storage.host``)."""
        wall = self.clock()
        out: dict[str, Any] = {"wall_s": wall, "devices": {}, "tasks": {}}
        for w in self.workers:
            out["devices"][w.label] = {
                "peak_resident_bytes": w.peak_resident_bytes,
                "busy_s": w.busy_s,
                "utilization": w.busy_s / wall if wall > 0 else 0.0,
            }
        out["host"] = self.host.summary()
        with self._cv:
            for name, e in self._tasks.items():
                out["tasks"][name] = {
                    "device_time_s": e.device_time,
                    "num_shards": len(e.plan),
                    "iterations": e.iteration,
                }
        # Engine(batch_shared=True): passes that ran several tasks' ops as one.
        out["batched_passes"] = 0 if self.batcher is None else self.batcher.passes
        return out

    def close(self) -> None:
        """Stop the threads, bring every model back to the CPU and remove the spill folder.

        With a disk tier, the states still on disk are not read back into host memory
        (all of them may not fit): their tensors stay memory-mapped views of the removed
        files, readable and writable as any CPU tensor, until the model replaces them (a
        ``load_state_dict``, ``.clone()``); their disk space is freed then. To get a
        model back in RAM, call :meth:`remove_task` first: it reads the task's model
        tensors back (``train_models`` does so for every task). Never raises for the
        disk tier: a spill folder that cannot be removed is logged. A loop still
        registered (a ``th.shard`` loop's runner, between its ops) leaves first, as its
        ``close`` does: its optimizer steps still waiting for its next op are applied, so
        its model keeps every step it took.
        """
        if self._dispatcher.closed:
            return
        with self._cv:
            runners = [e.runner for e in self._tasks.values()]
        for runner in runners:
            leave = getattr(runner, "close", None)
            if leave is not None and runner.current is None:  # not in an op right now
                leave(raise_errors=False)  # logs what it cannot apply
        if not self._dispatcher.stop():  # closed already (by another thread meanwhile)
            return
        for w in self.workers:
            w.close()
        for w in self.workers:
            w.join(30.0)
        torch.set_num_threads(self._saved_threads)
        self._dispatcher.release_all()
        self.host.close()

    # -- internals ------------------------------------------------------------------------------

    @property
    def _tasks(self) -> dict[str, TaskRecord]:
        """The registry's ``name -> TaskRecord`` map (read it under ``_cv``)."""
        return self._registry.tasks

    def _entry(self, name: str) -> TaskRecord:
        return self._registry.entry(name)

    def _leasable(self, name: str) -> TaskRecord | None:
        """Task ``name``'s record for :meth:`acquire` (under ``_cv``); ``None`` once the
        engine is closed."""
        return None if self._dispatcher.closed else self._entry(name)


def _engine_options(
    options: Any, positional: tuple[Any, ...], given: dict[str, Any]
) -> EngineOptions:
    """The engine's options: ``options`` as it is (checked when it was built), else the
    ones given by position and by name, checked (:func:`~tune_hydra.options.engine_options`).

    Raises:
        UnknownOptionError: a keyword the engine does not take (named with the closest).
        InvalidOptionError: ``options`` is no ``EngineOptions``, or comes with others.
    """
    if options is None:
        return engine_options(
            given, where="Engine", positional=positional, takes=("options", "clock")
        )
    if not isinstance(options, EngineOptions):
        raise InvalidOptionError(
            "options", options, "give a tune_hydra.options.EngineOptions, or None", "Engine"
        )
    if positional or given:
        mixed = [*POSITIONAL_OPTIONS[: len(positional)], *given]
        raise InvalidOptionError(
            mixed[0],
            given[mixed[0]] if mixed[0] in given else positional[0],
            f"leave out {', '.join(mixed)} when passing options=: the EngineOptions holds "
            f"them (derive another with dataclasses.replace(options, {mixed[0]}=...))",
            "Engine",
        )
    return options


def _recompute(options: EngineOptions, devices: list[torch.device]) -> bool:
    """Whether ops recompute forward in backward: ``options.recompute``, by default on
    GPUs and with ``copy_on_cpu``.

    Raises:
        InvalidOptionError: ``batch_shared`` without recomputing.
    """
    gpu, recompute = any(d.type == "cuda" for d in devices), options.recompute
    recompute = (gpu or options.copy_on_cpu) if recompute is None else recompute
    if options.batch_shared and not recompute:
        raise InvalidOptionError(
            "batch_shared",
            options.batch_shared,
            "the batched base runs recomputing ops only: give recompute=True (the "
            "default on GPUs and with copy_on_cpu=True), or leave batch_shared off",
            "Engine",
        )
    return recompute


def _labels(devices: list[torch.device]) -> list[str]:
    """The devices' labels: ``cpu#i`` when the CPU is several devices, else the device."""
    n_cpu = sum(d.type == "cpu" for d in devices)
    return [f"cpu#{i}" if d.type == "cpu" and n_cpu > 1 else str(d) for i, d in enumerate(devices)]


def _host_memory(options: EngineOptions, trace: Trace, clock: Callable[[], float]) -> HostMemory:
    """The engine's host memory, with its disk tier when ``host_memory`` and ``spill_dir``
    are given.

    Raises:
        SpillDirError: a ``spill_dir`` that is missing, not writable or on a full disk.
    """
    host_budget, spill_dir = options.host_bytes, options.spill_dir
    folder = SpillFolder(spill_dir) if host_budget is not None and spill_dir else None
    return HostMemory(host_budget, folder, trace, clock)


def _start_workers(
    devices: list[torch.device],
    labels: list[str],
    options: EngineOptions,
    trace: Trace,
    clock: Callable[[], float],
) -> list[DeviceWorker]:
    """One started worker per device; torch's intra-op threads are divided among several
    CPU devices."""
    n_cpu = sum(d.type == "cpu" for d in devices)
    threads = max(1, torch.get_num_threads() // n_cpu) if n_cpu > 1 else None
    return [
        DeviceWorker(
            i,
            d,
            labels[i],
            trace,
            clock,
            prefetch=options.prefetch,
            copy=options.copy_on_cpu,
            intra_threads=threads,
            budget=device_budget(d, options.device_bytes),
        )
        for i, d in enumerate(devices)
    ]


__all__ = ["Engine"]
