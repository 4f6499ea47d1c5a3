"""``train_models``: many ``ModelTask`` s trained at once on one engine, in one call.

Each task is trained by a :class:`~tune_hydra.frontends.task_loop.TaskLoop` (a
``th.shard`` loop): cut one after another first (as an engine registers tasks: frozen
tensors shared, cuts aligned, refusals reported), then each trained in a thread of its
own; the engine multiplexes their shard ops over its devices, told each task's work left
(its epochs, in ops).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import traceback
from collections.abc import Mapping
from typing import Any

from tune_hydra.core.policies import AUTO, resolve_policy
from tune_hydra.core.trace import Trace
from tune_hydra.engine.engine import Engine
from tune_hydra.engine.registration.partition import ShardPlan
from tune_hydra.engine.runtime.kept import kept_bytes
from tune_hydra.engine.task import ModelTask
from tune_hydra.exceptions import InvalidTaskError, TaskFailedError, TrainingError, TuneHydraError
from tune_hydra.options import (
    check_positive_int,
    check_task_options,
    engine_options,
)

log = logging.getLogger(__name__)


class History(dict[str, list[dict[str, Any]]]):
    """``{task name: [one dict per epoch]}``, plus the run's ``trace``, ``summary`` and
    ``plans``."""

    trace: Trace
    summary: dict[str, Any]
    plans: dict[str, ShardPlan]
    kept_graphs: bool = False  # batches' graphs were kept on devices that copy
    # The tasks whose loops kept them (a loop whose kept batch would not fit recomputes).
    keeping: frozenset[str] = frozenset()

    def validate(self, tolerance: float = 0.0) -> None:
        """Check the run's schedule from its trace: every task's operations one after
        another, one operation at a time per device, and (when the plans had a budget)
        the shard state held on each device plus the running operation's activations
        (and, when graphs were kept, the batches in flight) never over ``device_memory``.

        Raises:
            ScheduleError: a rule was broken; the message shows the offending rows.
        """
        budgets = {p.budget for p in self.plans.values() if p.budget is not None}
        acts = {(n, s.index): s.activation_bytes for n, p in self.plans.items() for s in p.shards}
        kept = (
            {n: kept_bytes(p) for n, p in self.plans.items() if n in self.keeping}
            if self.kept_graphs
            else None
        )
        self.trace.validate(
            tolerance,
            state_budget=min(budgets) if budgets else None,
            activation_bytes=acts,
            kept_bytes=kept,
        )


def train_models(
    tasks: Mapping[str, ModelTask],
    *,
    epochs: int = 1,
    seed: int | None = None,
    max_grad_norm: float | None = None,
    accumulate_steps: int = 1,
    precision: str | None = None,
    **options: Any,
) -> History:
    """Train many models at once, shard by shard, each exactly as plain PyTorch would.

    Every task's model is cut into shards that fit ``device_memory``; shard state lives in
    host memory between visits; shard operations of all tasks are multiplexed over
    ``devices``. Each task equals its own plain training (see :func:`train_plain`), whatever
    runs beside it.

    Args:
        tasks: ``{name: ModelTask}``.
        epochs: epochs to train every task.
        seed: each task's stream starts where ``torch.manual_seed(seed)`` would start it
            (``ModelTask.seed`` overrides; default ``torch.initial_seed()``).
        max_grad_norm: clip by the global norm over all shards, like ``clip_grad_norm_``.
        accumulate_steps: gradient accumulation over this many batches.
        precision: ``None`` / ``"fp32"`` or ``"bf16"`` (autocast).
        **options: the engine's options, documented and defaulted once in
            :class:`~tune_hydra.options.EngineOptions` and checked once there:
            ``devices``, ``device_memory`` (per device: bytes, ``"512MiB"``), ``policy``
            (``"auto"``, the default, is LRTF here: every task's budget is fixed),
            ``prefetch``, ``recompute``, ``copy_on_cpu``, ``max_layers_per_shard``,
            ``host_memory`` and ``spill_dir`` (the disk tier: results are the same
            either way), ``batch_shared``. Those not taken here, and why, are in
            ``tune_hydra.options.NOT_OFFERED``.

    Returns:
        A :class:`History`: ``history["a"]`` is a list with one dict per epoch holding
        ``loss``, ``val_loss`` (with ``eval_data``), each of the task's ``metrics`` (its
        batch-size-weighted mean over ``eval_data``; a metric named ``loss`` takes that
        key, and the mean training loss is then ``train_loss``), ``num_shards`` and
        engine figures (``device_time_s`` and ``bytes_spilled``, cumulative since
        registration).
        After return every ``task.model`` holds its trained weights, on the CPU, in RAM
        (with the disk tier, states on disk are read back first; nothing maps a spill
        file).

    Raises:
        TrainingError: some tasks failed; the others finished (see ``.errors`` and
            ``.history``). A task refused at registration (a bad model, optimizer factory
            or data, a layer over ``device_memory``, a shard over ``host_memory``
            (``HostBudgetError``), a model another task trains too ...) is reported there
            with an empty history, and does not stop the others. A task whose state could
            not be written to ``spill_dir`` mid-run fails with ``SpillWriteError``
            (``SpillDiskFullError`` for a full disk), one that could not be read back with
            ``SpillReadError``.
        InvalidOptionError: an option of the call itself is bad (``epochs``, ``seed``,
            ``max_grad_norm``, ``accumulate_steps``, ``precision``, ``prefetch``,
            ``recompute``, ``copy_on_cpu``, ``max_layers_per_shard``, ``spill_dir`` not a
            path): no task is trained. Every option is judged by the one validator of
            :mod:`tune_hydra.options` that ``Engine``, ``HydraExecutor`` and
            ``th.optimize`` use too.
        UnknownDeviceError, UnknownPolicyError: a bad device or policy.
        BudgetFormatError: ``device_memory`` or ``host_memory`` does not parse.
        SpillDirError: ``host_memory`` without ``spill_dir``, or ``spill_dir`` missing,
            not a writable folder, on a RAM file system, or on a full disk: no task is
            trained.
        InvalidTaskError: ``tasks`` is not a non-empty dict.
        UnknownOptionError: a keyword this function does not take (a typo: the message
            names the closest option; an engine option not taken here says why).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
        >>> make = lambda: th.ModelTask(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)),
        ...     nn.MSELoss(), lambda p: torch.optim.Adam(p, lr=1e-2), data)
        >>> h = th.train_models({"a": make(), "b": make()}, devices=["cpu"], epochs=2)
        >>> len(h["a"]), h["a"][0]["num_shards"]
        (2, 1)
    """
    where = "train_models"
    takes = ("epochs", "seed", "max_grad_norm", "accumulate_steps", "precision")
    checked = engine_options(options, where=where, takes=takes)
    if not isinstance(tasks, Mapping) or not tasks:
        raise InvalidTaskError("tasks must be a non-empty dict {name: ModelTask}")
    check_positive_int(epochs, "epochs", meaning="epochs to train every task", where=where)
    # Checked once here (no task is trained if one is bad), then given to every task.
    task_options = check_task_options(
        seed=seed,
        max_grad_norm=max_grad_norm,
        accumulate_steps=accumulate_steps,
        precision=precision,
        where=where,
    )
    if isinstance(checked.policy, str) and checked.policy == AUTO:
        # Fixed budgets: makespan first.
        checked = dataclasses.replace(checked, policy=resolve_policy(AUTO, search_aware=False))
    history = History({name: [] for name in tasks})  # in the order of ``tasks``
    errors: dict[str, BaseException] = {}
    with Engine(options=checked) as engine:
        trainers = [
            _Trainer(name, task, engine, epochs, task_options) for name, task in tasks.items()
        ]
        for t in trainers:
            t.prepare()
        # The tasks start together: a first task's thread could otherwise train alone
        # while this thread waits for the GIL to start the next one (seen: 130 ms).
        go = threading.Event()
        threads = [
            threading.Thread(target=t.run, args=(go,), name=f"hydra-train-{t.name}", daemon=True)
            for t in trainers
        ]
        for thread in threads:
            thread.start()
        go.set()
        for thread in threads:
            thread.join()
        cut = [t for t in trainers if t.loop is not None and t.loop.runner is not None]
        history.plans = {t.name: engine.plan(t.name) for t in cut}
        history.summary = engine.summary()
        history.trace = engine.trace
        history.kept_graphs = engine.keeps_graphs
        history.keeping = frozenset(t.name for t in cut if t.loop.runner.keep)
        for t in trainers:
            t.close()  # its model back on the CPU, in RAM (read back from the disk tier)
            history[t.name] = t.history
            if t.error is not None:
                errors[t.name] = t.error
        if engine.host.active:
            # The read-back is in the trace: the disk figures count it too.
            after = engine.summary()["host"]
            for key in ("read_bytes", "loads", "disk_wait_s"):
                history.summary["host"][key] = after[key]
    if errors:
        raise TrainingError(errors, dict(history))
    return history


class _Trainer:
    """One task of a ``train_models`` call: its loop, trained on a thread of its own."""

    def __init__(
        self, name: str, task: Any, engine: Engine, epochs: int, options: dict[str, Any]
    ) -> None:
        self.name = name
        self.task = task
        self.engine = engine
        self.epochs = epochs
        self.options = options
        self.loop: Any = None
        self.history: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._per_epoch: float | None = None  # its ops in one epoch, once cut

    def prepare(self) -> None:
        """Build and cut the task's loop (on the caller's thread, the tasks one after
        another, as an engine registers them: a task cut after another shares its frozen
        tensors and aligns its cut with it); a task refused here keeps its error."""
        from tune_hydra.frontends.task_loop import TaskLoop

        try:
            if not isinstance(self.task, ModelTask):
                raise InvalidTaskError(
                    f"tasks[{self.name!r}] must be a tune_hydra.ModelTask, not "
                    f"{type(self.task).__name__}"
                )
            self.loop = TaskLoop(self.name, self.task, self.engine, **self.options)
            self.loop.cut()
        except Exception as err:  # one task's refusal is reported, not fatal
            self.error = _as_task_error(self.name, err, "when added")
            return
        self._per_epoch = self.loop.ops_per_iteration()
        self._announce(0)  # the policy learns its work

    def run(self, go: threading.Event) -> None:
        """Train every epoch (on a thread of its own), once ``go`` is set."""
        go.wait()
        if self.error is not None:
            return
        try:
            for done in range(1, self.epochs + 1):
                self.history.append(self.loop.train_iteration())
                self._announce(done)
        except Exception as err:  # one task's failure is reported, not fatal
            self.error = _as_task_error(self.name, err, "")
        self.history = list(self.loop.history)

    def _announce(self, done: int) -> None:
        if self._per_epoch is not None:
            left = math.ceil((self.epochs - done) * self._per_epoch)
            self.engine.set_remaining(self.name, max(left, 0))

    def close(self) -> None:
        """The loop leaves the engine: the model keeps its trained weights, on the CPU, in
        RAM (states on the disk tier are read back; nothing maps a spill file). A state
        that cannot be read back fails the task with ``SpillReadError``."""
        if self.loop is None:
            return
        try:
            self.loop.close()
        except Exception as err:  # that task's model is not whole in RAM: its error
            log.warning("task %r: reading its model back failed: %s", self.name, err)
            if self.error is None:
                self.error = _as_task_error(self.name, err, "")


def _as_task_error(name: str, err: Exception, when: str) -> TuneHydraError:
    """``err`` of task ``name`` as a :class:`TuneHydraError` (an error of tune_hydra's own
    as it is; any other one wrapped, with its traceback)."""
    if isinstance(err, TuneHydraError):
        return err
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    said = f" ({when})" if when else ""
    wrapped = TaskFailedError(name, f"{type(err).__name__}: {err}{said}", tb)
    wrapped.__cause__ = err
    return wrapped
