"""The engine: tasks, device workers and the dispatcher that multiplexes their shards.

:class:`Engine` is thread-safe and Ray-free. ``train_models`` drives it for a fixed number
of epochs; the Ray Tune front end drives it one iteration per trial step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tune_hydra.core.dispatch import decide, offer
from tune_hydra.core.ops import Op
from tune_hydra.core.policies import BasePolicy, Candidate, get_policy
from tune_hydra.core.trace import Trace
from tune_hydra.engine.boundary import split_batch
from tune_hydra.engine.host import HostMemory
from tune_hydra.engine.kept import KeptGraphs
from tune_hydra.engine.lease import Lease
from tune_hydra.engine.lease import acquire as acquire_lease
from tune_hydra.engine.partition import ShardPlan, layer_costs, plan_shards
from tune_hydra.engine.protocol import Runner, check_runner
from tune_hydra.engine.records import PendingIterations, TaskRecord, batches_per_iter
from tune_hydra.engine.rng import CPU_RNG_LOCK
from tune_hydra.engine.runner import TaskRunner
from tune_hydra.engine.storage import LinkedStore, ShardStore, Store
from tune_hydra.engine.storage.disk import SpillFolder
from tune_hydra.engine.task import ModelTask, OwnedTensors, model_layers, owned_tensors
from tune_hydra.engine.units import device_capacity, resolve_devices
from tune_hydra.engine.workers import (
    _POLL_S,
    Assignment,
    Carry,
    DeviceWorker,
    default_clock,
)
from tune_hydra.exceptions import (
    EmptyDataError,
    HostBudgetError,
    InvalidModelError,
    InvalidOptionError,
    InvalidTaskError,
    ScheduleError,
    SharedModelError,
    TaskFailedError,
    TuneHydraError,
)
from tune_hydra.options import (
    DEFAULT_TRACE_WINDOW,
    EngineOptions,
    TrainOptions,
    check_seed,
)

log = logging.getLogger(__name__)


class Engine:
    """Trains many :class:`~tune_hydra.ModelTask` s at once, shard by shard, on shared devices.

    Args:
        devices: ``"auto"``, ``"cpu"``, or a list such as ``["cuda:0", "cuda:1"]``;
            ``"cpu"`` may repeat (each is an emulated device with its own worker thread,
            and torch's intra-op threads are divided among them).
        device_memory: per-device budget (bytes, or ``"512MiB"``); ``None`` is the whole
            device (on the CPU: no limit, one shard).
        policy: ``"auto"`` (default: the milestone policy, which decides as LRTF until a
            front end announces milestones with :meth:`set_milestone`), ``"lrtf"``,
            ``"milestone"``, ``"fifo"``, ``"round_robin"`` or a ``BasePolicy``.
        prefetch: double-buffer: promote the next assigned shard while one computes (on
            devices that copy; a CPU device that copies nothing queues one op at a time).
        recompute: re-run forward in backward instead of keeping activations; default
            ``True`` on GPUs (activations would occupy device memory) and ``False`` on the
            CPU (where the "device" is host memory and recomputing only costs time).
            Without it, on a device that copies, each batch's kept graphs are reserved in
            ``device_memory`` (see ``tune_hydra.engine.kept``).
        copy_on_cpu: really copy shard state on CPU "devices": they then run the way a
            GPU does (spills, budgets, and ``recompute`` on by default).
        max_layers_per_shard: cut finer than the budget requires (an int >= 1, or None).
        host_memory: host-memory budget for the shard states of all tasks (bytes, or
            ``"64GiB"``); the coldest states beyond it go to files under ``spill_dir`` and
            are read back ahead of their visits (see ``tune_hydra.engine.host``). ``None``:
            unlimited, nothing goes to disk.
        spill_dir: an existing folder on a local disk (not a tmpfs) for the disk tier;
            the engine works in a folder of its own there, removed when it closes (or, after
            a crash, by the next engine started with the same ``spill_dir``).
        trace_window: the most events :attr:`trace` keeps (default 200,000, 35-55 MiB;
            ``None``: all, growing with the run); older ones are folded into running
            totals, so the trace's figures (``trace.summary()``) still cover the whole run.
        options: the same options as one checked :class:`~tune_hydra.options.EngineOptions`
            (what the front ends build where the user gives them, and hand down as it is),
            instead of the keywords above (``Engine(options=opts)``; giving both is
            refused). The keywords build one; either way ``engine.options`` holds it, the
            one place the engine reads them from.
        clock: the engine's clock, seconds (default: ``time.perf_counter`` from the
            start); it times ops (the estimates policies see), readiness and the trace.
            Tests that script time pass a
            :class:`~tune_hydra.engine.scripted.ManualClock`.

    Raises:
        InvalidOptionError: a bad ``prefetch``, ``recompute``, ``copy_on_cpu``,
            ``max_layers_per_shard`` or ``trace_window``, or ``options`` with keywords.
        SpillDirError: ``host_memory`` without ``spill_dir``, or a ``spill_dir`` that is
            missing, not writable or on a full disk.
        UnknownDeviceError, BudgetFormatError, UnknownPolicyError: a bad device, budget or
            policy.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> from tune_hydra.engine import Engine
        >>> task = th.ModelTask(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), nn.MSELoss(),
        ...                     lambda p: torch.optim.SGD(p, lr=0.1),
        ...                     [(torch.randn(2, 4), torch.randn(2, 1))])
        >>> with Engine(devices="cpu") as engine:
        ...     shards = engine.add_task("a", task, seed=0)
        ...     results = engine.train("a", iterations=2).result(timeout=60)
        >>> [r["iteration"] for r in results]
        [1, 2]
    """

    def __init__(
        self,
        devices: Any = "auto",
        device_memory: int | str | None = None,
        policy: str | BasePolicy = "auto",
        *,
        prefetch: bool = True,
        recompute: bool | None = None,
        copy_on_cpu: bool = False,
        max_layers_per_shard: int | None = None,
        host_memory: int | str | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        trace_window: int | None = DEFAULT_TRACE_WINDOW,
        options: EngineOptions | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        given = {
            "devices": devices,
            "device_memory": device_memory,
            "policy": policy,
            "prefetch": prefetch,
            "recompute": recompute,
            "copy_on_cpu": copy_on_cpu,
            "max_layers_per_shard": max_layers_per_shard,
            "host_memory": host_memory,
            "spill_dir": spill_dir,
            "trace_window": trace_window,
        }
        options = _engine_options(options, given)
        self.options = options
        self.devices = resolve_devices(options.devices)
        self.policy = get_policy(options.policy)
        gpu = any(d.type == "cuda" for d in self.devices)
        copy_on_cpu = options.copy_on_cpu
        self.recompute = (gpu or copy_on_cpu) if options.recompute is None else options.recompute
        prefetch = options.prefetch
        n_cpu = sum(d.type == "cpu" for d in self.devices)
        labels = [
            f"cpu#{i}" if d.type == "cpu" and n_cpu > 1 else str(d)
            for i, d in enumerate(self.devices)
        ]
        self.trace = Trace(labels, options.trace_window)
        self.clock = default_clock() if clock is None else clock
        host_budget, spill_dir = options.host_bytes, options.spill_dir
        folder = SpillFolder(spill_dir) if host_budget is not None and spill_dir else None
        self.host = HostMemory(host_budget, folder, self.trace, self.clock)
        self._saved_threads = torch.get_num_threads()  # workers may change it; restored
        threads = max(1, torch.get_num_threads() // n_cpu) if n_cpu > 1 else None
        self.workers = [
            DeviceWorker(
                i,
                d,
                labels[i],
                self.trace,
                self.clock,
                prefetch=prefetch,
                copy=copy_on_cpu,
                intra_threads=threads,
                budget=self._device_budget(d),
            )
            for i, d in enumerate(self.devices)
        ]
        self._max_depth = max(w.depth for w in self.workers)
        self._kept = KeptGraphs(not self.recompute and any(w.copy for w in self.workers))
        self._op_sum = 0.0  # all measured op durations, for unmeasured tasks' estimates
        self._op_n = 0
        self._cv = threading.Condition(threading.RLock())
        self._tasks: dict[str, TaskRecord] = {}
        # Tasks being added (between their checks and their registration): the tensors
        # they claim, so that two concurrent add_task calls cannot share a model either.
        self._adding: dict[str, OwnedTensors] = {}
        self._order = 0
        self._held = 0  # hold_dispatch() depth: no decision while > 0
        self._closed = False
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hydra-dispatch", daemon=True)
        self._thread.start()

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

    def add_task(
        self,
        name: str,
        task: ModelTask,
        *,
        seed: int | None = None,
        max_grad_norm: float | None = None,
        accumulate_steps: int = 1,
        precision: str | None = None,
        iteration_batches: int | None = None,
    ) -> int:
        """Partition ``task``'s model and register it; returns the number of shards.

        A task's model must be its own: parameters or buffers that another task of this
        engine trains (until that task is removed) are refused, since the two would train
        one set of weights. Weights tied within the model are fine.

        Raises:
            SharedModelError: the model shares tensors with another registered task.
            ShardTooLargeError: a layer does not fit ``device_memory``.
            InvalidOptionError: a bad option (``seed``, ``max_grad_norm``,
                ``accumulate_steps``, ``precision``, ``iteration_batches``).
            InvalidModelError: the model is not sequential, or has nothing to train.
            InvalidOptimizerError: the optimizer factory does not build an optimizer.
            DataMismatchError: a layer fails on the first batch of ``train_data``.
            InvalidTaskError: an empty ``train_data``, a name in use, or another bad input.
        """
        if not isinstance(task, ModelTask):
            raise InvalidTaskError(
                f"task {name!r} must be a tune_hydra.ModelTask, not {type(task).__name__}"
            )
        options = _options(
            name,
            task,
            self.recompute,
            seed=seed,
            max_grad_norm=max_grad_norm,
            accumulate_steps=accumulate_steps,
            precision=precision,
            iteration_batches=iteration_batches,
        )
        # Before anything touches the model: it may be another task's, on a device now.
        claim = owned_tensors(task.model)  # type: ignore[arg-type]
        with self._cv:
            self._check_name(name)
            # Claimed at once, with a snapshot of the others: a task added after this sees
            # the claim, one added before is in the snapshot (read without the lock, so
            # that the dispatcher does not wait on it).
            others = [(n, e.runner) for n, e in self._tasks.items()]
            claims = list(self._adding.items())
            self._adding[name] = claim
        try:
            _check_shared(name, claim, others, claims)
            return self._add(name, task, options)
        finally:
            with self._cv:
                if self._adding.get(name) is claim:
                    del self._adding[name]

    def _add(self, name: str, task: ModelTask, options: TrainOptions) -> int:
        layers = model_layers(task.model, name)  # type: ignore[arg-type]
        _check_trainable(name, task.model)  # type: ignore[arg-type]
        task.model.to("cpu")  # type: ignore[union-attr]
        # Plain training's model.train(): a model given in eval mode (from_pretrained
        # returns it so) trains, and is probed, with its dropout on.
        task.model.train()  # type: ignore[union-attr]
        dtype = torch.bfloat16 if options.precision == "bf16" else None
        # Peeking at the data and probing the layers must not draw from any task's stream:
        # fork the global generators, and hold the lock other tasks' ops install theirs under.
        with CPU_RNG_LOCK, torch.random.fork_rng(devices=[]):
            try:
                sample = next(iter(task.train_data))
            except StopIteration:
                raise EmptyDataError(
                    f"task {name!r}: train_data yielded no batch; give it at least one "
                    f"(inputs, targets) pair"
                ) from None
            x, _ = split_batch(sample, name)
            _check_keyword_batch(name, task.model, x)  # type: ignore[arg-type]
            costs = layer_costs(layers, task.optimizer, x, dtype, device=self.devices[0], task=name)
        budget = self._device_budget(self.devices[0])
        plan = plan_shards(
            costs, budget, prefetch=self.prefetch, max_layers_per_shard=self.max_layers_per_shard
        )
        host = self.host.budget
        if host is not None:
            big = max(plan.shards, key=lambda spec: spec.state_bytes)
            if big.state_bytes > host:
                raise HostBudgetError(name, big.index, big.state_bytes, host)
        pin = any(d.type == "cuda" for d in self.devices)
        with self._cv:
            if name in self._tasks:
                raise InvalidTaskError(
                    f"a task named {name!r} is already registered; "
                    f"remove it first or pick another name"
                )
            self._kept.check(name, plan)
            runner = TaskRunner(
                name,
                task,
                plan,
                layers,
                options,
                order=self._order,
                pin=pin,
                budgeted_graphs=self._kept.active,
                host=self.host,
            )
            runner.note_probe(x)
            self.host.register(runner.stores)
            entry = TaskRecord(name, task, plan, options, self._order, runner)
            entry.batches_per_iter = batches_per_iter(task, options)
            runner.on_iteration = lambda result, e=entry: self._on_iteration(e, result)
            self._tasks[name] = entry
            self._order += 1
        return len(plan)

    def _check_name(self, name: str) -> None:
        if name in self._tasks or name in self._adding:
            raise InvalidTaskError(
                f"a task named {name!r} is already registered; remove it first or pick another name"
            )

    def add_runner(self, name: str, runner: Runner, *, options: TrainOptions | None = None) -> int:
        """Register a task whose operations come from ``runner`` (any
        :class:`~tune_hydra.engine.protocol.Runner`, such as a
        :class:`~tune_hydra.engine.scripted.ScriptedRunner`) instead of a ``ModelTask``;
        returns its number of shards. It is then trained, cancelled and removed like a
        task of :meth:`add_task` (checkpoints, :meth:`get_state`, are ``add_task``'s).

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
        """
        check_runner(name, runner)
        own = getattr(runner, "name", name)
        if own != name:  # its ops would carry another task's name
            raise InvalidTaskError(
                f"runner {own!r} registered as {name!r}: register it under its own name"
            )
        plan = runner.plan
        if not isinstance(plan, ShardPlan) or not plan.shards:
            raise InvalidTaskError(
                f"runner {name!r}: its plan must be a ShardPlan with at least one shard, "
                f"not {plan!r}"
            )
        if options is None:
            options = TrainOptions(recompute=self.recompute, where=f"task {name!r}")
        elif not isinstance(options, TrainOptions):
            raise InvalidTaskError(
                f"runner {name!r}: options must be a tune_hydra.options.TrainOptions, not "
                f"{type(options).__name__}"
            )
        with self._cv:
            self._check_name(name)
            self._kept.check(name, plan)
            self.host.register(runner.stores)
            entry = TaskRecord(name, None, plan, options, self._order, runner)
            entry.batches_per_iter = float(options.iteration_batches or 1)
            runner.on_iteration = lambda result, e=entry: self._on_iteration(e, result)
            self._tasks[name] = entry
            self._order += 1
        return len(plan)

    # -- read-only views of a task (for callers and tests; none changes anything) ---------

    def runner(self, name: str) -> Runner:
        """Task ``name``'s runner (a :class:`~tune_hydra.engine.runner.TaskRunner` for a
        task of :meth:`add_task`; a new one after :meth:`set_state`)."""
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
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                if not self._held and not self._closed and self._broken is None:
                    self._dispatch()
                self._cv.notify_all()

    @property
    def keeps_graphs(self) -> bool:
        """Whether batches' forward graphs are kept, and reserved, on devices that copy
        (``recompute=False`` there; see ``tune_hydra.engine.kept``)."""
        return self._kept.active

    def plan(self, name: str) -> ShardPlan:
        """The shard plan of a registered task."""
        return self._entry(name).plan

    def tasks(self) -> list[str]:
        with self._cv:
            return list(self._tasks)

    def train(
        self, name: str, iterations: int = 1
    ) -> concurrent.futures.Future[list[dict[str, Any]]]:
        """Grant ``iterations`` more iterations to a task; the future gets their results."""
        if iterations < 1:
            raise InvalidTaskError(f"iterations must be >= 1, got {iterations}")
        fut: concurrent.futures.Future[list[dict[str, Any]]] = concurrent.futures.Future()
        with self._cv:
            entry = self._entry(name)
            if self._broken is not None:
                fut.set_exception(self._broken)
                return fut
            if entry.error is not None or entry.cancelled:
                fut.set_exception(
                    entry.error
                    or TaskFailedError(
                        name, "it was cancelled; remove it, or restore it with set_state()"
                    )
                )
                return fut
            entry.pending.append(PendingIterations(fut, iterations))
            entry.runner.grant(iterations)
            entry.candidate = None  # more work left: a new estimate
            if entry.runner.current is None and entry.assigned is None:
                self._advance(entry)
            entry.ready_since = self.clock()
            self._cv.notify_all()
        return fut

    def set_remaining(self, name: str, iterations: int) -> None:
        """Tell the scheduler how many iterations this task will still be granted."""
        with self._cv:
            entry = self._entry(name)
            entry.hint = max(0, int(iterations))
            entry.candidate = None

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
            entry = self._entry(name)
            at = None if iterations is None else entry.runner.iteration + iterations
            entry.milestone_at = at
            entry.candidate = None

    def cancel(self, name: str) -> None:
        """Drop the task's queued work; its futures are cancelled once its running op ends."""
        with self._cv:
            entry = self._tasks.get(name)
            if entry is None:
                return
            entry.cancelled = True
            if entry.assigned is None:
                self._cancel_futures(entry)
            self._cv.notify_all()

    def remove_task(self, name: str) -> None:
        """Cancel the task and forget it (its model keeps its current weights, on the CPU)."""
        with self._cv:
            entry = self._tasks.get(name)
            if entry is None:
                return
            self.cancel(name)
            while entry.assigned is not None and not self._closed:
                self._cv.wait(_POLL_S)
            self._offload(entry, leave=True)
            self._note_carry(entry, None)
            del self._tasks[name]
            self.policy.forget(name)

    def metric_names(self, name: str) -> list[str]:
        """The names of task ``name``'s own ``metrics``, reported with each iteration."""
        with self._cv:
            task = self._entry(name).task
            return [] if task is None else list(task.metrics or {})

    def get_state(self, name: str) -> dict[str, Any]:
        """A checkpoint of a task between iterations: everything needed to resume exactly."""
        with self._cv:
            entry = self._entry(name)
            runner = self._task_runner(entry, "get_state")
            if entry.assigned is not None or runner.granted:
                raise TuneHydraError(
                    f"task {name!r} is training; get_state() needs it idle "
                    f"(wait for its train() future)"
                )
            self._offload(entry)
            return runner.get_state()

    def set_state(self, name: str, state: dict[str, Any]) -> None:
        """Restore a task from :meth:`get_state` (rebuilds its runner; clears errors)."""
        with self._cv:
            entry = self._entry(name)
            old = self._task_runner(entry, "set_state")
            if entry.assigned is not None:
                raise TuneHydraError(f"task {name!r} is training; cancel it first")
            assert entry.task is not None  # a TaskRunner's record has its ModelTask
            self._offload(entry, leave=True)
            layers = model_layers(entry.task.model)  # type: ignore[arg-type]
            pin = any(d.type == "cuda" for d in self.devices)
            runner = TaskRunner(
                name,
                entry.task,
                entry.plan,
                layers,
                entry.options,
                order=entry.order,
                pin=pin,
                budgeted_graphs=self._kept.active,
                probed=old.probed,
                host=self.host,
            )
            runner.set_state(state)
            # Only now: restoring writes into the model's tensors and replaces optimizer
            # state, which must be in host memory, not in a spill file.
            self.host.register(runner.stores)
            runner.on_iteration = lambda result, e=entry: self._on_iteration(e, result)
            self._cancel_futures(entry)
            self._note_carry(entry, None)
            entry.runner, entry.error, entry.cancelled = runner, None, False

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
        and optimizer from any thread (see :mod:`tune_hydra.engine.lease`).

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
        return acquire_lease(self, task, shard, device, timeout=timeout)

    def summary(self) -> dict[str, Any]:
        """Per-device busy time and utilization, bytes moved, per-task figures, and host
        memory (``"host"``: ``budget``, ``held_bytes``, ``peak_held_bytes``, ``over_bytes``,
        disk ``written_bytes`` / ``read_bytes``, ``spills``, ``loads``, ``disk_wait_s``,
        ``spill_dir``; see ``tune_hydra.engine.host``)."""
        wall = self.clock()
        out: dict[str, Any] = {"wall_s": wall, "devices": {}, "tasks": {}}
        for w in self.workers:
            out["devices"][w.label] = {
                "peak_resident_bytes": w.peak_resident_bytes,
                "parked_bytes": w.parked_bytes,
                "busy_s": w.busy_s,
                "utilization": w.busy_s / wall if wall > 0 else 0.0,
            }
        out["host"] = self.host.summary()
        with self._cv:
            for name, e in self._tasks.items():
                out["tasks"][name] = {
                    "device_time_s": e.runner.device_time,
                    "num_shards": len(e.plan),
                    "iterations": e.runner.iteration,
                }
        return out

    def close(self) -> None:
        """Stop the threads, bring every model back to the CPU and remove the spill folder.

        With a disk tier, the states still on disk are not read back into host memory
        (all of them may not fit): their tensors stay memory-mapped views of the removed
        files, readable and writable as any CPU tensor, until the model replaces them (a
        ``load_state_dict``, ``.clone()``); their disk space is freed then. To get a
        model back in RAM, call :meth:`remove_task` first: it reads the task's model
        tensors back (``train_models`` does so for every task). Never raises for the
        disk tier: a spill folder that cannot be removed is logged.
        """
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for entry in self._tasks.values():
                entry.cancelled = True
            self._cv.notify_all()
        self._thread.join(5.0)
        for w in self.workers:
            w.close()
        for w in self.workers:
            w.join(30.0)
        torch.set_num_threads(self._saved_threads)
        with self._cv:
            for entry in self._tasks.values():
                # States on disk are not read back (all of them may not fit in host
                # memory): they stay readable views of their files, whose disk space is
                # freed once nothing uses them.
                self._offload(entry, leave=True, load=False)
                self._cancel_futures(entry)
        self.host.close()

    # -- internals --------------------------------------------------------------------------

    def _device_budget(self, device: torch.device) -> int | None:
        if self.budget is None and device.type == "cuda":
            return int(device_capacity(device) * 0.9)
        return self.budget

    @staticmethod
    def _task_runner(entry: TaskRecord, what: str) -> TaskRunner:
        """``entry``'s runner, which must be a ``TaskRunner`` (checkpoints are theirs)."""
        if not isinstance(entry.runner, TaskRunner):
            raise InvalidTaskError(
                f"task {entry.name!r} was registered with add_runner "
                f"({type(entry.runner).__name__}); {what}() is for tasks of add_task"
            )
        return entry.runner

    def _entry(self, name: str) -> TaskRecord:
        try:
            return self._tasks[name]
        except KeyError:
            raise InvalidTaskError(
                f"no task named {name!r}; registered: {sorted(self._tasks)}"
            ) from None

    def _offload(self, entry: TaskRecord, leave: bool = False, load: bool = True) -> None:
        """Bring the task's states home from the devices (for good: a prefetch in a queue
        leaves them there). ``leave``: the task leaves the engine (or its runner is
        replaced): its states are the user's again, and with ``load`` those on disk come
        back into host memory."""
        runner = entry.runner
        if leave:
            self.host.unregister(runner.stores)
        for i in range(len(entry.plan)):
            store = runner.store_of(i)
            with store.lock:  # a prefetch may be bringing it in right now: after it
                if isinstance(store.owner, DeviceWorker):
                    store.owner.evict(store)  # counted there until copied out, and traced
                store.retire(load=leave and load)
            for w in self.workers:
                w.release(store)
        if leave:
            self.host.discard(runner.stores)

    def _cancel_futures(self, entry: TaskRecord) -> None:
        self._kept.end(entry, drop=True)
        for p in entry.pending:
            p.future.cancel()
        entry.pending.clear()
        entry.runner.revoke()

    def _advance(self, entry: TaskRecord) -> None:
        try:
            entry.runner.advance()
        except BaseException as err:  # a task's error stays with the task
            self._fail(entry, err)

    def _on_iteration(self, entry: TaskRecord, result: dict[str, Any]) -> None:
        if entry.options.iteration_batches is None and result["batches"]:
            entry.batches_per_iter = float(result["batches"])
        if entry.pending:
            p = entry.pending[0]
            p.results.append(result)
            if len(p.results) == p.count:
                entry.pending.pop(0)
                p.future.set_result(p.results)

    def _fail(self, entry: TaskRecord, err: BaseException) -> None:
        log.info("task %r failed: %s: %s", entry.name, type(err).__name__, err)
        if not isinstance(err, TuneHydraError):
            tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            wrapped = TaskFailedError(entry.name, f"{type(err).__name__}: {err}", tb)
            wrapped.__cause__ = err
            err = wrapped
        entry.error = err
        entry.runner.stop()
        self._kept.end(entry, drop=True)
        for p in entry.pending:
            p.future.set_exception(err)
        entry.pending.clear()

    def _on_done(
        self,
        entry: TaskRecord,
        a: Assignment,
        err: BaseException | None,
        release: Store | None = None,
    ) -> None:
        if release is not None:
            self.host.use(_parts(release), -1)
        with self._cv:
            worker = entry.assigned
            if worker is not None:
                worker.finished(a, entry.name)
            entry.assigned = None
            if err is None:
                per_batch = a.duration / max(1, a.op.count)
                entry.record(a.op.kind.value, a.op.shard, per_batch)
                self._op_sum += per_batch
                self._op_n += 1
            if err is not None:
                self._fail(entry, err)
            elif entry.cancelled:
                self._cancel_futures(entry)
            else:
                self._advance(entry)
                self._kept.end(entry)
                entry.ready_since = self.clock()
            self._note_carry(entry, worker, a.left if err is None else 0)
            wake = err is not None or entry.cancelled or self._closed
            if not self._closed and self._broken is None:
                # Dispatch right here instead of waking the dispatcher thread: one thread
                # hand-off less per operation. A policy error resurfaces in _loop.
                try:
                    self._dispatch()
                except Exception as e:
                    log.debug("dispatch after %s raised %r; the dispatcher thread retries", a.op, e)
                    wake = True
            if wake:  # waking the dispatcher on every op would contend for the GIL
                self._cv.notify_all()

    def _note_carry(self, entry: TaskRecord, worker: DeviceWorker | None, size: int = 0) -> None:
        """Where the task's boundary tensors now wait (``size`` bytes on ``worker``), for
        the workers' budgets (nowhere, with ``worker=None``: also as its next op starts,
        which takes them to its device)."""
        for w in self.workers:
            if entry.name in w.carries:
                w.set_carry(entry.name, None)
        op = entry.runner.current
        if worker is not None and size and op is not None:
            worker.set_carry(entry.name, Carry(size, op.shard, entry.runner.carry_parker()))

    def _loop(self) -> None:
        try:
            with self._cv:
                while not self._closed:
                    for w in self.workers:
                        if not w.alive or w.last_error is not None:
                            raise ScheduleError(
                                f"the worker of device {w.label} stopped ({w.last_error!r}); "
                                f"this is a tune_hydra bug, please report it"
                            ) from w.last_error
                    self._kept.audit(self._tasks, self.workers)
                    self._spill_failures()
                    self._dispatch()
                    self._cv.wait(_POLL_S)
        except BaseException as err:  # surface to every waiting caller
            with self._cv:
                self._broken = err
                for entry in self._tasks.values():
                    if entry.pending:
                        self._fail(entry, err)

    def _spill_failures(self) -> None:
        """Fail the tasks whose state could not be written to the disk tier."""
        for name, err in self.host.take_failures():
            entry = self._tasks.get(name)
            if entry is not None and entry.error is None:
                self._fail(entry, err)

    def _outlook(self) -> None:
        """Tell the host memory manager how soon each state will be visited: tasks in
        the order the policy would run them (those on a device first), ``len(devices)``
        at a time, each from its current op on (see ``Program.ops_until``)."""
        default_op_s = self._op_sum / self._op_n if self._op_n else 1.0
        live = [
            e
            for e in self._tasks.values()
            if e.error is None and not e.cancelled and e.runner.current is not None
        ]
        running = [e for e in live if e.assigned is not None]
        waiting = [e for e in live if e.assigned is None]
        cands = [
            self._offer(e, op, None, default_op_s)
            for e in waiting
            if (op := e.runner.current) is not None
        ]
        by_op = {id(c.op): e for c, e in zip(cands, waiting, strict=True)}
        ranked = running + [by_op[id(c.op)] for c in self.policy.rank(cands)]
        heat: dict[int, float] = {}
        per_slot = max(1, len(self.workers))
        for i, e in enumerate(ranked):
            runner = e.runner
            op = runner.current
            base = (i // per_slot) * runner.ops_per_batch
            for shard in range(len(e.plan)):
                h = base + runner.ops_until(op, shard)
                for s in _parts(runner.store_of(shard)):
                    heat[id(s)] = min(h, heat.get(id(s), h))
        self.host.set_outlook(heat)

    def _dispatch(self) -> None:
        if self._held:  # hold_dispatch(): decided on leaving it
            return
        if self.host.active:
            self._outlook()
        # Idle devices first; only then queue a second (prefetched) op on busy ones.
        for level in range(1, self._max_depth + 1):
            for w in self.workers:
                if len(w.assigned) < min(level, w.depth) and not self._fill(w):
                    return

    def _fill(self, w: DeviceWorker) -> bool:
        """Offer ``w`` every ready op and give it the one the policy picks (if any); False
        when no task is ready at all (only then may the dispatch stop early)."""
        # A task not measured yet is estimated like the average task so far (not as
        # "infinitely long", which would make LRTF alternate on cold estimates).
        default_op_s = self._op_sum / self._op_n if self._op_n else 1.0
        # The common case made cheap (a decision per op, a check per ready task): on a
        # device that computes in host memory with nothing queued, no disk tier and no
        # kept graphs, a task's last offer still holds while its op, its estimate's basis
        # and whether it ran here last are unchanged (what _offer checks, without its
        # store); anything else goes through _offer.
        plain = not (w.copy or w.assigned or self.host.active or self._kept.active)
        last = w.last_task
        cands = []
        entries = []
        for e in self._tasks.values():
            op = e.runner.current
            if e.assigned is not None or e.error is not None or e.cancelled or op is None:
                continue
            c = e.candidate
            if not (
                plain
                and c is not None
                and c.op is op
                and c.resident is (last == e.name)
                and c.fits
                and c.in_host
                and not c.bring_in_bytes
                and (e.known_n or e.offered_s == default_op_s)
            ):
                c = self._offer(e, op, w, default_op_s)
            cands.append(c)
            entries.append(e)
        if not cands:
            return False
        i = decide(self.policy, w.index, cands)
        if i is not None:
            self._assign(w, entries[i], cands[i].op)
        return True

    def _offer(
        self, e: TaskRecord, op: Op, w: DeviceWorker | None, default_op_s: float
    ) -> Candidate:
        """The candidate ``e``'s ready ``op`` is offered as for device ``w`` (``None``: for
        no device, to rank the tasks); the engine's one place that builds candidates."""
        store = e.runner.store_of(op.shard)
        in_host = not store.on_disk if self.host.active else True
        if w is None:
            return offer(
                op,
                e.remaining_s(default_op_s),
                ready_since=e.ready_since,
                order=e.order,
                in_host=in_host,
                milestone_s=e.milestone_s(default_op_s),
            )
        if w.copy:
            res = w.holds(store)
            bring = 0 if res else store.state_bytes
        else:  # computes in host memory: "resident" is the task that ran here last
            res = w.last_task == e.name
            bring = 0
        # Not now: its batch's graph is on another device, or has no room here, or its
        # shard would not fit beside the op(s) queued here.
        fits = not (self._kept.active and self._kept.blocks(e, op, w)) and (
            not w.assigned or w.fits(store)
        )
        c = e.candidate
        # A task's offer changes only with its own op or grant (both reset it), and with
        # where its shard is; a task not measured yet follows the engine-wide mean.
        if (
            c is None
            or c.op is not op
            or c.resident is not res
            or c.fits is not fits
            or c.in_host is not in_host
            or c.bring_in_bytes != bring
            or (not e.known_n and e.offered_s != default_op_s)
        ):
            e.offered_s = default_op_s
            c = e.candidate = offer(
                op,
                e.remaining_s(default_op_s),
                ready_since=e.ready_since,
                order=e.order,
                resident=res,
                in_host=in_host,
                fits=fits,
                bring_in_bytes=bring,
                milestone_s=e.milestone_s(default_op_s),
            )
        return c

    def _assign(self, w: DeviceWorker, entry: TaskRecord, op: Op) -> None:
        # A shard another device holds stays counted there until it is copied out (by
        # that device's LRU eviction, or by this device's copy thread taking it over).
        runner = entry.runner
        store = runner.store_of(op.shard)
        self._kept.begin(entry, op, w)
        a = Assignment(
            op,
            store,
            run=lambda dev: runner.execute(op, dev),
            done=lambda a, err: self._on_done(entry, a, err),
            # Inside a batch's reservation its boundary tensors are counted already.
            carry_bytes=runner.carry_bytes if w.copy and entry.kept_on is None else None,
            start=(lambda: self._note_carry(entry, None)) if w.copy else None,
        )
        entry.assigned = w
        if self.host.active and not w.copy:
            # A device that computes in host memory uses the host tensors themselves: they
            # must not go to disk from now until the op ends (a copying device computes on
            # its copies; its promotion reads a state back from disk if need be).
            self.host.use(_parts(store), 1)
            a.done = lambda a, err: self._on_done(entry, a, err, release=store)
        if log.isEnabledFor(logging.DEBUG):  # a decision per op: format only when asked
            resident = w.holds(store) if w.copy else w.last_task == entry.name
            log.debug("%s -> %s%s", op, w.label, " (resident)" if resident else "")
        w.submit(a)
        if w.depth > 1:
            # A task's next op is not ready until this one ends, so the dispatcher cannot
            # queue it yet; its shard is known, though: copy it in while this one computes.
            nxt = runner.next_shard(op)
            if nxt is not None:
                w.prefetch(runner.store_of(nxt), op.task, nxt, op.iteration)


def _parts(store: Store) -> list[ShardStore]:
    """The shard stores a store moves together (its own, and shared ones)."""
    if isinstance(store, LinkedStore):
        return [store.own, *store.shared]
    return [store]


def _engine_options(options: Any, given: dict[str, Any]) -> EngineOptions:
    """The engine's options: ``options`` as it is (checked when it was built), else the
    keywords ``given``, checked.

    Raises:
        InvalidOptionError: ``options`` is no ``EngineOptions``, or comes with keywords.
    """
    if options is None:
        return EngineOptions(**given, where="Engine")
    if not isinstance(options, EngineOptions):
        raise InvalidOptionError(
            "options", options, "give a tune_hydra.options.EngineOptions, or None", "Engine"
        )
    defaults = EngineOptions().kwargs()
    mixed = [k for k, v in given.items() if v is not defaults[k] and v != defaults[k]]
    if mixed:
        raise InvalidOptionError(
            mixed[0],
            given[mixed[0]],
            f"leave out {', '.join(mixed)} when passing options=: the EngineOptions holds "
            f"them (derive another with dataclasses.replace(options, {mixed[0]}=...))",
            "Engine",
        )
    return options


def _options(
    name: str, task: ModelTask, recompute: bool, *, seed: Any, **given: Any
) -> TrainOptions:
    """Task ``name``'s checked options; its seed is ``ModelTask.seed``, else ``seed``, else
    ``torch.initial_seed()``.

    Raises:
        InvalidOptionError: a bad ``ModelTask.seed`` first, then the first bad option.
    """
    where = f"task {name!r}"
    task_seed = check_seed(task.seed, option="ModelTask.seed", where=where)
    seed = check_seed(seed, where=where)
    if task_seed is not None:
        seed = task_seed
    if seed is None:
        seed = torch.initial_seed()
    return TrainOptions(seed, recompute=recompute, where=where, **given)


def _check_shared(
    name: str,
    claim: OwnedTensors,
    registered: list[tuple[str, Runner]],
    adding: list[tuple[str, OwnedTensors]],
) -> None:
    """Refuse task ``name`` if its tensors are those of a registered task, or of a task
    being added.

    The registered tasks' tensors are read as they are now (their host copies of shards
    on a device included), so no key outlives the tensor it was taken from.

    Raises:
        SharedModelError: naming the first such task and the shared tensors.
    """
    for owner, runner in registered:
        shared = claim.shared_with(runner.owned_tensors())
        if shared:
            raise SharedModelError(name, owner, shared)
    for owner, owned in adding:
        shared = claim.shared_with(owned)
        if shared:
            raise SharedModelError(name, owner, shared)


def _check_keyword_batch(name: str, model: torch.nn.Module, inputs: Any) -> None:
    """A dict batch is the model's keyword inputs (``model(**batch)``, as plain training
    calls it); only a Hugging Face model's cut takes them (a traced ``forward`` takes its
    one input)."""
    from tune_hydra.models import is_hf_model

    if isinstance(inputs, Mapping) and not is_hf_model(model):
        raise InvalidTaskError(
            f"task {name!r}: train_data yields dicts ({', '.join(map(str, inputs))}), which "
            f"are keyword inputs, model(**batch); tune_hydra passes them so to Hugging Face "
            f"models only. For {type(model).__name__}, yield (inputs, targets) pairs, or "
            f"{{'inputs': x, 'targets': y}}"
        )


def _check_trainable(name: str, model: torch.nn.Module) -> None:
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return
    what = (
        f"all {len(params)} of its parameters have requires_grad=False"
        if params
        else "it has no parameters"
    )
    raise InvalidModelError(
        f"task {name!r}: the model has nothing to train ({what}). Give it a layer with "
        f"parameters, or unfreeze some with p.requires_grad_(True)"
    )


__all__ = ["Engine"]
