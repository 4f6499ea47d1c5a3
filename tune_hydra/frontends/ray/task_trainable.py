"""A task factory's trial under Ray: a canned class trainable, run by the class relay.

``executor.trainable(make_task)`` gives Tune a proxy (:class:`~tune_hydra.frontends.ray.
trainable.HydraTrainable`, a :class:`~tune_hydra.frontends.ray.classes.
HydraClassTrainable`) whose instance in the engine process is a :class:`TaskTrainable`:
``setup`` calls the factory (in a thread of its own, waited at most the factory timeout,
or until the trial is stopped) and trains its task as a
:class:`~tune_hydra.frontends.task_loop.TaskLoop`; ``step`` is one iteration of it,
``save_checkpoint`` / ``load_checkpoint`` write and read the loop's checkpoint folder
(:func:`~tune_hydra.frontends.checkpoint.save_trial` / ``restore_trial``, with their
guards), ``reset_config`` builds the next trial's task in the same run
(``reuse_actors``). So a factory's trial is a class trainable like any other: Tune's
checkpoint frequency, PBT's saves and exploits, pauses and ``Tuner.restore`` reach it
the same way, and it trains on the runtime users' own loops train on.

This module imports neither torch nor the engine at import time.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import threading
from dataclasses import dataclass
from typing import Any

from ray import tune
from ray.tune.result import SHOULD_CHECKPOINT, TRIAL_INFO

from tune_hydra.exceptions import InvalidModelError, TaskFactoryTimeoutError, UndeclaredMetricError
from tune_hydra.frontends.common import REPORTED, declare_metric, task_reports, trial_result
from tune_hydra.frontends.failures import check_task, uncuttable
from tune_hydra.frontends.ray.errors import EngineUnavailableError, TrialNotRegisteredError
from tune_hydra.frontends.ray.reports import tune_report_call


class PendingBuilds:
    """The trials of one engine actor whose task factory is running, each with its
    owner's token and a future that ends the wait (thread-safe: the factories are awaited
    on the trials' threads, the aborts come from the actor's event loops).

    Args:
        secret: the experiment's secret (its driver may stop any trial's wait).
    """

    def __init__(self, secret: str = "") -> None:
        self._secret = secret
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[str, concurrent.futures.Future[None]]] = {}

    def wait(
        self,
        key: str,
        token: str,
        future: concurrent.futures.Future[Any],
        *,
        timeout_s: float | None,
        what: str,
    ) -> Any:
        """What the factory's ``future`` gives, waiting at most ``timeout_s`` or until
        :meth:`abort` (a late result is then dropped).

        Raises:
            TaskFactoryError: the factory raised.
            TaskFactoryTimeoutError: it did not return within ``timeout_s``.
            EngineUnavailableError: the trial was stopped while its factory ran.
        """
        abort: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._waiting[key] = (token, abort)
        try:
            done, _ = concurrent.futures.wait(
                {future, abort}, timeout=timeout_s, return_when="FIRST_COMPLETED"
            )
        finally:
            with self._lock:
                if self._waiting.get(key, (None, None))[1] is abort:
                    del self._waiting[key]
        if future in done:
            return future.result()
        future.cancel()  # a late result is dropped
        if abort in done:
            raise EngineUnavailableError(
                f"trial {key!r} was stopped while its task factory was still running (Tune "
                f"stopped or paused it, or the experiment was interrupted)"
            )
        raise TaskFactoryTimeoutError(what, float(timeout_s or 0.0))

    def abort(self, key: str, token: str) -> None:
        """Stop waiting for trial ``key``'s factory (its owner or the driver asks)."""
        with self._lock:
            waiting = self._waiting.get(key)
        if waiting is None:
            return
        owner, abort = waiting
        is_driver = bool(self._secret) and hmac.compare_digest(str(token), self._secret)
        if token != owner and not is_driver:
            raise TrialNotRegisteredError(
                f"trial {key!r} is being registered by someone else; only its owner or "
                f"its experiment's driver can stop it"
            )
        if not abort.done():
            abort.set_result(None)

    def abort_all(self) -> int:
        """Stop waiting for every factory (the driver was interrupted); returns how many."""
        with self._lock:
            keys = list(self._waiting)
        for key in keys:
            self.abort(key, self._secret)
        return len(keys)


@dataclass(frozen=True)
class TaskSpec:
    """What a task factory's trials are made of, given to each trial's run (one class,
    :class:`TaskTrainable`, for every factory: no class is made per trial, so nothing of
    a factory outlives its trials but the actor's factory cache).

    Attributes:
        factory: the factory (``tune.with_parameters`` bound), called with the config.
        task_options: the executor's task options (``seed``, ``max_grad_norm``,
            ``accumulate_steps``, ``precision``, ``iteration_batches``).
        builds: the actor's factories still running (aborted by a stop or the driver).
        timeout_s: the most seconds one factory call may take (None: no limit).
        trials: the actor's trials (its ``FunctionRelay``): who trains a model is
            recorded per actor and trial id, so a retried trial may reuse its own.
        required: metric names of the run that only a task's ``metrics`` can give.
        checkpoint: ``"every"``: ask Tune for a checkpoint after every iteration.
    """

    factory: Any
    task_options: dict[str, Any]
    builds: PendingBuilds
    timeout_s: float | None
    trials: Any
    required: tuple[str, ...] = ()
    checkpoint: str | None = None

    @property
    def name(self) -> str:
        """The factory's name."""
        return str(getattr(getattr(self.factory, "fn", self.factory), "__name__", "make_task"))

    def describe_call(self, method: str) -> str:
        """What a trial was doing in ``method``, for an error it raised."""
        doing = {
            "setup": "building its task",
            "reset": "building its task",
            "step": "training its task",
            "save_checkpoint": "saving its checkpoint",
            "load_checkpoint": "restoring its checkpoint",
        }.get(method, method)
        return f"{doing} (the task factory {self.name!r})"


class TaskTrainable(tune.Trainable):
    """The engine-process instance of a task factory's trial (see the module docstring);
    its run's ``spec`` (a :class:`TaskSpec`) says which factory and how."""

    def setup(self, config: dict[str, Any]) -> None:
        self.loop: Any = None
        self._build(config)

    def _trial(self) -> tuple[str, Any]:
        """The trial's key and its run (the class relay's :class:`~tune_hydra.frontends.
        ray.classes.ClassRun` of this thread)."""
        from tune_hydra.frontends.ray.function import session_router

        run = session_router().current()
        assert run is not None, "a TaskTrainable runs only in its trial's class run"
        return run.key, run

    def _build(self, config: dict[str, Any]) -> None:
        """Call the factory for ``config`` and make its task's loop."""
        from tune_hydra.engine.registration.factory import start_factory
        from tune_hydra.frontends.task_loop import TaskLoop
        from tune_hydra.frontends.trial import CLAIMS, prepare_model

        key, run = self._trial()
        spec: TaskSpec = run.spec
        self.plain_config = {k: v for k, v in config.items() if k != TRIAL_INFO}
        what = f"trial {key} (config {self.plain_config!r})"
        seed = spec.task_options.get("seed")
        future = start_factory(
            _on_trial(run, spec.factory), dict(self.plain_config), what=what, seed=seed
        )
        builds = spec.builds
        run.on_abort = lambda: builds.abort(key, run.token)
        try:
            task = builds.wait(key, run.token, future, timeout_s=spec.timeout_s, what=what)
        finally:
            run.on_abort = None
        factory = getattr(spec.factory, "fn", spec.factory)
        task = check_task(task, key, trainable=lambda: tune_report_call(factory))
        self._check_metrics(key, task, spec.required)
        prepare_model(task.model, spec.trials, key, _trains)
        options = {k: v for k, v in spec.task_options.items() if k != "seed"}
        taken = set(run.engine.tasks())
        name, n = key, 0
        while name in taken:  # an older copy of the trial still leaving the engine
            n += 1
            name = f"{key}~{n}"
        self.task = task
        run.guess = lambda _runner: self.loop.ops_per_iteration()  # told at its cut
        try:
            loop = TaskLoop(name, task, run.engine, seed=seed, **options)
        except InvalidModelError as err:  # the model's type cannot be cut
            raise uncuttable(key, task.model, err) from err
        try:
            # Cut and registered now, as a task was at registration: a model that does not
            # fit fails the trial here, and the loop's name is taken before its first step.
            self.loop = loop
            loop.cut()
        except BaseException as err:
            self.loop = None
            loop.close()  # the model back to the user's class, nothing left registered
            if isinstance(err, InvalidModelError):
                raise uncuttable(key, task.model, err) from err
            raise
        CLAIMS.record(task.model, spec.trials, key, _trains)
        self._every = spec.checkpoint == "every"

    def _check_metrics(self, key: str, task: Any, required: tuple[str, ...]) -> None:
        """Refuse a task that does not report a metric the run optimises (systematic)."""
        declared = list(task.metrics or {})
        reported = task_reports(declared)
        missing = [m for m in required if m not in reported]
        if missing:
            raise UndeclaredMetricError(
                key,
                f"the experiment optimises {', '.join(map(repr, missing))}, which the trials "
                f"do not report: the task's metrics are {declared or 'none'}, and the engine "
                f"reports {REPORTED}",
                f"Declare it in make_task: {declare_metric(missing[0])}, or optimise a metric "
                f"the trials report (metric='val_loss', mode='min')",
            )

    def step(self) -> dict[str, Any]:
        out = trial_result(self.loop.train_iteration(), self.task.metrics or {})
        if self._every:
            out[SHOULD_CHECKPOINT] = True  # Tune saves one now (HydraExecutor(checkpoint=))
        return out

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        from tune_hydra.frontends.checkpoint import save_trial

        key, _ = self._trial()
        save_trial(self.loop, checkpoint_dir, trial_id=key, config=self.plain_config)

    def load_checkpoint(self, checkpoint: Any) -> None:
        """Restore from the folder (written under another config, a PBT exploit, the
        trial keeps its own hyperparameters)."""
        from tune_hydra.frontends.checkpoint import restore_trial

        key, _ = self._trial()
        restore_trial(self.loop, checkpoint, trial_id=key, config=self.plain_config)

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        """Tune reuses this run for another trial: the old loop leaves the engine and the
        new config's task is built."""
        self.cleanup()
        self._build(new_config)
        return True

    def cleanup(self) -> None:
        loop, self.loop = self.loop, None
        if loop is not None:
            loop.close()


def _on_trial(run: Any, factory: Any) -> Any:
    """``factory`` called on a thread that is ``run``'s for Ray's session (``tune.report``
    there warns and does nothing, as in a class trainable; ``tune.get_context()`` is the
    trial's)."""
    from tune_hydra.frontends.ray.function import session_router

    def call(config: dict[str, Any]) -> Any:
        router = session_router()
        router.bind(run)
        try:
            return factory(config)
        finally:
            router.unbind()

    return call


def _trains(trials: Any, key: str) -> bool:
    """Whether trial ``key`` still runs in the actor whose trials are ``trials``."""
    return key in trials.running()


__all__ = ["PendingBuilds", "TaskSpec", "TaskTrainable"]
