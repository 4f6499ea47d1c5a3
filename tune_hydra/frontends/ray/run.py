""":func:`run`: ``tune.run`` with a ``trial_executor=`` argument that Ray no longer has.

``th.run`` mirrors ``tune.run``'s whole signature (``inspect.signature(th.run)`` shows every
``tune.run`` parameter plus ``trial_executor``) and returns what ``tune.run`` returns. With
``trial_executor=None`` it forwards every argument to ``tune.run`` unchanged; with a
:class:`~tune_hydra.HydraExecutor` the first argument is a task factory
``make_task(config) -> th.ModelTask`` and the trials train on the executor's engines.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

from ray import tune
from ray.tune.error import TuneError
from ray.tune.result import AUTO_RESULT_KEYS, DEBUG_METRICS, EPISODES_TOTAL, TIMESTEPS_TOTAL
from ray.tune.search import BasicVariantGenerator

from tune_hydra.frontends.common import REPORTED, RESULT_KEYS, TASK_METRICS
from tune_hydra.frontends.ray.callback import clear_systematic, systematic_error
from tune_hydra.frontends.ray.errors import (
    InvalidExecutorError,
    MissingMetricError,
    UnreportedMetricError,
)
from tune_hydra.frontends.ray.executor import HydraExecutor
from tune_hydra.frontends.ray.proxies import check_task_factory, warn_resources_dropped
from tune_hydra.options import ENGINE_KEYS, TRAIN_LOSS

REPORTED_KEYS = tuple(
    dict.fromkeys(
        [
            *RESULT_KEYS,
            *(k for k in AUTO_RESULT_KEYS if k not in (EPISODES_TOTAL, TIMESTEPS_TOTAL)),
            *DEBUG_METRICS,
        ]
    )
)
"""Every result key a tune_hydra trial reports: the engine's metrics and Tune's own."""
_TUNE_NUMBERS = (
    "training_iteration",
    "time_total_s",
    "time_this_iter_s",
    "time_since_restore",
    "iterations_since_restore",
    "timestamp",
)

_TUNE_RUN_SIGNATURE = inspect.signature(tune.run)
_TUNE_RUN_PARAMS = set(_TUNE_RUN_SIGNATURE.parameters) - {"run_or_experiment"}


def _metric_of(obj: Any) -> Any:
    if obj is None or isinstance(obj, str):
        return None
    for attr in ("metric", "_metric"):
        value = getattr(obj, attr, None)
        if isinstance(value, str) and value != "_metric":  # Tune's anonymous default
            return value
    searcher = getattr(obj, "searcher", None)  # ConcurrencyLimiter, SearchGenerator
    return _metric_of(searcher) if searcher is not None and searcher is not obj else None


def _check_metric(kwargs: dict[str, Any]) -> None:
    """Fail before any trial starts when a search algorithm or scheduler has nothing to
    optimise, or ``mode`` is not ``"min"``/``"max"``."""
    mode = kwargs.get("mode")
    if mode is not None and mode not in ("min", "max"):
        raise MissingMetricError(f"mode must be 'min' or 'max', not {mode!r}")
    if kwargs.get("metric") is not None and mode is None:
        raise MissingMetricError(
            f"metric={kwargs['metric']!r} was given without mode; pass mode='min' or 'max'"
        )
    if kwargs.get("metric") is not None:
        return
    needs = []
    search_alg = kwargs.get("search_alg")
    if (
        search_alg is not None
        and not isinstance(search_alg, (str, BasicVariantGenerator))
        and _metric_of(search_alg) is None
    ):
        needs.append(type(search_alg).__name__)
    scheduler = kwargs.get("scheduler")
    if (
        scheduler is not None
        and type(scheduler).__name__ != "FIFOScheduler"
        and _metric_of(scheduler) is None
    ):
        needs.append(scheduler if isinstance(scheduler, str) else type(scheduler).__name__)
    if needs:
        raise MissingMetricError(
            f"{' and '.join(map(str, needs))} need(s) a metric to optimise; pass "
            f"metric='val_loss' (or 'loss') and mode='min' to th.run (tune_hydra reports "
            f"{REPORTED}, and {TASK_METRICS})"
        )


def _check_reported(kwargs: dict[str, Any]) -> tuple[str, ...]:
    """Refuse, before any trial starts, a metric (of the run, its scheduler or its search
    algorithm) that tune_hydra's trials never report: Tune would fail every trial with a
    message about ``tune.report()`` calls the user no longer has.

    Any other name may be one of the tasks' own ``ModelTask(metrics=...)``, which are known
    only once a factory ran: those names are returned, and each trial checks at its first
    registration that its task declares them (a :class:`UndeclaredMetricError` ends the
    experiment at the first trial otherwise).

    Returns:
        The metric names that the tasks must declare.
    """
    named = {"metric": kwargs.get("metric")}
    for arg in ("scheduler", "search_alg"):
        named[arg] = _metric_of(kwargs.get(arg))
    custom: dict[str, None] = {}
    for arg, metric in named.items():
        if not isinstance(metric, str) or metric in REPORTED_KEYS:
            continue
        if metric.startswith("config/"):
            continue  # the trial's config, flattened into every result
        if metric not in ENGINE_KEYS or metric == TRAIN_LOSS:
            # A metric of the task's own (train_loss: with one named loss), checked per trial
            custom[metric] = None
            continue
        tune_keys = ", ".join(k for k in _TUNE_NUMBERS if k in REPORTED_KEYS)
        raise UnreportedMetricError(
            f"{arg}={metric!r} is not reported by tune_hydra's trials: they report "
            f"{REPORTED}, {TASK_METRICS}, and Tune's own {tune_keys}. Optimise one of "
            f"those, e.g. metric='val_loss', mode='min'"
        )
    return tuple(custom)


def _searcher(kwargs: dict[str, Any]) -> Any:
    """The run's search algorithm for the policy's choice (Tune's random/grid generator,
    by object or name, as None: not adaptive)."""
    search_alg = kwargs.get("search_alg")
    if isinstance(search_alg, str) and search_alg in ("variant_generator", "random"):
        return None
    return search_alg


def run(
    run_or_experiment: Any,
    *,
    trial_executor: HydraExecutor | None = None,
    **kwargs: Any,
) -> Any:
    """Run a Tune experiment; with ``trial_executor=HydraExecutor(...)``, on shared engines.

    Every ``tune.run`` argument is accepted and means what it means there (see
    ``inspect.signature(th.run)``). With a :class:`~tune_hydra.HydraExecutor`:

    * ``run_or_experiment`` is a task factory ``make_task(config) -> th.ModelTask``; it
      runs inside the engine actor's process, once per trial (and per restore).
    * each Tune iteration trains one epoch (or ``iteration_batches`` batches) and reports
      ``loss``, ``val_loss`` (with eval data), each of the task's ``metrics`` (one named
      ``loss`` takes that key, and the training loss is then ``train_loss``),
      ``num_shards``, ``epoch``, ``device_time_s`` and ``bytes_spilled``;
    * checkpoints hold ``model.pt`` (the whole model's ``state_dict``) and the state that
      resumes training exactly;
    * ``scheduler`` is wrapped so the engines learn each trial's remaining budget and next
      milestone (its next rung) and drop stopped or paused trials' queued work; the
      executor's ``policy="auto"`` becomes the milestone policy when the scheduler stops
      trials early or ``search_alg`` adapts, LRTF otherwise; ``max_concurrent_trials``
      defaults to the number of engine slots; ``reuse_actors`` is on for task factories
      and function trainables (a trial's process is only a proxy: the user's code runs
      in the engine actor, a fresh call each trial); a request for resources of the trials' own
      (``resources_per_trial``, ``tune.with_resources``) is dropped with one warning: each
      trial holds one engine slot and no CPU, and the engine places the model.
    * every trial ends with a checkpoint (``HydraExecutor(checkpoint="every")``, unless the
      run sets ``checkpoint_freq`` / ``checkpoint_config`` itself);
    * ``tune.with_parameters(make_task, data=...)`` is a task factory called as
      ``make_task(config, data=...)`` in the engine;
    * a mistake that every trial would repeat (the factory returns no ``ModelTask``, or is
      a function trainable; the model's type cannot be cut) stops the experiment at the
      first trial and is raised here, once; a ``metric`` the trials never report is
      refused before any trial starts, and one the first trial's task does not declare in
      ``ModelTask(metrics=...)`` ends the experiment at that trial
      (:class:`~tune_hydra.exceptions.UndeclaredMetricError`).

    The executor's engine actors are started if needed and, if this call started them,
    shut down at the end (their timeline stays available as ``trial_executor.trace()``).

    Args:
        run_or_experiment: a task factory (with an executor) or anything ``tune.run`` takes.
        trial_executor: None (plain ``tune.run``) or a :class:`~tune_hydra.HydraExecutor`.
        **kwargs: ``tune.run``'s keyword arguments.

    Returns:
        What ``tune.run`` returns: an ``ExperimentAnalysis``.

    Raises:
        InvalidExecutorError: ``trial_executor`` is not a HydraExecutor.
        NotATaskFactoryError: ``run_or_experiment`` is not a task factory (a function
            trainable that calls ``tune.report`` included).
        MissingMetricError: a search algorithm or scheduler has no metric/mode.
        UnreportedMetricError: the metric is not one the trials report.
        SystematicTaskError: the first trial hit a mistake every trial would repeat
            (raised even with ``raise_on_failed_trial=False``: the experiment failed).
    """
    unknown = set(kwargs) - _TUNE_RUN_PARAMS
    if unknown:
        raise TypeError(f"run() got unexpected keyword argument(s) {sorted(unknown)}")
    if trial_executor is None:
        return tune.run(run_or_experiment, **kwargs)
    if not isinstance(trial_executor, HydraExecutor):
        raise InvalidExecutorError(
            f"trial_executor must be a tune_hydra.HydraExecutor or None, not "
            f"{type(trial_executor).__name__}: Ray removed custom Tune TrialExecutors in 2.7"
        )
    # A function trainable reports its own metrics (a "loss" of its own included):
    # Tune judges them as in a plain run.
    required: tuple[str, ...] = ()
    if not check_task_factory(run_or_experiment):
        _check_metric(kwargs)
        required = _check_reported(kwargs)
    resources = kwargs.pop("resources_per_trial", None)
    if resources:  # as a tune.with_resources request: the trials keep their engine slot
        if isinstance(resources, Mapping):  # as tune.run reads it, for the warning
            from ray.tune.execution.placement_groups import resource_dict_to_pg_factory

            resources = resource_dict_to_pg_factory(dict(resources))
        warn_resources_dropped(resources, "(resources_per_trial of th.run)")
    ex = trial_executor
    owns = not ex.started
    trainable = None
    try:
        # Before trainable(), which starts the engines: policy="auto" is chosen here.
        kwargs["scheduler"] = ex.scheduler(
            kwargs.get("scheduler"), stop=kwargs.get("stop"), search_alg=_searcher(kwargs)
        )
        trainable = ex.trainable(run_or_experiment)
        # Checked by each trial's setup (see HydraTrainable._required_metrics).
        trainable._required_metrics = required
        kwargs["stop"] = ex.stopper(kwargs.get("stop"))
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), *ex.callbacks()]
        if kwargs.get("max_concurrent_trials") is None:
            kwargs["max_concurrent_trials"] = ex.max_concurrent_trials
        if trainable._reuse_process:
            kwargs["reuse_actors"] = True
        clear_systematic(ex.run_id)
        try:
            analysis = tune.run(trainable, **kwargs)
        except TuneError:
            if systematic_error(ex.run_id) is None:
                raise
            analysis = None
        mistake = systematic_error(ex.run_id)
        if mistake is not None:
            raise mistake from None  # once, instead of every trial's traceback
        return analysis
    finally:
        if owns:
            ex.shutdown()
        elif trainable is not None and ex.started:
            ex.release(trainable)  # the experiment is over: free its factory everywhere


def executor_of(trainable: Any) -> HydraExecutor | None:
    """The active executor whose :meth:`~HydraExecutor.trainable` made ``trainable``
    (Tune's wrappers around it included), else None."""
    from tune_hydra.frontends.ray import registry

    run_id = getattr(trainable, "_run_id", None) if isinstance(trainable, type) else None
    found = registry.active(run_id) if isinstance(run_id, str) and run_id else None
    return found if isinstance(found, HydraExecutor) else None  # only executors register


def tuner_configs(
    ex: HydraExecutor, tune_config: Any, run_config: Any, trainable: Any = None
) -> tuple[Any, Any]:
    """The ``TuneConfig`` and ``RunConfig`` of a ``tune.Tuner`` over a trainable of
    ``ex``, completed as :func:`run` completes a ``tune.run`` call: the scheduler wrapped
    by :meth:`HydraExecutor.scheduler` (with the run's ``stop`` and search algorithm),
    ``stop`` by :meth:`HydraExecutor.stopper`, the executor's :meth:`~HydraExecutor.callbacks`
    added, ``max_concurrent_trials`` the engines' slots unless set, and ``reuse_actors``
    on for the proxies of task factories and function trainables (``trainable``; see
    :class:`~tune_hydra.frontends.ray.client.EngineClient`). What is already the
    executor's is kept as it is, so passing them by hand changes nothing. The user's
    configs are copied, not changed.
    """
    from tune_hydra.frontends.ray.callback import HydraCallback

    tune_config = copy.copy(tune_config) if tune_config is not None else tune.TuneConfig()
    run_config = copy.copy(run_config) if run_config is not None else tune.RunConfig()
    tune_config.scheduler = ex.scheduler(
        tune_config.scheduler,
        stop=run_config.stop,
        search_alg=_searcher({"search_alg": tune_config.search_alg}),
    )
    if tune_config.max_concurrent_trials is None:
        tune_config.max_concurrent_trials = ex.max_concurrent_trials
    if getattr(trainable, "_reuse_process", False):
        tune_config.reuse_actors = True
    run_config.stop = ex.stopper(run_config.stop)
    callbacks = list(run_config.callbacks or [])
    if not any(isinstance(c, HydraCallback) and c.run_id == ex.run_id for c in callbacks):
        callbacks.extend(ex.callbacks())
    run_config.callbacks = callbacks
    return tune_config, run_config


def _signature() -> inspect.Signature:
    params = list(_TUNE_RUN_SIGNATURE.parameters.values())
    params.append(
        inspect.Parameter(
            "trial_executor",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation="HydraExecutor | None",
        )
    )
    return _TUNE_RUN_SIGNATURE.replace(parameters=params)


run.__signature__ = _signature()  # type: ignore[attr-defined]
