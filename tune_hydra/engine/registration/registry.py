"""The task registry: which tasks an engine trains, checked and admitted one at a time.

Design: the registry is one of the two owners behind the
:class:`~tune_hydra.engine.engine.Engine` facade (the other is the
:class:`~tune_hydra.engine.dispatch.dispatcher.Dispatcher`; see its module docstring for the cut).
It owns the ``name -> TaskRecord`` map and everything that decides whether a task may
join: its name, a model shared with another task (registered, or being added at the same
moment), probing a ``ModelTask``'s layers on the first batch and planning its shards
(``add_task``), a ``Runner``'s members and plan (``add_runner``), the kept-graph and
host-memory checks; it builds each ``TaskRunner`` (a restored one too) and registers its
stores with the host memory manager. What happens to a task once admitted is the
dispatcher's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from tune_hydra.engine.protocol import Runner, check_runner
from tune_hydra.engine.records import TaskRecord, batches_per_iter
from tune_hydra.engine.registration.partition import ShardPlan, layer_costs, plan_shards
from tune_hydra.engine.runtime.boundary import split_batch
from tune_hydra.engine.runtime.kept import KeptGraphs
from tune_hydra.engine.runtime.rng import CPU_RNG_LOCK
from tune_hydra.engine.runtime.runner import TaskRunner
from tune_hydra.engine.storage.frozen import FrozenPool, Prepared
from tune_hydra.engine.storage.host import HostMemory
from tune_hydra.engine.task import ModelTask, OwnedTensors, model_layers, owned_tensors
from tune_hydra.exceptions import (
    EmptyDataError,
    HostBudgetError,
    InvalidModelError,
    InvalidTaskError,
    SharedModelError,
)
from tune_hydra.options import EngineOptions, TrainOptions, check_seed


class TaskRegistry:
    """The tasks of one engine, by name (see the module docstring).

    Args:
        cv: the engine's lock (re-entrant), which guards the map.
        options: the engine's options (``prefetch``, ``max_layers_per_shard``).
        devices: the engine's devices; the first is where layers are probed.
        budget: the device budget plans are cut for (bytes; ``None``: one shard).
        recompute: the engine's resolved ``recompute``.
        host: the host memory manager the tasks' stores are registered with.
        kept: the kept-graph reservations (a task whose batch would not fit is refused).
    """

    def __init__(
        self,
        cv: threading.Condition,
        options: EngineOptions,
        devices: list[torch.device],
        budget: int | None,
        recompute: bool,
        host: HostMemory,
        kept: KeptGraphs,
    ) -> None:
        self._cv = cv
        self._options = options
        self._devices = devices
        self._budget = budget
        self._recompute = recompute
        self._pin = any(d.type == "cuda" for d in devices)
        self._host = host
        self._kept = kept
        self.tasks: dict[str, TaskRecord] = {}
        # Tasks being added (between their checks and their registration): the tensors
        # they claim, so that two concurrent add_task calls cannot share a model either.
        self._adding: dict[str, OwnedTensors] = {}
        self._order = 0
        # Frozen tensors equal across tasks, held once (tune_hydra.engine.storage.frozen).
        self.frozen = FrozenPool(host, enabled=options.share_frozen)
        host.attach(self.frozen)  # its entries are spill victims too

    @property
    def keeps_graphs(self) -> bool:
        """Whether batches' kept graphs are reserved (``Engine.keeps_graphs``)."""
        return self._kept.active

    def entry(self, name: str) -> TaskRecord:
        """Task ``name``'s record.

        Raises:
            InvalidTaskError: no such task.
        """
        try:
            return self.tasks[name]
        except KeyError:
            raise InvalidTaskError(
                f"no task named {name!r}; registered: {sorted(self.tasks)}"
            ) from None

    def remove(self, name: str) -> None:
        """Forget task ``name`` (the dispatcher has retired it)."""
        with self._cv:
            del self.tasks[name]

    # -- admission --------------------------------------------------------------------------

    def add_task(self, name: str, task: ModelTask, *, seed: Any, **given: Any) -> int:
        """``Engine.add_task``: check, probe, plan and register; returns the shard count."""
        if not isinstance(task, ModelTask):
            raise InvalidTaskError(
                f"task {name!r} must be a tune_hydra.ModelTask, not {type(task).__name__}"
            )
        options = _options(name, task, self._recompute, seed=seed, **given)
        # Before anything touches the model: it may be another task's, on a device now.
        claim = owned_tensors(task.model)  # type: ignore[arg-type]
        with self._cv:
            self._check_name(name)
            # Claimed at once, with a snapshot of the others: a task added after this sees
            # the claim, one added before is in the snapshot (read without the lock, so
            # that the dispatcher does not wait on it).
            others = [(n, e.runner) for n, e in self.tasks.items()]
            claims = list(self._adding.items())
            self._adding[name] = claim
        try:
            _check_shared(name, claim, others, claims)
            return self._add(name, task, options)
        finally:
            with self._cv:
                if self._adding.get(name) is claim:
                    del self._adding[name]

    def _add(self, name: str, task: ModelTask, options: TrainOptions) -> int:
        layers = model_layers(task.model, name)  # type: ignore[arg-type]
        check_trainable(name, task.model)  # type: ignore[arg-type]
        task.model.to("cpu")  # type: ignore[union-attr]
        # Plain training's model.train(): a model given in eval mode (from_pretrained
        # returns it so) trains, and is probed, with its dropout on.
        task.model.train()  # type: ignore[union-attr]
        dtype = torch.bfloat16 if options.precision == "bf16" else None
        # Peeking at the data and probing the layers must not draw from any task's stream:
        # fork the global generators, and hold the lock other tasks' ops install theirs under.
        with CPU_RNG_LOCK, torch.random.fork_rng(devices=[]):
            try:
                sample = next(iter(task.train_data))
            except StopIteration:
                raise EmptyDataError(
                    f"task {name!r}: train_data yielded no batch; give it at least one "
                    f"(inputs, targets) pair"
                ) from None
            x, _ = split_batch(sample, name)
            check_keyword_batch(name, task.model, x)  # type: ignore[arg-type]
            device = self._devices[0]
            costs = layer_costs(layers, task.optimizer, x, dtype, device=device, task=name)
        plan = plan_shards(
            costs,
            self._budget,
            prefetch=self._options.prefetch,
            max_layers_per_shard=self._options.max_layers_per_shard,
            prefer=self.shared_cuts(task.model, [c.name for c in costs]),  # type: ignore[arg-type]
            kept=self._kept.active,
        )
        # Digested and matched here, outside the engine's lock (it reads every frozen byte).
        prepared = self.frozen.prepare(name, task.model)  # type: ignore[arg-type]
        self._check_host(name, plan)
        with self._cv:
            if name in self.tasks:
                raise InvalidTaskError(
                    f"a task named {name!r} is already registered; "
                    f"remove it first or pick another name"
                )
            self._kept.check(name, plan)
            runner = TaskRunner(
                name,
                task,
                plan,
                layers,
                options,
                order=self._order,
                pin=self._pin,
                budgeted_graphs=self._kept.active,
                host=self._host,
            )
            runner.note_probe(x)
            per_iter = batches_per_iter(task, options)
            self._register(
                TaskRecord(
                    name, task, plan, options, self._order, runner, batches_per_iter=per_iter
                ),
                prepared,
            )
        return len(plan)

    def add_runner(self, name: str, runner: Runner, options: TrainOptions | None) -> int:
        """``Engine.add_runner``: check and register ``runner``; returns its shard count.

        A runner with a ``frozen_model`` attribute (an ``nn.Module`` whose parameters its
        stores hold: a ``th.shard`` loop's model) has that model's frozen tensors shared
        with the other tasks' through the frozen pool, as a ``ModelTask``'s are, and is
        refused if it trains (or holds the buffers of) another task's tensors.

        Raises:
            SharedModelError: that model's trainable parameters or buffers are another
                registered (or registering) task's.
        """
        check_runner(name, runner)
        own = getattr(runner, "name", name)
        if own != name:  # its ops would carry another task's name
            raise InvalidTaskError(
                f"runner {own!r} registered as {name!r}: register it under its own name"
            )
        plan = runner.plan
        if not isinstance(plan, ShardPlan) or not plan.shards:
            raise InvalidTaskError(
                f"runner {name!r}: its plan must be a ShardPlan with at least one shard, "
                f"not {plan!r}"
            )
        if options is None:
            options = TrainOptions(recompute=self._recompute, where=f"task {name!r}")
        elif not isinstance(options, TrainOptions):
            raise InvalidTaskError(
                f"runner {name!r}: options must be a tune_hydra.options.TrainOptions, not "
                f"{type(options).__name__}"
            )
        model = getattr(runner, "frozen_model", None)
        if not isinstance(model, torch.nn.Module):
            model = None
        claim = None
        if model is not None:
            # A runner training a model of its own (a th.shard loop) must not train
            # another task's tensors (two sharded models sharing a submodule), claimed as
            # add_task claims; its frozen ones are left out (the pool shares equal ones).
            claim = owned_tensors(model, frozen=False)
            with self._cv:
                self._check_name(name)
                others = [(n, e.runner) for n, e in self.tasks.items()]
                claims = list(self._adding.items())
                self._adding[name] = claim
        try:
            if claim is not None:
                _check_shared(name, claim, others, claims)
            self._check_host(name, plan)
            # It shares its frozen tensors as a ModelTask does; digested here, outside the
            # engine's lock.
            prepared = self.frozen.prepare(name, model) if model is not None else None
            with self._cv:
                if claim is None:
                    self._check_name(name)
                elif name in self.tasks:
                    raise InvalidTaskError(
                        f"a task named {name!r} is already registered; "
                        f"remove it first or pick another name"
                    )
                if not options.recompute:  # a runner that recomputes keeps no graph
                    self._kept.check(name, plan)
                per_iter = float(options.iteration_batches or 1)
                self._register(
                    TaskRecord(
                        name, None, plan, options, self._order, runner, batches_per_iter=per_iter
                    ),
                    prepared,
                )
        finally:
            if claim is not None:
                with self._cv:
                    if self._adding.get(name) is claim:
                        del self._adding[name]
        return len(plan)

    def _check_host(self, name: str, plan: ShardPlan) -> None:
        """Refuse a plan whose largest shard state is over the host-memory budget (it
        could never be held between its visits, however much the others spill)."""
        host = self._host.budget
        if host is not None:
            big = max(plan.shards, key=lambda spec: spec.state_bytes)
            if big.state_bytes > host:
                raise HostBudgetError(name, big.index, big.state_bytes, host)

    def shared_cuts(self, model: torch.nn.Module, layers: list[str]) -> list[list[tuple[int, int]]]:
        """The cuts (``(start, stop)`` per shard) of the registered tasks likely to share
        frozen tensors with ``model`` (see ``FrozenPool.peers``) and cut from the same
        layers (``layers``: their names), most shared bytes first (then the first
        registered), each once: for ``plan_shards(prefer=...)``, which takes the first
        that fits, so shard k of both holds the same frozen tensors."""
        peers = self.frozen.peers(model)
        if not peers:
            return []
        with self._cv:
            plans = {n: e.plan for n, e in self.tasks.items() if n in peers}
        names = tuple(layers)
        cuts: list[list[tuple[int, int]]] = []
        for name in sorted(plans, key=lambda n: -peers[n]):  # stable: registration order
            plan = plans[name]
            cut = [(s.start, s.stop) for s in plan.shards]
            if tuple(c.name for c in plan.layers) == names and cut not in cuts:
                cuts.append(cut)
        return cuts

    def restored(self, entry: TaskRecord, old: TaskRunner, state: dict[str, Any]) -> TaskRunner:
        """A new runner for ``entry``'s task, restored from ``state`` and registered with
        the host memory manager (``entry`` keeps its old one until ``entry.restart``)."""
        assert entry.task is not None  # a TaskRunner's record has its ModelTask
        runner = TaskRunner(
            entry.name,
            entry.task,
            entry.plan,
            model_layers(entry.task.model),  # type: ignore[arg-type]
            entry.options,
            order=entry.order,
            pin=self._pin,
            budgeted_graphs=self._kept.active,
            probed=old.probed,
            host=self._host,
        )
        runner.set_state(state)
        # Only now: restoring writes into the model's tensors and replaces optimizer
        # state, which must be in host memory, not in a spill file (and the frozen ones
        # must be the task's own: the old runner's left the pool).
        prepared = self.frozen.prepare(entry.name, entry.task.model)  # type: ignore[arg-type]
        self.frozen.adopt(prepared, runner.stores)
        self._host.register(runner.stores)
        runner.on_iteration = entry.deliver
        return runner

    def _check_name(self, name: str) -> None:
        if name in self.tasks or name in self._adding:
            raise InvalidTaskError(
                f"a task named {name!r} is already registered; remove it first or pick another name"
            )

    def _register(self, entry: TaskRecord, prepared: Prepared | None = None) -> None:
        """Add ``entry`` (under the lock, its checks passed); ``prepared``: its frozen
        tensors, matched with the pool's (a ``TaskRunner``'s, or a runner's with a
        ``frozen_model``)."""
        runner = entry.runner
        if prepared is not None:
            self.frozen.adopt(prepared, runner.stores)
        self._host.register(runner.stores)
        runner.on_iteration = entry.deliver
        self.tasks[entry.name] = entry
        self._order += 1


def task_runner(entry: TaskRecord, what: str) -> TaskRunner:
    """``entry``'s runner, which must be a ``TaskRunner`` (checkpoints are theirs).

    Raises:
        InvalidTaskError: a runner of ``add_runner``.
    """
    if not isinstance(entry.runner, TaskRunner):
        raise InvalidTaskError(
            f"task {entry.name!r} was registered with add_runner "
            f"({type(entry.runner).__name__}); {what}() is for tasks of add_task"
        )
    return entry.runner


def _options(
    name: str, task: ModelTask, recompute: bool, *, seed: Any, **given: Any
) -> TrainOptions:
    """Task ``name``'s checked options; its seed is ``ModelTask.seed``, else ``seed``, else
    ``torch.initial_seed()``.

    Raises:
        InvalidOptionError: a bad ``ModelTask.seed`` first, then the first bad option.
    """
    where = f"task {name!r}"
    task_seed = check_seed(task.seed, option="ModelTask.seed", where=where)
    seed = check_seed(seed, where=where)
    if task_seed is not None:
        seed = task_seed
    if seed is None:
        seed = torch.initial_seed()
    return TrainOptions(seed, recompute=recompute, where=where, **given)


def _check_shared(
    name: str,
    claim: OwnedTensors,
    registered: list[tuple[str, Runner]],
    adding: list[tuple[str, OwnedTensors]],
) -> None:
    """Refuse task ``name`` if its tensors are those of a registered task, or of a task
    being added.

    The registered tasks' tensors are read as they are now (their host copies of shards
    on a device included), so no key outlives the tensor it was taken from.

    Raises:
        SharedModelError: naming the first such task and the shared tensors.
    """
    for owner, runner in registered:
        shared = claim.shared_with(runner.owned_tensors())
        if shared:
            raise SharedModelError(name, owner, shared)
    for owner, owned in adding:
        shared = claim.shared_with(owned)
        if shared:
            raise SharedModelError(name, owner, shared)


def check_keyword_batch(name: str, model: torch.nn.Module, inputs: Any) -> None:
    """A dict batch is the model's keyword inputs (``model(**batch)``, as plain training
    calls it); only a Hugging Face model's cut takes them (a traced ``forward`` takes its
    one input)."""
    from tune_hydra.models import is_hf_model

    if isinstance(inputs, Mapping) and not is_hf_model(model):
        raise InvalidTaskError(
            f"task {name!r}: train_data yields dicts ({', '.join(map(str, inputs))}), which "
            f"are keyword inputs, model(**batch); tune_hydra passes them so to Hugging Face "
            f"models only. For {type(model).__name__}, yield (inputs, targets) pairs, or "
            f"{{'inputs': x, 'targets': y}}"
        )


def check_trainable(name: str, model: torch.nn.Module) -> None:
    """Refuse a model with nothing to train.

    Raises:
        InvalidModelError: no parameter, or none with ``requires_grad``.
    """
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return
    what = (
        f"all {len(params)} of its parameters have requires_grad=False"
        if params
        else "it has no parameters"
    )
    raise InvalidModelError(
        f"task {name!r}: the model has nothing to train ({what}). Give it a layer with "
        f"parameters, or unfreeze some with p.requires_grad_(True)"
    )


__all__ = ["TaskRegistry", "check_trainable", "task_runner"]
