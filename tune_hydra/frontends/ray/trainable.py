"""The proxy :class:`~ray.tune.Trainable` that Tune runs for each trial.

It holds no model: every call is forwarded to the engine actor of its node, which trains
all trials of that node together. The module must not import torch (directly or through the
engine): each trial is a Ray worker process, and torch would triple its memory.

Registration with the engine is *lazy* (first ``step`` or ``load_checkpoint``) and carries
an ownership token: with PBT and ``reuse_actors=True`` Tune may build an extra actor for a
trial and throw it away, and an eager ``setup``/``cleanup`` pair would clobber the live
trial's registration. ``reset()`` changes ``trial_id`` before ``reset_config`` runs, so the
key we registered under is remembered separately.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import types
import uuid
from typing import Any, ClassVar

import ray
from ray import tune
from ray.tune.registry import _ParameterRegistry
from ray.tune.result import SHOULD_CHECKPOINT

from tune_hydra.exceptions import (
    SystematicTaskError,
    TuneHydraError,
    UndeclaredMetricError,
)
from tune_hydra.frontends.checkpoint import (
    check_checkpoint_files,
    discard_partial_save,
    not_a_folder,
)
from tune_hydra.frontends.common import REPORTED, declare_metric, task_reports, trial_result
from tune_hydra.frontends.ray.errors import (
    EngineUnavailableError,
    engine_lost,
    no_slot,
)
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


def _checkpoint_listing(checkpoint: Any) -> tuple[str, list[str]] | None:
    """``(folder, names of its entries)`` of what Ray's ``Trainable.restore`` is given (a
    path, a ``tune.Checkpoint`` or a training result holding one), listed on the
    checkpoint's own file system (local, NFS, cloud); None when there is nothing to list
    (Ray then raises its own error)."""
    ckpt = checkpoint if isinstance(checkpoint, tune.Checkpoint) else None
    if ckpt is None and isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        return (path, os.listdir(path)) if os.path.isdir(path) else None
    if ckpt is None:
        ckpt = getattr(checkpoint, "checkpoint", None)
    if not isinstance(ckpt, tune.Checkpoint):
        return None
    import pyarrow.fs

    fs = ckpt.filesystem
    if fs is None:
        return None
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(ckpt.path))
    except (FileNotFoundError, OSError):
        return None  # gone: Ray says so
    return ckpt.path, [info.base_name for info in infos]


class EngineClient:
    """What a proxy trial needs to call its node's engine actor (shared by the task
    factories' :class:`HydraTrainable` and the function trainables' proxy of
    :mod:`tune_hydra.frontends.ray.function`).

    Class attributes (set on the subclass): ``_factory_id``, ``_run_id``, ``_secret``,
    ``_slot_resource`` (see :class:`HydraTrainable`), ``_param_refs`` (the references
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
        # of the proxy class deriving from this mixin (HydraTrainable,
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


class HydraTrainable(EngineClient, tune.Trainable):
    """Proxy trainable; :meth:`HydraExecutor.trainable` makes a subclass per task factory.

    Class attributes (set on the subclass):
        _factory_id: the id of the task factory the executor stored in the cluster (see
            :mod:`tune_hydra.frontends.ray.factories`): only the engine actors load the factory, so
            neither its bytes nor its imports (torch ...) ever reach a trial process.
        _run_id: the executor's id (part of the engine actors' names).
        _secret: the experiment's secret (see :class:`~tune_hydra.HydraExecutor`): a
            registration must present it, and the systematic-error records a trial writes
            are tagged with it. It comes with the class (which Tune pickles into the
            trial processes and its registry), never in a name, a key or the config.
        _slot_resource: the engine-slot resource every trial must hold (``""``: none,
            when Ray was started without slots).
        _checkpoint: ``"every"`` asks Tune for a checkpoint after every iteration (the
            ``should_checkpoint`` result); ``"end"`` and None leave it to the run (the
            executor's callback asks for the last one with ``"end"``).
        _param_refs: the object references of ``tune.with_parameters`` around this
            class, passed to the factory as keyword arguments (see
            :func:`with_parameters_refs`).
        _required_metrics: metric names of the run (its ``metric``, its scheduler's or
            search algorithm's) that only a task's ``metrics`` can give; a trial whose
            task does not declare them fails with the systematic
            :class:`~tune_hydra.exceptions.UndeclaredMetricError` (set by ``th.run``).
    """

    _factory_id: ClassVar[str] = ""
    _run_id: ClassVar[str] = ""
    _secret: ClassVar[str] = ""
    _slot_resource: ClassVar[str] = ""
    _checkpoint: ClassVar[str | None] = None
    _required_metrics: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def for_factory(
        cls,
        name: str,
        *,
        factory_id: str,
        run_id: str,
        secret: str,
        slot_resource: str,
        checkpoint: str | None,
    ) -> type[HydraTrainable]:
        """The proxy class of one stored task factory (see the class attributes)."""
        return type(
            f"Hydra_{name}",
            (cls,),
            {
                "_factory_id": factory_id,
                "_run_id": run_id,
                "_secret": secret,
                "_slot_resource": slot_resource,
                "_checkpoint": checkpoint,
                "__module__": cls.__module__,
            },
        )

    def setup(self, config: dict[str, Any], **params: Any) -> None:
        """Remember the trial's parameters; registration with the engine is lazy.

        Args:
            config: the trial's config.
            **params: values from ``tune.with_parameters`` that Tune fetched into this
                process (only when their references could not be kept; they then travel
                to the engine with each registration).
        """
        self._token = uuid.uuid4().hex
        self._key: str | None = None  # the trial id we are registered under
        self._actor: Any = None
        self._num_shards: int | None = None
        self._params: dict[str, Any] = {**self._param_refs, **params}
        if params:
            logger.warning(
                "tune_hydra: the tune.with_parameters values %s were fetched into this "
                "trial process and are sent to the engine with each registration; wrap "
                "the task factory instead (executor.trainable(tune.with_parameters("
                "make_task, ...))) to keep them in the object store",
                sorted(params),
            )
        self._slot_checked = False
        self._metric_names: tuple[str, ...] = ()  # the task's own metrics, once registered

    def _ensure_registered(self) -> None:
        try:
            self._register()
        except SystematicTaskError as err:
            # For the driver, which then ends the experiment once (plain JSON in the
            # cluster store: it never unpickles what a trial process wrote).
            try:
                FactoryStore(self._run_id, self._secret).record_error(self.trial_id, err)
            except Exception:
                logger.warning("tune_hydra: could not record %s", err, exc_info=True)
            raise

    def _register(self) -> None:
        if self._key == self.trial_id:
            return
        self._check_slot()
        self._deregister()
        self._num_shards = int(
            self._call(
                "register",
                self.trial_id,
                self._token,
                self._factory_id,
                self.config,
                self._params,
                self._secret,
            )
        )
        self._key = self.trial_id
        self._metric_names = tuple(self._call("task_metrics", self.trial_id, self._token))
        reported = task_reports(self._metric_names)
        missing = [m for m in self._required_metrics if m not in reported]
        if missing:
            declared = list(self._metric_names) or "none"
            raise UndeclaredMetricError(
                self.trial_id,
                f"the experiment optimises {', '.join(map(repr, missing))}, which the trials "
                f"do not report: the task's metrics are {declared}, and the engine reports "
                f"{REPORTED}",
                f"Declare it in make_task: {declare_metric(missing[0])}, or optimise a metric "
                f"the trials report (metric='val_loss', mode='min')",
            )

    def _deregister(self) -> None:
        key, self._key = self._key, None
        if key is not None and self._actor is not None:
            # If the engine is gone or restarted, there is nothing left to free there.
            with contextlib.suppress(Exception):
                self._call("deregister", key, self._token, retry=False)

    # ------------------------------------------------------------ Trainable API
    def step(self) -> dict[str, Any]:
        self._ensure_registered()
        # No retry: if the engine restarted mid-iteration, the trial's state there is gone
        # and Tune must restore it from its checkpoint.
        results = self._call("train", self._key, self._token, 1, retry=False)
        out = trial_result(results[-1], self._metric_names, num_shards=self._num_shards)
        if self._checkpoint == "every":
            out[SHOULD_CHECKPOINT] = True  # Tune saves one now (HydraExecutor(checkpoint=))
        return out

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Have the engine actor write the trial's checkpoint into ``checkpoint_dir``.

        The engine actor is on this node, so it writes the files straight into the
        directory: no model bytes pass through this process. If the save fails (the engine
        died mid-save, the disk is full ...), what it left is removed here, since a killed
        engine cannot: its temp files, and the directory itself when Tune's
        ``Trainable.save`` made it for this save in the temp folder (Ray 2.60 removes that
        directory only after a successful save).
        """
        before = set(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else set()
        try:
            self._ensure_registered()
            self._call("save", self._key, self._token, str(checkpoint_dir))
        except Exception:
            # tempfile.mkdtemp() of Trainable.save: a fresh "tmp..." folder in the temp dir
            folder, name = os.path.split(os.path.abspath(checkpoint_dir))
            made_by_tune = (
                not before
                and folder == os.path.abspath(tempfile.gettempdir())
                and name.startswith(tempfile.gettempprefix())
            )
            discard_partial_save(checkpoint_dir, keep=before, remove_dir=made_by_tune)
            raise

    def restore(self, checkpoint_path: Any) -> None:
        """Refuse a checkpoint folder holding anything tune_hydra does not write, then
        let Ray's ``Trainable.restore`` go on (it calls :meth:`load_checkpoint`).

        The check runs first because Ray's ``restore`` unpickles ``_dict_checkpoint.pkl``
        whenever a checkpoint folder holds one, in this process, before
        ``load_checkpoint``: a payload planted there would run (``Tuner.restore``,
        ``th.run(resume=...)``, retries after a failure, PBT exploits). tune_hydra never
        writes that file.

        Raises:
            ForeignCheckpointFileError: the folder holds a name that no tune_hydra
                checkpoint holds (see :func:`~tune_hydra.frontends.checkpoint.
                check_checkpoint_files`); nothing in it was read.
        """
        listed = _checkpoint_listing(checkpoint_path)
        if listed is not None:
            check_checkpoint_files(*listed)
        super().restore(checkpoint_path)

    def load_checkpoint(self, checkpoint: Any) -> None:
        if isinstance(checkpoint, tune.Checkpoint) or not isinstance(
            checkpoint, (str, os.PathLike)
        ):
            raise not_a_folder(checkpoint)
        check_checkpoint_files(checkpoint, os.listdir(checkpoint))
        self._ensure_registered()
        self._call("load", self._key, self._token, str(checkpoint))

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        # Called by Trainable.reset after trial_id already changed: drop the old key's
        # registration now; the new trial registers lazily.
        self._deregister()
        self.config = new_config
        return True

    def cleanup(self) -> None:
        self._deregister()
