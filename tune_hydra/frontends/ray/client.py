"""What a proxy trainable (the process Tune runs for a trial) needs to reach its node's
engine actor: :class:`EngineClient`, shared by every proxy kind, and the
``tune.with_parameters`` references it keeps (:func:`with_parameters_refs`).

The module must not import torch (directly or through the engine): each trial is a Ray
worker process, and torch would triple its memory.
"""

from __future__ import annotations

import logging
import time
import types
from typing import Any, ClassVar

import ray
from ray.tune.registry import _ParameterRegistry

from tune_hydra.exceptions import SystematicTaskError, TuneHydraError
from tune_hydra.frontends.ray.errors import EngineUnavailableError, engine_lost, no_slot
from tune_hydra.frontends.ray.factories import FactoryStore, closure
from tune_hydra.frontends.ray.names import engine_actor_name

logger = logging.getLogger(__name__)

_CONTROL_RETRY_S = 60.0  # how long a control call waits for a restarting engine actor


def with_parameters_refs(cls: type) -> dict[str, Any] | None:
    """The object references of ``tune.with_parameters(trainable, **params)`` when
    ``cls`` is the subclass that Tune made (its ``setup`` fetches the parameters from the
    object store and passes them on), else None.

    Tune keeps the parameters in Ray's object store and gives the class a ``setup`` that
    fetches every one of them in every trial process. A tune_hydra trial computes
    nothing, so it keeps the references instead and the engine fetches them once.
    """
    setup = cls.__dict__.get("setup")
    if not isinstance(setup, types.FunctionType) or not setup.__module__.startswith("ray."):
        return None
    cells = closure(setup)
    registry, prefix, keys = cells.get("parameter_registry"), cells.get("prefix"), cells.get("keys")
    if not isinstance(registry, _ParameterRegistry) or not isinstance(prefix, str):
        return None
    if not isinstance(keys, (set, frozenset, list, tuple)):
        return None
    refs = {str(k): registry.references.get(prefix + str(k)) for k in keys}
    if not all(isinstance(ref, ray.ObjectRef) for ref in refs.values()):
        return None  # not in the object store yet: Tune's own setup will fetch them
    return refs


class EngineClient:
    """What a proxy trial needs to call its node's engine actor (shared by the class
    trainables' proxy of :mod:`tune_hydra.frontends.ray.classes`, task factories' included,
    and the function trainables' proxy of :mod:`tune_hydra.frontends.ray.function`).

    Class attributes (set on the subclass): ``_factory_id`` (the id of what the executor
    stored in the cluster: only the engine actors load it), ``_run_id`` (the executor's
    id, part of the engine actors' names), ``_secret`` (the experiment's secret: it comes
    with the class, never in a name, a key or the config), ``_slot_resource`` (the
    engine-slot resource every trial holds; ``""``: none), ``_param_refs`` (the references
    of ``tune.with_parameters`` around the class, set here when Tune subclasses it).
    Instances have ``_actor`` (None until the first call) and ``_slot_checked``, and are
    Tune trainables (``trial_id``, ``trial_resources``).

    ``_reuse_process``: Tune keeps a proxy's process for the next trial
    (``reuse_actors=True``, set by :func:`~tune_hydra.frontends.ray.run.run` and
    :func:`~tune_hydra.frontends.ray.run.tuner_configs`). The user's code does not run in
    it (a task factory or function runs in the engine actor, a fresh call each trial), so
    a new process a trial would cost only time: ~2 core-s to start and import Tune. Class
    Trainables keep the run's own ``reuse_actors``: there it decides whether the user's
    ``reset_config`` is called.
    """

    _factory_id: ClassVar[str] = ""
    _run_id: ClassVar[str] = ""
    _secret: ClassVar[str] = ""
    _slot_resource: ClassVar[str] = ""
    _param_refs: ClassVar[dict[str, Any]] = {}
    _reuse_process: ClassVar[bool] = True
    _actor: Any = None
    _slot_checked: bool = False
    trial_id: str
    trial_resources: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refs = with_parameters_refs(cls)
        if refs is None:
            return
        # tune.with_parameters(executor.trainable(...), data=...): keep the references
        # (the engine fetches them once) instead of letting Tune's setup fetch the data
        # into every trial process, and give the class back the proxy's own setup: that
        # of the proxy class deriving from this mixin (HydraClassTrainable,
        # HydraFunctionTrainable), which keeps the references in ``_params``.
        proxy = next(c for c in cls.__mro__ if EngineClient in c.__bases__)
        cls._param_refs = {**cls._param_refs, **refs}
        cls.setup = proxy.__dict__["setup"]  # type: ignore[attr-defined]

    def _engine(self) -> Any:
        if self._actor is None:
            node_id = ray.get_runtime_context().get_node_id()
            name = engine_actor_name(self._run_id, node_id)
            try:
                self._actor = ray.get_actor(name)
            except ValueError:
                raise EngineUnavailableError(self._no_engine_message(node_id)) from None
        return self._actor

    def _no_engine_message(self, node_id: str) -> str:
        try:
            live = FactoryStore(self._run_id, self._secret).get(self._factory_id) is not None
        except TuneHydraError:  # replaced by someone else: still stored, so live
            live = True
        if live:
            # The experiment is live (its factory is stored): the engine died for good.
            return engine_lost(
                node_id,
                "is dead and was not restarted (killed, out of memory, or its node failed)",
                then="; restart the experiment with Tuner.restore(..., resume_errored=True) "
                "otherwise",
            )
        return (
            f"no tune_hydra engine actor on this trial's node ({node_id}): its "
            f"HydraExecutor was shut down (th.run returned, or its with-block ended) or "
            f"released this trainable. Run trials through th.run(...), or "
            f"executor.trainable(...) while the executor is started."
        )

    def _call(self, method: str, *args: Any, retry: bool = True) -> Any:
        """Call an engine-actor method and wait; control calls wait out an actor restart.
        A systematic error (see :class:`~tune_hydra.exceptions.SystematicTaskError`) is
        raised as itself, so the driver recognises it and ends the experiment."""
        deadline = time.monotonic() + _CONTROL_RETRY_S
        while True:
            try:
                return ray.get(getattr(self._engine(), method).remote(*args))
            except ray.exceptions.RayTaskError as err:
                cause = getattr(err, "cause", None)
                if isinstance(cause, SystematicTaskError):
                    raise cause from None
                raise
            except ray.exceptions.ActorUnavailableError as err:
                if retry and time.monotonic() <= deadline:
                    time.sleep(0.5)
                    continue
                node_id = ray.get_runtime_context().get_node_id()
                raise EngineUnavailableError(
                    engine_lost(
                        node_id,
                        f"became unreachable during its {method!r} call (it died and is "
                        f"restarting, or its node is failing): the trial's state there is lost",
                        ray_said=err,
                    )
                ) from None
            except ray.exceptions.ActorDiedError as err:
                node_id = ray.get_runtime_context().get_node_id()
                raise EngineUnavailableError(
                    engine_lost(
                        node_id,
                        f"died during its {method!r} call (killed, out of memory, or its node "
                        f"failed)",
                        ray_said=err,
                    )
                ) from None

    def _record(self, err: SystematicTaskError) -> None:
        """Record ``err`` for the driver, which then ends the experiment once (plain
        JSON in the cluster store: it never unpickles what a trial process wrote)."""
        try:
            FactoryStore(self._run_id, self._secret).record_error(self.trial_id, err)
        except Exception:
            logger.warning("tune_hydra: could not record %s", err, exc_info=True)

    def _check_slot(self) -> None:
        """Refuse to run without an engine slot: the trainable's resource request was
        replaced (``tune.with_resources``, ``resources_per_trial``), so the trials hold
        CPUs instead of slots and run one at a time."""
        if self._slot_checked or not self._slot_resource:
            return
        required = getattr(self.trial_resources, "required_resources", None)
        if required is None:  # not a placement group request: nothing to tell
            self._slot_checked = True
            return
        held = dict(required)
        if held.get(self._slot_resource, 0) < 1:
            raise no_slot(
                self.trial_id,
                f"this trial reserves {held or 'no resources'}",
                self._slot_resource,
                "tune.with_resources, resources_per_trial or a PlacementGroupFactory",
                {"cpu": 0, self._slot_resource: 1},
            )
        self._slot_checked = True


__all__ = ["EngineClient", "with_parameters_refs"]
