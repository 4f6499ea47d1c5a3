"""Driver-side :class:`~ray.tune.Callback` that frees a finished trial in the engine and
makes Ctrl-C end a run promptly, and the :class:`~ray.tune.Stopper` that ends an
experiment at its first systematic mistake.

A trial process that dies hard never runs ``Trainable.cleanup``; without this callback its
model would stay registered (and spilled in host memory) in the engine until the run ends.

Ctrl-C: Tune stops its trial actors gracefully, but a trial whose ``step`` is still
waiting for its task factory (a slow download, or one that never returns) cannot take the
stop request until that wait ends; Tune then waits about 10 s before killing it. While the
run is going, the callback chains a SIGINT handler in front of Tune's: it tells the engines
to stop waiting for factories (those trials' steps end at once), then lets Tune's handler
do what it always does. The previous handler is back in place when the run ends.

Systematic mistakes (a :class:`~tune_hydra.exceptions.SystematicTaskError`: a task factory
that returns no ``ModelTask``, a model type that cannot be cut, trials without an engine
slot) would fail every trial with the same traceback. The callback reads each failed
trial's error (the pickled error Tune writes for it) and records the first such mistake
for its executor; :class:`HydraStopper`, Tune's hook for ending a whole experiment
(``Stopper.stop_all``), then stops every other trial, and ``th.run`` raises the mistake.

Checkpoints: the proxy asks Tune for one after every iteration
(``HydraExecutor(checkpoint="every")``, Tune's ``should_checkpoint`` result); with
``checkpoint="end"`` the callback asks for one with each trial's last result (Tune lets
callbacks add to a result before it decides whether to save). When the run has a
checkpoint frequency of its own, that setting rules. ``checkpoint_at_end`` does not
replace the default: it adds the last iteration's checkpoint, and ``tune.Tuner`` turns it
on for every class trainable whatever the user asked, so yielding to it would drop every
per-iteration save of a Tuner run.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping
from typing import Any

from ray.tune import Callback, Stopper
from ray.tune.result import DONE, SHOULD_CHECKPOINT
from ray.tune.stopper import FunctionStopper
from ray.tune.utils import flatten_dict

from tune_hydra.exceptions import SystematicTaskError, TuneHydraError
from tune_hydra.frontends.ray import registry
from tune_hydra.frontends.ray.factories import FactoryStore

logger = logging.getLogger(__name__)

# Executor id -> the first systematic mistake of its current experiment (driver process).
_SYSTEMATIC: dict[str, SystematicTaskError] = {}
# Executors whose HydraStopper Tune consults (so the callback knows the run will stop).
_WATCHED: set[str] = set()
_LOCK = threading.Lock()


def _class_trial(trial: Any) -> bool:
    """Whether ``trial`` runs a user's class trainable (its checkpoints are the user's, as
    Tune asks for them: ``HydraExecutor(checkpoint=...)`` adds none; a task factory's
    canned class is ours)."""
    from tune_hydra.frontends.ray.classes import HydraClassTrainable
    from tune_hydra.frontends.ray.trainable import HydraTrainable

    try:
        cls = trial.get_trainable_cls()
    except Exception:  # not registered in this process: not ours
        return False
    return (
        isinstance(cls, type)
        and issubclass(cls, HydraClassTrainable)
        and not issubclass(cls, HydraTrainable)
    )


def check_checkpoint(checkpoint: Any) -> str | None:
    """``HydraExecutor(checkpoint=...)`` checked: ``"every"``, ``"end"`` or None (False
    means None).

    Raises:
        TuneHydraError: anything else.
    """
    if checkpoint is False:
        return None
    if checkpoint not in ("every", "end", None):
        raise TuneHydraError(
            f"checkpoint must be 'every' (a checkpoint after every iteration), 'end' "
            f"(after each trial's last iteration) or None (only what the run's "
            f"checkpoint settings ask), not {checkpoint!r}"
        )
    return checkpoint


def systematic_error(run_id: str) -> SystematicTaskError | None:
    """The systematic mistake recorded for executor ``run_id``'s current experiment."""
    with _LOCK:
        return _SYSTEMATIC.get(run_id)


def clear_systematic(run_id: str) -> None:
    """Forget executor ``run_id``'s recorded mistake (a new experiment starts)."""
    with _LOCK:
        _SYSTEMATIC.pop(run_id, None)


def find_systematic(err: BaseException | None) -> SystematicTaskError | None:
    """The :class:`SystematicTaskError` inside a trial's error (Ray wraps what the trial
    raised in ``RayTaskError``s: ``.cause``, ``__cause__``), or None."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, SystematicTaskError) and not type(err).__module__.startswith("ray"):
            return err
        cause = getattr(err, "cause", None)
        if isinstance(cause, SystematicTaskError):
            return cause
        err = cause if isinstance(cause, BaseException) else err.__cause__ or err.__context__
    return None


class HydraStopper(Stopper):
    """The user's stopping condition plus: stop the whole experiment once a trial failed
    with a systematic mistake (recorded by :class:`HydraCallback`). Made by
    :meth:`HydraExecutor.stopper <tune_hydra.HydraExecutor.stopper>`.

    Args:
        run_id: the executor's id.
        stop: the user's ``stop``: a dict of result thresholds (a trial stops when any
            ``result[key] >= value``, on the flattened result, as in Tune), a function
            ``stop(trial_id, result) -> bool``, a Tune ``Stopper``, or None.
    """

    def __init__(self, run_id: str, stop: Any = None) -> None:
        self.run_id = run_id
        self.user_stop = stop
        self._criteria: dict[str, Any] = {}
        self._stopper: Stopper | None = None
        if isinstance(stop, Mapping):
            self._criteria = dict(stop)
        elif isinstance(stop, Stopper):
            self._stopper = stop
        elif callable(stop) and FunctionStopper.is_valid_function(stop):
            self._stopper = FunctionStopper(stop)
        elif stop is not None:
            raise ValueError(
                f"stop must be a dict, a function stop(trial_id, result) or a "
                f"ray.tune.Stopper, not {type(stop).__name__}"
            )

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if self._criteria:
            flat = flatten_dict(result)
            for key, value in self._criteria.items():
                if key in flat and flat[key] >= value:
                    return True
        return bool(self._stopper(trial_id, result)) if self._stopper is not None else False

    def stop_all(self) -> bool:
        with _LOCK:
            _WATCHED.add(self.run_id)
            failed = self.run_id in _SYSTEMATIC
        return failed or (self._stopper is not None and bool(self._stopper.stop_all()))


class HydraCallback(Callback):
    """Deregisters a trial from every active engine when it errors or completes, on
    Ctrl-C stops the engines' waits for task factories, records systematic mistakes for
    :class:`HydraStopper`, and asks for checkpoints (see the module docstring).

    It finds the engines through the executors active in this driver process, so it also
    works after ``Tuner.restore`` unpickles it.

    Args:
        run_id: the executor's id (``""``: record no mistakes).
        checkpoint: the executor's ``checkpoint`` option (``"every"``, ``"end"`` or None).
        secret: the experiment's secret, which the trials' systematic-error records must
            carry (kept in this process only; after ``Tuner.restore`` unpickles the
            callback it is the active executor's).
    """

    def __init__(self, run_id: str = "", checkpoint: str | None = None, secret: str = "") -> None:
        self.run_id = run_id
        self.checkpoint = checkpoint
        self._secret = secret  # never pickled: Tune writes callbacks to the experiment folder
        self._previous: Any = None
        self._installed: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles callbacks with the experiment; signal handlers stay in this process.
        return {"run_id": self.run_id, "checkpoint": self.checkpoint}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def setup(
        self,
        stop: Any = None,
        num_samples: int | None = None,
        total_num_samples: int | None = None,
        **info: Any,
    ) -> None:
        if self.run_id:
            clear_systematic(self.run_id)  # a new (or restored) experiment
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set signal handlers (Tune does the same)
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum: int, frame: Any) -> None:
            registry.abort_builds()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

        try:
            signal.signal(signal.SIGINT, on_sigint)
        except ValueError:  # not the main interpreter
            logger.debug("tune_hydra: could not install the SIGINT handler", exc_info=True)
            return
        self._previous, self._installed = previous, on_sigint

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        if self._installed is not None and signal.getsignal(signal.SIGINT) is self._installed:
            signal.signal(signal.SIGINT, self._previous)
        self._previous = self._installed = None

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        if getattr(trial, "checkpoint_freq", 0):
            result.pop(SHOULD_CHECKPOINT, None)  # the run's own checkpoint frequency rules
        # checkpoint_at_end only adds the last checkpoint, which "every" saves anyway; it
        # is no setting of the user's to yield to: tune.Tuner turns it on for every class
        # trainable (and thereby once dropped every per-iteration save).
        elif self.checkpoint == "end" and result.get(DONE) and not _class_trial(trial):
            result[SHOULD_CHECKPOINT] = True  # the trial's last result: save it

    def _note_error(self, trial: Any) -> None:
        if not self.run_id:
            return
        try:
            ex = registry.active(self.run_id)
            secret = ex._secret if ex is not None else self._secret
            found = FactoryStore(self.run_id, secret).recorded_error(trial.trial_id)
        except Exception:  # an unreadable record is no systematic error
            logger.debug("tune_hydra: could not read trial %s's record", trial, exc_info=True)
            return
        if found is None:
            return
        with _LOCK:
            first = self.run_id not in _SYSTEMATIC
            if first:
                _SYSTEMATIC[self.run_id] = found
            watched = self.run_id in _WATCHED
        if first:
            action = (
                "ending the experiment"
                if watched
                else "pass stop=executor.stopper(...) in tune.RunConfig to end the experiment "
                "at the first such error"
            )
            logger.error("tune_hydra: %s (%s)", found, action)

    def on_trial_recover(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._note_error(trial)  # retried (max_failures), but it will fail again

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._note_error(trial)
        registry.broadcast("deregister", trial.trial_id)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        registry.broadcast("deregister", trial.trial_id, True)  # completed
