"""Errors raised by the Ray Tune front end (:mod:`tune_hydra.frontends.ray`).

They all derive from :class:`~tune_hydra.exceptions.TuneHydraError` and carry a message
that says how to fix the problem.
"""

from __future__ import annotations

from typing import Any

from tune_hydra.exceptions import (
    EngineError,
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


class NoShardError(SystematicTaskError):
    """A function trainable run by a :class:`~tune_hydra.HydraExecutor` reported without
    ever calling ``th.shard``: it trained plainly, one trial at a time, beside the engine."""


class TrialFunctionError(TuneHydraError, RuntimeError):
    """A function trainable raised in its engine process (the message holds its
    traceback); the other trials go on."""


class ReportThreadError(TuneHydraError, RuntimeError):
    """``tune.report`` (or another Tune session call) from a thread that the trial's
    function started: under a :class:`~tune_hydra.HydraExecutor` each trial's session
    belongs to the thread that runs its function."""


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


RETRY = "Tune retries this trial from its last checkpoint if max_failures allows"
"""What becomes of a trial that lost its engine (said in every such message)."""


def engine_lost(node_id: str, what: str, *, then: str = "", ray_said: Any = None) -> str:
    """The message of a trial whose node's engine actor ``what`` (``"died during its
    'train' call (...)"``): where the engine's log is, what Tune does about it, ``then``
    (what else to do) and what Ray said (``ray_said``: its error, first line)."""
    text = (
        f"the tune_hydra engine actor of this trial's node ({node_id}) {what}; its log is in "
        f"Ray's session folder (logs/worker-*.err). {RETRY}{then}."
    )
    if ray_said is not None:
        said = str(ray_said).splitlines()[0] if str(ray_said) else type(ray_said).__name__
        text += f" Ray said: {said}"
    return text


def no_slot(
    trial: str, asks: str, slot: str, replaced_by: str, reserves: Any
) -> TrialResourcesError:
    """The error for a trial whose resource request holds no engine slot ``slot``.

    Args:
        trial: the trial id.
        asks: what it asks for instead, in words.
        slot: the slot resource.
        replaced_by: what may have replaced its request.
        reserves: what a trial of ``executor.trainable(...)`` reserves.
    """
    return TrialResourcesError(
        trial,
        f"{asks} and no {slot!r}: its resource request was replaced ({replaced_by}), so "
        f"trials would hold CPUs instead of engine slots and run one at a time",
        f"Pass executor.trainable(make_task) to Tune without tune.with_resources: it already "
        f"reserves {reserves} per trial, and the models train on the engine's devices (size "
        f"them with HydraExecutor(devices=..., device_memory=...))",
    )


__all__ = [
    "RETRY",
    "EngineError",
    "EngineStartError",
    "EngineUnavailableError",
    "InvalidExecutorError",
    "MissingMetricError",
    "NoShardError",
    "NotATaskError",
    "NotATaskFactoryError",
    "NotOwnerError",
    "ReportThreadError",
    "SystematicTaskError",
    "TaskFactoryError",
    "TaskFactoryTimeoutError",
    "TrialFunctionError",
    "TrialNotRegisteredError",
    "TrialResourcesError",
    "UncuttableModelError",
    "UnreportedMetricError",
    "engine_lost",
    "no_slot",
]
