""":class:`HydraExecutor`: configuration and lifecycle of the engine actors.

It is **not** a Tune ``TrialExecutor``: Ray deprecated custom trial executors in 2.3 and
removed ``RayTrialExecutor`` in 2.7, and ``tune.run(trial_executor=...)`` raises
``TypeError`` in current Ray. The call form ``trial_executor=HydraExecutor(...)`` is honoured
by :func:`tune_hydra.run`; for ``tune.Tuner`` pass :meth:`HydraExecutor.trainable` as
the trainable (the Tuner adds :meth:`HydraExecutor.scheduler`, :meth:`HydraExecutor.stopper`
and :meth:`HydraExecutor.callbacks` itself).
"""

from __future__ import annotations

import inspect
import logging
import secrets
import uuid
from collections.abc import Callable
from typing import Any

from tune_hydra.core.policies import BasePolicy
from tune_hydra.exceptions import TuneHydraError
from tune_hydra.frontends.ray import registry
from tune_hydra.frontends.ray.actor import DEFAULT_ENGINE_CLASS, DEFAULT_FACTORY_TIMEOUT_S
from tune_hydra.frontends.ray.engines import DEFAULT_SLOT_RESOURCE, EngineFleet
from tune_hydra.frontends.ray.factories import FactoryStore, RunFactories
from tune_hydra.frontends.ray.factories import unwrap_with_parameters as unwrap_with_parameters
from tune_hydra.frontends.ray.proxies import check_task_factory as check_task_factory
from tune_hydra.frontends.ray.proxies import (
    class_resources,
    proxy_class,
    slotted,
    warn_resources_dropped,
)
from tune_hydra.options import check_factory_timeout, check_task_options, engine_options

logger = logging.getLogger(__name__)


def wrap_scheduler(
    base: Any, *, stop: Any, max_iterations: int | None, run_id: str, search_alg: Any
) -> Any:
    """``base`` (a ``TrialScheduler``, a scheduler name Tune knows, or None for FIFO)
    wrapped in a :class:`~tune_hydra.frontends.ray.scheduler.HydraScheduler` of the
    executor ``run_id``; one that already is a ``HydraScheduler`` is returned as is."""
    from tune_hydra.frontends.ray.scheduler import HydraScheduler

    if isinstance(base, str):
        from ray.tune.schedulers import create_scheduler

        base = create_scheduler(base)
    if isinstance(base, HydraScheduler):
        return base
    return HydraScheduler(
        base, stop=stop, max_iterations=max_iterations, run_id=run_id, search_alg=search_alg
    )


class _Held:
    """An option of the executor that another object holds (read-only here)."""

    def __init__(self, holder: str) -> None:
        self.holder = holder

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.holder), self.name)


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
    :func:`tune_hydra.patch_tune`). For ``tune.Tuner``, wrap the trainable; the Tuner
    then gets the executor's scheduler wrapper, stopper, callbacks and
    ``max_concurrent_trials`` by itself::

        with th.HydraExecutor(device_memory="8GiB") as ex:
            tuner = tune.Tuner(
                ex.trainable(make_task),
                param_space={...},
                tune_config=tune.TuneConfig(
                    metric="val_loss", mode="min", scheduler=ASHAScheduler()
                ),
            )
            results = tuner.fit()

    Args:
        **options: every engine's options, documented and defaulted once in
            :class:`~tune_hydra.options.EngineOptions`: ``devices`` (``"auto"``: the
            node's GPUs, or its CPU with a warning; the same on each node),
            ``device_memory`` (per device, bytes or ``"8GiB"``), ``policy``, ``prefetch``,
            ``recompute``, ``max_layers_per_shard`` (:meth:`plan` shows the cut it
            gives), ``batch_shared``, and the disk tier's ``host_memory`` and
            ``spill_dir`` (a folder on every engine node: one that is missing, not
            writable or on a full disk stops the engines from starting with
            ``SpillDirError``; a write that fails mid-run fails that trial). ``policy="auto"``
            (the default) is chosen from the run by :meth:`scheduler` (which ``th.run``
            calls): the milestone policy when its scheduler stops trials early or its
            search algorithm adapts (each trial's next rung first), LRTF for fixed
            budgets (the shortest makespan); engines started before that (``trainable``
            first) run the milestone policy, which decides as LRTF when no milestones
            come.
        iteration_batches: None: one Tune iteration is one epoch; N: N batches.
        seed, max_grad_norm, accumulate_steps, precision: per-task engine options
            (``TaskLoop``'s), the same for every trial.
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
            ``CheckpointConfig(num_to_keep=...)`` for large models. A class trainable's
            checkpoints are its own (``save_checkpoint``), when Tune asks for them as for
            the plain class: this option adds none.

    Every option is checked here, when the executor is built (before Ray starts, and
    without loading torch), by the one validator of :mod:`tune_hydra.options` that
    ``Engine``, ``train_models`` and ``th.optimize`` use too; the engine options it does
    not take, and why, are in ``tune_hydra.options.NOT_OFFERED``. A keyword it does not
    take raises ``UnknownOptionError`` naming the closest option (or why it is not taken).

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
        *,
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
        **options: Any,
    ) -> None:
        from tune_hydra.frontends.ray.callback import check_checkpoint

        where = "HydraExecutor"
        code = HydraExecutor.__init__.__code__
        takes = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
        # What every engine actor gets (devices="auto" is resolved per node, and the
        # spill folder is checked on each node, where the engine starts: a path on the
        # driver need not exist there).
        engine = engine_options(
            options, where=where, takes=[k for k in takes if not k.startswith("_")]
        )
        # Every option is judged here by the one validator of tune_hydra.options that the
        # other front ends use (torch-free: nothing of the engine is imported into the
        # driver), rather than in every trial later.
        # Every trial's TaskLoop options, as given (the loop resolves the seed).
        task_options: dict[str, Any] = {
            "seed": seed,
            "max_grad_norm": max_grad_norm,
            "accumulate_steps": accumulate_steps,
            "precision": precision,
            "iteration_batches": iteration_batches,
        }
        check_task_options(**task_options, where=where)
        self.engine_options = engine
        self.factory_timeout_s = check_factory_timeout(factory_timeout_s, where=where)
        self.iteration_batches = iteration_batches
        self.task_options = task_options
        self.checkpoint = check_checkpoint(checkpoint)
        self._engine_class = _engine_class
        self.run_id = uuid.uuid4().hex[:10]
        # The experiment's secret: every call to its engine actors and every record it
        # keeps in the cluster store is bound to it (see the README's "Ownership").
        self._secret = secrets.token_hex(16)
        self._store = FactoryStore(self.run_id, self._secret)
        self._engines = EngineFleet(  # checks slots_per_node, torch_threads, start_timeout_s
            self.run_id,
            self._secret,
            self._store,
            self.engine_options,
            task_options,
            slot_resource=slot_resource,
            slots_per_node=slots_per_node,
            torch_threads=torch_threads,
            start_timeout_s=start_timeout_s,
            factory_timeout_s=self.factory_timeout_s,
            engine_class=_engine_class,
        )
        # The experiment's task factories, freed in the cluster and in every engine.
        self._factories = RunFactories(self._store, self._engines.release_factory)

    # ---------------------------------------------------------------- options
    # Held once, by what they configure: the engines' options, the engine actors.
    devices = _Held("engine_options")
    device_memory = _Held("engine_options")
    host_memory = _Held("engine_options")
    spill_dir = _Held("engine_options")
    policy = _Held("engine_options")
    prefetch = _Held("engine_options")
    recompute = _Held("engine_options")
    max_layers_per_shard = _Held("engine_options")
    slots_per_node = _Held("_engines")
    slot_resource = _Held("_engines")
    torch_threads = _Held("_engines")
    start_timeout_s = _Held("_engines")

    @property
    def engine_policy(self) -> str | BasePolicy:
        """The policy the engines are (or will be) built with: ``policy``, with
        ``"auto"`` resolved by :meth:`scheduler` to ``"milestone"`` or ``"lrtf"`` (still
        ``"auto"`` before that: the engines' own default, the milestone policy)."""
        return self._engines.engine_options.policy

    # ---------------------------------------------------------------- lifecycle
    @property
    def started(self) -> bool:
        """True while the engine actors are up."""
        return bool(self._engines.handles)

    def start(self) -> HydraExecutor:
        """Start Ray (if needed) and one engine actor per engine node. Idempotent."""
        if not self._engines.handles:
            self._engines.start()
            registry.register(self)
        return self

    def shutdown(self) -> None:
        """Collect the engines' trace and summary, then stop the engine actors.

        Safe to call twice. :meth:`trace` and :meth:`summary` still answer afterwards.
        """
        if not self._engines.handles:
            return
        registry.unregister(self.run_id)
        self._factories.drop_all()
        try:
            self._store.clear_errors()  # the trials' recorded mistakes, read by now
        except Exception:
            logger.warning("tune_hydra: could not clear recorded trial errors", exc_info=True)
        self._engines.stop()

    def __enter__(self) -> HydraExecutor:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------- Tune building blocks
    @property
    def trial_resources(self) -> dict[str, float]:
        """What each trial reserves: no CPU, one slot (a CPU sliver without slots)."""
        if self._engines.fallback:
            return {"cpu": 0.01}
        return {"cpu": 0, self.slot_resource: 1}

    @property
    def max_concurrent_trials(self) -> int:
        """The number of slots over all engine nodes (starts the engines if needed)."""
        self.start()
        return self._engines.slots

    def trainable(self, make_task: Callable[..., Any]) -> Any:
        """A Tune trainable (for ``tune.Tuner`` or ``tune.run``) whose trials train
        ``make_task(config)`` on this executor's engines. Starts the engines.

        ``make_task`` may also be a function trainable, ``train(config)`` that calls
        ``th.shard(model, optimizer)`` and ``tune.report`` (read from its code): each
        trial's function then runs in its node's engine process, in a thread of its own
        (its own working directory, the trial's, and its own random generator), where
        ``tune.report``, ``train.report``, ``tune.get_checkpoint`` and
        ``tune.get_context()`` work as in plain Tune; Tune persists its checkpoints and
        restores them (PBT, pauses, ``Tuner.restore``) as for any function trainable
        (see :mod:`tune_hydra.frontends.ray.function`).

        ``make_task`` may also be a ``tune.Trainable`` subclass whose ``setup`` calls
        ``th.shard``: each trial's instance then lives in its node's engine process, its
        calls on a thread of its own (working directory and random generator as above),
        and Tune drives a proxy ``Trainable`` that forwards ``step``,
        ``save_checkpoint``, ``load_checkpoint``, ``reset_config`` and ``cleanup`` to it,
        so checkpoints, PBT, pauses, ``reuse_actors`` and ``Tuner.restore`` are Tune's own
        (see :mod:`tune_hydra.frontends.ray.classes`).

        Tune's wrappers: ``trainable(tune.with_parameters(make_task, data=...))`` and
        ``tune.with_parameters(trainable(make_task), data=...)`` both call
        ``make_task(config, data=...)`` in the engine; the data stays in Ray's object
        store and is fetched once per engine, never into the trial processes.
        ``tune.with_resources`` around the result or inside it (Ray's examples do this) is
        dropped with one warning: each trial reserves one engine slot and no CPU, and the
        engine places the model, whether or not Ray was started by the user.

        ``tune.Tuner(executor.trainable(...), ...)`` alone is enough: a ``tune.Tuner``
        built on this trainable adds what
        :func:`~tune_hydra.frontends.ray.run.tuner_configs` says (the executor's
        scheduler wrapper, stopper, callbacks and ``max_concurrent_trials``) to its
        ``TuneConfig`` and ``RunConfig`` (see
        :func:`~tune_hydra.frontends.ray.patch.hook_tuner`).
        """
        reports = check_task_factory(make_task)
        requested = (
            class_resources(make_task)
            if inspect.isclass(make_task)
            else getattr(make_task, "_resources", None)
        )
        if requested is not None:  # tune.with_resources(fn, ...) inside: the slot rules
            warn_resources_dropped(requested, "inside executor.trainable(...)")
        self.start()
        factory_id = self._factories.put(make_task)  # the trial processes carry only its id
        cls = proxy_class(
            make_task,
            reports=reports,
            factory_id=factory_id,
            run_id=self.run_id,
            secret=self._secret,
            slot_resource="" if self._engines.fallback else self.slot_resource,
            checkpoint=self.checkpoint,
        )
        from tune_hydra.frontends.ray.patch import hook_tuner

        hook_tuner()  # tune.Tuner(this trainable, ...) then adds the executor's pieces
        return slotted(cls, self.trial_resources)

    def release(self, trainable: Any) -> None:
        """Free the task factory of a trainable made by :meth:`trainable` (in the cluster
        and in every engine), once its experiment is over. ``th.run`` does this itself;
        call it between ``Tuner.fit`` calls that each made a new trainable, or let
        :meth:`shutdown` free them all. Trials of that trainable cannot start afterwards."""
        # tune.with_resources wraps our class in a subclass: it inherits the id
        factory_id = getattr(trainable, "_factory_id", None)
        if not factory_id:
            raise TuneHydraError(
                f"{trainable!r} was not made by HydraExecutor.trainable(); nothing to release"
            )
        self._factories.drop(factory_id)

    def scheduler(
        self,
        base: Any = None,
        *,
        stop: Any = None,
        max_iterations: int | None = None,
        search_alg: Any = None,
    ) -> Any:
        """Wrap the user's scheduler (or FIFO) so the engines learn each trial's remaining
        budget and next milestone, and drop a stopped or paused trial's queued work.

        With ``policy="auto"`` and the engines not started yet, this also chooses their
        policy from the run (one log line says which and why): the milestone policy when
        ``base`` stops trials early, ``stop`` ends them on results or ``search_alg``
        adapts; LRTF otherwise. Call it before :meth:`trainable` (which starts them).

        Args:
            base: a ``TrialScheduler``, a scheduler name Tune knows (``"asha"``), or None.
            stop: the run's stopping condition (``{"training_iteration": N}`` gives the budget).
            max_iterations: explicit per-trial budget (overrides ``stop`` and ``max_t``).
            search_alg: the run's search algorithm (``TuneConfig(search_alg=...)``), or None.
        """
        wrapped = wrap_scheduler(
            base,
            stop=stop,
            max_iterations=max_iterations,
            run_id=self.run_id,
            search_alg=search_alg,
        )
        # The executor's option stays "auto"; the engines get the choice.
        self._engines.choose_policy(self.policy, search_aware=wrapped.milestones.search_aware)
        return wrapped

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
        ``prefetch``, ``max_layers_per_shard``, ``seed`` and ``factory_timeout_s``.

        Args:
            make_task: the task factory the experiment will train.
            configs: a config, a list of configs, or a Tune search space (the
                ``param_space`` / ``config`` of the run).
            num_samples: configs drawn from a search space (the run's ``num_samples``).
            options: more :func:`tune_hydra.plan` options (``meta`` ...), or overrides of
                the executor's.

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
        from tune_hydra.planning import plan_for_engines

        options = {"timeout_s": self.factory_timeout_s, **options}
        return plan_for_engines(
            make_task,
            configs,
            self.engine_options,
            self.task_options,
            num_samples=num_samples,
            **options,
        )

    # ------------------------------------------------------------- inspection
    def engines(self) -> dict[str, Any]:
        """Node id -> engine actor handle (empty when not started)."""
        return dict(self._engines.handles)

    def registered_trials(self) -> dict[str, dict[str, list[str]]]:
        """Per node: the trials the engine actor knows and the engine's task names."""
        return self._engines.ask("registered")

    def trace(self) -> Any:
        """The engines' timeline (a ``Trace``; devices are prefixed by node when several):
        live while started, else the one collected at shutdown. Draw it with
        ``th.plot_timeline(executor.trace(), "timeline.png")``."""
        from tune_hydra.core.trace import Trace

        return Trace.from_events(self._engines.trace_events())

    def summary(self) -> dict[str, Any]:
        """Node id -> the engine's summary (live while started, else the last collected)."""
        return self._engines.summary()

    def __repr__(self) -> str:
        handles = self._engines.handles
        state = f"{len(handles)} engine(s)" if handles else "not started"
        return (
            f"HydraExecutor(devices={self.devices!r}, device_memory={self.device_memory!r}, "
            + (
                f"host_memory={self.host_memory!r}, spill_dir={str(self.spill_dir)!r}, "
                if self.host_memory is not None
                else ""
            )
            + f"policy={self.policy!r}, {state})"
        )
