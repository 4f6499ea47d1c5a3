"""Errors raised by the Ray Tune front end (:mod:`tune_hydra.frontends.ray`).

They all derive from :class:`~tune_hydra.exceptions.TuneHydraError` and carry a message
that says how to fix the problem.
"""

from __future__ import annotations

from tune_hydra.exceptions import (
    InvalidTaskError,
    NotATaskError,
    SystematicTaskError,
    TaskFactoryError,
    TaskFactoryTimeoutError,
    TuneHydraError,
    UncuttableModelError,
)


class InvalidExecutorError(TuneHydraError, TypeError):
    """``trial_executor`` is not a :class:`~tune_hydra.HydraExecutor`."""


class NotATaskFactoryError(InvalidTaskError, TypeError):
    """``run_or_experiment`` is not a task factory ``make_task(config) -> ModelTask``."""


class MissingMetricError(TuneHydraError, ValueError):
    """A search algorithm or scheduler needs ``metric`` and ``mode`` but got none."""


class UnreportedMetricError(MissingMetricError):
    """``metric`` (of ``th.run``, its scheduler or its search algorithm) names a value that
    tune_hydra's trials never report; the message lists the ones they do."""


class TrialResourcesError(SystematicTaskError, InvalidExecutorError):
    """A trial of a :class:`~tune_hydra.HydraExecutor` does not hold an engine slot: its
    resource request was replaced (``tune.with_resources``, ``resources_per_trial``, a
    ``PlacementGroupFactory``), so trials would hold CPUs instead of slots and run one at
    a time."""


class EngineStartError(TuneHydraError, RuntimeError):
    """The engine actors could not be started (bad engine options, no node with the slot
    resource, ...)."""


class EngineUnavailableError(TuneHydraError, RuntimeError):
    """A trial could not reach the engine actor of its node, or the engine lost the trial
    (it restarted). Tune retries the trial from its last checkpoint when ``max_failures``
    allows."""


class TrialNotRegisteredError(EngineUnavailableError):
    """The engine does not know this trial (any more), e.g. after an engine restart or
    after a newer copy of the trial took it over."""


class NotOwnerError(TrialNotRegisteredError):
    """A call to an engine actor that does not carry the key of the experiment that
    started it (another experiment's driver on the same cluster, or a stale handle): it
    is refused and changes nothing."""


class EngineError(TuneHydraError, RuntimeError):
    """An engine error whose original type could not cross the process boundary; the
    message names the original type."""


__all__ = [
    "EngineError",
    "EngineStartError",
    "EngineUnavailableError",
    "InvalidExecutorError",
    "MissingMetricError",
    "NotATaskError",
    "NotATaskFactoryError",
    "NotOwnerError",
    "SystematicTaskError",
    "TaskFactoryError",
    "TaskFactoryTimeoutError",
    "TrialNotRegisteredError",
    "TrialResourcesError",
    "UncuttableModelError",
    "UnreportedMetricError",
]
