"""Where a search decides: the milestones of the Tune scheduler or Optuna pruner a user
configured, for the milestone-first policy (:class:`~tune_hydra.core.policies.MilestonePolicy`).

A *milestone* is an iteration count at whose result the search can act on a trial: a
successive-halving rung, a median rule's report, a PBT perturbation, a pruner's step.
The end of a trial's budget is not one (nothing is decided there that could spare
work). :func:`tune_milestones` reads them from a Tune scheduler (and ``stop``),
:func:`optuna_milestones` from an Optuna pruner and sampler; both read the objects'
own attributes, import Ray / Optuna lazily and work when either is not installed. What
they do not know falls back to no milestones (``policy="auto"`` then resolves to LRTF)
with one log line.

Example:
    >>> from ray.tune.schedulers import ASHAScheduler
    >>> m = tune_milestones(ASHAScheduler(max_t=27, grace_period=1, reduction_factor=3))
    >>> m.points, m.next_after(0), m.next_after(3), m.next_after(9), m.search_aware
    ((1, 3, 9), 1, 9, None, True)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

HORIZON = 1_000_000
"""Iterations beyond which an unbounded geometric series of rungs is not listed."""

_ITERATION = "training_iteration"
# ``stop`` keys that only bound a trial's budget (a fixed budget, not early stopping).
_BUDGET_KEYS = frozenset({_ITERATION, "time_total_s", "timesteps_total", "episodes_total"})


@dataclass(frozen=True)
class Milestones:
    """A search's decision points, in iterations completed.

    Attributes:
        points: the listed decision points, ascending.
        start, every: besides ``points``, a decision point at ``start`` and every
            ``every`` iterations after it (``None``: none such).
        until: no periodic decision point at or past this (a trial's ``max_t``).
        early_stopping: the scheduler or pruner acts on results (stops, pauses or
            exploits trials).
        adaptive: the searcher learns from finished trials (TPE, GP, CMA-ES, BOHB...).
        startup_trials: how many trials must *finish* before the pruner prunes or the
            sampler models (Optuna's ``n_startup_trials``): the search also waits for
            those trials' ends.
        source: what they were read from, for the log and messages.
    """

    points: tuple[int, ...] = ()
    start: int | None = None
    every: int | None = None
    until: int | None = None
    early_stopping: bool = False
    adaptive: bool = False
    startup_trials: int = 0
    source: str = ""

    @property
    def search_aware(self) -> bool:
        """Whether results should come early (``policy="auto"`` picks the milestone
        policy): the run stops trials early or adapts its search."""
        return self.early_stopping or self.adaptive

    def next_after(self, iteration: int) -> int | None:
        """The first decision point after ``iteration`` completed iterations (``None``:
        none left: the trial is committed to its end)."""
        best = next((p for p in self.points if p > iteration), None)
        if self.start is not None and self.every is not None:
            k = max(0, -(-(iteration + 1 - self.start) // self.every))
            periodic = self.start + k * self.every
            if self.until is None or periodic < self.until:
                best = periodic if best is None else min(best, periodic)
        return best


NONE = Milestones(source="none")


def _unknown(what: object, kind: str) -> Milestones:
    log.info(
        "tune_hydra: %s %s is not known to tune_hydra's milestones: no milestones, "
        "policy='auto' runs lrtf",
        kind,
        type(what).__name__,
    )
    return Milestones(source=f"unknown {kind} {type(what).__name__}")


def _iterations(value: float) -> int:
    """The first iteration count at which ``result >= value`` holds."""
    return max(1, math.ceil(value - 1e-9))


def _geometric(first: float, factor: float, below: float | None, shift: int = 0) -> list[int]:
    out: list[int] = []
    r = first
    limit = HORIZON if below is None else below
    while r < limit and len(out) < 64:
        out.append(_iterations(r) + shift)
        r *= factor
    return out


# --- Ray Tune ------------------------------------------------------------------------------


def tune_milestones(scheduler: Any, stop: Any = None, search_alg: Any = None) -> Milestones:
    """The milestones of a Tune run: its ``scheduler``, ``stop`` and ``search_alg``.

    Read: ``ASHAScheduler`` / ``AsyncHyperBandScheduler`` (every bracket's rungs below
    ``max_t``), ``HyperBandScheduler`` / ``HyperBandForBOHB`` (every bracket's
    successive-halving points), ``MedianStoppingRule`` (each result from
    ``grace_period`` on), ``PopulationBasedTraining`` (every ``perturbation_interval``
    past ``burn_in_period``), ``ResourceChangingScheduler`` and tune_hydra's
    ``HydraScheduler`` (the scheduler they wrap), ``FIFOScheduler`` or ``None`` (none).
    A ``time_attr`` other than ``training_iteration`` has no iteration milestones
    (early stopping still counts). ``stop`` bounds the budget (``training_iteration``
    and the like: a fixed budget) or, with a metric, a callable or a ``Stopper``, may
    end a trial on its results (early stopping, at no known milestone). A
    ``search_alg`` other than Tune's default random/grid generator is adaptive.

    Args:
        scheduler: the ``tune.TuneConfig(scheduler=...)`` object, or ``None``.
        stop: the ``RunConfig(stop=...)`` value, or ``None``.
        search_alg: the ``tune.TuneConfig(search_alg=...)`` object, or ``None``.

    Returns:
        The milestones; an unknown scheduler gives none (one log line).
    """
    base = _tune_scheduler(scheduler)
    stops_early, until = _tune_stop(stop)
    adaptive = _adaptive_search_alg(search_alg)
    until = base.until if base.until is not None else until
    return Milestones(
        base.points,
        base.start,
        base.every,
        until,
        base.early_stopping or stops_early,
        base.adaptive or adaptive,
        base.startup_trials,
        base.source,
    )


def _tune_scheduler(scheduler: Any) -> Milestones:
    if scheduler is None:
        return Milestones(source="FIFOScheduler")
    try:
        import ray.tune.schedulers as s
    except ImportError:  # Ray missing: nothing of Ray's can be read
        return _unknown(scheduler, "scheduler")
    if _is_hydra_scheduler(scheduler):
        return _tune_scheduler(scheduler.base)
    if isinstance(scheduler, s.ResourceChangingScheduler):
        return _tune_scheduler(scheduler._base_scheduler)
    name = type(scheduler).__name__
    if type(scheduler) is s.FIFOScheduler:
        return Milestones(source=name)
    if isinstance(scheduler, s.AsyncHyperBandScheduler):
        if not _iteration_time(scheduler, name):
            return Milestones(early_stopping=True, source=name)
        max_t = scheduler._max_t
        rungs = {r for b in scheduler._brackets for r, _ in b._rungs}
        points = sorted({_iterations(r) for r in rungs if r < max_t})
        return Milestones(tuple(points), until=max_t, early_stopping=True, source=name)
    if isinstance(scheduler, s.HyperBandScheduler):  # HyperBandForBOHB too
        bohb = isinstance(scheduler, s.HyperBandForBOHB)
        if not _iteration_time(scheduler, name):
            return Milestones(early_stopping=True, adaptive=bohb, source=name)
        max_t, eta = scheduler._max_t_attr, scheduler._eta
        hb_points: set[int] = set()
        for bracket in range(scheduler._s_max_1):
            r = int(max_t * eta ** (-bracket))
            for _ in range(bracket):  # each halving decides at the bracket's current r
                if r >= max_t:
                    break
                hb_points.add(_iterations(r))
                r = int(min(r * eta, max_t))
        return Milestones(
            tuple(sorted(hb_points)), until=max_t, early_stopping=True, adaptive=bohb, source=name
        )
    if isinstance(scheduler, s.MedianStoppingRule):
        if not _iteration_time(scheduler, name):
            return Milestones(early_stopping=True, source=name)
        start = _iterations(scheduler._grace_period)
        return Milestones(start=start, every=1, early_stopping=True, source=name)
    if isinstance(scheduler, s.PopulationBasedTraining):  # PB2 too
        if not _iteration_time(scheduler, name):
            return Milestones(early_stopping=True, source=name)
        every = _iterations(scheduler._perturbation_interval)
        first = _iterations(max(scheduler._perturbation_interval, scheduler._burn_in_period))
        return Milestones(start=first, every=every, early_stopping=True, source=name)
    return _unknown(scheduler, "scheduler")


def _is_hydra_scheduler(scheduler: Any) -> bool:
    return type(scheduler).__name__ == "HydraScheduler" and type(scheduler).__module__.startswith(
        "tune_hydra."
    )


def _iteration_time(scheduler: Any, name: str) -> bool:
    attr = getattr(scheduler, "_time_attr", _ITERATION)
    if attr == _ITERATION:
        return True
    log.info(
        "tune_hydra: %s decides on time_attr=%r, not %r: its milestones are not known in "
        "iterations (the policy still serves it early results where it can)",
        name,
        attr,
        _ITERATION,
    )
    return False


def _tune_stop(stop: Any) -> tuple[bool, int | None]:
    """(whether ``stop`` may end a trial on its results, its iteration budget)."""
    if stop is None:
        return False, None
    if isinstance(stop, Mapping):
        until = stop.get(_ITERATION)
        budget = int(until) if isinstance(until, (int, float)) and until > 0 else None
        return bool(set(stop) - _BUDGET_KEYS), budget
    try:
        from ray.tune.stopper import MaximumIterationStopper
    except ImportError:  # Ray missing: a Stopper of Ray's cannot be here
        return True, None
    if isinstance(stop, MaximumIterationStopper):
        return False, int(stop._max_iter)
    return True, None  # a callable or a Stopper: it may end any trial on its results


def _adaptive_search_alg(search_alg: Any) -> bool:
    if search_alg is None:
        return False
    try:
        from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter
    except ImportError:
        return True
    if isinstance(search_alg, ConcurrencyLimiter):
        return _adaptive_search_alg(search_alg.searcher)
    return not isinstance(search_alg, BasicVariantGenerator)


# --- Optuna --------------------------------------------------------------------------------


def optuna_milestones(pruner: Any, sampler: Any = None) -> Milestones:
    """The milestones of an Optuna study run by ``th.optimize``: its ``pruner`` and
    ``sampler`` (pass ``study.pruner`` and ``study.sampler``).

    ``th.optimize`` reports epoch ``e`` as step ``e - 1``, so a pruner's step ``s`` is
    decided after iteration (epoch) ``s + 1``. Read: ``MedianPruner`` /
    ``PercentilePruner`` / ``ThresholdPruner`` (step ``n_warmup_steps`` and every
    ``interval_steps`` after), ``SuccessiveHalvingPruner`` (rungs ``min_resource x
    reduction_factor**(min_early_stopping_rate + k)``; ``min_resource="auto"``, known only
    once a trial completes, is taken as 1: Optuna derives it from a completed trial's
    steps / 100), ``HyperbandPruner`` (the union of its brackets' rungs, below
    ``max_resource``), ``PatientPruner`` (its wrapped pruner's, every step without
    one), ``WilcoxonPruner`` (every step from ``n_startup_steps``), ``NopPruner`` or
    ``None`` (none). Samplers with ``n_startup_trials`` (TPE, GP, CMA-ES) and NSGA-II
    adapt; random, grid, QMC and brute-force samplers do not.

    Args:
        pruner: the study's pruner, or ``None``.
        sampler: the study's sampler, or ``None``.

    Returns:
        The milestones; an unknown pruner gives none, an unknown sampler is taken as not
        adaptive (one log line each).
    """
    base = _optuna_pruner(pruner)
    adaptive, sampler_startup = _optuna_sampler(sampler)
    return Milestones(
        base.points,
        base.start,
        base.every,
        base.until,
        base.early_stopping,
        adaptive,
        max(base.startup_trials, sampler_startup),
        base.source + (f" + {type(sampler).__name__}" if sampler is not None else ""),
    )


def _optuna_pruner(pruner: Any) -> Milestones:
    if pruner is None:
        return Milestones(source="no pruner")
    try:
        import optuna.pruners as p
    except ImportError:  # Optuna missing: nothing of Optuna's can be read
        return _unknown(pruner, "pruner")
    name = type(pruner).__name__
    if isinstance(pruner, p.NopPruner):
        return Milestones(source=name)
    if isinstance(pruner, (p.MedianPruner, p.PercentilePruner)):  # Median is a Percentile
        start = pruner._n_warmup_steps + 1
        return Milestones(
            start=start,
            every=pruner._interval_steps,
            early_stopping=True,
            startup_trials=pruner._n_startup_trials,
            source=name,
        )
    if isinstance(pruner, p.ThresholdPruner):
        start = pruner._n_warmup_steps + 1
        return Milestones(
            start=start, every=pruner._interval_steps, early_stopping=True, source=name
        )
    if isinstance(pruner, p.SuccessiveHalvingPruner):
        first = pruner._min_resource if isinstance(pruner._min_resource, (int, float)) else 1
        first *= pruner._reduction_factor**pruner._min_early_stopping_rate
        points = _geometric(first, pruner._reduction_factor, None, shift=1)
        return Milestones(tuple(points), early_stopping=True, source=name)
    if isinstance(pruner, p.HyperbandPruner):
        top = pruner._max_resource if isinstance(pruner._max_resource, (int, float)) else None
        points = _geometric(pruner._min_resource, pruner._reduction_factor, top, shift=1)
        return Milestones(tuple(points), early_stopping=True, source=name)
    if isinstance(pruner, p.PatientPruner):
        inner = pruner._wrapped_pruner
        if inner is None:
            return Milestones(start=1, every=1, early_stopping=True, source=name)
        m = _optuna_pruner(inner)
        return Milestones(
            m.points,
            m.start,
            m.every,
            m.until,
            m.early_stopping,
            m.adaptive,
            m.startup_trials,
            f"{name}({m.source})",
        )
    if isinstance(pruner, p.WilcoxonPruner):
        start = pruner._n_startup_steps + 1
        return Milestones(start=start, every=1, early_stopping=True, source=name)
    return _unknown(pruner, "pruner")


def _optuna_sampler(sampler: Any) -> tuple[bool, int]:
    """(whether ``sampler`` adapts to results, its startup trials)."""
    if sampler is None:
        return False, 0
    try:
        import optuna.samplers as s
    except ImportError:
        return False, 0
    startup = getattr(sampler, "_n_startup_trials", None)
    if isinstance(sampler, (s.TPESampler, s.GPSampler, s.CmaEsSampler)):
        return True, int(startup or 0)
    if isinstance(sampler, s.NSGAIISampler):
        return True, int(getattr(sampler, "_population_size", 0) or 0)
    if isinstance(sampler, (s.RandomSampler, s.GridSampler, s.QMCSampler, s.BruteForceSampler)):
        return False, 0
    log.info(
        "tune_hydra: sampler %s is not known to tune_hydra's milestones: taken as not adaptive",
        type(sampler).__name__,
    )
    return False, 0


__all__ = ["HORIZON", "NONE", "Milestones", "optuna_milestones", "tune_milestones"]
