"""The engine actor: one async Ray actor per node, hosting one :class:`Engine` for every
trial that runs on that node.

Every trial runs in a thread of this process: a task factory's and a class trainable's
as a class run (:mod:`tune_hydra.frontends.ray.classes`), a function trainable's as a
function run (:mod:`tune_hydra.frontends.ray.function`). Why an *async* actor: each
trial's proxy awaits its run's next result, so many trials wait at once while the engine
interleaves their shard operations on the node's devices. Compute never runs inside a
coroutine, and control calls use their own concurrency group, so a burst of ``step``
calls never delays a ``deregister``.

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
import threading
from collections.abc import Callable
from typing import Any

import ray

from tune_hydra.exceptions import TuneHydraError
from tune_hydra.frontends.failures import portable
from tune_hydra.frontends.ray.class_relay import ClassRelay
from tune_hydra.frontends.ray.errors import NotOwnerError
from tune_hydra.frontends.ray.factories import BoundFactory as BoundFactory  # its old home
from tune_hydra.frontends.ray.factories import FactoryCache
from tune_hydra.frontends.ray.function_relay import FunctionRelay
from tune_hydra.frontends.ray.hints import TrialHints
from tune_hydra.frontends.ray.names import engine_actor_name as engine_actor_name
from tune_hydra.frontends.ray.task_trainable import PendingBuilds, TaskSpec, TaskTrainable
from tune_hydra.options import EngineOptions

CONTROL_GROUP = "control"
DEFAULT_ENGINE_CLASS = "tune_hydra.engine:Engine"
DEFAULT_FACTORY_TIMEOUT_S = 600.0
"""How long a task factory may take by default (``HydraExecutor(factory_timeout_s=...)``)."""


class EngineActor:
    """Hosts one engine for the trials of one node. Created by
    :class:`~tune_hydra.HydraExecutor`; not meant to be used directly.

    Its jobs have owners of their own: a task factory's trial is a
    :class:`~tune_hydra.frontends.ray.task_trainable.TaskTrainable` (building, guarding
    and training its task, its checkpoints), the experiments' factories a
    :class:`~tune_hydra.frontends.ray.factories.FactoryCache`, the factories still running
    :class:`~tune_hydra.frontends.ray.task_trainable.PendingBuilds`, the driver's hints a
    :class:`~tune_hydra.frontends.ray.hints.TrialHints`, and the
    trials that train themselves in threads of this process a
    :class:`~tune_hydra.frontends.ray.function_relay.FunctionRelay` (function trainables)
    and a :class:`~tune_hydra.frontends.ray.class_relay.ClassRelay` (class trainables).
    The actor checks who calls, and runs blocking work off its event loops.

    Args:
        engine_options: the options of the engine (``Engine(**engine_options.kwargs())``).
        task_options: the task options shared by every factory's trial (seed,
            max_grad_norm, accumulate_steps, precision, iteration_batches).
        engine_class: ``"module:Class"`` of the engine (tests may swap in a stub).
        torch_threads: ``torch.set_num_threads`` for CPU work; None leaves torch's default.
        node_label: prefix of the device labels in :meth:`trace` (tells nodes apart).
        factories: where the experiment's pickled task factories are read from (a
            :class:`~tune_hydra.frontends.ray.factories.FactoryStore`, or a ``{id: blob}``
            dict when hosted without Ray).
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
        self._secret = secret
        self._factory_timeout_s = factory_timeout_s
        self._engine: Any = None
        self._lock = threading.RLock()  # the engine may be asked for from several threads
        self._hints = TrialHints()
        self._milestones_given = 0  # set_milestone calls that reached the engine
        self._factories = FactoryCache(factories if factories is not None else {})
        self._builds = PendingBuilds(secret)
        self._functions = FunctionRelay(self._hints, self._is_driver)
        self._classes = ClassRelay(self._functions)
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

    async def _offload(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run blocking work in the control pool, re-raising errors Ray can ship."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        except TuneHydraError as err:
            raise portable(err) from None

    def _driver(self, secret: str) -> None:
        """Refuse a driver-side call that does not carry this executor's secret."""
        if not self._secret or not hmac.compare_digest(str(secret), self._secret):
            raise NotOwnerError(
                "this call needs the key of the experiment (HydraExecutor) that started "
                "this engine, and did not carry it: another experiment's driver on the "
                "cluster cannot register, change, list, trace or close its trials. Use the "
                "HydraExecutor (or the trainable it made) that started this engine"
            )

    def _is_driver(self, token: str) -> bool:
        return bool(self._secret) and hmac.compare_digest(str(token), self._secret)

    # ------------------------------------------------------------ actor methods
    @ray.method(concurrency_group=CONTROL_GROUP)
    async def start(self) -> dict[str, Any]:
        """Build the engine now (so bad options fail at start, not in the first trial)."""
        await self._offload(self._ensure_engine)
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    # ------------------------------------------------------ function trainables
    @ray.method(concurrency_group=CONTROL_GROUP)
    async def fn_start(
        self,
        key: str,
        token: str,
        factory_id: str,
        config: dict[str, Any],
        params: dict[str, Any] | None,
        secret: str,
        context: dict[str, Any],
    ) -> None:
        """Start trial ``key``'s function trainable (the experiment's stored function
        ``factory_id``) in a thread of this process, on this engine; it replaces (stops)
        any older copy of the trial's function and belongs to ``token``. ``context``:
        the proxy session's trial info, storage, working directory and checkpoint (see
        :class:`~tune_hydra.frontends.ray.function.FunctionRun`).

        Raises:
            NotOwnerError: ``secret`` is not the experiment's.
        """
        self._driver(secret)
        fn = await self._offload(self._factories.bind, factory_id, params or {})
        engine = await self._offload(self._ensure_engine)
        self._functions.start(
            fn,
            config,
            key=key,
            token=token,
            engine=engine,
            context=context,
            seed=self._task_options.get("seed"),
        )

    async def fn_next(self, key: str, token: str, persisted: Any = None) -> tuple[str, Any, Any]:
        """Let trial ``key``'s function go on from its last report, and wait for its next
        item: ``("report", metrics, checkpoint)``, ``("error", text, systematic error or
        None)`` or ``("done", None, None)``. ``persisted``: the checkpoint the proxy's
        session persisted from the last report (``tune.get_checkpoint()`` from now on)."""
        return await self._functions.next(key, token, persisted)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def fn_stop(self, key: str, token: str) -> bool:
        """Stop trial ``key``'s function (Tune stopped or paused it): it ends at its next
        forward or report and its loops leave the engine. False if it was not running."""
        return self._functions.stop(key, token)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def functions(self, secret: str) -> list[str]:
        """The trial ids whose function's thread still runs here (a stopped one until it
        reached its next forward or report); for the executor's driver only."""
        self._driver(secret)
        return self._functions.alive()

    # -------------------------------------------------------- class trainables
    @ray.method(concurrency_group=CONTROL_GROUP)
    async def cls_start(
        self,
        key: str,
        token: str,
        factory_id: str,
        config: dict[str, Any],
        params: dict[str, Any] | None,
        secret: str,
        context: dict[str, Any],
    ) -> None:
        """Build trial ``key``'s instance of the experiment's stored class trainable
        ``factory_id`` (its ``setup`` runs) on a thread of its own in this process, on
        this engine; it belongs to ``token`` and replaces (stops) an older run of the
        trial. ``context``: the proxy's trial info, storage and working directory (see
        :class:`~tune_hydra.frontends.ray.classes.ClassRun`).

        Raises:
            NotOwnerError: ``secret`` is not the experiment's.
            TrialFunctionError: the class's ``__init__`` / ``setup`` raised.
        """
        from tune_hydra.frontends.ray.classes import class_and_parameters

        self._driver(secret)
        bound = await self._offload(self._factories.bind, factory_id, params or {})
        cls, values = await self._offload(class_and_parameters, bound)
        spec = None
        if not isinstance(cls, type):  # a task factory: the canned class trainable
            task = dict(context.get("task") or {})
            spec = TaskSpec(
                bound,
                self._task_options,
                self._builds,
                self._factory_timeout_s,
                self._functions,
                required=tuple(task.get("required") or ()),
                checkpoint=task.get("checkpoint"),
            )
            cls, values = TaskTrainable, {}
        engine = await self._offload(self._ensure_engine)
        await self._classes.start(
            cls,
            values,
            config,
            key=key,
            token=token,
            engine=engine,
            context=context,
            seed=self._task_options.get("seed"),
            spec=spec,
        )

    async def cls_call(
        self, token: str, method: str, args: tuple[Any, ...], counters: dict[str, Any]
    ) -> Any:
        """Call ``method`` (``step``, ``save_checkpoint`` or ``load_checkpoint``) of the
        class-trainable instance of the proxy ``token``, on its thread, after setting its
        iteration counters to the proxy's (``counters``); returns what it returns."""
        return await self._classes.call(token, method, args, counters)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def cls_reset(
        self,
        token: str,
        new_key: str,
        config: dict[str, Any],
        context: dict[str, Any],
        counters: dict[str, Any],
    ) -> bool:
        """Tune reset the proxy ``token`` for trial ``new_key`` (``reuse_actors``): reset
        its instance likewise (Tune's ``Trainable.reset``: the new config, trial info,
        storage and working directory, then the class's ``reset_config``); on success
        the run serves ``new_key`` from now on. Returns what ``reset_config`` returned."""
        return await self._classes.reset(token, new_key, config, context, counters)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def cls_end(self, token: str) -> bool:
        """The proxy ``token``'s cleanup: its instance's ``cleanup()`` runs, then its
        thread ends and its loops leave the engine. False if it was not running."""
        return await self._classes.end(token)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def abort_builds(self, secret: str) -> int:
        """Stop waiting for every factory still running (the driver was interrupted), so
        that those trials end at once instead of when their factories return. Returns how
        many were waiting."""
        self._driver(secret)
        return self._builds.abort_all()

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def release_factory(self, secret: str, factory_id: str) -> None:
        """Forget an experiment's factory (it ended); trials still registered keep their
        tasks."""
        self._driver(secret)
        self._factories.release(factory_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def set_remaining(self, key: str, secret: str, iterations: int) -> None:
        """LRTF hint from the driver: iterations the trial still has after those already
        granted (kept for later if the trial has not registered yet)."""
        self._driver(secret)
        self._hints.set_remaining(key, int(iterations))
        self._functions.hint(key, remaining=int(iterations))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def set_milestone(self, key: str, secret: str, iterations: int | None) -> None:
        """Milestone hint from the driver: iterations until the trial's next milestone
        (a rung its scheduler decides at), ``None`` past its last (kept for later if the
        trial has not registered yet); see ``Engine.set_milestone``."""
        self._driver(secret)
        value = None if iterations is None else int(iterations)
        self._hints.set_milestone(key, value)
        if self._functions.hint(key, milestone=value):
            self._milestones_given += 1

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def cancel(self, key: str, secret: str) -> None:
        """Tune stopped or paused trial ``key``: stop waiting for its factory if it is
        still being built (its setup then fails); for the executor's driver only (a
        trial's proxy ends its own wait with its cleanup). A trial between two steps has
        no work queued in the engine."""
        self._driver(secret)
        self._builds.abort(key, secret)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def deregister(self, key: str, token: str, completed: bool = False) -> bool:
        """Stop trial ``key``'s run if ``token`` owns it (or is the executor's secret).
        True if it was stopped; False for a trial that does not run here or belongs to
        someone else. ``completed``: the trial completed, which leaves a class
        trainable's run (a task factory's too) to its proxy (Tune may reset it for
        another trial)."""
        stopped = self._functions.stop(key, token, completed)
        if stopped:  # the trial ended: its hints go with it
            self._hints.forget(key)
            with contextlib.suppress(TuneHydraError):  # someone else's: theirs to stop
                self._builds.abort(key, token)
        return stopped

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def registered(self, secret: str) -> dict[str, list[str]]:
        """``{"trials": the trial ids with a run here, "engine_tasks": the engine's task
        names}`` (for the executor's driver only)."""
        self._driver(secret)
        tasks = sorted(self._engine.tasks()) if self._engine is not None else []
        return {"trials": self._functions.running(), "engine_tasks": tasks}

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
        only), with the ``policy`` it runs and ``milestones_given``: the trials' milestone
        hints (``set_milestone``) that reached it."""
        self._driver(secret)
        if self._engine is None:
            return {}
        return {
            **self._engine.summary(),
            "policy": getattr(self._engine.policy, "name", type(self._engine.policy).__name__),
            "milestones_given": self._milestones_given,
        }

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def close(self, secret: str = "") -> None:
        """Close the engine (its threads stop); the actor may then be killed (for the
        experiment's driver only)."""
        self._driver(secret)
        self._functions.stop_all()
        self._classes.stop_all()
        if self._engine is not None:
            await self._offload(self._engine.close)
            self._engine = None
