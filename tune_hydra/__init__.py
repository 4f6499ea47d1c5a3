"""tune_hydra: Hydra's shard parallelism for Ray Tune.

The engine (``ModelTask``, ``train_models``, ...) needs only torch; the Ray Tune front end
(``run``, ``HydraExecutor``, ``patch_tune``) is imported on first use, so
``import tune_hydra`` works where Ray is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tune_hydra import exceptions
from tune_hydra.exceptions import TuneHydraError

if TYPE_CHECKING:
    from tune_hydra.engine import Engine, ModelTask, plot_timeline, save_trace, train_plain
    from tune_hydra.frontends.lightning import HydraStrategy
    from tune_hydra.frontends.optuna import optimize
    from tune_hydra.frontends.ray import HydraExecutor, patch_tune, run, unpatch_tune
    from tune_hydra.frontends.shard import configure, shard, shard_count, unshard
    from tune_hydra.frontends.train import History, train_models
    from tune_hydra.planning import PlanReport, plan

__version__ = "0.1.0"

# Loaded on first use: the engine imports torch (a trial process of the Tune front end
# must not: it triples its memory), and the front end imports Ray (the engine alone must
# work where Ray is not installed).
_LAZY = {
    "Engine": "tune_hydra.engine",
    "History": "tune_hydra.frontends.train",
    "ModelTask": "tune_hydra.engine",
    "plot_timeline": "tune_hydra.engine",
    "save_trace": "tune_hydra.engine",
    "train_models": "tune_hydra.frontends.train",
    "train_plain": "tune_hydra.engine",
    "optimize": "tune_hydra.frontends.optuna",
    "HydraStrategy": "tune_hydra.frontends.lightning",
    "shard": "tune_hydra.frontends.shard",
    "shard_count": "tune_hydra.frontends.shard",
    "configure": "tune_hydra.frontends.shard",
    "unshard": "tune_hydra.frontends.shard",
    "plan": "tune_hydra.planning",
    "PlanReport": "tune_hydra.planning",
    "run": "tune_hydra.frontends.ray",
    "HydraExecutor": "tune_hydra.frontends.ray",
    "patch_tune": "tune_hydra.frontends.ray",
    "unpatch_tune": "tune_hydra.frontends.ray",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'tune_hydra' has no attribute {name!r}")


__all__ = [
    "Engine",
    "History",
    "HydraExecutor",
    "HydraStrategy",
    "ModelTask",
    "PlanReport",
    "TuneHydraError",
    "configure",
    "exceptions",
    "optimize",
    "patch_tune",
    "plan",
    "plot_timeline",
    "run",
    "save_trace",
    "shard",
    "shard_count",
    "train_models",
    "train_plain",
    "unpatch_tune",
    "unshard",
]
