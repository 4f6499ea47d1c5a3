""":class:`HydraExecutor`: configuration and lifecycle of the engine actors.

It is **not** a Tune ``TrialExecutor``: Ray deprecated custom trial executors in 2.3 and
removed ``RayTrialExecutor`` in 2.7, and ``tune.run(trial_executor=...)`` raises
``TypeError`` in current Ray. The call form ``trial_executor=HydraExecutor(...)`` is honoured
by :func:`tune_hydra.run`; for ``tune.Tuner`` use :meth:`HydraExecutor.trainable`,
:meth:`HydraExecutor.scheduler` and :meth:`HydraExecutor.callbacks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import secrets
import types
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray import tune
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tune_hydra.core.policies import BasePolicy
from tune_hydra.exceptions import TuneHydraError
from tune_hydra.frontends.ray import registry
from tune_hydra.frontends.ray.actor import (
    CONTROL_GROUP,
    DEFAULT_ENGINE_CLASS,
    DEFAULT_FACTORY_TIMEOUT_S,
    BoundFactory,
    EngineActor,
    engine_actor_name,
    tune_report_call,
)
from tune_hydra.frontends.ray.errors import (
    EngineStartError,
    NotATaskFactoryError,
    TrialResourcesError,
)
from tune_hydra.frontends.ray.factories import FactoryStore
from tune_hydra.options import (
    EngineOptions,
    check_factory_timeout,
    check_positive_int,
    check_seconds,
    check_task_options,
)

logger = logging.getLogger(__name__)

DEFAULT_SLOT_RESOURCE = "hydra_slot"
DEFAULT_SLOTS_PER_NODE = 8


def _unwrap(err: BaseException) -> BaseException:
    """The user-facing error inside a RayTaskError / ActorDiedError, if there is one."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return cause
    return err


def unwrap_with_parameters(fn: Any) -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """``(make_task, parameters)`` when ``fn`` is what ``tune.with_parameters(make_task,
    **parameters)`` returns for a function, else None.

    Tune's wrapper fetches every parameter from the object store at each call; the engine
    calls ``make_task(config, **parameters)`` itself instead (through a
    :class:`~tune_hydra.frontends.ray.actor.BoundFactory`, which fetches them once per engine).
    A parameter is an ``ObjectRef`` once Ray is up, else the value Tune holds until then.
    """
    if not isinstance(fn, types.FunctionType) or not fn.__module__.startswith("ray."):
        return None
    cells: dict[str, Any] = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            cells[name] = cell.cell_contents
    from ray.tune.registry import _ParameterRegistry

    params_registry, prefix = cells.get("parameter_registry"), cells.get("prefix")
    keys, inner = cells.get("keys"), cells.get("trainable")
    if (
        not isinstance(params_registry, _ParameterRegistry)
        or not isinstance(prefix, str)
        or not isinstance(keys, (set, frozenset, list, tuple))
        or not callable(inner)
    ):
        return None
    params: dict[str, Any] = {}
    for key in keys:
        ref = params_registry.references.get(prefix + str(key))
        if ref is None and prefix + str(key) not in params_registry.to_flush:
            return None
        params[str(key)] = ref if ref is not None else params_registry.to_flush[prefix + str(key)]
    return inner, params


def check_task_factory(make_task: Any) -> None:
    """Raise unless ``make_task`` looks like ``make_task(config) -> ModelTask``.

    ``tune.with_parameters(make_task, data=...)`` is a task factory called as
    ``make_task(config, data=...)``.

    Raises:
        NotATaskFactoryError: not callable with a config, a class, a string, or a function
            trainable (its code calls ``tune.report``).
        TrialResourcesError: ``tune.with_resources`` was applied to it.
    """
    fix = (
        "HydraExecutor needs a task factory: a function make_task(config) -> th.ModelTask "
        "that builds the model, loss, optimizer and data for one config. To run an ordinary "
        "Tune trainable, drop trial_executor (th.run then forwards to tune.run)."
    )
    if isinstance(make_task, str) or inspect.isclass(make_task) or not callable(make_task):
        kind = (
            f"the string {make_task!r}"
            if isinstance(make_task, str)
            else f"the class {make_task.__name__}"
            if inspect.isclass(make_task)
            else f"a {type(make_task).__name__}"
        )
        raise NotATaskFactoryError(f"got {kind}. {fix}")
    name = getattr(make_task, "__name__", make_task)
    if getattr(make_task, "_resources", None) is not None:
        raise TrialResourcesError(
            "",
            f"tune.with_resources was applied to the task factory {name!r}, but the "
            f"factory only builds a model: every trial is a proxy that reserves one engine "
            f"slot and trains on the engine's devices",
            "Pass the factory without tune.with_resources; size the engines with "
            "HydraExecutor(devices=..., device_memory=...), and the number of concurrent "
            "trials per node with the hydra_slot resource (slots_per_node)",
        )
    unwrapped = unwrap_with_parameters(make_task)
    fn, params = unwrapped if unwrapped is not None else (make_task, {})
    call = tune_report_call(fn)
    if call is not None:
        raise NotATaskFactoryError(
            f"{name!r} calls {call}(...): it is a function trainable, which trains and "
            f"reports by itself, not a task factory (tune_hydra runs the training loop and "
            f"reports loss and val_loss itself). {fix}"
        )
    try:
        inspect.signature(fn).bind({}, **dict.fromkeys(params))
    except TypeError:
        with_params = f" and the keyword arguments {sorted(params)}" if params else ""
        raise NotATaskFactoryError(
            f"{name!r} cannot be called with one argument (the config){with_params}. {fix}"
        ) from None
    except ValueError:
        pass  # no signature (a builtin): let the engine actor find out


class HydraExecutor:
    """Runs the trials of a Ray Tune experiment on shared tune_hydra engines.

    One engine actor per node that carries the slot resource trains all trials placed on
    that node, multiplexing their shards over the node's devices. Trials are light proxies
    that ask for no CPU, only one slot (``{"CPU": 0, slot_resource: 1}``), so a node runs as
    many trials at once as it has slots, and every trial runs next to its engine.

    This is a configuration and lifecycle object, **not** a Tune ``TrialExecutor``: Ray
    deprecated custom trial executors in 2.3 and removed them in 2.7, so Ray's own
    ``ray.tune.run(..., trial_executor=HydraExecutor(...))`` raises ``TypeError: run() got
    an unexpected keyword argument 'trial_executor'``. Either call
    ``tune_hydra.run(make_task, ..., trial_executor=HydraExecutor(...))`` (the same
    arguments), or call ``th.patch_tune()`` once first, after which ``tune.run`` accepts
    ``trial_executor=`` and forwards such calls to ``tune_hydra.run`` (see
    :func:`tune_hydra.patch_tune`). For ``tune.Tuner``, build its arguments from the
    executor::

        with th.HydraExecutor(device_memory="8GiB") as ex:
            tuner = tune.Tuner(
                ex.trainable(make_task),
                param_space={...},
                tune_config=tune.TuneConfig(
                    metric="val_loss", mode="min", scheduler=ex.scheduler(ASHAScheduler()),
                    max_concurrent_trials=ex.max_concurrent_trials,
                ),
                run_config=tune.RunConfig(stop=ex.stopper(), callbacks=ex.callbacks()),
            )
            results = tuner.fit()

    Args:
        devices: ``"auto"`` (the node's GPUs, or its CPU with a warning), ``"cpu"``, or a
            list such as ``["cuda:0", "cuda:1"]`` / ``["cpu", "cpu"]``; the same on each node.
        device_memory: per-device memory budget for shards (bytes or ``"8GiB"``); None uses
            the whole device.
        host_memory: each engine's host-memory budget for the trials' shard state between
            visits (bytes or ``"8GiB"``); the state beyond it is written to ``spill_dir``
            and read back before its shard runs, so a node trains more (or larger) trials
            than its RAM holds, with the same results. None: no limit, nothing goes to
            disk. Needs ``spill_dir``; smaller than one shard's state fails that trial
            with ``HostBudgetError``. The engine may go over it by up to (devices + 1) x
            the largest shard's state unless it is at least (devices + 2) x that plus the
            boundary tensors waiting trials park (one batch boundary each).
        spill_dir: the folder, on every engine node, of the disk tier: a local NVMe disk,
            not a tmpfs (which is RAM) nor a network file system. Each engine makes its own
            scratch subfolder there and removes it when it shuts down. A folder that is
            missing, not writable or on a full disk stops the engines from starting
            (``SpillDirError``); a write that fails mid-run fails that trial
            (``SpillDiskFullError``). Unused without ``host_memory``.
        policy: the engine's scheduling policy (``"lrtf"``, ``"fifo"``, ``"round_robin"`` or a
            policy instance).
        prefetch: copy the next shard in while the current one computes.
        recompute: re-run each shard's forward in its backward instead of keeping its
            graph; default ``True`` on GPUs, ``False`` on CPU devices. Without it each
            trial's batch reserves its kept activations in ``device_memory``, so fewer
            trials run at once on a GPU (see ``tune_hydra.engine.Engine``).
        iteration_batches: None: one Tune iteration is one epoch; N: N batches.
        seed, max_grad_norm, accumulate_steps, precision: per-task engine options
            (``Engine.add_task``), the same for every trial.
        slots_per_node: concurrent trials per node when tune_hydra starts Ray itself
            (``ray.init(resources={slot_resource: slots_per_node})``). On an existing cluster,
            start each node with ``--resources='{"hydra_slot": N}'``.
        slot_resource: the custom resource that marks engine nodes and trial slots.
        torch_threads: torch CPU threads in the engine actor (default: the node's CPUs).
        start_timeout_s: how long to wait for the engine actors to come up.
        factory_timeout_s: how long one call of the task factory may take (default 600 s;
            None: no limit). A factory that takes longer fails its trial with
            ``TaskFactoryTimeoutError``; the other trials are never held up by a factory,
            slow or not: it runs in its own thread on a private random generator.
        checkpoint: when trials save a Tune checkpoint (``model.pt`` and the state that
            resumes training) without any checkpoint setting of the run: ``"every"``
            iteration (the default, like Ray Tune's examples: every trial, ASHA-stopped
            ones too, ends with one, and PBT finds one to exploit), at each trial's
            ``"end"`` (its last iteration, whatever stopped it), or None / False (only
            what the run's ``checkpoint_freq`` / ``checkpoint_config`` ask). When the
            run sets a checkpoint frequency, that setting rules; ``checkpoint_at_end``
            only adds the last checkpoint (``tune.Tuner`` turns it on by itself).
            Every checkpoint holds the whole model: bound their number with
            ``CheckpointConfig(num_to_keep=...)`` for large models.

    Every option is checked here, when the executor is built (before Ray starts, and
    without loading torch), by the one validator of :mod:`tune_hydra.options` that
    ``Engine``, ``train_models`` and ``th.optimize`` use too; the engine options it does
    not take, and why, are in ``tune_hydra.options.NOT_OFFERED``.

    Mistakes that every trial would repeat (a task factory that returns no ``ModelTask``
    or is a function trainable, a model type that cannot be cut, trials that lost their
    slot) end the experiment at the first trial that hits one: ``th.run`` raises that
    :class:`~tune_hydra.exceptions.SystematicTaskError`; with ``tune.Tuner`` pass
    ``stop=executor.stopper(...)`` and ``callbacks=executor.callbacks()``.

    Host memory: each running trial keeps its model, gradients and optimizer state in the
    engine's process (beyond ``host_memory``, when given, on disk in ``spill_dir``), and is
    also a Ray worker process of its own (about 200 MiB, even though it computes nothing:
    see the README's sizing advice). The task factory is
    stored once in the cluster and once in each engine, never in the trial processes, and
    freed when the experiment ends (``th.run`` returns, :meth:`release`, or
    :meth:`shutdown`).
    """

    def __init__(
        self,
        devices: str | Sequence[str] = "auto",
        device_memory: int | str | None = None,
        policy: str | BasePolicy = "lrtf",
        *,
        host_memory: int | str | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        prefetch: bool = True,
        recompute: bool | None = None,
        iteration_batches: int | None = None,
        seed: int | None = None,
        max_grad_norm: float | None = None,
        accumulate_steps: int = 1,
        precision: Any = None,
        slots_per_node: int | None = None,
        slot_resource: str = DEFAULT_SLOT_RESOURCE,
        torch_threads: int | None = None,
        start_timeout_s: float = 180.0,
        factory_timeout_s: float | None = DEFAULT_FACTORY_TIMEOUT_S,
        checkpoint: str | bool | None = "every",
        _engine_class: str = DEFAULT_ENGINE_CLASS,
    ) -> None:
        if checkpoint is False:
            checkpoint = None
        if checkpoint not in ("every", "end", None):
            raise TuneHydraError(
                f"checkpoint must be 'every' (a checkpoint after every iteration), 'end' "
                f"(after each trial's last iteration) or None (only what the run's "
                f"checkpoint settings ask), not {checkpoint!r}"
            )
        where = "HydraExecutor"
        # Every option is judged here by the one validator of tune_hydra.options that the
        # other front ends use (torch-free: nothing of the engine is imported into the
        # driver), rather than in every trial later.
        # Every trial's Engine.add_task options, as given (the engine resolves the seed).
        task_options: dict[str, Any] = {
            "seed": seed,
            "max_grad_norm": max_grad_norm,
            "accumulate_steps": accumulate_steps,
            "precision": precision,
            "iteration_batches": iteration_batches,
        }
        check_task_options(**task_options, where=where)
        # What every engine actor gets (devices="auto" is resolved per node, and the
        # spill folder is checked on each node, where the engine starts: a path on the
        # driver need not exist there).
        self.engine_options = EngineOptions(
            devices,
            device_memory,
            policy,
            prefetch=prefetch,
            recompute=recompute,
            host_memory=host_memory,
            spill_dir=spill_dir,
            where=where,
        )
        self.factory_timeout_s = check_factory_timeout(factory_timeout_s, where=where)
        check_positive_int(
            slots_per_node,
            "slots_per_node",
            allow_none=True,
            meaning="concurrent trials per node; None: the default",
            where=where,
        )
        check_positive_int(
            torch_threads,
            "torch_threads",
            allow_none=True,
            meaning="torch CPU threads in each engine; None: the node's CPUs",
            where=where,
        )
        check_seconds(
            start_timeout_s,
            "start_timeout_s",
            meaning="the longest wait for the engine actors to start",
            where=where,
        )
        self.iteration_batches = iteration_batches
        self.task_options = task_options
        self.slots_per_node = slots_per_node
        self.slot_resource = slot_resource
        self.torch_threads = torch_threads
        self.start_timeout_s = start_timeout_s
        self.checkpoint: str | None = checkpoint
        self._engine_class = _engine_class
        self.run_id = uuid.uuid4().hex[:10]
        # The experiment's secret: every call to its engine actors (the driver's, and the
        # trials' registrations) and every record it keeps in the cluster store is bound
        # to it; calls and records without it are refused. It travels to the engine actors
        # (creation arguments) and to the trials (the trainable class), never in a name or
        # a key; see the README's "Ownership" for what that does and does not keep out.
        self._secret = secrets.token_hex(16)
        self._store = FactoryStore(self.run_id, self._secret)
        self._factory_ids: list[str] = []
        self._handles: dict[str, Any] = {}  # node id -> engine actor handle
        self._slots = 0
        self._fallback = False
        self._last_trace: list[Any] = []
        self._last_summary: dict[str, Any] = {}

    # ---------------------------------------------------------------- options
    # The engine options are held once, in ``engine_options``; these read them.
    @property
    def devices(self) -> Any:
        return self.engine_options.devices

    @property
    def device_memory(self) -> int | str | None:
        return self.engine_options.device_memory

    @property
    def host_memory(self) -> int | str | None:
        return self.engine_options.host_memory

    @property
    def spill_dir(self) -> str | os.PathLike[str] | None:
        return self.engine_options.spill_dir

    @property
    def policy(self) -> str | BasePolicy:
        return self.engine_options.policy

    @property
    def prefetch(self) -> bool:
        return self.engine_options.prefetch

    @property
    def recompute(self) -> bool | None:
        return self.engine_options.recompute

    # ---------------------------------------------------------------- lifecycle
    @property
    def started(self) -> bool:
        """True while the engine actors are up."""
        return bool(self._handles)

    def start(self) -> HydraExecutor:
        """Start Ray (if needed) and one engine actor per engine node. Idempotent."""
        if self._handles:
            return self
        if not ray.is_initialized():
            slots = self.slots_per_node or DEFAULT_SLOTS_PER_NODE
            ray.init(resources={self.slot_resource: slots})
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        engine_nodes = [n for n in nodes if n["Resources"].get(self.slot_resource, 0) >= 1]
        self._fallback = False
        if not engine_nodes:
            if len(nodes) != 1:
                raise EngineStartError(
                    f"no node of this Ray cluster has the {self.slot_resource!r} resource that "
                    f"marks engine nodes; start each node that should train models with "
                    f"ray start ... --resources='{{\"{self.slot_resource}\": 8}}'"
                )
            # A plain local ray.init(): trials ask for a sliver of CPU instead of a slot.
            self._fallback = True
            engine_nodes = nodes
            warnings.warn(
                f"Ray was started without the {self.slot_resource!r} resource; trials will "
                f"each reserve 0.01 CPU. Call ray.init(resources={{'{self.slot_resource}': 8}}) "
                f"(or let tune_hydra start Ray) to control concurrency with slots.",
                stacklevel=2,
            )
        handles: dict[str, Any] = {}
        slots = 0
        try:
            for node in engine_nodes:
                node_id = node["NodeID"]
                res = node["Resources"]
                slots += (
                    int(res[self.slot_resource])
                    if not self._fallback
                    else (self.slots_per_node or DEFAULT_SLOTS_PER_NODE)
                )
                handles[node_id] = self._create_actor(node_id, res, len(handles))
        except BaseException:
            self._kill(handles)
            raise
        self._slots = slots
        refs = {node: h.start.remote() for node, h in handles.items()}
        try:
            ray.get(list(refs.values()), timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._kill(handles)
            raise EngineStartError(
                f"the engine actors did not start within {self.start_timeout_s:.0f} s; check "
                f"that the engine nodes have free memory and that tune_hydra is installed there"
            ) from None
        except Exception as err:
            self._kill(handles)
            cause = _unwrap(err)
            if isinstance(cause, TuneHydraError):
                raise cause from None
            raise EngineStartError(f"the engine actors failed to start: {cause}") from err
        self._handles = handles
        registry.register(self)
        return self

    def _create_actor(self, node_id: str, res: dict[str, float], index: int) -> Any:
        devices = self.devices
        if isinstance(devices, str) and devices == "auto":
            num_gpus = int(res.get("GPU", 0))
            if num_gpus == 0:
                warnings.warn(
                    f"devices='auto': node {node_id[:8]} has no GPU; its engine trains on the CPU",
                    stacklevel=3,
                )
                devices = "cpu"  # say it here once rather than in every actor's log
        else:
            names = [devices] if isinstance(devices, str) else list(devices)
            num_gpus = sum(1 for d in names if str(d).startswith("cuda"))
        if num_gpus > int(res.get("GPU", 0)):
            raise EngineStartError(
                f"devices={self.devices!r} asks for {num_gpus} GPU(s), but node {node_id[:8]} "
                f"has {int(res.get('GPU', 0))}: use devices='auto' (its GPUs, or its CPU), "
                f"devices='cpu', or run on a node with GPUs"
            )
        threads = self.torch_threads or max(1, int(res.get("CPU", 1)))
        cls = ray.remote(concurrency_groups={CONTROL_GROUP: 32})(EngineActor)  # type: ignore[call-overload]
        return cls.options(
            name=engine_actor_name(self.run_id, node_id),
            # No CPU: an engine that reserved its node's CPUs starved Tune's trials (hang).
            num_cpus=0,
            num_gpus=num_gpus,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(
            dataclasses.replace(self.engine_options, devices=devices),
            self.task_options,
            self._engine_class,
            threads,
            f"node{index}" if index or len(ray.nodes()) > 1 else "",
            self._store,
            self._secret,
            self.factory_timeout_s,
        )

    @staticmethod
    def _kill(handles: dict[str, Any]) -> None:
        for handle in handles.values():
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)

    def shutdown(self) -> None:
        """Collect the engines' trace and summary, then stop the engine actors.

        Safe to call twice. :meth:`trace` and :meth:`summary` still answer afterwards.
        """
        if not self._handles:
            return
        registry.unregister(self.run_id)
        for factory_id in list(self._factory_ids):
            self._drop_factory(factory_id)
        try:
            self._store.clear_errors()  # the trials' recorded mistakes, read by now
        except Exception:
            logger.warning("tune_hydra: could not clear recorded trial errors", exc_info=True)
        try:
            self._last_trace = self._gather_trace()
            self._last_summary = self._gather_summary()
        except Exception:
            logger.warning("tune_hydra: could not collect the engines' trace", exc_info=True)
        with contextlib.suppress(Exception):
            ray.get([h.close.remote(self._secret) for h in self._handles.values()], timeout=30)
        self._kill(self._handles)
        self._handles = {}

    def __enter__(self) -> HydraExecutor:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------- Tune building blocks
    @property
    def trial_resources(self) -> dict[str, float]:
        """What each trial reserves: no CPU, one slot (a CPU sliver without slots)."""
        if self._fallback:
            return {"cpu": 0.01}
        return {"cpu": 0, self.slot_resource: 1}

    @property
    def max_concurrent_trials(self) -> int:
        """The number of slots over all engine nodes (starts the engines if needed)."""
        self.start()
        return self._slots

    def trainable(self, make_task: Callable[..., Any]) -> Any:
        """A Tune trainable (for ``tune.Tuner`` or ``tune.run``) whose trials train
        ``make_task(config)`` on this executor's engines. Starts the engines.

        Tune's wrappers: ``trainable(tune.with_parameters(make_task, data=...))`` and
        ``tune.with_parameters(trainable(make_task), data=...)`` both call
        ``make_task(config, data=...)`` in the engine; the data stays in Ray's object
        store and is fetched once per engine, never into the trial processes. Do not wrap
        the result in ``tune.with_resources``: each trial already reserves one engine slot
        and no CPU (a request without the slot is refused when the trial is added).
        """
        check_task_factory(make_task)
        from tune_hydra.frontends.ray.trainable import HydraTrainable

        self.start()
        name = getattr(make_task, "__name__", "make_task")
        unwrapped = unwrap_with_parameters(make_task)
        factory: Any = make_task if unwrapped is None else BoundFactory(*unwrapped)
        # Stored once in the cluster; the trial processes carry only its id.
        factory_id = self._store.put(ray.cloudpickle.dumps(factory))
        self._factory_ids.append(factory_id)
        cls = type(
            f"Hydra_{name}",
            (HydraTrainable,),
            {
                "_factory_id": factory_id,
                "_run_id": self.run_id,
                "_secret": self._secret,
                "_slot_resource": "" if self._fallback else self.slot_resource,
                "_checkpoint": self.checkpoint,
                "__module__": HydraTrainable.__module__,
            },
        )
        return tune.with_resources(cls, self.trial_resources)

    def release(self, trainable: Any) -> None:
        """Free the task factory of a trainable made by :meth:`trainable` (in the cluster
        and in every engine), once its experiment is over. ``th.run`` does this itself;
        call it between ``Tuner.fit`` calls that each made a new trainable, or let
        :meth:`shutdown` free them all. Trials of that trainable cannot start afterwards."""
        factory_id = getattr(trainable, "_factory_id", None)
        if factory_id is None:  # tune.with_resources wraps our class in a subclass
            factory_id = next(
                (getattr(c, "_factory_id", None) for c in getattr(trainable, "__mro__", ())),
                None,
            )
        if not factory_id:
            raise TuneHydraError(
                f"{trainable!r} was not made by HydraExecutor.trainable(); nothing to release"
            )
        self._drop_factory(factory_id)

    def _drop_factory(self, factory_id: str) -> None:
        if factory_id in self._factory_ids:
            self._factory_ids.remove(factory_id)
        refs = []
        for handle in self._handles.values():
            with contextlib.suppress(Exception):  # a dead engine holds nothing
                refs.append(handle.release_factory.remote(self._secret, factory_id))
        with contextlib.suppress(Exception):
            ray.get(refs, timeout=30)
        try:
            self._store.delete(factory_id)
        except Exception:
            logger.warning("tune_hydra: could not free a task factory", exc_info=True)

    def scheduler(
        self, base: Any = None, *, stop: Any = None, max_iterations: int | None = None
    ) -> Any:
        """Wrap the user's scheduler (or FIFO) so the engines learn each trial's remaining
        budget and drop a stopped or paused trial's queued work.

        Args:
            base: a ``TrialScheduler``, a scheduler name Tune knows (``"asha"``), or None.
            stop: the run's stopping condition (``{"training_iteration": N}`` gives the budget).
            max_iterations: explicit per-trial budget (overrides ``stop`` and ``max_t``).
        """
        from tune_hydra.frontends.ray.scheduler import HydraScheduler

        if isinstance(base, HydraScheduler):
            return base
        if isinstance(base, str):
            from ray.tune.schedulers import create_scheduler

            base = create_scheduler(base)
        return HydraScheduler(base, stop=stop, max_iterations=max_iterations, run_id=self.run_id)

    def callbacks(self) -> list[Any]:
        """Driver-side callbacks to add to the run: they free trials that end abnormally,
        recognise a mistake every trial would repeat (so :meth:`stopper` ends the
        experiment), and ask for the checkpoints of ``HydraExecutor(checkpoint=...)``."""
        from tune_hydra.frontends.ray.callback import HydraCallback

        return [HydraCallback(run_id=self.run_id, checkpoint=self.checkpoint, secret=self._secret)]

    def stopper(self, stop: Any = None) -> Any:
        """The run's stopping condition for ``tune.Tuner``: ``stop`` (a dict such as
        ``{"training_iteration": 4}``, a function ``stop(trial_id, result)`` or a Tune
        ``Stopper``: it means what it means to Tune), plus: end the whole experiment at
        the first trial that fails with a mistake every trial would repeat (see
        :class:`~tune_hydra.exceptions.SystematicTaskError`; it needs
        :meth:`callbacks` in the same run). ``th.run`` uses it by itself::

            tune.RunConfig(stop=ex.stopper({"training_iteration": 4}), callbacks=ex.callbacks())
        """
        from tune_hydra.frontends.ray.callback import HydraStopper

        if isinstance(stop, HydraStopper) and stop.run_id == self.run_id:
            return stop  # already this executor's
        return HydraStopper(self.run_id, stop)

    def systematic_error(self) -> BaseException | None:
        """The mistake that ended this executor's last experiment at its first trial (see
        :meth:`stopper`), or None."""
        from tune_hydra.frontends.ray.callback import systematic_error

        return systematic_error(self.run_id)

    def plan(
        self, make_task: Callable[..., Any], configs: Any, *, num_samples: int = 1, **options: Any
    ) -> Any:
        """How each config's model will be cut by this executor's engines, and the
        smallest ``device_memory`` it fits, without training and without starting Ray:
        :func:`tune_hydra.plan` with this executor's ``device_memory``, ``precision``,
        ``prefetch``, ``seed`` and ``factory_timeout_s``.

        Args:
            make_task: the task factory the experiment will train.
            configs: a config, a list of configs, or a Tune search space (the
                ``param_space`` / ``config`` of the run).
            num_samples: configs drawn from a search space (the run's ``num_samples``).
            options: more :func:`tune_hydra.plan` options (``meta``, ``max_layers_per_shard``
                ...), or overrides of the executor's.

        Returns:
            A :class:`tune_hydra.planning.PlanReports`: one report per config, printed as
            a table.

        Raises:
            TaskFactoryError: the factory raised for a config, naming it.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> import tune_hydra as th
            >>> def make_task(config):
            ...     model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
            ...     return th.ModelTask(model, nn.MSELoss(), torch.optim.Adam,
            ...                         [(torch.randn(8, 256), torch.randn(8, 256))])
            >>> ex = th.HydraExecutor(devices="cpu", device_memory="3MiB")
            >>> [r.num_shards for r in ex.plan(make_task, {"lr": 1e-3})]
            [4]
        """
        from dataclasses import replace

        from tune_hydra.planning import plan

        defaults: dict[str, Any] = {
            "device_memory": self.device_memory,
            "precision": self.task_options["precision"],
            "prefetch": self.prefetch,
            "timeout_s": self.factory_timeout_s,
        }
        if self.task_options["seed"] is not None:
            defaults["seed"] = self.task_options["seed"]
        reports = plan(make_task, configs, num_samples=num_samples, **{**defaults, **options})
        names = [self.devices] if isinstance(self.devices, str) else list(self.devices)
        if any(str(d) == "auto" or str(d).startswith("cuda") for d in names):
            note = (
                "on a GPU the engine also measures each layer's peak there (allocator "
                "rounding, workspaces) and keeps the larger figure: leave some headroom"
                + ("; with device_memory=None it budgets 90% of each GPU's memory"
                   if self.device_memory is None else "")
            )  # fmt: skip
            for i, r in enumerate(reports):
                reports[i] = replace(r, notes=(*r.notes, note))
        return reports

    # ------------------------------------------------------------- inspection
    def engines(self) -> dict[str, Any]:
        """Node id -> engine actor handle (empty when not started)."""
        return dict(self._handles)

    def registered_trials(self) -> dict[str, dict[str, list[str]]]:
        """Per node: the trials the engine actor knows and the engine's task names."""
        refs = {node: h.registered.remote(self._secret) for node, h in self._handles.items()}
        return {node: ray.get(ref, timeout=60) for node, ref in refs.items()}

    def _gather_trace(self) -> list[Any]:
        events: list[Any] = []
        for ref in [h.trace.remote(self._secret) for h in self._handles.values()]:
            events.extend(ray.get(ref, timeout=60))
        return events

    def _gather_summary(self) -> dict[str, Any]:
        refs = {node: h.summary.remote(self._secret) for node, h in self._handles.items()}
        return {node: ray.get(ref, timeout=60) for node, ref in refs.items()}

    def trace(self) -> Any:
        """The engines' timeline (a ``Trace``; devices are prefixed by node when several):
        live while started, else the one collected at shutdown. Draw it with
        ``th.plot_timeline(executor.trace(), "timeline.png")``."""
        events = self._gather_trace() if self._handles else list(self._last_trace)
        from tune_hydra.core.trace import Trace

        return Trace.from_events(events)

    def summary(self) -> dict[str, Any]:
        """Node id -> the engine's summary (live while started, else the last collected)."""
        return self._gather_summary() if self._handles else dict(self._last_summary)

    def __repr__(self) -> str:
        state = f"{len(self._handles)} engine(s)" if self._handles else "not started"
        return (
            f"HydraExecutor(devices={self.devices!r}, device_memory={self.device_memory!r}, "
            + (
                f"host_memory={self.host_memory!r}, spill_dir={str(self.spill_dir)!r}, "
                if self.host_memory is not None
                else ""
            )
            + f"policy={self.policy!r}, {state})"
        )
