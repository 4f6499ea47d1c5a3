"""The executors started in this driver process, and the calls that reach their engines.

The scheduler wrapper and the callback are pickled by Tune/Tuner and must not hold actor
handles: they find the engines here, by the executor's ``run_id``. This module does not
import the executor (which registers itself here), so neither of them imports the other.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import TYPE_CHECKING, Any, Protocol

from tune_hydra.frontends.ray.errors import no_slot

if TYPE_CHECKING:
    from tune_hydra.frontends.ray.engines import EngineFleet

logger = logging.getLogger(__name__)


class Registered(Protocol):
    """What this registry reads of a started
    :class:`~tune_hydra.frontends.ray.executor.HydraExecutor` (a protocol, so that this
    module needs no import of the executor, not even for type checking)."""

    run_id: str
    _engines: EngineFleet
    _secret: str

    @property
    def slot_resource(self) -> str: ...

    @property
    def trial_resources(self) -> dict[str, float]: ...


_ACTIVE: dict[str, Registered] = {}
_ACTIVE_LOCK = threading.Lock()
_WARNED_CPU: set[str] = set()  # run ids already warned about trials reserving CPUs


def register(executor: Registered) -> None:
    """Make ``executor`` (started) reachable by its ``run_id``."""
    with _ACTIVE_LOCK:
        _ACTIVE[executor.run_id] = executor


def unregister(run_id: str) -> None:
    """Forget the executor of ``run_id`` (shut down); nothing if it is not registered."""
    with _ACTIVE_LOCK:
        _ACTIVE.pop(run_id, None)


def active(run_id: str) -> Registered | None:
    """The started executor of ``run_id``, or None."""
    with _ACTIVE_LOCK:
        return _ACTIVE.get(run_id)


def _executors() -> list[Registered]:
    with _ACTIVE_LOCK:
        return list(_ACTIVE.values())


def broadcast(method: str, key: str, *args: Any) -> None:
    """Fire-and-forget ``method(key, secret, *args)`` on every engine actor of every active
    executor, each call carrying its own executor's secret (the engine actors refuse
    driver-side calls without it)."""
    for ex in _executors():
        for handle in ex._engines.handles.values():
            try:
                getattr(handle, method).remote(key, ex._secret, *args)
            except Exception:  # a dead actor must not break Tune's event loop
                logger.debug("tune_hydra: %s on an engine actor failed", method, exc_info=True)


def abort_builds() -> None:
    """Fire-and-forget: every engine of every active executor stops waiting for the task
    factories still running (the driver is being interrupted). Safe in a signal handler:
    it only submits calls."""
    for ex in _executors():
        for handle in ex._engines.handles.values():
            try:
                handle.abort_builds.remote(ex._secret)
            except Exception:  # interrupted anyway: nothing more to do
                logger.debug("tune_hydra: abort_builds on an engine actor failed", exc_info=True)


def check_trial_resources(run_id: str, trial: Any) -> None:
    """Refuse, when Tune adds it, a trial of executor ``run_id`` whose resource request
    holds no engine slot (``tune.with_resources`` around ``executor.trainable(...)``);
    warn once when trials reserve CPUs beside their slot.

    Raises:
        TrialResourcesError: the trial would hold CPUs instead of a slot.
    """
    ex = active(run_id)
    if ex is None or ex._engines.fallback:
        return
    pgf = getattr(trial, "placement_group_factory", None)
    if pgf is None:
        return
    required = dict(pgf.required_resources)
    slot = ex.slot_resource
    if required.get(slot, 0) < 1:
        from tune_hydra.frontends.ray.trainable import HydraTrainable

        try:
            cls = trial.get_trainable_cls()
        except Exception:  # not registered (yet): the proxy checks when it runs
            return
        if not (isinstance(cls, type) and issubclass(cls, HydraTrainable)):
            return
        raise no_slot(
            trial.trial_id,
            f"the trainable asks for {required} per trial",
            slot,
            "tune.with_resources around executor.trainable(...), or a PlacementGroupFactory",
            ex.trial_resources,
        )
    if required.get("CPU", 0) > 0 and run_id not in _WARNED_CPU:
        _WARNED_CPU.add(run_id)
        warnings.warn(
            f"tune_hydra: each trial reserves {required['CPU']:g} CPU beside its {slot!r}, "
            f"although it computes nothing (its model trains in the engine): concurrent "
            f"trials are limited by CPUs. Drop the CPUs from tune.with_resources",
            stacklevel=2,
        )


__all__ = ["abort_builds", "active", "broadcast", "check_trial_resources", "register", "unregister"]
