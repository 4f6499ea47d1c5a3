"""``th.optimize``: Optuna's own study loop on the embedded engine, without Ray.

:func:`optimize` drives an ``optuna.Study`` with Optuna's ask-and-tell interface: it asks
up to ``max_concurrent`` trials at a time, builds each trial's
:class:`~tune_hydra.ModelTask` with the user's define-by-run ``make_task(trial)`` (which
calls ``trial.suggest_*``), and trains it, one epoch at a time, as the canned objective
of a task: a ``th.shard`` loop (:class:`~tune_hydra.frontends.task_loop.TaskLoop`) on one
:class:`~tune_hydra.engine.Engine`, which multiplexes the shards of every trial's loop on
the shared devices. An objective that trains its own loop runs the same way. After each
epoch the trial reports the metric (``trial.report``); the study's pruner decides whether
it goes on. Several processes or machines running
:func:`optimize` on one study through Optuna's RDB or journal storage is Optuna's own
distributed mode: each process trains its own trials on its own devices.

Importing this module imports neither torch, optuna nor Ray; :func:`optimize` imports
torch and optuna when called, and never Ray.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import difflib
import logging
import math
import numbers
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tune_hydra.core.policies import AUTO, resolve_policy
from tune_hydra.exceptions import (
    InvalidModelError,
    InvalidOptionError,
    InvalidStudyError,
    InvalidTaskError,
    MissingDependencyError,
    TuneHydraError,
    UnknownMetricError,
)
from tune_hydra.frontends.checkpoint import save_model
from tune_hydra.frontends.common import LOSS_METRICS, TASK_METRICS, declare_metric, task_reports
from tune_hydra.frontends.failures import check_task, error_text, uncuttable
from tune_hydra.frontends.milestones import Milestones, optuna_milestones
from tune_hydra.options import (
    ENGINE_KEYS,
    NOT_OFFERED,
    TRAIN_LOSS,
    EngineOptions,
    check_factory_timeout,
    check_option_names,
    check_positive_int,
    check_seconds,
    check_task_options,
)
from tune_hydra.options import ENGINE_OPTIONS as _ENGINE_FIELDS
from tune_hydra.options import TASK_OPTIONS as _TASK_FIELDS

if TYPE_CHECKING:
    import optuna

    from tune_hydra.engine import Engine, ModelTask

METRICS = LOSS_METRICS
"""The metrics :func:`optimize` can report to Optuna (keys of the engine's per-epoch
results), each lower-is-better."""

ENGINE_OPTIONS = tuple(
    k
    for k in _ENGINE_FIELDS
    if k not in ("devices", "device_memory") and k not in NOT_OFFERED["optimize"]
)
"""``train_opts`` that configure the engine (the fields of
:class:`~tune_hydra.options.EngineOptions` but ``devices`` and ``device_memory``, which are
arguments of their own, and those ``NOT_OFFERED["optimize"]`` names)."""
TASK_OPTIONS = tuple(k for k in _TASK_FIELDS if k not in NOT_OFFERED["optimize"])
"""``train_opts`` given to every trial's task (see
:class:`~tune_hydra.frontends.task_loop.TaskLoop`)."""
OTHER_OPTIONS = ("factory_timeout_s",)
"""Other ``train_opts``: the most seconds one ``make_task(trial)`` call may take."""

_POLL_S = 0.5  # the driver wakes at least this often (timeouts, Ctrl-C)
_ABORT_WAIT_S = 5.0  # after Ctrl-C, the longest wait for factories and saves in flight
_MAX_ERROR_CHARS = 20_000  # an error stored in trial.user_attrs["error"]
# A loop's milestone before its ops per step are known (no report yet, in this study):
# far, so that it is served as a trial with a milestone ahead (not as committed work)
# after those whose next report is known to be nearer.
_UNKNOWN_OPS = 1_000_000


def optimize(
    study: optuna.Study,
    make_task: Callable[[optuna.Trial], ModelTask],
    n_trials: int | None = None,
    epochs: int = 1,
    devices: Any = "auto",
    device_memory: int | str | None = None,
    max_concurrent: int | None = None,
    metric: str | None = None,
    save_dir: str | os.PathLike[str] | None = None,
    *,
    timeout: float | None = None,
    engine: Engine | None = None,
    **train_opts: Any,
) -> optuna.Study:
    """Run an Optuna study with many trials trained at once, shard by shard, on shared
    devices.

    This is Optuna's own study loop (``study.ask()`` / ``study.tell()``), without Ray: up
    to ``max_concurrent`` trials are in flight, their shards multiplexed on ``devices`` by
    one engine, each trained exactly as plain PyTorch would (see :func:`~tune_hydra.train_plain`).
    For each trial:

    1. ``make_task(trial)`` builds its task: define-by-run, it calls ``trial.suggest_*``
       and returns a :class:`~tune_hydra.ModelTask`. It runs in a thread of its own on a
       private random generator (seeded with ``seed`` if given), so it draws exactly what
       it would alone, and other trials keep training meanwhile. Raising
       ``optuna.TrialPruned`` there skips the configuration (the trial ends ``PRUNED``).
    2. The trial trains one epoch at a time. After each epoch it calls
       ``trial.report(value, step)`` with the epoch's ``metric`` and the epoch's index as
       the step (0 for the first, as in Optuna's ``for epoch in range(...)`` examples, so
       pruner settings carry over), then asks ``trial.should_prune()`` (after the last
       epoch too), exactly as Optuna's documented training loop does.
    3. **Pruned**: the trial's shards are dropped from the engine at once (nothing more of
       it is queued or run) and it ends ``PRUNED``; a new trial takes its slot.
    4. **Failed**: if ``make_task`` raises (or returns no ``ModelTask``, or takes longer
       than ``factory_timeout_s``), or training raises (a NaN loss, a layer over
       ``device_memory``, bad data ...), the trial ends ``FAIL`` with the error logged and
       stored in ``trial.user_attrs["error"]``; the other trials go on.
    5. **Complete**: after ``epochs`` epochs its value is the metric of the last epoch.
       With ``save_dir``, its model's ``state_dict`` (your own keys) is written atomically
       to ``save_dir/trial_<number>/model.pt`` first, and that path is stored in
       ``trial.user_attrs["model_path"]``.

    **Your own loop**: ``make_task`` may instead be an Optuna objective that owns its
    training loop, ``objective(trial) -> float``, calling
    ``model, optimizer = th.shard(model, optimizer)`` (as for ``study.optimize``). Which
    one it is is known when it returns, trial by trial: a ``ModelTask`` is a factory's
    (steps 2-5 follow), a number is an objective's value, and the trial ends
    ``COMPLETE`` with it (``epochs``, ``metric`` and ``save_dir`` do not apply: the loop
    reports with ``trial.report`` and prunes with ``trial.should_prune()`` /
    ``raise optuna.TrialPruned()`` itself). Objectives run in threads, up to
    ``max_concurrent`` at once, and ``th.shard`` without ``engine=`` inside them trains
    on *this call's* engine (not the process's embedded one), so every loop is
    multiplexed there. When the objective returns or raises, its loops leave the engine
    (``th.unshard``: weights home, the user's classes back). ``factory_timeout_s``
    bounds the whole call, training included; a call past it, or running at Ctrl-C,
    ends ``FAIL`` and its loop stops at its next forward (``ShardClosedError``). A
    function that returns a number without calling ``th.shard`` trained plainly,
    outside the engine: its value is kept and one warning says to add the line.
    Objectives run on a private random generator (seeded with ``seed`` if given), as
    factories do: their draws (weight init, a shuffling ``DataLoader``) never race with
    the other trials' ops, so each trial is exactly its plain run.

    Every factory trial also gets ``trial.user_attrs["num_shards"]`` (how its model was
    cut).
    Whether lower or higher is better comes from the study: ``loss`` and ``val_loss``
    need a minimizing study; a metric of the task's own (``ModelTask(metrics=...)``, e.g.
    ``accuracy``) goes either way. A trial's task is named ``trial_<number>`` in the engine (and
    its trace). Ctrl-C (``KeyboardInterrupt``) drops every trial's queued work, ends the
    running trials ``FAIL`` (error ``"interrupted ..."``), closes the engine and re-raises.

    Distributed: give every process (on any machine) the same study through Optuna's
    shared storage, ``optuna.load_study(study_name=..., storage="postgresql://...")`` or a
    ``JournalStorage`` on a shared file system, and run :func:`optimize` in each on its
    own devices; Optuna gives each trial a distinct number, and ``n_trials`` counts the
    trials of this process.

    Args:
        study: a single-objective ``optuna.Study`` (its sampler, pruner, direction and
            storage are used as they are).
        make_task: ``make_task(trial) -> th.ModelTask``; build the model inside it. Or an
            objective ``objective(trial) -> float`` whose loop calls ``th.shard``.
        n_trials: trials this call runs (like ``study.optimize``); ``None``: until
            ``timeout`` (or Ctrl-C).
        epochs: epochs each trial trains unless pruned.
        devices: ``"auto"``, ``"cpu"``, or a list such as ``["cuda:0", "cuda:1"]``
            (``"cpu"`` may repeat: emulated devices).
        device_memory: per-device budget (bytes, ``"8GiB"``); ``None``: the whole device.
        max_concurrent: trials in flight at once (default: twice the number of devices).
            Each keeps its model, gradients and optimizer state in host memory (or, with
            ``host_memory`` and ``spill_dir``, partly on disk).
        metric: what each epoch reports to Optuna: ``"val_loss"`` (needs ``eval_data``),
            ``"loss"`` (see :data:`METRICS`), or a name in the task's ``metrics`` (one
            named ``loss`` is the task's own ``"loss"``; the training loss is then
            ``"train_loss"``).
            ``None``: ``"val_loss"``; a maximizing study (fine for objectives, which
            return their own value) then stops the call at the first task factory's
            trial, with ``UnknownMetricError``.
        save_dir: where finished trials' ``model.pt`` files go (``None``: not saved).
        timeout: seconds after which no new trial starts (the running ones finish), like
            ``study.optimize(timeout=...)``.
        engine: an :class:`~tune_hydra.engine.Engine` to train on, which the caller keeps
            (and may inspect, e.g. ``engine.trace``) and closes; it is not closed here,
            and ``devices``, ``device_memory`` and engine options must then be left out.
            ``None``: one is built for this call and closed when it returns.
        **train_opts: engine options (``policy``, ``prefetch``, ``recompute``,
            ``copy_on_cpu``, ``max_layers_per_shard``, and the disk tier's ``host_memory``
            and ``spill_dir``: see :func:`~tune_hydra.train_models`), task options for
            every trial (``seed``, ``max_grad_norm``, ``accumulate_steps``,
            ``precision``) and ``factory_timeout_s`` (seconds > 0, as for
            ``HydraExecutor``; default ``None``: no limit). Each is judged by the one
            validator of :mod:`tune_hydra.options` that every front end uses (see
            ``tune_hydra.options.NOT_OFFERED`` for the options not taken here, and why).
            ``policy="auto"`` (the default) is the milestone policy when the study's
            pruner prunes or its sampler adapts (TPE, GP, CMA-ES: each trial's next
            pruning step, and the startup trials' ends, first), LRTF otherwise
            (``NopPruner`` with a random or grid sampler); one log line says which.
            Either way every trial's next milestone goes to the engine
            (``Engine.set_milestone``); an objective's ``th.shard`` loops get theirs in
            ops, from its ``trial.report`` steps (the ops between two reports measured,
            half a step of slack; a loop that has not reported yet takes the last
            measure of this call, or none: a far milestone).

    Returns:
        ``study``, with this call's trials finished (``COMPLETE``, ``PRUNED`` or ``FAIL``).

    Raises:
        MissingDependencyError: optuna is not installed.
        InvalidStudyError: ``study`` is not a single-objective ``optuna.Study``, or
            ``make_task`` is not callable.
        UnknownMetricError: ``metric`` is an engine figure that is not a loss
            (``epoch`` ...), or the study maximizes a loss (with the default
            ``metric``: at the first trial whose function returns a ``ModelTask``). (A
            name that a trial's task does not declare fails that trial, with this
            error.)
        UnknownOptionError: a keyword in ``train_opts`` that this function does not take.
        InvalidOptionError: a bad value (``epochs``, ``n_trials``, a task option ...).
        UnknownDeviceError, BudgetFormatError, UnknownPolicyError: a bad engine option.
        SpillDirError: ``host_memory`` without ``spill_dir``, or a ``spill_dir`` that is
            missing, not a writable folder, or on a full disk.
        KeyboardInterrupt: re-raised after the cleanup above.

        All of these but the last are raised before any trial starts. A trial's own
        errors never propagate: they end that trial ``FAIL``.

    Example:
        >>> import optuna, torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> def make_task(trial):
        ...     lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        ...     torch.manual_seed(0)
        ...     x = torch.randn(4, 16, 8)
        ...     data = [(xb, xb.sum(1, keepdim=True)) for xb in x]
        ...     return th.ModelTask(
        ...         model=nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)),
        ...         loss_fn=nn.MSELoss(),
        ...         optimizer=lambda params: torch.optim.Adam(params, lr=lr),
        ...         train_data=data[:3],
        ...         eval_data=data[3:],
        ...     )
        >>> study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
        >>> study = th.optimize(study, make_task, n_trials=4, epochs=2, devices=["cpu"], seed=0)
        >>> best = study.best_trial
        >>> len(study.trials), best.state.name, best.user_attrs["num_shards"]
        (4, 'COMPLETE', 1)
    """
    optuna = _import_optuna()
    options = _split_options(train_opts)
    _check_study(optuna, study, make_task)
    given = metric is not None
    metric = "val_loss" if metric is None else metric
    # Unless given, the metric's direction is judged when a factory returns a task: an
    # objective returns its own value, which a maximizing study may rank.
    deferred = _check_metric(optuna, study, metric, defer_direction=not given)
    where = "optimize"
    n_trials = check_positive_int(
        n_trials, "n_trials", allow_none=True, meaning="trials this call runs", where=where
    )
    checked = check_positive_int(epochs, "epochs", meaning="epochs per trial", where=where)
    assert checked is not None  # None is refused
    epochs = checked
    max_concurrent = check_positive_int(
        max_concurrent, "max_concurrent", allow_none=True, meaning="trials at once", where=where
    )
    timeout = check_seconds(
        timeout,
        "timeout",
        meaning="after which no new trial starts",
        allow_zero=True,
        where=where,
    )
    factory_timeout_s = check_factory_timeout(
        options["other"].get("factory_timeout_s"), where=where
    )
    task_options = check_task_options(**options["task"], where=where)
    del task_options["iteration_batches"]  # an iteration is an epoch here
    engine_options = EngineOptions(devices, device_memory, **options["engine"], where=where)
    folder = _prepare_save_dir(save_dir)
    milestones = optuna_milestones(study.pruner, study.sampler)

    from tune_hydra.engine import Engine

    if engine is not None:
        _check_given_engine(Engine, engine, devices, device_memory, options["engine"])
        own = False
    else:
        if isinstance(engine_options.policy, str) and engine_options.policy == AUTO:
            # Chosen here, where the pruner and sampler are known (one log line says which).
            policy = resolve_policy(AUTO, search_aware=milestones.search_aware)
            engine_options = dataclasses.replace(engine_options, policy=policy)
        engine = Engine(options=engine_options)
        own = True
    if max_concurrent is None:
        max_concurrent = 2 * len(engine.devices)
    driver = _Driver(
        optuna,
        study,
        make_task,
        engine,
        epochs=epochs,
        metric=metric,
        folder=folder,
        task_options=task_options,
        factory_timeout_s=factory_timeout_s,
        milestones=milestones,
        direction_error=deferred,
    )
    try:
        driver.run(n_trials, max_concurrent, timeout)
    except BaseException as err:  # Ctrl-C, or the storage failed: end every running trial
        driver.abort(err)
        raise
    finally:
        if own:
            engine.close()
    return study


# ----------------------------------------------------------------------- the study loop
@dataclass
class _Run:
    """One trial in flight: its Optuna trial and where it stands."""

    trial: optuna.Trial
    key: str  # trial_<number>: its loop's name in the engine
    epoch: int = 0  # epochs a task factory's task trained
    value: float | None = None  # the metric of its last epoch, or the objective's value
    scope: Any = None  # its th.shard scope (tune_hydra.frontends.shard)
    factory: bool = False  # its function returned a ModelTask


class _Interrupted(Exception):
    """A trial's build ended because the call is being aborted."""


class _PrunedByFactory(Exception):
    """``make_task`` raised ``optuna.TrialPruned`` (as an objective may, to skip a
    configuration or when ``trial.should_prune()`` says so): the trial ends ``PRUNED``,
    as in ``study.optimize``."""

    def __init__(self, message: str, loops: int) -> None:
        super().__init__(message)
        self.loops = loops  # th.shard calls made before it raised


class _Systematic(Exception):
    """An error of the call, not of one trial: :func:`optimize` raises it."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _model_task_type() -> type:
    from tune_hydra.engine import ModelTask

    return ModelTask


@dataclass
class _ObjectiveDone:
    """The trial's function returned: an objective's value (it trained its own loop with
    ``th.shard``), or a task factory's task trained for every epoch."""

    value: float
    loops: int  # th.shard calls it made


class _TaskPruned(Exception):
    """A task factory's task was pruned after an epoch (``trial.should_prune()``)."""


class _Driver:
    """The driver loop of one :func:`optimize` call: asks trials as slots free up, waits
    on their futures (build, one epoch, save) and tells Optuna how each ended."""

    def __init__(
        self,
        optuna: Any,
        study: optuna.Study,
        make_task: Callable[[optuna.Trial], ModelTask],
        engine: Engine,
        *,
        epochs: int,
        metric: str,
        folder: Path | None,
        task_options: dict[str, Any],
        factory_timeout_s: float | None,
        milestones: Milestones,
        direction_error: UnknownMetricError | None = None,
    ) -> None:
        self.optuna = optuna
        self.study = study
        self.make_task = make_task
        self.engine = engine
        self.epochs = epochs
        self.metric = metric
        self.folder = folder
        self.task_options = task_options
        self.factory_timeout_s = factory_timeout_s
        self.direction_error = direction_error  # raised at the first factory's task
        # Under Optuna's logger, so trials are logged as study.optimize logs them (and
        # optuna.logging.set_verbosity applies).
        self.log = optuna.logging.get_logger("optuna.tune_hydra")
        self.live: dict[int, _Run] = {}  # trial number -> every trial asked and not told
        self.running: dict[concurrent.futures.Future[Any], _Run] = {}  # what each waits on
        # Optuna keeps a study's storage private; study.optimize reads it the same way.
        self._storage: Any = study._storage
        get_interval = getattr(self._storage, "get_heartbeat_interval", None)
        self._interval: int | None = get_interval() if callable(get_interval) else None
        self._beat_at = -math.inf
        self._beaten: set[int] = set()  # trials that beat once (a new one beats at once)
        # TaskLoop's keywords for every factory's task (the seed is resolved per task).
        self._opts = {k: v for k, v in task_options.items() if k != "seed"}
        self._lock = threading.Lock()  # guards _stopping (build threads read it)
        self._stopping = False
        self._warned_plain = False  # one warning for functions that never call th.shard
        self.milestones = milestones
        # The ops one trial.report step of an objective's loop took, last measured in
        # this call (for loops that have not reported yet).
        self.ops_per_step: float | None = None
        # Trials that inform the pruner and sampler (COMPLETE or PRUNED), counted once from
        # the storage, then by this driver's own tells.
        finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        self._finished = (
            len(study.get_trials(deepcopy=False, states=finished))
            if milestones.startup_trials
            else 0
        )

    # -- heartbeats: what study.optimize does with a storage that has them --------------

    def _heartbeat(self, new_only: bool = False) -> None:
        """Record a heartbeat for the trials in flight, once per the storage's
        ``heartbeat_interval`` (``RDBStorage(..., heartbeat_interval=...)``), and for a
        trial just asked at once (``new_only``). A process that dies stops beating, and
        the next ``th.optimize`` or ``study.optimize`` on the study ends its trials FAIL
        (Optuna's ``fail_stale_trials``), as with plain ``study.optimize``. The loop wakes
        every ``_POLL_S``, so this one thread beats for all trials.
        """
        if self._interval is None:
            return
        if new_only:
            runs = [r for r in self.live.values() if r.trial.number not in self._beaten]
        elif time.monotonic() - self._beat_at >= self._interval:
            self._beat_at = time.monotonic()
            runs = list(self.live.values())
        else:
            return
        for run in runs:
            self._storage.record_heartbeat(run.trial._trial_id)
            self._beaten.add(run.trial.number)

    def _fail_stale(self) -> None:
        """End FAIL the trials of processes that stopped beating (Optuna's own call, as
        ``study.optimize`` makes it before each trial)."""
        if self._interval is None:
            return
        with warnings.catch_warnings():  # experimental in Optuna; it is what optimize runs
            warnings.simplefilter("ignore", self.optuna.exceptions.ExperimentalWarning)
            self.optuna.storages.fail_stale_trials(self.study)

    # -- the loop ---------------------------------------------------------------------

    def run(self, n_trials: int | None, max_concurrent: int, timeout: float | None) -> None:
        # As inside study.optimize: study.stop() from a sampler's after_trial (GridSampler,
        # its grid done) or a callback on this thread asks no new trials; the running end.
        local = getattr(self.study, "_thread_local", None)
        if local is None or not hasattr(self.study, "_stop_flag"):
            self._run(n_trials, max_concurrent, timeout)
            return
        outer = getattr(local, "in_optimize_loop", False)
        local.in_optimize_loop = True
        self.study._stop_flag = False
        try:
            self._run(n_trials, max_concurrent, timeout)
        finally:
            local.in_optimize_loop = outer
            self.study._stop_flag = False

    def _run(self, n_trials: int | None, max_concurrent: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        asked = 0
        while True:
            while (
                len(self.live) < max_concurrent
                and (n_trials is None or asked < n_trials)
                and (deadline is None or time.monotonic() < deadline)
                and not getattr(self.study, "_stop_flag", False)
            ):
                self._fail_stale()
                self._start(self.study.ask())
                self._heartbeat(new_only=True)
                asked += 1
            if not self.live:
                return
            self._heartbeat()
            done, _ = concurrent.futures.wait(
                list(self.running), timeout=_POLL_S, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                self._advance(self.running.pop(future), future)

    def _start(self, trial: optuna.Trial) -> None:
        run = _Run(trial, f"trial_{trial.number}")
        self.live[trial.number] = run
        self.running[_in_thread(self._build, run, name=f"hydra-build-{run.key}")] = run

    def _advance(self, run: _Run, future: concurrent.futures.Future[Any]) -> None:
        """The trial's function ended (the future of :meth:`_build` is done): tell Optuna."""
        try:
            outcome = future.result()
        except _Interrupted:
            return
        except _Systematic as systematic:  # ends the call, as before any trial
            raise systematic.error from None
        except _PrunedByFactory as pruned:
            self._drop(run)
            self._tell(run, self.optuna.trial.TrialState.PRUNED)
            self.log.info("Trial %d pruned by its function: %s", run.trial.number, pruned)
            return
        except _TaskPruned:
            self._drop(run)
            self._tell(run, self.optuna.trial.TrialState.PRUNED)
            return
        except Exception as err:
            self._fail(run, err)
            return
        self._objective_done(run, outcome.value)

    def _objective_done(self, run: _Run, value: float) -> None:
        """An objective returned ``value`` (or a task trained every epoch): the trial is
        complete, as in ``study.optimize`` (a NaN fails it, as there)."""
        if not math.isfinite(value):
            self._fail(
                run,
                InvalidTaskError(
                    f"trial {run.trial.number}: the objective returned {value!r}, not a "
                    f"finite number, so Optuna cannot rank it"
                ),
            )
            return
        run.value = value
        self._tell(run, self.optuna.trial.TrialState.COMPLETE)

    def trains(self, key: str) -> bool:
        """Whether trial ``key`` is in flight (its model is trained; see
        :func:`~tune_hydra.frontends.trial.prepare_model`)."""
        return any(run.key == key for run in list(self.live.values()))

    def loop_milestone(
        self, done: int, per_step: float | None, steps: int | None = None
    ) -> int | None:
        """Ops of a ``th.shard`` loop (one op is one of its engine iterations) from
        ``done`` reported steps (the last ``trial.report`` step + 1) to the trial's next
        milestone, when each step takes ``per_step`` ops (``None``: not known yet).

        The pruner's next step, as :func:`optuna_milestones` reads it. While fewer trials
        than the pruner's or sampler's ``n_startup_trials`` are COMPLETE or PRUNED, a
        trial's end is a milestone too: the pruner prunes nothing and the sampler samples
        at random until then, so those ends are what the search waits for. A task
        factory's trial reports ``steps`` (its epochs): no milestone lies at or past its
        last one (pruning after it spares nothing), and its end is known. An objective's
        end is not: while it is a milestone, and before ``per_step`` is known, the
        milestone is :data:`_UNKNOWN_OPS` away. Half a step of slack: a loop whose step
        takes an op or two more than the last one did is not taken for committed work
        before it reports."""
        if steps is not None and done >= steps:
            return None  # it reported its last step: nothing ahead
        at = self.milestones.next_after(done)
        if steps is not None and at is not None and at >= steps:
            at = None
        if at is None and self._finished < self.milestones.startup_trials:
            if steps is None:
                return _UNKNOWN_OPS
            at = steps
        if at is None:
            return None
        if per_step is None:
            return _UNKNOWN_OPS
        return max(1, math.ceil((at - done + 0.5) * per_step))

    # -- ending trials ----------------------------------------------------------------

    def _drop(self, run: _Run) -> None:
        """Stop the trial's loops at their next forward (its trial has ended; they leave
        the engine when its function returns)."""
        if run.scope is not None:
            run.scope.stop()

    def _fail(self, run: _Run, err: BaseException) -> None:
        self._drop(run)
        self.log.warning(
            "Trial %d failed with parameters: %s because of the following error: %s",
            run.trial.number,
            run.trial.params,
            error_text(err, limit=None),
        )
        run.trial.set_user_attr("error", error_text(err, limit=_MAX_ERROR_CHARS))
        self._tell(run, self.optuna.trial.TrialState.FAIL)

    def _tell(self, run: _Run, state: Any) -> None:
        trial = run.trial
        self.live.pop(trial.number, None)
        self._beaten.discard(trial.number)
        if state in (self.optuna.trial.TrialState.COMPLETE, self.optuna.trial.TrialState.PRUNED):
            self._finished += 1
        if state == self.optuna.trial.TrialState.COMPLETE:
            self.study.tell(trial, run.value)
            if self.log.isEnabledFor(logging.INFO):
                how = (
                    f"{self.metric} after {run.epoch} epochs"
                    if run.factory
                    else "returned by the objective"
                )
                message = (
                    f"Trial {trial.number} finished with value: {run.value} ({how}) and "
                    f"parameters: {trial.params}."
                )
                with contextlib.suppress(ValueError):  # no feasible trial yet
                    best = self.study.best_trial
                    message += f" Best is trial {best.number} with value: {best.value}."
                self.log.info(message)
        else:
            self.study.tell(trial, state=state)
            if state == self.optuna.trial.TrialState.PRUNED and run.epoch:
                self.log.info(
                    "Trial %d pruned at step %d (%d of %d epochs trained).",
                    trial.number,
                    run.epoch - 1,
                    run.epoch,
                    self.epochs,
                )

    def abort(self, err: BaseException) -> None:
        """End every running trial ``FAIL`` and stop its loops (Ctrl-C, or a failure of
        the loop itself), then wait a little for the trials' threads, so that none of ours
        is still inside torch when Python exits. Raises nothing of its own."""
        with self._lock:
            self._stopping = True
        threads = list(self.running)
        runs, self.live, self.running = list(self.live.values()), {}, {}
        for run in runs:
            with contextlib.suppress(Exception):
                self._drop(run)
        if isinstance(err, KeyboardInterrupt):
            why = "interrupted (KeyboardInterrupt)"
        else:
            why = f"interrupted: th.optimize stopped on {type(err).__name__}: {err}"
        for run in runs:
            with contextlib.suppress(Exception):
                run.trial.set_user_attr("error", why[:_MAX_ERROR_CHARS])
            with contextlib.suppress(Exception):
                self.study.tell(
                    run.trial, state=self.optuna.trial.TrialState.FAIL, skip_if_finished=True
                )
        if runs:
            self.log.warning("%s; trials %s ended FAIL", why, sorted(r.trial.number for r in runs))
        concurrent.futures.wait(threads, timeout=_ABORT_WAIT_S)

    # -- work done in threads -----------------------------------------------------------

    def _build(self, run: _Run) -> _ObjectiveDone:
        """Call the user's function for the trial: an objective trains its own loop and
        returns its value; a task factory's task is then trained here, as a ``th.shard``
        loop (:meth:`_train_task`). Either way the trial's loops have left the engine
        when this returns."""
        from tune_hydra.engine.registration.factory import call_factory
        from tune_hydra.frontends.shard import engine_scope

        number = run.trial.number
        pruned = self.optuna.TrialPruned
        make_task = self.make_task
        engine = self.engine

        def build(trial: optuna.Trial) -> Any:
            # th.shard inside trains on this call's engine; the loops it made leave the
            # engine when the function returns or raises, whatever its frames still hold.
            with engine_scope(engine) as scope:
                run.scope = scope
                # An objective's loops are told their milestones at their cut and at each
                # trial.report.
                steps = _LoopMilestones(self, trial.report)
                scope.on_loop = steps.add
                trial.report = steps.report  # type: ignore[method-assign]
                try:
                    out = make_task(trial)
                except pruned as err:  # not an error: returned, so that it keeps its type
                    return _PrunedByFactory(str(err), scope.sharded)
                finally:
                    del trial.report  # Optuna's own again
                    loops = scope.sharded
                    scope.close()
            if isinstance(out, numbers.Real) and not isinstance(out, bool):
                return _ObjectiveDone(float(out), loops)
            return out

        task = call_factory(
            build,
            run.trial,
            what=f"trial {number} of study {self.study.study_name!r}",
            seed=self.task_options["seed"],
            timeout_s=self.factory_timeout_s,
        )
        if isinstance(task, _PrunedByFactory | _ObjectiveDone):
            if task.loops == 0 and not self._warned_plain:
                self._warned_plain = True
                self.log.warning(
                    "th.optimize: trial %d's function returned %s without calling "
                    "th.shard, so it trained plainly, outside the engine (one trial at a "
                    "time gains nothing from th.optimize). Add model, optimizer = "
                    "th.shard(model, optimizer) after building them, or return a "
                    "th.ModelTask",
                    number,
                    "a value" if isinstance(task, _ObjectiveDone) else "TrialPruned",
                )
            if isinstance(task, _PrunedByFactory):
                raise task
            return task
        if self.direction_error is not None and isinstance(task, _model_task_type()):
            raise _Systematic(self.direction_error)
        # A define-by-run factory may build no task for one trial alone: not systematic.
        task = check_task(task, str(number), takes="trial", systematic=False)
        self._check_metric(number, task)
        run.factory = True
        return self._train_task(run, task)

    def _train_task(self, run: _Run, task: ModelTask) -> _ObjectiveDone:
        """Train ``task`` for every epoch as a ``th.shard`` loop (the canned objective of
        a task factory: :class:`~tune_hydra.frontends.task_loop.TaskLoop`), reporting
        each epoch's metric and asking the pruner; with ``save_dir``, save its model.

        Raises:
            _TaskPruned: the pruner stopped it after an epoch.
            InvalidTaskError: an epoch's metric is not a finite number.
        """
        from tune_hydra.frontends.shard import engine_scope
        from tune_hydra.frontends.task_loop import TaskLoop
        from tune_hydra.frontends.trial import CLAIMS, prepare_model

        trial, number = run.trial, run.trial.number
        prepare_model(task.model, self, run.key, _Driver.trains)  # type: ignore[arg-type]
        with engine_scope(self.engine) as scope:
            run.scope = scope
            with self._lock:
                if self._stopping:
                    raise _Interrupted
            steps = _LoopMilestones(
                self,
                trial.report,
                epochs=self.epochs,
                guess=lambda _runner: loop.ops_per_iteration(),
            )
            scope.on_loop = steps.add
            try:
                seed = self.task_options["seed"]  # the task's own wins (TaskLoop)
                try:
                    loop = TaskLoop(run.key, task, self.engine, seed=seed, **self._opts)
                except InvalidModelError as err:  # the model's type cannot be cut
                    raise uncuttable(run.key, task.model, err) from err
                CLAIMS.record(task.model, self, run.key, _Driver.trains)  # type: ignore[arg-type]
                for epoch in range(self.epochs):
                    try:
                        result = loop.train_iteration()
                    except InvalidModelError as err:  # the model's type cannot be cut
                        raise uncuttable(run.key, task.model, err) from err
                    if epoch == 0:
                        trial.set_user_attr("num_shards", int(result["num_shards"]))
                    value = result.get(self.metric)
                    if not isinstance(value, numbers.Real) or not math.isfinite(value):
                        raise InvalidTaskError(
                            f"trial {number}: epoch {epoch + 1} gave {self.metric}={value!r}, "
                            f"not a finite number, so Optuna cannot rank it. Check the eval "
                            f"data and loss_fn (a NaN or infinite loss on eval_data), or "
                            f"lower the learning rate"
                        )
                    run.value, run.epoch = float(value), epoch + 1
                    steps.report(run.value, epoch)  # Optuna's steps count from 0
                    if trial.should_prune():
                        raise _TaskPruned
            finally:
                scope.close()  # the loop leaves the engine; the model keeps its weights
        if self.folder is not None:
            path = save_model(self.folder / f"trial_{number}", task.model.state_dict())  # type: ignore[union-attr]
            trial.set_user_attr("model_path", str(path))
        assert run.value is not None
        return _ObjectiveDone(run.value, 1)

    def _check_metric(self, number: int, task: ModelTask) -> None:
        """Refuse a task that does not report the study's metric."""
        declared = task.metrics or {}
        if self.metric not in METRICS and self.metric not in task_reports(declared):
            close = difflib.get_close_matches(self.metric, [*METRICS, *declared], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownMetricError(
                f"trial {number}: metric={self.metric!r} is not reported: it is neither "
                f"{' nor '.join(map(repr, METRICS))} nor one of the task's metrics "
                f"({sorted(declared)}). Declare it: {declare_metric(self.metric)}.{hint}"
            )
        if self.metric == "val_loss" and task.eval_data is None:
            raise InvalidTaskError(
                f"trial {number}: metric='val_loss' needs eval_data, but make_task returned "
                f"a ModelTask without it; give th.ModelTask(..., eval_data=...) or call "
                f"th.optimize(..., metric='loss')"
            )


class _LoopMilestones:
    """The milestones of one objective's ``th.shard`` loops, told to the engine
    (``Engine.set_milestone``, in ops: a loop's engine iteration is one op) when a loop is
    cut and at each ``trial.report``; the ops a step takes are measured between reports,
    per loop (the study's last measure for a loop that has not reported yet)."""

    def __init__(
        self,
        driver: _Driver,
        report: Callable[..., None],
        *,
        epochs: int | None = None,
        guess: Callable[[Any], float | None] | None = None,
    ) -> None:
        self.driver = driver
        self._report = report  # Optuna's trial.report
        self.epochs = epochs  # a task factory's: the steps it reports (None: not known)
        # A task factory's: the ops a step (epoch) of a loop takes, read from its task and
        # cut, for a loop that has not reported while none has in this call.
        self._guess = guess
        self.loops: dict[str, tuple[Any, int]] = {}  # name -> (runner, ops at last report)
        self.per_step: dict[str, float] = {}  # name -> ops a step took
        self.done = 0  # steps reported: the last trial.report step + 1

    def add(self, loop: Any) -> None:
        """``EngineScope.on_loop``: a loop of the objective was cut and registered."""
        self.loops[loop.name] = (loop, loop.iteration)
        per_step = self.driver.ops_per_step
        if per_step is None and self._guess is not None:
            per_step = self._guess(loop)
            if per_step is not None:
                self.per_step[loop.name] = per_step
        self._announce(loop.name, per_step)

    def report(self, value: float, step: int) -> None:
        """``trial.report``: Optuna's, then the loops' next milestones."""
        self._report(value, step)
        if not isinstance(step, numbers.Integral) or isinstance(step, bool):
            return  # Optuna refused it already, or will: nothing to measure
        done = int(step) + 1
        for name, (loop, at) in list(self.loops.items()):
            ops = loop.iteration
            if done > self.done and ops > at:
                self.per_step[name] = (ops - at) / (done - self.done)
                self.driver.ops_per_step = self.per_step[name]
            self.loops[name] = (loop, ops)
        self.done = max(self.done, done)
        for name, (loop, _) in self.loops.items():
            loop.reports = self.done  # its next ops' iteration: the policy sees it progress
            self._announce(name, self.per_step.get(name, self.driver.ops_per_step))

    def _announce(self, name: str, per_step: float | None) -> None:
        engine = self.driver.engine
        milestone = self.driver.loop_milestone(self.done, per_step, self.epochs)
        with contextlib.suppress(TuneHydraError):  # the loop left (th.unshard): no hint
            engine.set_milestone(name, milestone)
            if self.epochs is not None and per_step is not None:  # its work left, known
                engine.set_remaining(name, math.ceil((self.epochs - self.done) * per_step))


def _in_thread(
    fn: Callable[[_Run], Any], run: _Run, *, name: str
) -> concurrent.futures.Future[Any]:
    """Run ``fn(run)`` in a daemon thread (one that hangs cannot keep Python from exiting);
    the future gets its result or its error."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(run)
        except BaseException as err:  # reported to the driver, whatever it is
            future.set_exception(err)
        else:
            future.set_result(result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


# ------------------------------------------------------------------------- the checks
def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError as err:
        raise MissingDependencyError(
            'th.optimize needs optuna, which is not installed: pip install "tune_hydra[optuna]"'
        ) from err
    return optuna


def _split_options(train_opts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    known = ("devices", "device_memory", *ENGINE_OPTIONS, *TASK_OPTIONS, *OTHER_OPTIONS)
    check_option_names(train_opts, known, where="th.optimize", not_offered=NOT_OFFERED["optimize"])
    return {
        "engine": {k: v for k, v in train_opts.items() if k in ENGINE_OPTIONS},
        "task": {k: v for k, v in train_opts.items() if k in TASK_OPTIONS},
        "other": {k: v for k, v in train_opts.items() if k in OTHER_OPTIONS},
    }


def _check_study(optuna: Any, study: Any, make_task: Any) -> None:
    if not isinstance(study, optuna.Study):
        raise InvalidStudyError(
            f"th.optimize(study, make_task, ...) takes an optuna.Study first, not "
            f"{type(study).__name__}; make one with study = optuna.create_study() (or "
            f"optuna.load_study(...) to share one through a storage)"
        )
    if len(study.directions) != 1:
        raise InvalidStudyError(
            f"study {study.study_name!r} has {len(study.directions)} objectives; th.optimize "
            f"reports one metric per trial: create the study with direction='minimize'"
        )
    if not callable(make_task):
        raise InvalidStudyError(
            f"make_task must be a function make_task(trial) -> th.ModelTask, not "
            f"{type(make_task).__name__}"
        )


def _check_metric(
    optuna: Any, study: optuna.Study, metric: Any, *, defer_direction: bool = False
) -> UnknownMetricError | None:
    """Refuse, before any trial, a metric that is no name or an engine figure other than
    a loss, and a loss in a maximizing study (returned instead, with
    ``defer_direction``). Any other name may be one of the tasks' ``metrics`` (checked
    when each trial's task is built), whose direction the study decides."""
    if (
        not isinstance(metric, str)
        or not metric
        # train_loss: a task's training loss when it declares a metric named loss
        or (metric in ENGINE_KEYS and metric not in (*METRICS, TRAIN_LOSS))
    ):
        listed = "; ".join(f"{k!r}: {v}" for k, v in METRICS.items())
        close = difflib.get_close_matches(str(metric), METRICS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownMetricError(
            f"metric={metric!r} is not reported by training; th.optimize reports {listed}, "
            f"and {TASK_METRICS}.{hint}"
        )
    loss = metric in METRICS or metric == TRAIN_LOSS
    if loss and study.direction == optuna.study.StudyDirection.MAXIMIZE:
        error = UnknownMetricError(
            f"study {study.study_name!r} maximizes, but metric={metric!r} is a loss (lower "
            f"is better): create the study with optuna.create_study(direction='minimize'), "
            f"or give metric= one of the task's metrics"
        )
        if not defer_direction:
            raise error
        return error
    return None


def _prepare_save_dir(save_dir: Any) -> Path | None:
    if save_dir is None:
        return None
    if not isinstance(save_dir, str | os.PathLike):
        raise InvalidOptionError(
            "save_dir", save_dir, "give a folder path (str or pathlib.Path), or None", "optimize"
        )
    folder = Path(save_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidOptionError(
            "save_dir", save_dir, f"the folder cannot be created ({err}); give a writable one",
            "optimize",
        ) from err  # fmt: skip
    return folder


def _check_given_engine(
    engine_type: type, engine: Any, devices: Any, device_memory: Any, options: dict[str, Any]
) -> None:
    if not isinstance(engine, engine_type):
        raise InvalidOptionError(
            "engine", engine, "give a tune_hydra.engine.Engine, or None to build one", "optimize"
        )
    given = dict(options)
    if device_memory is not None:
        given = {"device_memory": device_memory, **given}
    if not (isinstance(devices, str) and devices == "auto"):
        given = {"devices": devices, **given}
    if given:
        option, value = next(iter(given.items()))
        raise InvalidOptionError(
            option,
            value,
            f"leave out {', '.join(given)} when passing engine=: that engine has its own; "
            f"give them to Engine(...) instead",
            "optimize",
        )


__all__ = ["METRICS", "optimize"]
