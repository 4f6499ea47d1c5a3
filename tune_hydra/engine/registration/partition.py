"""Cut a sequential model into contiguous shards that fit a per-device memory budget.

A shard's footprint on its device while it runs is its *state* (parameters, gradients,
optimizer state, buffers) plus its *activations* for one batch (tensors autograd saves
for backward, and its input and output). With prefetch the device also holds the next
shard's state, so each shard must fit beside the largest state of any shard.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from tune_hydra.engine.task import OptimizerFactory, describe, mismatch_hint
from tune_hydra.exceptions import (
    DataMismatchError,
    InvalidModelError,
    InvalidOptimizerError,
    ShardTooLargeError,
    TuneHydraError,
    format_bytes,
)
from tune_hydra.options import check_max_layers_per_shard


@dataclass(frozen=True, slots=True)
class LayerCost:
    """Measured or estimated bytes of one layer, and how it treats its input (from the
    probe; ``None``: not known, e.g. a non-tensor input)."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    activation_bytes: int
    writes_input: bool | None = None  # in place, like ReLU(inplace=True)
    passes_input: bool | None = None  # returns its input or a view of it

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """One shard of a plan: layers ``[start, stop)`` of the model."""

    index: int
    start: int
    stop: int
    layer_names: tuple[str, ...]
    state_bytes: int
    activation_bytes: int
    # Whether the shard writes into its input in place (then it computes on a clone);
    # None: not known from the probe, found on the shard's first visit.
    writes_input: bool | None = None

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    def __str__(self) -> str:
        first, last = self.layer_names[0], self.layer_names[-1]
        span = first if first == last else f"{first}..{last}"
        return (
            f"shard {self.index}: layers [{self.start}:{self.stop}] ({span}) "
            f"state {format_bytes(self.state_bytes)}, "
            f"activations {format_bytes(self.activation_bytes)}"
        )


@dataclass(frozen=True)
class ShardPlan:
    """How a model is cut: printable data, checked against the budget.

    Attributes:
        shards: the shards in execution order.
        budget: per-device budget in bytes, or ``None`` for no limit.
        prefetch: whether the plan leaves room for a second (prefetched) shard state.
        layers: the per-layer costs the plan was built from.
    """

    shards: tuple[ShardSpec, ...]
    budget: int | None
    prefetch: bool
    layers: tuple[LayerCost, ...]

    def __len__(self) -> int:
        return len(self.shards)

    def peak_bytes(self) -> int:
        """The most device memory one visit of any shard needs (plus the prefetched one)."""
        room = max(s.state_bytes for s in self.shards) if self.prefetch and len(self) > 1 else 0
        return max(s.total_bytes for s in self.shards) + room

    def kept_peak_bytes(self) -> int:
        """The most device memory one batch needs when every shard keeps its forward graph
        until its backward (``recompute=False``): all shards' activations at once, beside
        the largest state (twice, with prefetch)."""
        states = max(s.state_bytes for s in self.shards)
        room = states if self.prefetch and len(self) > 1 else 0
        return sum(s.activation_bytes for s in self.shards) + states + room

    def __str__(self) -> str:
        budget = "unlimited" if self.budget is None else format_bytes(self.budget)
        head = (
            f"ShardPlan: {len(self.shards)} shard(s), budget {budget}, "
            f"peak {format_bytes(self.peak_bytes())}{' (with prefetch)' if self.prefetch else ''}"
        )
        return "\n".join([head, *(f"  {s}" for s in self.shards)])


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) structure."""
    leaves, _ = tree_flatten(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def optimizer_state_factor(factory: OptimizerFactory, dtype: torch.dtype, task: str = "?") -> float:
    """Bytes of optimizer state per byte of parameter, measured on a dummy parameter.

    Only state the size of a parameter counts; scalars such as Adam's step stay on the
    host. This is also where a task's optimizer factory is first called, so it is checked
    here.

    Args:
        factory: the task's optimizer factory.
        dtype: the dtype of the parameters it will get.
        task: the task's name, for errors.

    Raises:
        InvalidOptimizerError: the factory raised, returned something other than a
            ``torch.optim.Optimizer``, or the optimizer's first ``step()`` raised.
    """
    probe = nn.Parameter(torch.zeros(64, dtype=dtype))
    opt = build_optimizer(factory, [probe], task, "a list of parameters")
    probe.grad = torch.zeros_like(probe)
    try:
        opt.step()
    except Exception as err:
        if _not_ours(err):
            raise
        raise InvalidOptimizerError(
            task,
            f"the optimizer built by the factory ({type(opt).__name__}) raised "
            f"{_what(err)} on its first step(){_string_hint(err)}",
        ) from err
    per_param = sum(
        v.numel() * v.element_size()
        for v in opt.state[probe].values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return per_param / (probe.numel() * probe.element_size())


def build_optimizer(
    factory: OptimizerFactory, params: list[nn.Parameter], task: str, what: str
) -> torch.optim.Optimizer:
    """``factory(params)``, checked: a ``torch.optim.Optimizer`` or a clear error.

    Args:
        factory: the task's optimizer factory.
        params: the parameters to give it.
        task: the task's name, for errors.
        what: what ``params`` are, for errors (``"the parameters of shard 1"``).

    Raises:
        InvalidOptimizerError: the factory raised or returned something else.
    """
    try:
        opt = factory(params)
    except Exception as err:
        if _not_ours(err):
            raise
        raise InvalidOptimizerError(
            task,
            f"the optimizer factory raised {_what(err)} when called with {what}"
            f"{_string_hint(err)}. It must build an optimizer from the parameters it gets, "
            f"e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)",
        ) from err
    if not isinstance(opt, torch.optim.Optimizer):
        got = "None" if opt is None else f"an object of type {type(opt).__name__}"
        raise InvalidOptimizerError(
            task,
            f"the optimizer factory returned {got}, not a torch.optim.Optimizer. It must "
            f"return the optimizer it builds, e.g. optimizer=lambda params: "
            f"torch.optim.AdamW(params, lr=1e-3) (a def needs a return statement)",
        )
    return opt


def _not_ours(err: BaseException) -> bool:
    """Errors passed on as they are: tune_hydra's own, and running out of memory."""
    return isinstance(err, (TuneHydraError, MemoryError, torch.OutOfMemoryError))


def _what(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _string_hint(err: BaseException) -> str:
    if "'str'" in str(err) or "str" in type(err).__name__:
        return " (a hyperparameter given as a string? pass numbers, e.g. lr=float(config['lr']))"
    return ""


@contextlib.contextmanager
def _preserved(modules: list[nn.Module]) -> Iterator[None]:
    """Run a probe without side effects: restore buffers (BatchNorm statistics) and RNG."""
    saved = [[b.detach().clone() for b in m.buffers()] for m in modules]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for m, bufs in zip(modules, saved, strict=True):
                    for b, s in zip(m.buffers(), bufs, strict=True):
                        b.copy_(s)


def _detach_grad(obj: Any) -> Any:
    """A layer's probe input: a non-leaf copy in the graph, as in the model (a layer that
    writes its input in place, such as ``ReLU(inplace=True)``, fails on a leaf)."""

    def f(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().requires_grad_(True).clone()
        return t

    return tree_map(f, obj)


def _probe(
    layers: list[tuple[str, nn.Module]],
    sample: Any,
    autocast_dtype: torch.dtype | None,
    task: str = "?",
) -> list[tuple[int, bool | None, bool | None]]:
    """:func:`measure_layers` without side effects (buffers and the RNG restored); a
    layer that raises on the sample is a :class:`DataMismatchError` naming it."""
    with _preserved([m for _, m in layers]):
        return measure_layers(layers, sample, autocast_dtype, task)


def measure_layers(
    layers: list[tuple[str, nn.Module]],
    sample: Any,
    autocast_dtype: torch.dtype | None,
    task: str | None = None,
) -> list[tuple[int, bool | None, bool | None]]:
    """Per layer, run forward with grad on ``sample`` (then on each layer's output):
    activation bytes (the distinct storages autograd saves for backward, parameters
    excluded, plus the output's), whether it wrote its input in place, and whether it
    returned its input (or a view of it). Storages are told apart by :func:`storage_id`,
    so this works on the meta device and on fake tensors too (``tune_hydra.planning``).

    Raises:
        DataMismatchError: with ``task``, a layer raised on the sample (named, with what
            it got); without, the layer's error is raised as is.
    """
    out: list[tuple[int, bool | None, bool | None]] = []
    params = {storage_id(p) for _, m in layers for p in m.parameters()}
    x = sample
    for layer_name, module in layers:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            key = storage_id(t)
            if key not in params:
                seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
            # Not ``t``: a node saving its own output would then hold that output's
            # Python object, which holds the node: a cycle gc cannot see (a leak).
            return t.detach()

        inp = _detach_grad(x)
        held, version = input_versions(inp)
        autocast = (
            torch.autocast("cpu", dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        try:
            with (
                torch.enable_grad(),
                autocast,
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            ):
                y = module(inp)
        except Exception as err:
            if task is None or _not_ours(err):
                raise
            raise layer_error(task, layer_name, module, x, err, sample) from err
        writes, passes = treats_input(held, version, y)
        out.append((sum(seen.values()) + output_bytes(y, held), writes, passes))
        x = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
    return out


def storage_id(t: torch.Tensor) -> int:
    """Identifies a tensor's storage (views share it) on any device, the meta device
    included (which has no addresses)."""
    return int(t.untyped_storage()._cdata)


def input_versions(inp: Any) -> tuple[list[torch.Tensor], tuple[int, ...] | None]:
    """A layer's input tensors (one, or the values live across a traced cut) and their
    version counters before it runs (``None``: no tensor)."""
    held = [t for t in tree_flatten(inp)[0] if isinstance(t, torch.Tensor)]
    return held, (tuple(t._version for t in held) if held else None)


def treats_input(
    held: list[torch.Tensor], before: tuple[int, ...] | None, y: Any
) -> tuple[bool | None, bool | None]:
    """Whether a layer wrote into its input tensors ``held`` in place (their versions
    were ``before``), and whether its output ``y`` holds one of them or a view of one
    (a traced stage passes on the values a later stage needs); ``None``: no tensor in."""
    if before is None:
        return None, None
    writes = tuple(t._version for t in held) != before
    ids = {storage_id(t) for t in held}
    passes = any(storage_id(t) in ids for t in tree_flatten(y)[0] if isinstance(t, torch.Tensor))
    return writes, passes


def output_bytes(y: Any, held: list[torch.Tensor]) -> int:
    """Bytes of a layer's output. Of a tuple (the values live across a traced cut), the
    tensors passed on from its input ``held`` are not counted again: a skip connection's
    input crosses many stages and is one tensor all along."""
    if isinstance(y, torch.Tensor):
        return tensor_bytes(y)
    have = {storage_id(t) for t in held}
    fresh: dict[int, int] = {}
    for t in tree_flatten(y)[0]:
        if isinstance(t, torch.Tensor) and storage_id(t) not in have:
            key = storage_id(t)
            fresh[key] = max(fresh.get(key, 0), tensor_bytes(t))
    return sum(fresh.values())


def layer_error(
    task: str,
    layer_name: str,
    module: nn.Module,
    inputs: Any,
    err: BaseException,
    batch: Any,
    where: str = "the first batch of train_data (probed when the task was added)",
    note: str = "",
) -> DataMismatchError:
    """The error for a layer that raised on a batch: names the layer, what it got, and,
    when it can be told, what does not fit (see :func:`~tune_hydra.engine.task.mismatch_hint`).

    Args:
        task: the task's name.
        layer_name: the layer's qualified name in the model.
        module: the layer.
        inputs: what the layer got.
        err: what it raised.
        batch: the batch's inputs (what the model got).
        where: which batch, for the message.
        note: more about the inputs, appended to what it got.
    """
    # A traced stage whose input goes into one module as is: tell about that module.
    direct = getattr(module, "direct_layer", None)
    module = direct if isinstance(direct, nn.Module) else module
    hint = mismatch_hint(inputs, module) or mismatch_hint(batch, module)
    if not hint:  # not told apart from a fault of the layer's own: show where it raised
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        hint = (
            f"Make the data's inputs match what the model takes (shape, dtype), or, if the "
            f"data is right, fix the layer.\n\nOriginal traceback:\n{tb}"
        )
    got = describe(inputs)
    given = describe(batch)
    also = "" if got == given else f"; the batch's inputs: {given}"
    return DataMismatchError(
        task,
        f"layer {layer_name!r} ({_short(module)}) raised {_what(err)} on {where} (it got "
        f"{got}{also}{note}). {hint}",
    )


def _short(module: nn.Module) -> str:
    text = repr(module).splitlines()
    return text[0] if len(text) == 1 else f"{type(module).__name__}(...)"


def probe_cuda_peaks(
    layers: list[tuple[str, nn.Module]],
    sample: Any,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> list[int]:
    """Peak device bytes of each layer's forward + backward beyond its parameters,
    measured with ``torch.cuda.max_memory_allocated`` (gradients, allocator rounding and
    workspaces included, so the plan errs on the safe side)."""
    mods = [m for _, m in layers]
    out: list[int] = []
    with _preserved(mods), torch.random.fork_rng(devices=[device]):
        x = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, sample)
        for _, module in layers:
            grads = [p.grad for p in module.parameters()]
            module.to(device)
            inp = _detach_grad(x)  # before the baseline: the input is the previous layer's
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            autocast = (
                torch.autocast("cuda", dtype=autocast_dtype)
                if autocast_dtype is not None
                else contextlib.nullcontext()
            )
            with torch.enable_grad(), autocast:
                y = module(inp)
            outs = [
                t for t in tree_flatten(y)[0] if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
            out.append(max(0, peak))
            x = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
            module.to("cpu")
            for p, g in zip(module.parameters(), grads, strict=True):
                p.grad = g
            del y, inp, outs
    return out


def layer_costs(
    layers: list[tuple[str, nn.Module]],
    optimizer: OptimizerFactory,
    sample: Any,
    autocast_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    task: str = "?",
) -> list[LayerCost]:
    """Every layer's bytes: state from tensor sizes; activations from a probe forward on
    the CPU, or measured on ``device`` when it is a GPU (the larger of the two).

    ``task`` names the task in errors: a layer that raises on ``sample``
    (:class:`~tune_hydra.exceptions.DataMismatchError`) or an optimizer factory that does
    not build an optimizer (:class:`~tune_hydra.exceptions.InvalidOptimizerError`)."""
    probed = _probe(layers, sample, autocast_dtype, task)
    acts = [act for act, _, _ in probed]
    if device is not None and device.type == "cuda":
        peaks = probe_cuda_peaks(layers, sample, device, autocast_dtype)
        acts = [max(a, pk) for a, pk in zip(acts, peaks, strict=True)]
    factors: dict[torch.dtype, float] = {}
    costs = []
    for (name, module), act, (_, writes, passes) in zip(layers, acts, probed, strict=True):
        params = [p for p in module.parameters() if p.requires_grad]
        pbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        gbytes = sum(p.numel() * p.element_size() for p in params)
        obytes = 0
        for p in params:
            if p.dtype not in factors:
                factors[p.dtype] = optimizer_state_factor(optimizer, p.dtype, task)
            obytes += math.ceil(factors[p.dtype] * p.numel() * p.element_size())
        bbytes = sum(b.numel() * b.element_size() for b in module.buffers())
        costs.append(LayerCost(name, pbytes, gbytes, obytes, bbytes, act, writes, passes))
    return costs


def _pack(
    states: list[int], totals: list[int], state_cap: int, total_cap: int
) -> list[tuple[int, int]] | None:
    """Greedy contiguous packing (optimal in shard count for additive costs)."""
    spans = []
    start, state, act = 0, 0, 0
    for i, (s, t) in enumerate(zip(states, totals, strict=True)):
        if s > state_cap or t > total_cap:
            return None
        if i > start and (state + s > state_cap or state + act + t > total_cap):
            spans.append((start, i))
            start, state, act = i, 0, 0
        state += s
        act += t - s
    spans.append((start, len(states)))
    return spans


def plan_shards(
    costs: list[LayerCost],
    budget: int | None,
    *,
    prefetch: bool = True,
    max_layers_per_shard: int | None = None,
    prefer: Sequence[Sequence[tuple[int, int]]] = (),
    kept: bool = False,
) -> ShardPlan:
    """Cut layers into the fewest contiguous shards that fit ``budget``.

    Each shard must satisfy ``state + activations (+ largest shard state, with prefetch)
    <= budget``.

    Args:
        costs: the layers' costs, in order.
        budget: bytes per device (``None``: no limit, ``max_layers_per_shard`` cuts).
        prefetch: leave room for the next shard's state.
        max_layers_per_shard: at most this many layers a shard.
        prefer: cuts (``(start, stop)`` per shard) to take instead: the first that covers
            the layers and whose every shard fits (the cuts of tasks sharing this one's
            frozen tensors: shard k of both then uses the same ones); if none does, the
            fewest shards.
        kept: a preferred cut must also fit one batch with every shard's activations
            kept (``ShardPlan.kept_peak_bytes``: an engine keeping graphs), so that it
            is not refused, or made to recompute, where its own cut would not be.

    Raises:
        ShardTooLargeError: one layer alone does not fit; its ``min_device_memory`` is the
            smallest budget at which every layer does (:func:`min_device_memory`).
        InvalidOptionError: ``max_layers_per_shard`` is not None or an int >= 1.
    """
    try:
        return _cut_shards(
            costs,
            budget,
            prefetch=prefetch,
            max_layers_per_shard=max_layers_per_shard,
            prefer=prefer,
            kept=kept,
        )
    except ShardTooLargeError as err:
        # Every path that cuts (a th.shard loop's first forward, th.plan)
        # comes through here: the error tells the budget to give, not just the first layer
        # over this one (which users otherwise find by bisecting with failing runs).
        smallest = min_device_memory(costs, prefetch=prefetch)
        raise ShardTooLargeError(err.layer, err.nbytes, err.budget, err.detail, smallest) from None


def min_device_memory(costs: Sequence[LayerCost], *, prefetch: bool = True) -> int:
    """The smallest per-device budget (bytes) for which :func:`plan_shards` cuts these
    layers: one byte less and some layer does not fit (beside the largest layer's state,
    with ``prefetch``). Found by bisection on :func:`plan_shards`' own test, so it is the
    engine's figure whatever its cost model charges; ``max_layers_per_shard``, preferred
    cuts and ``kept`` do not change whether a layer fits.

    Args:
        costs: the layers' costs (:func:`layer_costs`).
        prefetch: as the engine will run (its default: True).

    Raises:
        InvalidModelError: no layers.

    Example:
        >>> costs = [LayerCost("a", 100, 100, 0, 0, 50), LayerCost("b", 40, 40, 0, 0, 300)]
        >>> min_device_memory(costs), min_device_memory(costs, prefetch=False)
        (580, 380)
    """
    layers = list(costs)
    if not layers:
        raise InvalidModelError("min_device_memory: no layers to plan")

    def fits(budget: int) -> bool:
        try:
            _cut_shards(layers, budget, prefetch=prefetch)
        except ShardTooLargeError:
            return False
        return True

    low = max(1, max(c.total_bytes for c in layers))  # no budget below a layer's own bytes
    if fits(low):
        return low
    high = sum(c.total_bytes for c in layers) + max(c.state_bytes for c in layers)
    while not fits(high):  # never more than once: one shard of everything fits
        high *= 2
    while high - low > 1:  # invariant: low does not fit, high does
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid
    return high


def _cut_shards(
    costs: list[LayerCost],
    budget: int | None,
    *,
    prefetch: bool = True,
    max_layers_per_shard: int | None = None,
    prefer: Sequence[Sequence[tuple[int, int]]] = (),
    kept: bool = False,
) -> ShardPlan:
    """:func:`plan_shards`, whose :class:`ShardTooLargeError` does not yet hold the
    smallest budget (what :func:`min_device_memory` bisects with)."""
    max_layers_per_shard = check_max_layers_per_shard(max_layers_per_shard)
    if budget is None:
        step = max_layers_per_shard or len(costs)
        spans = [(i, min(i + step, len(costs))) for i in range(0, len(costs), step)]
    else:
        for c in costs:
            need = c.total_bytes + (c.state_bytes if prefetch and len(costs) > 1 else 0)
            if need > budget:
                detail = (
                    f" (state {format_bytes(c.state_bytes)}, activations "
                    f"{format_bytes(c.activation_bytes)}"
                    + (", x2 state room for the prefetched shard" if prefetch else "")
                    + ")"
                )
                raise ShardTooLargeError(c.name, need, budget, detail)
    fitting = (c for c in prefer if _fits(c, costs, budget, prefetch, max_layers_per_shard, kept))
    cut = next(fitting, None)
    if cut is not None:
        spans = list(cut)
    elif budget is not None:
        # The prefetch room depends on the largest shard state, which depends on the cut:
        # try a ladder of caps on shard state and keep the cut with the fewest shards.
        best: list[tuple[int, int]] | None = None
        lo = max(c.state_bytes for c in costs)
        caps = {lo, budget}
        if prefetch:
            caps |= {int(lo + (budget - lo) * k / 64) for k in range(65)}
        states = [c.state_bytes for c in costs]  # plain ints: the ladder packs ~65 times
        totals = [c.total_bytes for c in costs]
        for cap in sorted(caps):
            total_cap = budget - cap if prefetch else budget
            packed = _pack(states, totals, cap, total_cap)
            if packed is not None and max_layers_per_shard is not None:
                packed = _split_long(packed, max_layers_per_shard)
            if packed is not None and (best is None or len(packed) < len(best)):
                best = packed
        if best is None:  # each layer fits alone, but not beside the largest layer's state
            worst = max(costs, key=lambda c: c.total_bytes)
            room = max(c.state_bytes for c in costs)
            raise ShardTooLargeError(
                worst.name,
                worst.total_bytes + room,
                budget,
                f" (its {format_bytes(worst.total_bytes)} plus {format_bytes(room)} of room "
                f"for the prefetched shard; or pass prefetch=False)",
            )
        spans = best
    shards = tuple(
        ShardSpec(
            index=k,
            start=a,
            stop=b,
            layer_names=tuple(c.name for c in costs[a:b]),
            state_bytes=sum(c.state_bytes for c in costs[a:b]),
            activation_bytes=sum(c.activation_bytes for c in costs[a:b]),
            writes_input=_writes_input(costs[a:b]),
        )
        for k, (a, b) in enumerate(spans)
    )
    return ShardPlan(shards, budget, prefetch, tuple(costs))


def _fits(
    spans: Sequence[tuple[int, int]],
    costs: list[LayerCost],
    budget: int | None,
    prefetch: bool,
    max_layers: int | None,
    kept: bool = False,
) -> bool:
    """Whether ``spans`` cut ``costs`` into contiguous shards that each fit ``budget``
    (as :func:`plan_shards` counts them) and ``max_layers``; ``kept``: and one batch
    with every shard's activations kept fits too."""
    if not spans or spans[0][0] != 0 or spans[-1][1] != len(costs):
        return False
    if any(a >= b for a, b in spans) or any(b != c for (_, b), (c, _) in itertools.pairwise(spans)):
        return False
    if max_layers is not None and any(b - a > max_layers for a, b in spans):
        return False
    if budget is None:
        return True
    states = [sum(c.state_bytes for c in costs[a:b]) for a, b in spans]
    totals = [sum(c.total_bytes for c in costs[a:b]) for a, b in spans]
    room = max(states) if prefetch and len(spans) > 1 else 0
    if kept:
        acts = sum(t - s for t, s in zip(totals, states, strict=True))
        if acts + max(states) + room > budget:
            return False
    return all(t + room <= budget for t in totals)


def _writes_input(costs: list[LayerCost]) -> bool | None:
    """Whether a shard of these layers writes into its own input: a layer writes into
    what it gets, and what it gets is the shard's input while the layers before it
    returned their input as is (or a view)."""
    for c in costs:
        if c.writes_input is None:
            return None
        if c.writes_input:
            return True
        if not c.passes_input:
            return c.passes_input  # False: later layers get a new tensor; None: unknown
    return False


def _split_long(spans: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in spans:
        out.extend((i, min(i + limit, b)) for i in range(a, b, limit))
    return out
