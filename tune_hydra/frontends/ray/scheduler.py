"""A :class:`~ray.tune.schedulers.TrialScheduler` wrapper that tells the engine what Tune
decides.

Why a scheduler wrapper (the pattern of Tune's ``ResourceChangingScheduler``): it is the one
public hook that sees every trial's results *and* the decisions taken on them, in the driver,
as they happen. Every decision is the user's scheduler's (FIFO by default); the wrapper only

* tells the engine how many iterations each trial still has (``set_remaining``), so the
  Sharded-LRTF policy can favour long-running trials. The budget is the smallest of
  ``stop={"training_iteration": N}`` and the scheduler's ``max_t`` (when its time attribute
  is ``training_iteration``); trials without a known budget send no hint;
* tells the engine how many iterations each trial has to its next *milestone*, the next
  result the wrapped scheduler can act on (an ASHA rung, a median rule's report, a PBT
  perturbation: :func:`~tune_hydra.frontends.milestones.tune_milestones`), ``None`` past
  its last (``set_milestone``), when the trial is added and after each of its results,
  so the milestone policy (``policy="auto"`` with an early-stopping scheduler) serves
  every trial's next decision first; a scheduler without milestones sends none;
* drops a trial's queued engine work the moment the scheduler stops or pauses it, or the
  trial errors, completes or is removed (``cancel``).

The engine actors are found through the executors active in this driver process, so a
wrapper unpickled by ``Tuner.restore`` still reaches the new run's engines.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from tune_hydra.frontends.common import ranks_training_loss, training_loss_ranked
from tune_hydra.frontends.milestones import NONE, Milestones, tune_milestones
from tune_hydra.frontends.ray import registry

logger = logging.getLogger(__name__)


def _budget_from_stop(stop: Any) -> int | None:
    stop = getattr(stop, "user_stop", stop)  # executor.stopper(...) keeps the user's stop
    if isinstance(stop, Mapping) and "training_iteration" in stop:
        try:
            return int(stop["training_iteration"])
        except (TypeError, ValueError):
            return None
    return None


def _budget_from_scheduler(scheduler: Any) -> int | None:
    time_attr = getattr(scheduler, "_time_attr", "training_iteration")
    if time_attr != "training_iteration":
        return None
    for attr in ("_max_t", "_max_t_attr"):  # ASHA / HyperBand
        value = getattr(scheduler, attr, None)
        if isinstance(value, (int, float)) and value > 0:
            return int(value)
    return None


class HydraScheduler(TrialScheduler):
    """Forwards every decision to ``base`` and keeps the engines informed.

    Args:
        base: the user's scheduler (default: FIFO).
        stop: the run's ``stop`` argument (a ``{"training_iteration": N}`` mapping gives the
            trials' budget).
        max_iterations: an explicit budget, overriding the one derived from ``stop`` and the
            scheduler's ``max_t``.
        run_id: the executor whose trials this run holds: a trial whose resource request
            lost that executor's engine slot is refused when Tune adds it.
        search_alg: the run's search algorithm (an adaptive one makes the run
            search-aware: :attr:`milestones`).
    """

    def __init__(
        self,
        base: TrialScheduler | None = None,
        stop: Any = None,
        max_iterations: int | None = None,
        run_id: str = "",
        search_alg: Any = None,
    ) -> None:
        self._base = base if base is not None else FIFOScheduler()
        self._run_id = run_id
        budgets = [b for b in (_budget_from_stop(stop), _budget_from_scheduler(self._base)) if b]
        self._budget = max_iterations if max_iterations is not None else min(budgets, default=None)
        user_stop = getattr(stop, "user_stop", stop)  # executor.stopper(...) keeps the user's
        self._milestones = tune_milestones(self._base, user_stop, search_alg)

    @property
    def base(self) -> TrialScheduler:
        """The wrapped (user's) scheduler."""
        return self._base

    @property
    def budget(self) -> int | None:
        """Iterations per trial, when known."""
        return self._budget

    @property
    def milestones(self) -> Milestones:
        """Where the wrapped scheduler decides (read from it, ``stop`` and the search
        algorithm when the wrapper was built)."""
        # A wrapper pickled before milestones existed has none (not the base's attribute).
        return self.__dict__.get("_milestones", NONE)

    # Tune reads these on the scheduler it was given.
    @property
    def metric(self) -> Any:
        return self._base.metric

    @property
    def _metric(self) -> Any:  # type: ignore[override]
        return getattr(self._base, "_metric", None)

    @property
    def supports_buffered_results(self) -> bool:
        return self._base.supports_buffered_results

    def __getattr__(self, name: str) -> Any:
        # Anything else (e.g. PBT's internals a user inspects) comes from the base.
        if name.startswith("__") or name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)

    # ---------------------------------------------------------------- engine hints
    def _hint(self, trial: Any, done: int) -> None:
        if self._budget is not None:
            # ``done`` iterations reported; the next step is granted one more.
            registry.broadcast("set_remaining", trial.trial_id, max(0, self._budget - done - 1))
        if self.has_milestones:
            registry.broadcast("set_milestone", trial.trial_id, self.to_milestone(done))

    @property
    def has_milestones(self) -> bool:
        """Whether the wrapped scheduler has milestones in iterations (else no
        ``set_milestone`` is sent)."""
        m = self.milestones
        return bool(m.points) or m.every is not None

    def to_milestone(self, done: int) -> int | None:
        """Iterations from ``done`` completed ones to the next milestone; ``None`` past
        the last (or at the trial's budget: its end decides nothing that spares work)."""
        at = self.milestones.next_after(done)
        if at is None or (self._budget is not None and at >= self._budget):
            return None
        return at - done

    @staticmethod
    def _cancel(trial: Any) -> None:
        registry.broadcast("cancel", trial.trial_id)

    # --------------------------------------------------------- TrialScheduler API
    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        if metric is not None:
            self.__dict__["_run_metric"] = metric  # the run's metric (FIFO keeps none)
        return self._base.set_search_properties(metric, mode, **spec)

    def _check_loss_metric(self, result: dict[str, Any]) -> None:
        """Warn once when the run ranks a task's trials by ``loss`` (the engine's
        training loss) although the task has eval data: its result holds ``val_loss``.
        A function trainable's results are its own (no engine figures): its ``loss``
        is whatever it reports; so is a task's own metric named ``loss``."""
        if self.__dict__.get("_loss_warned") or "device_time_s" not in result:
            return
        metric = self.__dict__.get("_run_metric") or getattr(self._base, "metric", None)
        if ranks_training_loss(metric, result):
            self.__dict__["_loss_warned"] = True
            message = training_loss_ranked("the run's metric='loss'")
            logger.warning("tune_hydra: %s", message)
            warnings.warn(f"tune_hydra: {message}", UserWarning, stacklevel=2)

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        run_id = getattr(self, "_run_id", "")  # absent in a wrapper pickled before it
        if run_id:
            # Raising here ends tune.run / Tuner.fit before the trial starts.
            registry.check_trial_resources(run_id, trial)
        self._base.on_trial_add(tune_controller, trial)
        self._hint(trial, int(trial.last_result.get("training_iteration", 0) or 0))

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        self._cancel(trial)
        self._base.on_trial_error(tune_controller, trial)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        self._check_loss_metric(result)
        decision = self._base.on_trial_result(tune_controller, trial, result)
        if decision in (TrialScheduler.STOP, TrialScheduler.PAUSE):
            self._cancel(trial)
        elif decision == TrialScheduler.CONTINUE:
            self._hint(trial, int(result.get("training_iteration", 0) or 0))
        return decision

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> None:
        self._cancel(trial)
        self._base.on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        self._cancel(trial)
        self._base.on_trial_remove(tune_controller, trial)

    def choose_trial_to_run(self, tune_controller: Any) -> Any:
        return self._base.choose_trial_to_run(tune_controller)

    def debug_string(self) -> str:
        return self._base.debug_string()

    def save(self, checkpoint_path: str) -> None:
        self._base.save(checkpoint_path)

    def restore(self, checkpoint_path: str) -> None:
        self._base.restore(checkpoint_path)
