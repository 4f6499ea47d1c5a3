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
import importlib
import json
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from tune_hydra.exceptions import TuneHydraError
from tune_hydra.tune.errors import (
    EngineError,
    EngineUnavailableError,
    TaskFactoryError,
    TrialNotRegisteredError,
)

ENGINE_ACTOR_PREFIX = "tune_hydra_engine"
MODEL_FILE = "model.pt"
"""The whole model's ``state_dict`` (user's keys): ``model.load_state_dict(torch.load(p))``."""
STATE_FILE = "hydra_state.pt"
"""Everything else needed to resume exactly: optimizer states, RNG, epoch, iteration."""
META_FILE = "hydra_meta.json"
"""Human-readable facts about the checkpoint (iteration, epoch, files)."""
CONTROL_GROUP = "control"
DEFAULT_ENGINE_CLASS = "tune_hydra.engine:Engine"
_CONFIG_KEY = "_tune_config"


def engine_actor_name(run_id: str, node_id: str) -> str:
    """The Ray name of the engine actor of executor ``run_id`` on node ``node_id``."""
    return f"{ENGINE_ACTOR_PREFIX}:{run_id}:{node_id}"


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
    """Optimizer states from a checkpoint, with the hyperparameters (``lr``, betas, ...)
    of freshly built optimizers.

    PBT restores a checkpoint into a trial with a *mutated* config: the moments must come
    from the checkpoint but the learning rate from the new config, as in a hand-written
    PBT loop that sets ``lr`` after loading. Structures that do not match are left alone.
    """
    if not isinstance(loaded, list) or not isinstance(fresh, list) or len(loaded) != len(fresh):
        return loaded
    out = []
    for old, new in zip(loaded, fresh, strict=True):
        if (
            isinstance(old, dict)
            and isinstance(new, dict)
            and isinstance(old.get("param_groups"), list)
            and isinstance(new.get("param_groups"), list)
            and len(old["param_groups"]) == len(new["param_groups"])
        ):
            groups = [
                {**{k: v for k, v in ng.items() if k != "params"}, "params": og["params"]}
                for og, ng in zip(old["param_groups"], new["param_groups"], strict=True)
            ]
            old = {**old, "param_groups": groups}
        out.append(old)
    return out


class EngineActor:
    """Hosts one engine for the trials of one node. Created by
    :class:`~tune_hydra.HydraExecutor`; not meant to be used directly.

    Args:
        engine_kwargs: keyword arguments of ``Engine(...)`` (devices, device_memory, policy,
            prefetch, recompute).
        task_options: keyword arguments of ``Engine.add_task`` shared by every trial (seed,
            max_grad_norm, accumulate_steps, precision, iteration_batches).
        engine_class: ``"module:Class"`` of the engine (tests may swap in a stub).
        torch_threads: ``torch.set_num_threads`` for CPU work; None leaves torch's default.
        node_label: prefix of the device labels in :meth:`trace` (tells nodes apart).
    """

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        task_options: dict[str, Any],
        engine_class: str = DEFAULT_ENGINE_CLASS,
        torch_threads: int | None = None,
        node_label: str = "",
    ) -> None:
        self._engine_kwargs = engine_kwargs
        self._task_options = task_options
        self._engine_class = engine_class
        self._torch_threads = torch_threads
        self._node_label = node_label
        self._engine: Any = None
        self._lock = threading.RLock()  # registry is touched from two event-loop threads
        self._regs: dict[str, _Registration] = {}
        self._hints: dict[str, int] = {}
        self._factories: dict[bytes, Callable[[dict[str, Any]], Any]] = {}
        self._counter = 0
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
                self._engine = cls(**self._engine_kwargs)
            return self._engine

    async def _offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking work in the control pool, re-raising errors Ray can ship."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        except TuneHydraError as err:
            raise _portable(err) from None

    def _owned(self, key: str, token: str) -> _Registration:
        with self._lock:
            reg = self._regs.get(key)
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

    def _factory(self, blob: bytes) -> Callable[[dict[str, Any]], Any]:
        with self._lock:
            fn = self._factories.get(blob)
        if fn is None:
            fn = ray.cloudpickle.loads(blob)
            with self._lock:
                self._factories[blob] = fn
        return fn

    def _build(self, key: str, token: str, blob: bytes, config: dict[str, Any]) -> int:
        """Build the trial's task with the factory and add it to the engine (blocking).

        Registrations run one at a time: a factory's seeded draws and ``add_task``'s peek
        at the data (which saves and restores torch's global generator) must not interleave
        with another registration's.
        """
        with self._build_lock:
            return self._build_one(key, token, blob, config)

    def _build_one(self, key: str, token: str, blob: bytes, config: dict[str, Any]) -> int:
        from tune_hydra.engine.task import ModelTask

        eng = self._ensure_engine()
        try:
            factory = self._factory(blob)
            # Factories seed and draw from torch's global CPU generator (torch.manual_seed,
            # weight init); it is shared with other registrations and the engine's workers,
            # so build under the engine's RNG lock or concurrent builds get each other's draws.
            from tune_hydra.engine.rng import CPU_RNG_LOCK

            with CPU_RNG_LOCK:
                task = factory(dict(config))
        except Exception:
            raise TaskFactoryError(
                f"the task factory raised for trial {key} (config {config!r}); fix make_task, "
                f"the other trials go on. Factory traceback:\n{traceback.format_exc()}"
            ) from None
        if not isinstance(task, ModelTask):
            raise TaskFactoryError(
                f"the task factory returned {type(task).__name__} for trial {key}, not a "
                f"tune_hydra.ModelTask; make_task(config) must return "
                f"th.ModelTask(model=..., loss_fn=..., optimizer=..., train_data=...)"
            )
        with self._lock:
            old = self._regs.pop(key, None)
            self._counter += 1
            name = key if not old and key not in eng.tasks() else f"{key}~{self._counter}"
        if old is not None:
            eng.remove_task(old.name)
        n_shards = int(eng.add_task(name, task, **self._task_options))
        with self._lock:
            self._regs[key] = _Registration(key, token, name, dict(config))
            hint = self._hints.get(key)
        if hint is not None:
            eng.set_remaining(name, hint)
        return n_shards

    def _save(self, reg: _Registration, path: str) -> dict[str, Any]:
        import torch

        state = dict(self._ensure_engine().get_state(reg.name))
        model = state.pop("model")
        state[_CONFIG_KEY] = reg.config
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(model, out / MODEL_FILE)
        torch.save(state, out / STATE_FILE)
        meta = {
            "format": 1,
            "trial_id": reg.key,
            "iteration": state.get("iteration"),
            "epoch": state.get("epoch"),
            "files": {"model": MODEL_FILE, "state": STATE_FILE},
        }
        (out / META_FILE).write_text(json.dumps(meta, default=str, indent=1))
        return meta

    def _load(self, reg: _Registration, path: str) -> None:
        import torch

        src = Path(path)
        if not (src / MODEL_FILE).exists() or not (src / STATE_FILE).exists():
            raise EngineError(
                f"{src} is not a tune_hydra checkpoint (it lacks {MODEL_FILE} or {STATE_FILE}); "
                f"restore from a checkpoint written by a HydraExecutor trial"
            )
        eng = self._ensure_engine()
        model = torch.load(src / MODEL_FILE, map_location="cpu", weights_only=True)
        # Our own file (RNG states, optimizer states): not a user-supplied pickle.
        state = torch.load(src / STATE_FILE, map_location="cpu", weights_only=False)
        old_config = state.pop(_CONFIG_KEY, None)
        state["model"] = model
        if old_config is not None and old_config != reg.config and "optimizers" in state:
            fresh = eng.get_state(reg.name)
            state["optimizers"] = _merge_hyperparameters(
                state["optimizers"], fresh.get("optimizers")
            )
        eng.set_state(reg.name, state)

    # ------------------------------------------------------------ actor methods
    @ray.method(concurrency_group=CONTROL_GROUP)
    async def start(self) -> dict[str, Any]:
        """Build the engine now (so bad options fail at start, not in the first trial)."""
        await self._offload(self._ensure_engine)
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def register(self, key: str, token: str, blob: bytes, config: dict[str, Any]) -> int:
        """Build trial ``key``'s task and add it to the engine; it replaces any older
        registration of ``key``. Returns the number of shards."""
        return int(await self._offload(self._build, key, token, blob, config))

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
    async def set_remaining(self, key: str, iterations: int) -> None:
        """LRTF hint: iterations the trial still has after those already granted."""
        with self._lock:
            self._hints[key] = int(iterations)
            reg = self._regs.get(key)
        if reg is not None and self._engine is not None:
            # The task may go away meanwhile; a hint is not worth an error.
            with contextlib.suppress(TuneHydraError):
                self._engine.set_remaining(reg.name, int(iterations))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def cancel(self, key: str) -> None:
        """Drop the trial's granted-but-unstarted work (Tune stopped or paused it)."""
        with self._lock:
            reg = self._regs.get(key)
        if reg is not None and self._engine is not None:
            with contextlib.suppress(TuneHydraError):
                self._engine.cancel(reg.name)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def deregister(self, key: str, token: str | None = None) -> bool:
        """Forget trial ``key`` (only if ``token`` owns it, when given). True if removed."""
        with self._lock:
            reg = self._regs.get(key)
            if reg is None or (token is not None and reg.token != token):
                return False
            del self._regs[key]
            self._hints.pop(key, None)
        if self._engine is not None:
            await self._offload(self._engine.remove_task, reg.name)
        return True

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def registered(self) -> dict[str, list[str]]:
        """``{"trials": registered trial ids, "engine_tasks": the engine's task names}``."""
        with self._lock:
            trials = sorted(self._regs)
        tasks = sorted(self._engine.tasks()) if self._engine is not None else []
        return {"trials": trials, "engine_tasks": tasks}

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def trace(self) -> list[Any]:
        """The engine's trace events, device labels prefixed with this node's label."""
        if self._engine is None:
            return []
        events = list(self._engine.trace.events)
        if self._node_label:
            events = [
                dataclasses.replace(e, device=f"{self._node_label}/{e.device}") for e in events
            ]
        return events

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def summary(self) -> dict[str, Any]:
        """The engine's summary (per-device utilization ...)."""
        return dict(self._engine.summary()) if self._engine is not None else {}

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def close(self) -> None:
        """Close the engine (its threads stop); the actor may then be killed."""
        if self._engine is not None:
            await self._offload(self._engine.close)
            self._engine = None
        with self._lock:
            self._regs.clear()
