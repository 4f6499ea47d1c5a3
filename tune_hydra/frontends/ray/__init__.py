"""Ray Tune front end: :func:`run`, :class:`HydraExecutor` and :func:`patch_tune`.

Importing this package imports Ray but never torch; the engine (and torch) load in the
engine actors only.
"""

from __future__ import annotations

from tune_hydra.frontends.ray.errors import (
    EngineError,
    EngineStartError,
    EngineUnavailableError,
    InvalidExecutorError,
    MissingMetricError,
    NotATaskError,
    NotATaskFactoryError,
    NotOwnerError,
    SystematicTaskError,
    TaskFactoryError,
    TaskFactoryTimeoutError,
    TrialNotRegisteredError,
    TrialResourcesError,
    UncuttableModelError,
    UnreportedMetricError,
)
from tune_hydra.frontends.ray.executor import HydraExecutor
from tune_hydra.frontends.ray.patch import patch_tune, unpatch_tune
from tune_hydra.frontends.ray.run import run

__all__ = [
    "EngineError",
    "EngineStartError",
    "EngineUnavailableError",
    "HydraExecutor",
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
    "patch_tune",
    "run",
    "unpatch_tune",
]
