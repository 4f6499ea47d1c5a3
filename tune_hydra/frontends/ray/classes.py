"""Class trainables (a ``tune.Trainable`` subclass: ``setup`` / ``step`` /
``save_checkpoint`` / ``load_checkpoint`` / ``reset_config`` / ``cleanup``) under a
:class:`~tune_hydra.HydraExecutor`.

The user's class is instantiated in its node's engine process, so that ``th.shard`` in
its ``setup`` trains on that node's engine, multiplexed with every other trial. Tune runs
a proxy per trial, :class:`HydraClassTrainable`: itself a ``tune.Trainable`` class, so
Tune calls its ``train`` / ``save`` / ``restore`` / ``reset`` / ``stop`` exactly as it
would the user's class (checkpoint frequency, PBT's saves and exploits, HyperBand's pauses,
``reuse_actors``, ``Tuner.restore`` are all Tune's). The proxy forwards each of the
methods Tune's wrappers call (``step``, ``save_checkpoint(dir)``, ``load_checkpoint(dir or
dict)``, ``reset_config(new_config)``, ``cleanup``) to the user's instance, with the
proxy's iteration counters (``self.iteration`` ... read the same there as in the plain
class).

In the engine process, :class:`ClassRun` is the trial's side. It is a
:class:`~tune_hydra.frontends.ray.function.FunctionRun` whose thread, instead of calling a
function, builds the instance (the class's own ``__init__``, with the trial's config and
Tune's storage context, as Tune builds it: ``setup`` runs there) and then runs that
trial's calls one after another. So every call of one trial runs on one thread, with what
``FunctionRun`` gives a function: the engine's ``EngineScope`` (``th.shard`` goes there;
the loops leave the engine at ``cleanup``), a private random generator, and the trial's
own working directory (``Trainable`` chdirs into it, as in plain Tune: only that thread
moves). ``tune.report`` in a class trainable warns and does nothing, as in plain Tune.

Checkpoint folders are passed as paths: the proxy finds the engine actor of its own node
(one per node), so the folder Tune's ``save`` made and the folder Tune's ``restore``
reads are on the engine's node. A ``save_checkpoint`` that returns a dict returns it to
the proxy, which Tune pickles there (the proxy process then unpickles what it holds:
torch is loaded there if it holds tensors).

This module imports neither torch nor the engine at import time (trial processes import
it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import traceback
import uuid
import warnings
from typing import Any, ClassVar

import ray
from ray import tune
from ray.tune.result import TRIAL_INFO

from tune_hydra.exceptions import SystematicTaskError, TuneHydraError
from tune_hydra.frontends.ray.client import EngineClient
from tune_hydra.frontends.ray.errors import (
    RETRY,
    NoShardError,
    TrialFunctionError,
    TrialNotRegisteredError,
)
from tune_hydra.frontends.ray.function import _UNSET, FunctionRun

logger = logging.getLogger(__name__)

COUNTERS = (
    "_iteration",
    "_time_total",
    "_timesteps_total",
    "_episodes_total",
    "_time_since_restore",
    "_timesteps_since_restore",
    "_iterations_since_restore",
    "_restored",
)
"""The ``Trainable`` attributes Tune's wrappers keep on the proxy (``train``,
``restore``, ``reset``), copied onto the user's instance before each call."""

SHARD_LINE = "self.model, self.optimizer = th.shard(self.model, self.optimizer)"

_CALLS = ("step", "save_checkpoint", "load_checkpoint")


def class_and_parameters(bound: Any) -> tuple[Any, dict[str, Any]]:
    """The stored class and the ``tune.with_parameters`` values put around its proxy
    (fetched once per engine: see :class:`~tune_hydra.frontends.ray.factories.
    BoundFactory`); blocking."""
    from tune_hydra.frontends.ray.factories import BoundFactory

    if isinstance(bound, BoundFactory):
        return bound.fn, dict(bound.values())
    return bound, {}


def _with_parameters(cls: type, values: dict[str, Any]) -> type:
    """``cls`` whose ``setup(config)`` gets ``values`` as keyword arguments, as the
    subclass ``tune.with_parameters`` makes of a class."""

    class _Inner(cls):
        def setup(self, config: dict[str, Any]) -> None:
            super().setup(config, **values)

    _Inner.__name__ = cls.__name__
    _Inner.__qualname__ = cls.__qualname__
    return _Inner


# ------------------------------------------------------------------ engine process side
class ClassRun(FunctionRun):
    """One trial's class trainable in the engine process: its instance and the thread
    that runs every call of it (see the module docstring).

    Calls come through :meth:`call` as jobs: ``"setup"`` (build the instance),
    ``"step"``, ``"save_checkpoint"``, ``"load_checkpoint"``, ``"reset"`` (Tune's
    ``Trainable.reset``: the new trial's config, info, storage and working directory,
    then the user's ``reset_config``) and ``"stop"`` (the user's ``cleanup``; the thread
    then ends and the trial's loops leave the engine). A run stopped from outside (the
    driver deregistered its trial: it failed, or its proxy died) still calls the user's
    ``cleanup`` once, as Tune's ``stop`` does.

    Args:
        cls: the user's class.
        config: the trial's config.
        key, token, engine, context, seed: as :class:`FunctionRun`'s (``context`` has no
            checkpoint: Tune restores a class through ``load_checkpoint``).
        params: keyword arguments for ``setup`` (``tune.with_parameters`` around the
            proxy).
    """

    # Tune may keep the proxy (reuse_actors) after its trial completed or moved to
    # another proxy, and reset it for another trial: its cleanup ends the run.
    proxy_owned = True

    def __init__(
        self,
        cls: type,
        config: dict[str, Any],
        *,
        key: str,
        token: str,
        engine: Any,
        context: dict[str, Any],
        seed: int | None = None,
        params: dict[str, Any] | None = None,
        spec: Any = None,
    ) -> None:
        self.spec = spec  # what a canned class reads in setup (a task factory's TaskSpec)
        super().__init__(
            cls, config, key=key, token=token, engine=engine, context=context, seed=seed
        )
        self.thread.name = f"hydra-cls-{key}"
        self.params = dict(params or {})
        self.instance: Any = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._open = True  # takes jobs (under self._lock)
        self._cleaned = False  # the user's cleanup ran
        # Ends what a setup in progress waits for (a task factory's call), set by it.
        self.on_abort: Any = None

    def _name(self) -> str:
        return repr(getattr(self.spec, "name", None) or getattr(self.fn, "__name__", "Trainable"))

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        """``tune.report`` in a class trainable: as in plain Tune (no function session),
        a warning, and nothing is reported (``step``'s return value is the result)."""
        warnings.warn(
            "`report` is meant to only be called inside a function that is executed by a "
            "Tuner or Trainer: a class Trainable returns its results from step(). "
            "Returning `None`.",
            stacklevel=3,
        )

    def _finish(self) -> None:
        """Nothing to add: each ``step`` returned its own result."""

    # -- the proxy's side (through the engine actor) ----------------------------------
    def call(
        self, method: str, args: tuple[Any, ...] = (), counters: dict[str, Any] | None = None
    ) -> concurrent.futures.Future[Any]:
        """Queue a call for the trial's thread; its future gets the return value, or the
        error (:class:`TrialFunctionError` with the user's traceback, or a systematic
        error as itself)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._open and not self.stopped:
                self._jobs.put((method, tuple(args), counters, future))
                return future
        future.set_exception(self._gone())
        return future

    def stop(self) -> None:
        """End the run from outside (never blocks): a call in progress ends at its next
        forward, the user's ``cleanup`` runs, the thread ends."""
        super().stop()
        self.abort_setup()
        self._jobs.put(None)

    def abort_setup(self) -> None:
        """Stop waiting for what a ``setup`` in progress waits for (a task factory)."""
        hook = self.on_abort
        if hook is not None:
            try:
                hook()
            except Exception:
                logger.warning(
                    "tune_hydra: aborting trial %s's setup failed", self.key, exc_info=True
                )

    def _gone(self) -> TrialNotRegisteredError:
        return TrialNotRegisteredError(
            f"trial {self.key!r}: its class trainable {self.title} no longer runs in this "
            f"engine (it was cleaned up, or stopped: the trial ended, failed or was "
            f"replaced). {RETRY}"
        )

    # -- the trial's thread --------------------------------------------------------------
    def _call_function(self) -> None:
        """Run the trial's calls until its ``cleanup`` (or a stop)."""
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    break
                method, args, counters, future = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = self._run(method, args, counters)
                except BaseException as err:  # the proxy raises it, whatever it is
                    future.set_exception(self._error(method, err))
                else:
                    future.set_result(result)
                if method == "stop":
                    break
        finally:
            with self._lock:
                self._open = False
            while True:  # calls queued behind the end: their proxy gets an answer
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None and job[3].set_running_or_notify_cancel():
                    job[3].set_exception(self._gone())
            if self.instance is not None and not self._cleaned:
                self._cleaned = True
                try:
                    self.instance.stop()
                except Exception:
                    logger.warning(
                        "tune_hydra: cleanup() of trial %s's %s raised",
                        self.key,
                        self.title,
                        exc_info=True,
                    )
            self.instance = None  # the model goes with it (its loops leave the engine)
            self.spec = self.on_abort = None

    def _run(self, method: str, args: tuple[Any, ...], counters: dict[str, Any] | None) -> Any:
        if method == "setup":
            self._build()
            return None
        instance = self.instance
        if instance is None:
            if method == "stop":
                return None  # its setup failed: nothing to clean up
            raise TrialFunctionError(
                f"trial {self.key}: the class trainable {self.title} has no instance in "
                f"the engine (its setup failed)"
            )
        for name, value in (counters or {}).items():
            if name in COUNTERS:
                setattr(instance, name, value)
        if method == "step":
            result = instance.step()
            if self.scope is not None and not self.scope.sharded:
                raise NoShardError(
                    self.key,
                    f"the class trainable {self.title} stepped without calling th.shard, "
                    f"so it trained plainly beside the engine (one trial at a time per node "
                    f"gains nothing from a HydraExecutor)",
                    f"Add `{SHARD_LINE}` at the end of its setup(), or run the class "
                    f"without a HydraExecutor (plain Tune)",
                )
            self.reports += 1
            self._measure()
            return result
        if method == "reset":
            config, context, new_key = args
            old_key, self.key = self.key, new_key  # the instance's reset builds for it
            self.trial_info = context.get("trial_info")
            self.storage = context.get("storage")
            self.cwd = context.get("cwd")
            with self._lock:  # the new trial's hints come with its key
                self._milestone = _UNSET
                self._remaining = None
            new_config = {**config, TRIAL_INFO: self.trial_info}
            ok = False
            try:
                ok = bool(instance.reset(new_config, storage=self.storage))
            finally:
                if not ok:
                    self.key = old_key
            return ok
        if method == "stop":
            self._cleaned = True
            instance.stop()  # Tune's Trainable.stop: the user's cleanup()
            return None
        if method in _CALLS:
            return getattr(instance, method)(*args)
        raise ValueError(f"not a call of a class trainable: {method!r}")

    def _build(self) -> None:
        """The instance, as Tune's trial actor builds it (``setup`` runs in ``__init__``,
        which also chdirs into the trial's directory: this thread alone)."""
        cls: Any = self.fn
        if self.params:
            cls = _with_parameters(cls, self.params)
        config = dict(self.config)
        if self.trial_info is not None:
            config[TRIAL_INFO] = self.trial_info
        self.instance = cls(config=config, storage=self.storage)

    def _error(self, method: str, err: BaseException) -> BaseException:
        canned = getattr(self.spec, "describe_call", None)  # a task factory's trial
        if isinstance(err, (SystematicTaskError, TrialFunctionError)) or (
            canned is not None and isinstance(err, TuneHydraError)
        ):
            return err  # tune_hydra's own error says what to do
        text = "".join(traceback.format_exception(err))
        what = (
            canned(method)
            if canned is not None
            else f"{'__init__/setup' if method == 'setup' else method}() of the class "
            f"trainable {self.title}"
        )
        return TrialFunctionError(f"trial {self.key}: {what} raised in the engine process:\n{text}")


# ------------------------------------------------------------------- trial process side
class HydraClassTrainable(EngineClient, tune.Trainable):
    """The proxy of one class trainable (made by :meth:`HydraExecutor.trainable
    <tune_hydra.HydraExecutor.trainable>`): a ``tune.Trainable`` that forwards the
    methods of the user's class to its instance in the engine actor (see the module
    docstring). The instance is started lazily, at the first call Tune makes after
    ``setup`` (``step``, or ``load_checkpoint`` of a restore), with an ownership token:
    Tune may build a proxy it throws away (PBT, ``reuse_actors``).

    Class attributes: as :class:`~tune_hydra.frontends.ray.client.EngineClient`'s
    (``_factory_id`` names the stored class); ``_name`` the user's class name (Tune names
    the experiment with it); ``_has_reset_config``: the user's class overrides
    ``reset_config``.
    """

    _name: ClassVar[str] = ""
    _has_reset_config: ClassVar[bool] = False
    _reuse_process: ClassVar[bool] = False  # reuse_actors stays the run's: see EngineClient
    _required_metrics: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def for_class(
        cls,
        user_class: Any,
        *,
        factory_id: str,
        run_id: str,
        secret: str,
        slot_resource: str,
    ) -> type[HydraClassTrainable]:
        """The proxy class of one stored class (it holds nothing of that class but its
        name, so the trial processes never import the user's module)."""
        name = user_class.__name__
        return type(
            f"Hydra_{name}",
            (cls,),
            {
                "_name": name,
                "_has_reset_config": user_class.reset_config is not tune.Trainable.reset_config,
                "_factory_id": factory_id,
                "_run_id": run_id,
                "_secret": secret,
                "_slot_resource": slot_resource,
                "__module__": cls.__module__,
            },
        )

    def setup(self, config: dict[str, Any], **params: Any) -> None:
        self._token = uuid.uuid4().hex
        self._key: str | None = None  # the trial the engine's instance serves
        self._actor = None
        self._slot_checked = False
        self._params: dict[str, Any] = {**self._param_refs, **params}

    def _context(self) -> dict[str, Any]:
        storage = self._storage
        cwd = storage.trial_working_directory if storage is not None else None
        return {"trial_info": self._trial_info, "storage": storage, "cwd": cwd}

    def _counters(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in COUNTERS}

    def _forward(self, method: str, *args: Any, retry: bool = False) -> Any:
        """An engine-actor call; an error of tune_hydra's raised as itself (the user's
        traceback is in a :class:`TrialFunctionError`'s message)."""
        try:
            return self._call(method, *args, retry=retry)
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, TuneHydraError):
                raise cause from None
            raise

    def _started(self) -> str:
        """The instance's trial id, building it in the engine first if needed."""
        if self._key is None:
            try:
                self._check_slot()
                self._key = self.trial_id  # from now on cleanup() ends it, built or not
                self._forward(
                    "cls_start",
                    self.trial_id,
                    self._token,
                    self._factory_id,
                    dict(self.config),
                    self._params,
                    self._secret,
                    self._context(),
                    retry=True,
                )
            except SystematicTaskError as err:
                self._record(err)
                raise
        return self._key

    def _invoke(self, method: str, *args: Any) -> Any:
        self._started()
        try:
            # No retry: an engine that restarted lost the instance; Tune restores the
            # trial from its checkpoint.
            return self._forward("cls_call", self._token, method, args, self._counters())
        except SystematicTaskError as err:
            self._record(err)
            raise

    def step(self) -> dict[str, Any]:
        return self._invoke("step")

    def save_checkpoint(self, checkpoint_dir: str) -> Any:
        return self._invoke("save_checkpoint", checkpoint_dir)

    def load_checkpoint(self, checkpoint: Any) -> None:
        self._invoke("load_checkpoint", checkpoint)

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        # Trainable.reset set the new trial's config, info, storage (and trial_id) first.
        if self._key is None:
            # Never built: the next call builds it with the new config. The answer is
            # what the class gives (Trainable's default refuses the reuse).
            return self._has_reset_config
        ok = bool(
            self._forward(
                "cls_reset",
                self._token,
                self.trial_id,
                dict(new_config),
                self._context(),
                self._counters(),
            )
        )
        if ok:
            self._key = self.trial_id
        return ok

    def cleanup(self) -> None:
        key, self._key = self._key, None
        if key is None or self._actor is None:
            return
        with contextlib.suppress(TrialNotRegisteredError):  # ended there already
            self._forward("cls_end", self._token)


__all__ = ["COUNTERS", "ClassRun", "HydraClassTrainable", "class_and_parameters"]
