"""The task registry: which tasks an engine trains, checked and admitted one at a time.

Design: the registry is one of the two owners behind the
:class:`~tune_hydra.engine.engine.Engine` facade (the other is the
:class:`~tune_hydra.engine.dispatch.dispatcher.Dispatcher`; see its module docstring for the cut).
It owns the ``name -> TaskRecord`` map and everything that decides whether a runner may
join (``add_runner``): its name, its members and plan, a model shared with another task
(registered, or being added at the same moment), the kept-graph and host-memory checks;
it registers its stores with the host memory manager and its frozen tensors with the
frozen pool. What happens to a task once admitted is the dispatcher's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from tune_hydra.engine.protocol import Runner, check_runner, stores_of
from tune_hydra.engine.records import TaskRecord
from tune_hydra.engine.registration.partition import ShardPlan
from tune_hydra.engine.runtime.kept import KeptGraphs
from tune_hydra.engine.storage.frozen import FrozenPool, Prepared
from tune_hydra.engine.storage.host import HostMemory
from tune_hydra.engine.task import OwnedTensors, owned_tensors
from tune_hydra.exceptions import (
    HostBudgetError,
    InvalidModelError,
    InvalidTaskError,
    SharedModelError,
)
from tune_hydra.options import EngineOptions, TrainOptions


class TaskRegistry:
    """The tasks of one engine, by name (see the module docstring).

    Args:
        cv: the engine's lock (re-entrant), which guards the map.
        options: the engine's options (``share_frozen``).
        recompute: the engine's resolved ``recompute``.
        host: the host memory manager the tasks' stores are registered with.
        kept: the kept-graph reservations (a task whose batch would not fit is refused).
    """

    def __init__(
        self,
        cv: threading.Condition,
        options: EngineOptions,
        recompute: bool,
        host: HostMemory,
        kept: KeptGraphs,
    ) -> None:
        self._cv = cv
        self._recompute = recompute
        self._host = host
        self._kept = kept
        self.tasks: dict[str, TaskRecord] = {}
        # Tasks being added (between their checks and their registration): the tensors
        # they claim, so that two concurrent add_runner calls cannot share a model either.
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
            # another task's tensors (two sharded models sharing a submodule); its frozen
            # ones are left out (the pool shares equal ones).
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
            # Its frozen tensors are shared through the pool; digested here, outside the
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
                # A runner that recomputes keeps no graph, but its states take room too.
                self._kept.check(name, plan, keeps=not options.recompute)
                per_iter = float(options.iteration_batches or 1)
                self._register(
                    TaskRecord(name, plan, options, self._order, runner, batches_per_iter=per_iter),
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

    def _check_name(self, name: str) -> None:
        if name in self.tasks or name in self._adding:
            raise InvalidTaskError(
                f"a task named {name!r} is already registered; remove it first or pick another name"
            )

    def _register(self, entry: TaskRecord, prepared: Prepared | None = None) -> None:
        """Add ``entry`` (under the lock, its checks passed); ``prepared``: its frozen
        tensors, matched with the pool's (a runner's with a ``frozen_model``)."""
        runner = entry.runner
        stores = stores_of(runner)
        if prepared is not None:
            self.frozen.adopt(prepared, stores)
        self._host.register(stores)
        self.tasks[entry.name] = entry
        self._order += 1


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


__all__ = ["TaskRegistry", "check_keyword_batch", "check_trainable"]
