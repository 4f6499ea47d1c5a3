"""Plan before the search: how each config's model will be cut into shards, and the
smallest ``device_memory`` it fits, without training it.

:func:`plan` builds each config's :class:`~tune_hydra.ModelTask` with the task factory, on
the ``meta`` device where it can (no weights are allocated, no data is computed: a 6B
model plans in seconds on a laptop), probes one batch through the layers and runs the
engine's own cost model on it (:func:`~tune_hydra.engine.registration.partition.layer_costs`
for the state bytes of every layer,
:func:`~tune_hydra.engine.registration.partition.plan_shards` for the cut), so its numbers
are the ones a ``TaskLoop`` of the task finds for the same budget on a CPU device.
On a GPU the engine also measures each layer's peak on the device (allocator rounding,
kernel workspaces) and keeps the larger figure: leave some headroom there.

A config may be one dict, a list of dicts, or a Tune search space (values made with
``tune.uniform``, ``tune.choice``, ``tune.grid_search`` ...), from which ``num_samples``
configs are drawn the way Tune draws them. Ray is imported only for a search space.

A loop of one's own is planned from its model and a sample batch:
``plan(model, x, optimizer=opt, device_memory=...)`` finds the cut ``th.shard`` makes on
the first forward ``model(x)`` (its ``th.shard_count`` then), by the same code.

This module never imports Ray at import time.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import tune_hydra as th
    >>> def make_task(config):
    ...     width = config["width"]
    ...     model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width),
    ...                           nn.ReLU(), nn.Linear(width, 1))
    ...     data = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(4)]
    ...     return th.ModelTask(model, nn.MSELoss(),
    ...                         lambda p: torch.optim.Adam(p, lr=config["lr"]), data)
    >>> configs = [{"width": w, "lr": 1e-3} for w in (64, 256, 512)]
    >>> reports = th.plan(make_task, configs, device_memory="2.2MiB")
    >>> [(r.num_shards, r.probe_device) for r in reports]  # 512 wide: a layer is too large
    [(1, 'meta'), (2, 'meta'), (None, 'meta')]
    >>> print(reports[2])  # doctest: +ELLIPSIS
    config {'width': 512, 'lr': 0.001}:
      does NOT fit device_memory 2.2 MiB; 3 shard(s) at the smallest that fits
      smallest device_memory: 8.1 MiB (... bytes); host memory (state): 4.1 MiB; probed on meta
      shard  layers     state  activations
      0      0, 1    72.0 KiB    193.0 KiB
      1      2        4.0 MiB    128.0 KiB
      2      3, 4     8.0 KiB    192.1 KiB
    >>> reports.min_device_memory == reports[2].min_device_memory  # what every config fits
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from tune_hydra.engine.registration import partition
from tune_hydra.engine.registration.factory import call_factory
from tune_hydra.engine.registration.partition import (
    LayerCost,
    ShardPlan,
    ShardSpec,
    layer_costs,
    measure_layers,
    plan_shards,
)
from tune_hydra.engine.runtime.boundary import split_batch
from tune_hydra.engine.runtime.rng import CPU_RNG_LOCK
from tune_hydra.engine.task import ModelTask, model_layers
from tune_hydra.engine.units import parse_bytes
from tune_hydra.exceptions import (
    EmptyDataError,
    InvalidModelError,
    InvalidOptimizerError,
    InvalidOptionError,
    InvalidTaskError,
    MissingDependencyError,
    ShardTooLargeError,
    TaskFactoryError,
    TaskFactoryTimeoutError,
    format_bytes,
)
from tune_hydra.options import (
    EngineOptions,
    check_max_layers_per_shard,
    check_positive_int,
    check_precision,
)

DEFAULT_TIMEOUT_S = 600.0
"""How long one call of the task factory may take by default."""


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """How one config's model is cut, and what it needs (see :func:`plan`).

    Attributes:
        config: the config the task was built from.
        device_memory: the per-device budget asked for, in bytes (None: none given).
        num_shards: the number of shards at ``device_memory``; None when none was given
            or when the model does not fit it (a layer alone is too large).
        shards: the cut, shard by shard (layer names, state and activation bytes): at
            ``device_memory``, or at ``min_device_memory`` when none was given or it
            does not fit (``cut_for`` says which).
        min_device_memory: the smallest per-device budget the engine can cut the model
            for (with room for the prefetched next shard, when ``prefetch``).
        state_bytes: the parameters, gradients, optimizer state and buffers of the whole
            model: the host memory the trial holds in the engine's process.
        layers: every layer's costs, as the engine's cost model measured them.
        probe_device: where the batch was probed: ``"meta"`` (no weights allocated) or
            ``"cpu"`` (see ``notes`` for why).
        notes: anything to know about these figures.
        model: the model's class name when a model was planned (``th.plan(model,
            sample)``, ``config`` is then None); None for a task factory's config.
    """

    config: Any
    device_memory: int | None
    num_shards: int | None
    shards: tuple[ShardSpec, ...]
    min_device_memory: int
    state_bytes: int
    layers: tuple[LayerCost, ...]
    probe_device: str
    notes: tuple[str, ...] = ()
    model: str | None = None

    def label(self, limit: int = 70) -> str:
        """What was planned, for printing: the model, or the config."""
        return f"model {self.model}" if self.model is not None else _short_repr(self.config, limit)

    @property
    def fits(self) -> bool | None:
        """Whether the model fits ``device_memory`` (None: no budget was given)."""
        return None if self.device_memory is None else self.num_shards is not None

    @property
    def cut_for(self) -> int:
        """The budget ``shards`` were cut for."""
        if self.device_memory is not None and self.num_shards is not None:
            return self.device_memory
        return self.min_device_memory

    def __str__(self) -> str:
        if self.device_memory is None:
            head = f"{len(self.shards)} shard(s) at the smallest device_memory that fits"
        elif self.fits:
            head = f"{self.num_shards} shard(s) at device_memory {format_bytes(self.device_memory)}"
        else:
            head = (
                f"does NOT fit device_memory {format_bytes(self.device_memory)}; "
                f"{len(self.shards)} shard(s) at the smallest that fits"
            )
        lines = [
            f"{self.label()}:" if self.model is not None else f"config {self.label()}:",
            f"  {head}",
            f"  smallest device_memory: {format_bytes(self.min_device_memory)} "
            f"({self.min_device_memory} bytes); host memory (state): "
            f"{format_bytes(self.state_bytes)}; probed on {self.probe_device}",
        ]
        rows = [("shard", "layers", "state", "activations")]
        rows += [
            (
                str(s.index),
                _span(s.layer_names),
                format_bytes(s.state_bytes),
                format_bytes(s.activation_bytes),
            )
            for s in self.shards
        ]
        lines += _table(rows, right=(False, False, True, True))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class PlanReports(list[PlanReport]):
    """The :class:`PlanReport` of every config :func:`plan` looked at, in order; printed
    as one line per config."""

    @property
    def min_device_memory(self) -> int:
        """The smallest per-device budget that fits every one of these configs."""
        return max(r.min_device_memory for r in self)

    def __str__(self) -> str:
        if not self:
            return "no configs planned"
        budgets = {r.device_memory for r in self}
        asked = budgets.pop() if len(budgets) == 1 else None
        at = f"at {format_bytes(asked)}" if asked is not None else "at the smallest"
        rows = [("config", f"shards {at}", "smallest device_memory", "host memory")]
        for r in self:
            if r.fits is None:
                shards = str(len(r.shards))
            else:
                shards = str(r.num_shards) if r.fits else "too large"
            rows.append(
                (
                    r.label(48),
                    shards,
                    format_bytes(r.min_device_memory),
                    format_bytes(r.state_bytes),
                )
            )
        lines = _table(rows, right=(False, True, True, True), indent="")
        lines.append(
            f"every config fits device_memory >= {format_bytes(self.min_device_memory)} "
            f"({self.min_device_memory} bytes)"
        )
        notes = dict.fromkeys(n for r in self for n in r.notes)
        lines += [f"note: {n}" for n in notes]
        return "\n".join(lines)


def plan(
    make_task: Callable[[Any], ModelTask] | nn.Module,
    configs: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    device_memory: int | str | None = None,
    num_samples: int = 1,
    precision: str | None = None,
    prefetch: bool = True,
    max_layers_per_shard: int | None = None,
    seed: int | None = 0,
    meta: bool = True,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> PlanReports:
    """How each config's model will be cut, and the smallest ``device_memory`` it fits,
    without training (one batch is probed through the layers, on the meta device).

    Also ``plan(model, sample)``: how ``th.shard`` will cut a model of a loop of one's own
    on its first forward, ``model(sample)``: the cut ``th.shard_count(model)`` then tells
    (for a ``th.Engine`` of the same ``device_memory`` and ``prefetch`` on the CPU).

    Args:
        make_task: the task factory, ``make_task(config) -> ModelTask`` (the same one
            given to ``th.run`` or ``HydraExecutor.trainable``); or the model (an
            ``nn.Module``, before ``th.shard``) of a loop that ``th.shard`` will run.
        configs: one config (a dict), a list of configs, or a Tune search space (a dict
            holding ``tune.uniform(...)``, ``tune.choice(...)``, ``tune.grid_search(...)``
            ... values, at any depth); a list may mix plain configs and spaces. With a
            model: the input of its first forward, ``model(sample)`` (a dict of keyword
            inputs for a Hugging Face model, ``model(**sample)``), of the largest batch
            size the loop will train on. Probed on the CPU, as ``th.shard`` probes it, or
            on the meta device when the model was built there (no weights).
        optimizer: with a model only: the optimizer that will go to ``th.shard`` with it
            (its state counts; None: none, as ``th.shard(model)``).
        device_memory: the per-device budget to cut for (bytes, or ``"8GiB"``); None
            reports the cut at each config's smallest budget.
        num_samples: configs drawn from each search space (with a grid search: that many
            passes over the grid, as Tune's ``num_samples``); plain configs are planned
            once.
        precision: ``None`` (full precision) or ``"bf16"`` (bfloat16 autocast), as the
            training will use: it changes the activations' size.
        prefetch: leave room for the next shard's state beside the running one (the
            engine's default double buffering).
        max_layers_per_shard: cut finer than the budget requires (as ``Engine``).
        seed: seeds the search-space sampling and each factory call's private random
            generator (None: random).
        meta: build on the meta device (True) or on the CPU with real weights (False).
        timeout_s: how long one factory call may take (None: no limit).
            (``num_samples``, ``seed``, ``meta`` and ``timeout_s`` concern task
            factories: a model is planned as it is.)

    Returns:
        One :class:`PlanReport` per config, in a :class:`PlanReports` list that prints as
        a table and tells the budget every config fits (``min_device_memory``); with a
        model, one report (its ``model`` names the class).

    Raises:
        TaskFactoryError: the factory raised for a config (the message names it and holds
            the factory's traceback), or returned something that is not a ModelTask.
        TaskFactoryTimeoutError: it did not return within ``timeout_s``.
        InvalidModelError: a model that cannot be cut into sequential shards.
        DataMismatchError: a layer fails on the first batch of ``train_data``.
        InvalidOptimizerError: the optimizer factory does not build an optimizer.
        InvalidOptionError, BudgetFormatError: a bad option.
        InvalidTaskError: ``configs`` is not a dict or a list of dicts.
        MissingDependencyError: a search space was given and Ray Tune is not installed.
        AlreadyShardedError: the model was given to ``th.shard`` already (its cut:
            ``th.shard_count``).

    Notes:
        The meta device needs nothing but shapes. When building or probing a config
        there fails (an op without a meta kernel, a factory that reads tensor values),
        that config is built and probed on the CPU instead, with a note in its report.
        Data made outside the factory (real tensors) is moved to the meta device for the
        probe; bfloat16 autocast, which the meta device ignores, is probed on fake CPU
        tensors (``torch._subclasses.FakeTensorMode``), which hold no data either.
    """
    budget = parse_bytes(device_memory)
    num_samples = int(check_positive_int(num_samples, "num_samples", where="th.plan") or 1)
    precision = check_precision(precision, where="th.plan")
    max_layers_per_shard = check_max_layers_per_shard(max_layers_per_shard, where="th.plan")
    if isinstance(make_task, nn.Module):
        report = _plan_model(
            make_task,
            configs,
            optimizer,
            budget=budget,
            precision=precision,
            prefetch=prefetch,
            max_layers_per_shard=max_layers_per_shard,
        )
        return PlanReports([report])
    if optimizer is not None:
        raise InvalidOptionError(
            "optimizer",
            optimizer,
            "th.plan takes an optimizer with a model only (th.plan(model, sample, "
            "optimizer=opt)); a task factory's ModelTask names its own",
            "th.plan",
        )
    if not callable(make_task):
        raise TaskFactoryError(
            f"th.plan needs the task factory first, make_task(config) -> th.ModelTask (or a "
            f"model, th.plan(model, sample)), not a {type(make_task).__name__}"
        )
    reports = PlanReports()
    for index, config in enumerate(expand_configs(configs, num_samples, seed)):
        reports.append(
            _plan_one(
                make_task,
                config,
                index,
                budget=budget,
                precision=precision,
                prefetch=prefetch,
                max_layers_per_shard=max_layers_per_shard,
                seed=seed,
                meta=meta,
                timeout_s=timeout_s,
            )
        )
    return reports


def plan_for_engines(
    make_task: Callable[[Any], ModelTask],
    configs: Any,
    engine_options: EngineOptions,
    task_options: Mapping[str, Any],
    *,
    num_samples: int = 1,
    **options: Any,
) -> PlanReports:
    """:func:`plan` for engines built with ``engine_options`` whose trials are added with
    ``task_options`` (``TaskLoop``'s): their ``device_memory``, ``prefetch``,
    ``max_layers_per_shard``, ``precision`` and ``seed`` (when set). Where the engines
    may run on a GPU (``"auto"`` or a ``cuda`` device), each report notes that the engine
    measures there too.

    Args:
        make_task, configs, num_samples: as :func:`plan`'s.
        engine_options: the engines' options.
        task_options: the trials' ``TaskLoop`` options.
        options: more :func:`plan` options (``timeout_s``, ``meta`` ...), or overrides.
    """
    defaults: dict[str, Any] = {
        "device_memory": engine_options.device_memory,
        "precision": task_options["precision"],
        "prefetch": engine_options.prefetch,
        "max_layers_per_shard": engine_options.max_layers_per_shard,
    }
    if task_options["seed"] is not None:
        defaults["seed"] = task_options["seed"]
    reports = plan(make_task, configs, num_samples=num_samples, **{**defaults, **options})
    devices = engine_options.devices
    names = [devices] if isinstance(devices, str) else list(devices)
    if any(str(d) == "auto" or str(d).startswith("cuda") for d in names):
        note = (
            "on a GPU the engine also measures each layer's peak there (allocator "
            "rounding, workspaces) and keeps the larger figure: leave some headroom"
            + ("; with device_memory=None it budgets 90% of each GPU's memory"
               if engine_options.device_memory is None else "")
        )  # fmt: skip
        for i, r in enumerate(reports):
            reports[i] = dataclasses.replace(r, notes=(*r.notes, note))
    return reports


# --------------------------------------------------------------------------- configs
def _is_domain(value: Any) -> bool:
    """A Tune search-space value: a ``Domain`` (``tune.uniform`` ...: it has ``sample``
    and ``get_sampler``), or ``tune.grid_search``'s ``{"grid_search": [...]}``."""
    if isinstance(value, Mapping):
        return list(value) == ["grid_search"]
    return (
        not isinstance(value, type)
        and callable(getattr(value, "sample", None))
        and callable(getattr(value, "get_sampler", None))
    )


def _has_domain(obj: Any) -> bool:
    if _is_domain(obj):
        return True
    if isinstance(obj, Mapping):
        return any(_has_domain(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_domain(v) for v in obj)
    return False


def expand_configs(configs: Any, num_samples: int = 1, seed: int | None = 0) -> list[Any]:
    """The configs :func:`plan` looks at: a plain config as it is, ``num_samples`` draws
    from a Tune search space (through Ray Tune's own variant generator, imported only
    then), a list item by item.

    Args:
        configs: a config, a search space, or a list of them.
        num_samples: draws per search space (each a pass over its grid, as in Tune).
        seed: the sampling's random seed (None: random).

    Raises:
        InvalidTaskError: ``configs`` is not a dict or a list of dicts.
        MissingDependencyError: a search space, without Ray Tune installed.

    Example:
        >>> expand_configs([{"lr": 0.1}, {"lr": 0.2}], num_samples=3)
        [{'lr': 0.1}, {'lr': 0.2}]
    """
    items = list(configs) if isinstance(configs, list | tuple) else [configs]
    out: list[Any] = []
    rng: Any = None
    for item in items:
        if not isinstance(item, Mapping):
            raise InvalidTaskError(
                f"th.plan takes a config dict, a list of config dicts or a Tune search "
                f"space (a dict), not a {type(item).__name__}: {_short_repr(item, 60)}"
            )
        if not _has_domain(item):
            out.append(item)
            continue
        try:
            import numpy as np
            from ray.tune.search.variant_generator import generate_variants
        except ImportError as err:
            raise MissingDependencyError(
                f"planning a Tune search space needs Ray Tune ({err}); pip install "
                f"'ray[tune]', or pass plain configs"
            ) from None
        if rng is None:
            rng = np.random.RandomState(seed)
        for _ in range(num_samples):
            out.extend(config for _, config in generate_variants(dict(item), random_state=rng))
    return out


# ---------------------------------------------------------------------------- one config
def _plan_one(
    make_task: Callable[[Any], ModelTask],
    config: Any,
    index: int,
    *,
    budget: int | None,
    precision: str | None,
    prefetch: bool,
    max_layers_per_shard: int | None,
    seed: int | None,
    meta: bool,
    timeout_s: float | None,
) -> PlanReport:
    name = f"config {index}"
    notes: list[str] = []
    costs: list[LayerCost] | None = None
    probe = "cpu"
    if meta:
        try:
            task = _build(make_task, config, index, seed, timeout_s, on_meta=True)
            costs, probe, note = _meta_costs(task, name, precision)
            if note:
                notes.append(note)
        except (
            TaskFactoryTimeoutError,
            _NotATask,
            InvalidModelError,
            EmptyDataError,
            InvalidOptimizerError,
        ):
            raise  # not the meta device's doing: the CPU would not do better
        except Exception as err:
            # Informational, not an error: the CPU plan is the same cut, only slower to
            # make. The innermost cause says why (not the wrapper's "fix make_task").
            notes.append(
                f"planned on the CPU with real weights (the meta device holds no values and "
                f"could not run it: {_what(_root_cause(err))}); the plan is exact, nothing "
                f"to fix"
            )
    if costs is None:
        task = _build(make_task, config, index, seed, timeout_s, on_meta=False)
        costs = _cpu_costs(task, name, precision)
    cut = None if budget is None else _cut(costs, budget, prefetch, max_layers_per_shard)
    smallest = min_device_memory(costs, prefetch=prefetch)
    shards = (
        cut
        if cut is not None
        else plan_shards(
            costs, smallest, prefetch=prefetch, max_layers_per_shard=max_layers_per_shard
        )
    )
    return PlanReport(
        config=config,
        device_memory=budget,
        num_shards=None if cut is None or budget is None else len(cut),
        shards=shards.shards,
        min_device_memory=smallest,
        state_bytes=sum(c.state_bytes for c in costs),
        layers=tuple(costs),
        probe_device=probe,
        notes=tuple(notes),
    )


def _plan_model(
    model: nn.Module,
    sample: Any,
    optimizer: torch.optim.Optimizer | None,
    *,
    budget: int | None,
    precision: str | None,
    prefetch: bool,
    max_layers_per_shard: int | None,
) -> PlanReport:
    """``th.plan(model, sample)``: what ``th.shard``'s first forward does to cut the model
    (``_State.cut``, ``build_loop``: its layers, :func:`~tune_hydra.engine.runtime.loop.loop_costs`
    on the first stage's input, ``plan_shards``), without registering it anywhere."""
    from tune_hydra.engine.runtime.loop import loop_costs
    from tune_hydra.exceptions import AlreadyShardedError
    from tune_hydra.frontends.shard import first_cut
    from tune_hydra.models import is_hf_model

    kind = type(model).__name__
    if "_th_shard" in model.__dict__:
        raise AlreadyShardedError(
            f"th.plan(model, sample) plans a model before th.shard; this {kind} is sharded "
            f"already: th.shard_count(model) tells its cut (after its first forward)"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidOptimizerError(
            f"th.plan({kind})",
            f"optimizer= must be the torch.optim.Optimizer that goes to th.shard with the "
            f"model, not {type(optimizer).__name__}",
        )
    name = f"th.plan({kind})"
    if is_hf_model(model) and isinstance(sample, Mapping):  # model(**sample)
        layers, inputs = first_cut(model, (), dict(sample))
    else:
        layers, inputs = first_cut(model, (sample,), {})
    tensors = [*model.parameters(), *model.buffers()]
    on_meta = bool(tensors) and all(t.is_meta for t in tensors)
    dtype = torch.bfloat16 if precision == "bf16" else None
    cls = type(optimizer) if optimizer is not None else None
    cpu = torch.device("cpu")
    if on_meta:  # built without weights: the meta probe (activations as the CPU's)
        inputs = tree_map(_to_meta, inputs)
        with torch.random.fork_rng(devices=[]):
            costs = loop_costs(layers, inputs, optimizer, cls, cpu, name)
            probed = _probe_without_data(layers, inputs, dtype)
        costs = [
            dataclasses.replace(c, activation_bytes=act, writes_input=writes, passes_input=passes)
            for c, (act, writes, passes) in zip(costs, probed, strict=True)
        ]
    else:
        # The first forward's probe runs in the user's thread, under its autocast: bf16
        # is planned under the autocast the loop will train in.
        autocast = (
            torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
        )
        with autocast:
            costs = loop_costs(layers, inputs, optimizer, cls, cpu, name)
    cut = None if budget is None else _cut(costs, budget, prefetch, max_layers_per_shard)
    smallest = min_device_memory(costs, prefetch=prefetch)
    shards = (
        cut
        if cut is not None
        else plan_shards(
            costs, smallest, prefetch=prefetch, max_layers_per_shard=max_layers_per_shard
        )
    )
    return PlanReport(
        config=None,
        device_memory=budget,
        num_shards=None if cut is None else len(cut),
        shards=shards.shards,
        min_device_memory=smallest,
        state_bytes=sum(c.state_bytes for c in costs),
        layers=tuple(costs),
        probe_device="meta" if on_meta else "cpu",
        model=kind,
    )


class _NotATask(TaskFactoryError):
    """The factory returned something that is not a ModelTask (a systematic mistake)."""


def _on_meta(make_task: Callable[[Any], Any], config: Any) -> Any:
    """``make_task(config)`` with tensors created on the meta device by default (the
    default device is per thread: this runs in the factory's own thread)."""
    with torch.device("meta"):
        return make_task(config)


def _build(
    make_task: Callable[[Any], Any],
    config: Any,
    index: int,
    seed: int | None,
    timeout_s: float | None,
    *,
    on_meta: bool,
) -> ModelTask:
    """The config's task, built by the factory in its own thread on a private random
    generator (``tune_hydra.engine.registration.factory.call_factory``)."""
    what = f"config {index} ({_short_repr(config, 200)})"
    factory = functools.partial(_on_meta, make_task) if on_meta else make_task
    try:
        task = call_factory(factory, config, what=what, seed=seed, timeout_s=timeout_s)
    except TaskFactoryTimeoutError:
        raise
    except TaskFactoryError as err:
        if on_meta:
            raise  # retried on the CPU
        trace = str(err).partition("Factory traceback:\n")[2]
        raise TaskFactoryError(
            f"th.plan: the task factory raised for {what}; fix make_task for that config. "
            f"Factory traceback:\n{trace}"
        ) from None
    if not isinstance(task, ModelTask):
        raise _NotATask(
            f"th.plan: the task factory returned {type(task).__name__} for {what}, not a "
            f"tune_hydra.ModelTask; make_task(config) must build and return "
            f"th.ModelTask(model=..., loss_fn=..., optimizer=..., train_data=...)"
        )
    return task


def _sample(task: ModelTask, name: str) -> Any:
    """The inputs of the first batch of ``train_data`` (what a task's loop is cut on)."""
    try:
        batch = next(iter(task.train_data))
    except StopIteration:
        raise EmptyDataError(
            f"{name}: train_data yielded no batch; give it at least one (inputs, targets) pair"
        ) from None
    inputs, _ = split_batch(batch, name)
    return inputs


def _check_trainable(name: str, model: nn.Module) -> None:
    from tune_hydra.engine.registration.registry import check_trainable as check

    check(name, model)


def _cpu_costs(task: ModelTask, name: str, precision: str | None) -> list[LayerCost]:
    """Exactly what a task's loop measures when it is cut on a CPU device."""
    model = task.model
    assert isinstance(model, nn.Module)
    layers = model_layers(model, name)
    _check_trainable(name, model)
    model.to("cpu")
    dtype = torch.bfloat16 if precision == "bf16" else None
    with CPU_RNG_LOCK, torch.random.fork_rng(devices=[]):
        inputs = _sample(task, name)
        return layer_costs(layers, task.optimizer, inputs, dtype, task=name)


def _meta_costs(
    task: ModelTask, name: str, precision: str | None
) -> tuple[list[LayerCost], str, str]:
    """The engine's cost model on a model without data: state bytes from
    :func:`layer_costs` on the meta model, activations (and how each layer treats its
    input) from :func:`_probe_without_data`. Returns the costs, the probe device and a
    note (or ``""``)."""
    model = task.model
    assert isinstance(model, nn.Module)
    layers = model_layers(model, name)
    _check_trainable(name, model)
    tensors = [*model.parameters(), *model.buffers()]
    note = ""
    if tensors and not all(t.is_meta for t in tensors):
        real = sum(not t.is_meta for t in tensors)
        note = (
            f"the factory made {real} of the model's {len(tensors)} parameters and buffers "
            f"on a real device (an explicit device=, or loaded weights); they were moved to "
            f"the meta device for the probe"
        )
    model.to("meta")
    dtype = torch.bfloat16 if precision == "bf16" else None
    with torch.random.fork_rng(devices=[]):
        inputs = tree_map(_to_meta, _sample(task, name))
        costs = layer_costs(layers, task.optimizer, inputs, None, task=name)
        probed = _probe_without_data(layers, inputs, dtype)
    costs = [
        dataclasses.replace(c, activation_bytes=act, writes_input=writes, passes_input=passes)
        for c, (act, writes, passes) in zip(costs, probed, strict=True)
    ]
    return costs, "meta", note


def _to_meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _probe_without_data(
    layers: list[tuple[str, nn.Module]], sample: Any, autocast_dtype: torch.dtype | None
) -> list[tuple[int, bool | None, bool | None]]:
    """The engine's activation probe
    (:func:`~tune_hydra.engine.registration.partition.measure_layers`) for a model and sample on the
    meta device: per layer, the bytes of the distinct storages autograd saves for backward
    (parameters excluded) plus the output's, whether it wrote its input in place and
    whether it returned its input (or a view of it).

    With ``autocast_dtype`` the tensors become fake CPU tensors (shapes only, like meta)
    so that CPU autocast applies to them, as it does in the engine's probe."""
    fake_mode: Any = None
    if autocast_dtype is not None:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        fake_mode = FakeTensorMode()
        cpu = torch.device("cpu")

        def fake(t: torch.Tensor) -> torch.Tensor:
            return FakeTensor(fake_mode, t.to("meta"), cpu)

        for _, module in layers:
            for sub in module.modules():
                for k, p in list(sub._parameters.items()):
                    if p is not None:
                        sub._parameters[k] = nn.Parameter(fake(p.data), p.requires_grad)
                for k, b in list(sub._buffers.items()):
                    if b is not None:
                        sub._buffers[k] = fake(b)
        sample = tree_map(lambda t: fake(t) if isinstance(t, torch.Tensor) else t, sample)
    mode = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with mode, _CpuNormStats():
        return measure_layers(layers, sample, autocast_dtype)


class _CpuNormStats(TorchDispatchMode):
    """Gives normalization ops the statistics dtype their CPU kernels give (what the
    engine's probe saves): the weight's dtype, or the input's without a weight. The meta
    kernels (and fake tensors) keep them in float32 for a bfloat16 model, or in bfloat16
    for a float32 weight under autocast."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        weight_at = _NORM_WEIGHT.get(func)
        if weight_at is None:
            return out
        weight = args[weight_at] if len(args) > weight_at else None
        dtype = weight.dtype if isinstance(weight, torch.Tensor) else args[0].dtype
        return (
            out[0],
            *(
                t.to(dtype)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
                else t
                for t in out[1:]
            ),
        )


_aten = torch.ops.aten
# op -> the position of its weight argument
_NORM_WEIGHT = {
    _aten.native_layer_norm.default: 2,
    _aten.native_batch_norm.default: 1,
    _aten._native_batch_norm_legit.default: 1,
    _aten._native_batch_norm_legit.no_stats: 1,
    _aten._native_batch_norm_legit_no_training.default: 1,
    _aten.native_group_norm.default: 1,
}


# ------------------------------------------------------------------------------- budgets
def _cut(
    costs: list[LayerCost], budget: int | None, prefetch: bool, max_layers: int | None
) -> ShardPlan | None:
    """``plan_shards`` at ``budget``; None when a layer does not fit it."""
    try:
        return plan_shards(costs, budget, prefetch=prefetch, max_layers_per_shard=max_layers)
    except ShardTooLargeError:
        return None


def min_device_memory(costs: Sequence[LayerCost], *, prefetch: bool = True) -> int:
    """The smallest per-device budget (bytes) for which
    :func:`~tune_hydra.engine.registration.partition.plan_shards` cuts these layers: one byte less
    and some layer does not fit (beside the largest layer's state, with ``prefetch``).

    Args:
        costs: the layers' costs (``layer_costs``, or a :class:`PlanReport`'s ``layers``).
        prefetch: as the engine will run (its default: True).

    Example:
        >>> from tune_hydra.engine.registration.partition import LayerCost
        >>> costs = [LayerCost("a", 100, 100, 0, 0, 50), LayerCost("b", 40, 40, 0, 0, 300)]
        >>> min_device_memory(costs), min_device_memory(costs, prefetch=False)
        (580, 380)
    """
    return partition.min_device_memory(costs, prefetch=prefetch)  # the engine's own figure


# ------------------------------------------------------------------------------ printing
def _span(names: tuple[str, ...]) -> str:
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)} layers)"


def _short_repr(obj: Any, limit: int) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _table(
    rows: Sequence[tuple[str, ...]], right: tuple[bool, ...], indent: str = "  "
) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        indent
        + "  ".join(
            (cell.rjust(w) if r else cell.ljust(w))
            for cell, w, r in zip(row, widths, right, strict=True)
        ).rstrip()
        for row in rows
    ]


def _root_cause(err: BaseException) -> BaseException:
    """The innermost exception ``err`` was raised from (itself when none)."""
    seen = {id(err)}
    while err.__cause__ is not None and id(err.__cause__) not in seen:
        err = err.__cause__
        seen.add(id(err))
    return err


def _what(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first[:200]}".rstrip(": ")


__all__ = ["PlanReport", "PlanReports", "expand_configs", "min_device_memory", "plan"]
