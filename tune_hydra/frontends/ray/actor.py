"""The engine actor: one async Ray actor per node, hosting one :class:`Engine` for every
trial that runs on that node.

Why an *async* actor: each trial's ``step`` awaits its engine future, so many trials wait
at once while the engine interleaves their shard operations on the node's devices (a
synchronous actor would serialise the trials completely). Compute never runs inside a
coroutine: the engine runs it in its own device threads, and slow control work (building a
model, reading or writing a checkpoint) runs in a small thread pool, so the event loops stay
responsive. Control calls use their own concurrency group, so a burst of ``train`` calls
never delays a ``save`` or ``deregister``.

This module imports neither torch nor the engine at import time: trial processes import it
(for the actor's name) and must stay light.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import importlib
import os
import pickle
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import ray

from tune_hydra.exceptions import CheckpointError, TuneHydraError

# The checkpoint file names live in tune_hydra.frontends.checkpoint (torch-free); re-exported here.
from tune_hydra.frontends.checkpoint import META_FILE as META_FILE
from tune_hydra.frontends.checkpoint import MODEL_FILE as MODEL_FILE
from tune_hydra.frontends.checkpoint import STATE_FILE as STATE_FILE
from tune_hydra.frontends.checkpoint import (
    config_digest,
    plan_layers,
    read_checkpoint,
    write_checkpoint,
)
from tune_hydra.frontends.ray.errors import (
    EngineError,
    EngineUnavailableError,
    NotOwnerError,
    TaskFactoryError,
    TrialNotRegisteredError,
)
from tune_hydra.options import EngineOptions

ENGINE_ACTOR_PREFIX = "tune_hydra_engine"
CONTROL_GROUP = "control"
DEFAULT_ENGINE_CLASS = "tune_hydra.engine:Engine"
DEFAULT_FACTORY_TIMEOUT_S = 600.0
"""How long a task factory may take by default (``HydraExecutor(factory_timeout_s=...)``)."""


def engine_actor_name(run_id: str, node_id: str) -> str:
    """The Ray name of the engine actor of executor ``run_id`` on node ``node_id``."""
    return f"{ENGINE_ACTOR_PREFIX}:{run_id}:{node_id}"


def _ray_object(obj: Any) -> bool:
    """Whether ``obj`` is a module or function of Ray."""
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        name = getattr(obj, "__module__", None) or ""
    return name == "ray" or name.startswith("ray.")


def _callable_function(obj: Any) -> types.FunctionType | None:
    """The Python function behind a callable (a partial, a bound method, a wrapper, a
    :class:`BoundFactory`, a callable instance), or None."""
    for _ in range(8):
        if isinstance(obj, types.FunctionType):
            return obj
        if isinstance(obj, BoundFactory):
            obj = obj.fn
        elif isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif getattr(obj, "__wrapped__", None) is not None:
            obj = obj.__wrapped__
        elif callable(obj) and not isinstance(obj, type):
            obj = type(obj).__call__
        else:
            return None
    return None


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def tune_report_call(fn: Any, depth: int = 2) -> str | None:
    """How ``fn`` calls Ray's ``report`` (``"tune.report"``, ``"train.report"``,
    ``"report"`` ...), read from its code without running it; None if it does not.

    A function trainable (``def train(config): ... tune.report(...)``) passed where a
    task factory belongs would run its whole training loop inside the engine's process,
    with no Tune session to report to. The check reads the names the function's code
    (and its nested functions) uses: ``report`` reached through one of Ray's modules or
    imported from one. Functions of the same module that it calls, and functions it
    closes over (``tune.with_parameters`` keeps the wrapped function in a closure), are
    read too, ``depth`` calls deep. Cheap: nothing is run or imported.

    Example:
        >>> from ray import tune
        >>> def train_fn(config):
        ...     tune.report({"loss": 1.0})
        >>> tune_report_call(train_fn)
        'tune.report'
        >>> tune_report_call(lambda config: None) is None
        True
    """
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> str | None:
        func = _callable_function(obj)
        if func is None or id(func.__code__) in seen:
            return None
        seen.add(id(func.__code__))
        cells = dict(zip(func.__code__.co_freevars, func.__closure__ or (), strict=False))
        closure: dict[str, Any] = {}
        for name, cell in cells.items():
            with contextlib.suppress(ValueError):  # an empty cell
                closure[name] = cell.cell_contents
        scope = getattr(func, "__globals__", {})

        def lookup(name: str) -> Any:
            if name in closure:
                return closure[name]
            if name in scope:
                return scope[name]
            # ``from ray import tune`` / ``import ray.train`` inside the function
            return sys.modules.get(name) if name.split(".")[0] == "ray" else None

        callees: list[Any] = []
        for code in _code_objects(func.__code__):
            names = code.co_names
            if "report" in names:
                for name in names:
                    module = lookup(name)
                    if not isinstance(module, types.ModuleType) or not _ray_object(module):
                        continue
                    if callable(getattr(module, "report", None)):
                        return f"{name}.report"
                    for attr in names:
                        sub = getattr(module, attr, None)
                        if isinstance(sub, types.ModuleType) and callable(
                            getattr(sub, "report", None)
                        ):
                            return f"{name}.{attr}.report"
                found = lookup("report")
                if callable(found) and _ray_object(found):
                    return "report"
            callees.extend(
                found
                for found in map(lookup, names + code.co_freevars)
                if isinstance(found, types.FunctionType) and found.__module__ == func.__module__
            )
        callees.extend(v for v in closure.values() if callable(v) and not _ray_object(v))
        if level > 0:
            for callee in callees:
                hit = visit(callee, level - 1)
                if hit is not None:
                    return hit
        return None

    return visit(fn, depth)


class BoundFactory:
    """A task factory with keyword arguments bound to it, as ``tune.with_parameters``
    binds them: calling it with a config calls ``fn(config, **parameters)``.

    Parameters that are Ray ``ObjectRef``s (what ``tune.with_parameters`` keeps in Ray's
    object store) are fetched on the first call, in the calling thread, and the values
    are kept for the next calls: one copy per engine process, shared by the trials it
    builds (as the data a factory closes over is), none in the trial processes. Pickling
    keeps the references, never the fetched values.

    Args:
        fn: the user's task factory, ``fn(config, **parameters) -> ModelTask``.
        parameters: keyword name -> ``ObjectRef`` or value.
    """

    def __init__(self, fn: Callable[..., Any], parameters: dict[str, Any]) -> None:
        self.fn = fn
        self.parameters = dict(parameters)
        self._values: dict[str, Any] | None = None
        self._lock = threading.Lock()

    @property
    def __name__(self) -> str:  # names the factory in errors
        return str(getattr(self.fn, "__name__", "make_task"))

    def __getstate__(self) -> dict[str, Any]:
        return {"fn": self.fn, "parameters": self.parameters}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fn"], state["parameters"])  # type: ignore[misc]

    def values(self) -> dict[str, Any]:
        """The parameters' values (fetched from the object store once)."""
        with self._lock:
            if self._values is None:
                refs = {k: v for k, v in self.parameters.items() if isinstance(v, ray.ObjectRef)}
                fetched = dict(zip(refs, ray.get(list(refs.values())), strict=True))
                self._values = {k: fetched.get(k, v) for k, v in self.parameters.items()}
            return self._values

    def __call__(self, config: Any) -> Any:
        return self.fn(config, **self.values())

    def __repr__(self) -> str:
        return f"BoundFactory({self.__name__}, {sorted(self.parameters)})"


@dataclasses.dataclass
class _Registration:
    key: str  # the Tune trial id
    token: str  # the proxy Trainable instance that owns it
    name: str  # the engine's task name
    config: dict[str, Any]


def _portable(err: BaseException) -> BaseException:
    """``err`` if it survives pickling (Ray ships it to the trial), else an
    :class:`EngineError` carrying its type, message and the traceback of its cause (the
    user's code that raised inside the engine)."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        text = f"{type(err).__name__}: {err}"
        cause = err.__cause__
        if cause is not None and cause.__traceback__ is not None:
            tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
            text += f"\n\nOriginal traceback:\n{tb}"
        return EngineError(text)


def _merge_hyperparameters(loaded: Any, fresh: Any) -> Any:
    """Optimizer state from a checkpoint, with the hyperparameters (``lr``, betas, ...)
    of freshly built optimizers.

    PBT restores a checkpoint into a trial with a *mutated* config: the moments must come
    from the checkpoint but the learning rate from the new config, as in a hand-written
    PBT loop that sets ``lr`` after loading.

    ``loaded`` and ``fresh`` are the engine state's ``"optimizer"``: per-parameter state
    and groups of parameter names (``tune_hydra.engine.resume``); the result keeps
    ``loaded``'s per-parameter state with ``fresh``'s groups, so each parameter gets the
    hyperparameters the new config gives it, however either was cut into shards. A
    checkpoint of the older layout (``"optimizers"``: one ``state_dict`` per shard, which
    restores under the same cut only) is merged group by group with ``fresh``'s groups,
    listed in the same order. Structures that do not match are left alone.

    Example:
        >>> loaded = {"state": {"0.weight": {"momentum_buffer": 1.0}},
        ...           "param_groups": [{"lr": 0.1, "params": ["0.weight"]}]}
        >>> fresh = {"state": {}, "param_groups": [{"lr": 0.5, "params": ["0.weight"]}]}
        >>> _merge_hyperparameters(loaded, fresh)["param_groups"]
        [{'lr': 0.5, 'params': ['0.weight']}]
    """
    fresh_groups = fresh.get("param_groups") if isinstance(fresh, dict) else None
    if not isinstance(fresh_groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in fresh_groups
    ):
        return loaded
    if isinstance(loaded, dict):
        if not isinstance(loaded.get("param_groups"), list):
            return loaded
        old = {n for g in loaded["param_groups"] for n in g.get("params", ())}
        new = {n for g in fresh_groups for n in g["params"]}
        if old != new:
            return loaded
        return {**loaded, "param_groups": [dict(g) for g in fresh_groups]}
    if not isinstance(loaded, list):
        return loaded
    # The older per-shard layout: its groups, shard after shard, pair with fresh's.
    old_groups = [g for sd in loaded if isinstance(sd, dict) for g in sd.get("param_groups") or ()]
    if len(old_groups) != len(fresh_groups) or any(
        len(og.get("params", ())) != len(ng["params"])
        for og, ng in zip(old_groups, fresh_groups, strict=True)
    ):
        return loaded
    pairs = iter(fresh_groups)
    out = []
    for sd in loaded:
        if isinstance(sd, dict) and isinstance(sd.get("param_groups"), list):
            groups = [
                {**{k: v for k, v in next(pairs).items() if k != "params"}, "params": og["params"]}
                for og in sd["param_groups"]
            ]
            sd = {**sd, "param_groups": groups}
        out.append(sd)
    return out


class EngineActor:
    """Hosts one engine for the trials of one node. Created by
    :class:`~tune_hydra.HydraExecutor`; not meant to be used directly.

    Args:
        engine_options: the options of the engine (``Engine(**engine_options.kwargs())``).
        task_options: keyword arguments of ``Engine.add_task`` shared by every trial (seed,
            max_grad_norm, accumulate_steps, precision, iteration_batches).
        engine_class: ``"module:Class"`` of the engine (tests may swap in a stub).
        torch_threads: ``torch.set_num_threads`` for CPU work; None leaves torch's default.
        node_label: prefix of the device labels in :meth:`trace` (tells nodes apart).
        factories: where the experiment's pickled task factories are read from (a
            :class:`~tune_hydra.frontends.ray.factories.FactoryStore`, or a ``{id: blob}`` dict when
            hosted without Ray).
        secret: the executor's key for driver-side calls (cancel, hints, deregister,
            listing); a trial's own calls use the token it registered with.
        factory_timeout_s: how long one factory call may take (None: no limit).

    Ownership: every call that reads or changes a trial needs that trial's token (the
    proxy that registered it) or the executor's ``secret`` (its driver), so another
    experiment's driver on the same cluster cannot stop or free this one's trials.
    """

    def __init__(
        self,
        engine_options: EngineOptions,
        task_options: dict[str, Any],
        engine_class: str = DEFAULT_ENGINE_CLASS,
        torch_threads: int | None = None,
        node_label: str = "",
        factories: Any = None,
        secret: str = "",
        factory_timeout_s: float | None = DEFAULT_FACTORY_TIMEOUT_S,
    ) -> None:
        self._engine_options = engine_options
        self._task_options = task_options
        self._engine_class = engine_class
        self._torch_threads = torch_threads
        self._node_label = node_label
        self._store: Any = factories if factories is not None else {}
        self._secret = secret
        self._factory_timeout_s = factory_timeout_s
        self._engine: Any = None
        self._lock = threading.RLock()  # registry is touched from two event-loop threads
        self._regs: dict[str, _Registration] = {}
        self._hints: dict[str, int] = {}
        self._factories: dict[str, Callable[[dict[str, Any]], Any]] = {}  # id -> factory
        # id -> the factory bound to each set of tune.with_parameters references
        self._bound: dict[str, dict[tuple[tuple[str, str], ...], BoundFactory]] = {}
        self._counter = 0
        # Trials whose factory is running: key -> (owner token, future that aborts the wait)
        self._building: dict[str, tuple[str, asyncio.Future[None]]] = {}
        self._build_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="hydra-ctl")

    # ---------------------------------------------------------------- helpers
    def _ensure_engine(self) -> Any:
        with self._lock:
            if self._engine is None:
                # An actor with num_cpus=0 gets OMP_NUM_THREADS=1 from Ray; give torch the
                # node's cores back for CPU devices.
                if self._torch_threads:
                    import torch

                    torch.set_num_threads(self._torch_threads)
                module, _, attr = self._engine_class.partition(":")
                cls = getattr(importlib.import_module(module), attr)
                self._engine = cls(**self._engine_options.kwargs())
            return self._engine

    async def _offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking work in the control pool, re-raising errors Ray can ship."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        except TuneHydraError as err:
            raise _portable(err) from None

    def _driver(self, secret: str) -> None:
        """Refuse a driver-side call that does not carry this executor's secret."""
        if not self._secret or not hmac.compare_digest(str(secret), self._secret):
            raise NotOwnerError(
                "this call needs the key of the experiment (HydraExecutor) that started "
                "this engine, and did not carry it: another experiment's driver on the "
                "cluster cannot register, change, list, trace or close its trials. Use the "
                "HydraExecutor (or the trainable it made) that started this engine"
            )

    def _owned(self, key: str, token: str) -> _Registration:
        with self._lock:
            reg = self._regs.get(key)
        if reg is not None and self._secret and token == self._secret:
            return reg  # the executor's own driver
        if reg is None or reg.token != token:
            why = (
                "the engine does not know it (the engine actor restarted, or the trial "
                "was deregistered)"
                if reg is None
                else "a newer copy of the trial took it over"
            )
            raise TrialNotRegisteredError(
                f"trial {key!r} is not registered with this engine: {why}. Tune retries it "
                f"from its last checkpoint if max_failures allows; set "
                f"checkpoint_freq/checkpoint_config so that nothing is lost."
            )
        return reg

    def _factory(self, factory_id: str) -> Callable[[dict[str, Any]], Any]:
        """The experiment's factory: read from the store once, then kept here until
        :meth:`release_factory` (one copy per engine, none in the trial processes)."""
        with self._lock:
            fn = self._factories.get(factory_id)
        if fn is not None:
            return fn
        blob = self._store.get(factory_id)
        if blob is None:
            raise TaskFactoryError(
                f"the task factory {factory_id[:8]} is not available: its experiment ended "
                f"(th.run returned, or the HydraExecutor was shut down) and released it. Get "
                f"a new trainable with executor.trainable(make_task) for a new experiment"
            )
        try:
            fn = ray.cloudpickle.loads(blob)
        except Exception:
            raise TaskFactoryError(
                f"the task factory could not be unpickled in the engine's process; install "
                f"what it imports on every engine node. Traceback:\n{traceback.format_exc()}"
            ) from None
        with self._lock:
            return self._factories.setdefault(factory_id, fn)

    def _bind(
        self, factory_id: str, factory: Callable[..., Any], params: dict[str, Any]
    ) -> BoundFactory:
        """``factory`` with the trial's ``tune.with_parameters`` parameters. Object
        references are fetched once per engine (the bound factory is kept until the
        experiment releases its factory); plain values come with every registration."""
        if not all(isinstance(v, ray.ObjectRef) for v in params.values()):
            return BoundFactory(factory, params)
        key = tuple(sorted((k, v.hex()) for k, v in params.items()))
        with self._lock:
            bound = self._bound.setdefault(factory_id, {})
            return bound.setdefault(key, BoundFactory(factory, params))

    async def _make_task(
        self,
        key: str,
        token: str,
        factory_id: str,
        config: dict[str, Any],
        params: dict[str, Any] | None = None,
    ) -> Any:
        """Call the factory in its own thread, on a private RNG (no lock is held, so a
        slow factory delays no other trial) and wait at most ``factory_timeout_s``, or
        until the trial is cancelled (Tune stopped it, the driver was interrupted). No
        thread of ours waits with it: a factory that hangs costs only its own thread.
        ``params`` (from ``tune.with_parameters`` around the trainable) are passed to the
        factory as keyword arguments."""
        from tune_hydra.engine.factory import start_factory
        from tune_hydra.exceptions import TaskFactoryTimeoutError

        factory = await self._offload(self._factory, factory_id)
        if params:
            factory = self._bind(factory_id, factory, params)
        what = f"trial {key} (config {config!r})"
        seed = self._task_options.get("seed")
        future = start_factory(factory, dict(config), what=what, seed=seed)
        result = asyncio.wrap_future(future)
        abort = asyncio.get_running_loop().create_future()
        self._building[key] = (token, abort)  # only touched in the control group's loop
        try:
            done, _ = await asyncio.wait(
                {result, abort}, timeout=self._factory_timeout_s, return_when="FIRST_COMPLETED"
            )
        finally:
            if self._building.get(key, (None, None))[1] is abort:
                del self._building[key]
        if result in done:
            return result.result()
        future.cancel()  # a late result is dropped
        if abort in done:
            raise EngineUnavailableError(
                f"trial {key!r} was stopped while its task factory was still running (Tune "
                f"stopped or paused it, or the experiment was interrupted)"
            )
        raise TaskFactoryTimeoutError(what, float(self._factory_timeout_s or 0.0))

    def _abort_build(self, key: str, token: str) -> None:
        """Stop waiting for trial ``key``'s factory (its owner or our driver asks)."""
        token_and_abort = self._building.get(key)
        if token_and_abort is None:
            return
        owner, abort = token_and_abort
        if token != owner and not (self._secret and token == self._secret):
            raise TrialNotRegisteredError(
                f"trial {key!r} is being registered by someone else; only its owner or "
                f"its experiment's driver can stop it"
            )
        if not abort.done():
            abort.set_result(None)

    def _build(
        self, key: str, token: str, task: Any, config: dict[str, Any], factory_id: str = ""
    ) -> int:
        """Add the trial's freshly built task to the engine (blocking); returns its
        number of shards. One at a time: two copies of one trial (PBT) registering at once
        must not both replace the older registration."""
        with self._build_lock:
            return self._build_one(key, token, task, config, factory_id)

    def _not_a_task(self, key: str, factory_id: str, task: Any) -> Exception:
        """The systematic error for a factory that returned ``task``, not a ModelTask."""
        from tune_hydra.exceptions import NotATaskError

        with self._lock:
            factory = self._factories.get(factory_id)
        call = tune_report_call(factory) if factory is not None else None
        fix = (
            "make_task(config) must build and return th.ModelTask(model=..., "
            "loss_fn=..., optimizer=..., train_data=..., eval_data=...); tune_hydra runs "
            "the training loop and reports loss and val_loss itself"
        )
        if call is not None or task is None:
            ran = (
                f"it calls {call}(...): it is a function trainable, whose training loop "
                f"just ran inside the engine with no Tune session to report to"
                if call is not None
                else "a function trainable passed by mistake returns None like this"
            )
            fix += (
                ". To run a function trainable as it is, drop trial_executor (th.run "
                "then is tune.run) or use it with tune.Tuner directly; to train it "
                "with tune_hydra, move its model, loss, optimizer and data into a "
                "make_task(config)"
            )
            return NotATaskError(
                key,
                f"the task factory returned {type(task).__name__}, not a "
                f"tune_hydra.ModelTask ({ran})",
                fix,
            )
        return NotATaskError(
            key,
            f"the task factory returned {type(task).__name__}, not a tune_hydra.ModelTask",
            fix,
        )

    def _build_one(
        self, key: str, token: str, task: Any, config: dict[str, Any], factory_id: str = ""
    ) -> int:
        from tune_hydra.engine.task import ModelTask
        from tune_hydra.exceptions import InvalidModelError
        from tune_hydra.frontends.trial import CLAIMS

        eng = self._ensure_engine()
        if not isinstance(task, ModelTask):
            raise self._not_a_task(key, factory_id, task)
        self._check_fresh(key, task.model, eng)
        with self._lock:
            old = self._regs.pop(key, None)
            self._counter += 1
            name = key if not old and key not in eng.tasks() else f"{key}~{self._counter}"
        if old is not None:
            eng.remove_task(old.name)
        try:
            n_shards = int(eng.add_task(name, task, **self._task_options))
        except InvalidModelError as err:
            raise self._uncuttable(key, task, err) from err
        with self._lock:
            self._regs[key] = _Registration(key, token, name, dict(config))
            hint = self._hints.get(key)
        CLAIMS.record(task.model, self, key, eng, type(self)._trains)  # type: ignore[arg-type]
        if hint is not None:
            eng.set_remaining(name, hint)
        return n_shards

    @staticmethod
    def _uncuttable(key: str, task: Any, err: Exception) -> Exception:
        """``err`` as an :class:`UncuttableModelError` when the model's *type* cannot be
        cut, else ``err`` itself (a cut that fails for this config's sizes). Either fails
        this trial alone: a search space may choose the architecture."""
        from tune_hydra.engine.task import model_layers
        from tune_hydra.exceptions import InvalidModelError, UncuttableModelError

        try:
            model_layers(task.model, key)
        except InvalidModelError:
            return UncuttableModelError(
                key,
                f"the model the task factory built cannot be cut into shards: {err}",
                "Build a model of another type for this config in make_task (an "
                "nn.Sequential, a traced nn.Module or a Hugging Face model); the other "
                "trials go on",
            )
        return err

    def _check_fresh(self, key: str, model: Any, engine: Any) -> None:
        """Refuse modules and parameters that another trial of this process trained (the
        engine itself refuses those of its live trials), and give tensors the trial trains
        a storage of their own where anything outside its model holds theirs
        (``tune_hydra.frontends.trial``)."""
        from tune_hydra.frontends.trial import prepare_model

        prepare_model(model, self, key, engine, type(self)._trains)

    def _trains(self, key: str) -> bool:
        """Whether trial ``key`` is registered here (it trains its model)."""
        with self._lock:
            return key in self._regs

    def _save(self, reg: _Registration, path: str) -> dict[str, Any]:
        """Write the trial's checkpoint into ``path`` (atomic files, manifest last); the
        manifest records a digest of the trial's config, not the config itself."""
        eng = self._ensure_engine()
        state = dict(eng.get_state(reg.name))
        model = state.pop("model")
        plan_of = getattr(eng, "plan", None)  # test engines may not have one
        return write_checkpoint(
            path,
            model,
            state,
            trial_id=reg.key,
            config=reg.config,
            shards=plan_layers(plan_of(reg.name)) if callable(plan_of) else None,
        )

    def _load(self, reg: _Registration, path: str) -> None:
        """Verify the checkpoint in ``path`` and restore the trial from it. If it was
        written under another config (a PBT exploit), the optimizers keep the new config's
        hyperparameters.

        A checkpoint made with the model cut another way (another ``device_memory`` or
        device count) restores exactly: its optimizer state is kept per parameter and the
        engine rebuilds each shard's from it (``tune_hydra.engine.resume``). Only a
        checkpoint of the older per-shard layout needs the cut it was made with."""
        eng = self._ensure_engine()
        model, state, manifest = read_checkpoint(path)  # CheckpointError: nothing loaded
        saved_plan = manifest.get("shards")
        plan_of = getattr(eng, "plan", None)
        plan = plan_layers(plan_of(reg.name)) if callable(plan_of) else None
        legacy = "optimizers" in state  # one optimizer state_dict per shard
        if saved_plan is not None and plan is not None and saved_plan != plan:
            i = next(
                (i for i, (a, b) in enumerate(zip(saved_plan, plan, strict=False)) if a != b),
                min(len(saved_plan), len(plan)),
            )
            diff = (
                f"{len(saved_plan)} shard(s) in the checkpoint, {len(plan)} now; first "
                f"difference at shard {i}: {saved_plan[i] if i < len(saved_plan) else 'none'} "
                f"in the checkpoint, {plan[i] if i < len(plan) else 'none'} now"
            )
            if legacy:
                raise CheckpointError(
                    path,
                    STATE_FILE,
                    f"keeps optimizer state per shard (an older tune_hydra wrote it), and trial "
                    f"{reg.key}'s model is now cut another way ({diff})",
                    "Restore it once with the device_memory of the run that wrote it and save "
                    "a new checkpoint: those restore under any device_memory",
                )
            import logging

            logging.getLogger(__name__).info(
                "tune_hydra: trial %s: re-sharding checkpoint %s (%s)", reg.key, path, diff
            )
        state["model"] = model
        saved_digest = manifest.get("config_digest")
        key = "optimizers" if legacy else "optimizer"
        if saved_digest is not None and saved_digest != config_digest(reg.config) and key in state:
            fresh = eng.get_state(reg.name)
            state[key] = _merge_hyperparameters(state[key], fresh.get("optimizer"))
        from tune_hydra.exceptions import ResumeStateError

        try:
            eng.set_state(reg.name, state)  # checks the state against the task first
        except ResumeStateError as err:
            raise CheckpointError(
                path,
                STATE_FILE,
                f"does not fit trial {reg.key}'s task: {err.detail}",
                "Nothing of the checkpoint was loaded into the trial",
            ) from None

    # ------------------------------------------------------------ actor methods
    @ray.method(concurrency_group=CONTROL_GROUP)
    async def start(self) -> dict[str, Any]:
        """Build the engine now (so bad options fail at start, not in the first trial)."""
        await self._offload(self._ensure_engine)
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def register(
        self,
        key: str,
        token: str,
        factory_id: str,
        config: dict[str, Any],
        params: dict[str, Any] | None = None,
        secret: str = "",
    ) -> int:
        """Build trial ``key``'s task with the experiment's factory ``factory_id`` and add
        it to the engine; it replaces any older registration of ``key`` (a retried or
        newer copy of the trial) and belongs to ``token`` from now on. Returns the number
        of shards.

        ``params``: keyword arguments for the factory from ``tune.with_parameters``
        around the trainable (``ObjectRef``s, fetched once per engine, or values).
        ``secret``: the experiment's secret; a registration without it (another
        experiment's driver re-registering one of our trial ids) is refused before it
        touches anything.

        Raises:
            NotOwnerError: ``secret`` is not the experiment's.
            NotATaskError: the factory returned no ModelTask (systematic).
            UncuttableModelError: the model's type cannot be cut (this trial alone).
        """
        self._driver(secret)  # before anything: the owner's trial keeps running
        try:
            task = await self._make_task(key, token, factory_id, config, params)
        except TuneHydraError as err:
            raise _portable(err) from None
        return int(await self._offload(self._build, key, token, task, config, factory_id))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def task_metrics(self, key: str, token: str) -> list[str]:
        """The names of the trial's task's own ``metrics`` (its results carry them)."""
        reg = self._owned(key, token)
        return self._ensure_engine().metric_names(reg.name)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def abort_builds(self, secret: str) -> int:
        """Stop waiting for every factory still running (the driver was interrupted), so
        that those trials end at once instead of when their factories return. Returns how
        many were waiting."""
        self._driver(secret)
        keys = list(self._building)
        for key in keys:
            self._abort_build(key, secret)
        return len(keys)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def release_factory(self, secret: str, factory_id: str) -> None:
        """Forget an experiment's factory (it ended); trials still registered keep their
        tasks."""
        self._driver(secret)
        with self._lock:
            self._factories.pop(factory_id, None)
            self._bound.pop(factory_id, None)

    async def train(self, key: str, token: str, iterations: int = 1) -> list[dict[str, Any]]:
        """Train ``iterations`` iterations of the trial; one metrics dict per iteration."""
        reg = self._owned(key, token)
        try:
            fut = self._ensure_engine().train(reg.name, iterations)
        except TuneHydraError as err:
            raise _portable(err) from None
        try:
            return list(await asyncio.wrap_future(fut))
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            # A cancelled asyncio task would read as a Ray task cancellation; say why.
            with self._lock:
                now = self._regs.get(key)
            if now is not None and now.token != token:
                raise TrialNotRegisteredError(
                    f"trial {key!r}: a newer copy of this trial (of the same experiment: "
                    f"Tune retried or re-created it) registered it again, which dropped "
                    f"this copy's queued work"
                ) from None
            raise EngineUnavailableError(
                f"trial {key!r}: its queued work was cancelled (Tune stopped or paused it, "
                f"or it was deregistered)"
            ) from None
        except TuneHydraError as err:
            raise _portable(err) from None

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def save(self, key: str, token: str, path: str) -> dict[str, Any]:
        """Write the trial's checkpoint files into ``path`` (a directory on this node)."""
        reg = self._owned(key, token)
        return dict(await self._offload(self._save, reg, path))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def load(self, key: str, token: str, path: str) -> None:
        """Restore the trial from the checkpoint directory ``path``."""
        reg = self._owned(key, token)
        await self._offload(self._load, reg, path)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def set_remaining(self, key: str, secret: str, iterations: int) -> None:
        """LRTF hint from the driver: iterations the trial still has after those already
        granted (kept for later if the trial has not registered yet)."""
        self._driver(secret)
        with self._lock:
            self._hints[key] = int(iterations)
            reg = self._regs.get(key)
        if reg is not None and self._engine is not None:
            # The task may go away meanwhile; a hint is not worth an error.
            with contextlib.suppress(TuneHydraError):
                self._engine.set_remaining(reg.name, int(iterations))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def cancel(self, key: str, token: str) -> None:
        """Drop the trial's granted-but-unstarted work (Tune stopped or paused it), or stop
        waiting for its factory if it is still being built; needs the trial's token or the
        executor's secret."""
        self._abort_build(key, token)
        with self._lock:
            reg = self._regs.get(key)
        if reg is None:
            return
        self._owned(key, token)
        if self._engine is not None:
            with contextlib.suppress(TuneHydraError):
                self._engine.cancel(reg.name)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def deregister(self, key: str, token: str) -> bool:
        """Forget trial ``key`` if ``token`` owns it (or is the executor's secret). True if
        removed; False for a trial that is not registered or belongs to someone else."""
        with self._lock:
            reg = self._regs.get(key)
            owner = reg is not None and (
                reg.token == token or (bool(self._secret) and token == self._secret)
            )
            if reg is None or not owner:
                return False
            del self._regs[key]
            self._hints.pop(key, None)
        if self._engine is not None:
            await self._offload(self._engine.remove_task, reg.name)
        return True

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def registered(self, secret: str) -> dict[str, list[str]]:
        """``{"trials": registered trial ids, "engine_tasks": the engine's task names}``
        (for the executor's driver only)."""
        self._driver(secret)
        with self._lock:
            trials = sorted(self._regs)
        tasks = sorted(self._engine.tasks()) if self._engine is not None else []
        return {"trials": trials, "engine_tasks": tasks}

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def trace(self, secret: str = "") -> list[Any]:
        """The engine's trace events, device labels prefixed with this node's label (for
        the experiment's driver only)."""
        self._driver(secret)
        if self._engine is None:
            return []
        events = list(self._engine.trace.events)
        if self._node_label:
            events = [
                dataclasses.replace(e, device=f"{self._node_label}/{e.device}") for e in events
            ]
        return events

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def summary(self, secret: str = "") -> dict[str, Any]:
        """The engine's summary (per-device utilization ...; for the experiment's driver
        only)."""
        self._driver(secret)
        return dict(self._engine.summary()) if self._engine is not None else {}

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def close(self, secret: str = "") -> None:
        """Close the engine (its threads stop); the actor may then be killed (for the
        experiment's driver only)."""
        self._driver(secret)
        if self._engine is not None:
            await self._offload(self._engine.close)
            self._engine = None
        with self._lock:
            self._regs.clear()
