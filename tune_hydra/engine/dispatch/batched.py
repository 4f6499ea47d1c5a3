"""One pass of a shared frozen shard for several LoRA trials (mLoRA's "BatchLoRA").

Trials of a fine-tuning search over one base hold the same frozen tensors (the engine's
:class:`~tune_hydra.engine.storage.frozen.FrozenPool`), and aligned cuts make shard k of each
use the same ones. :class:`BatchedShard` runs such a shard once for N trials: their
inputs are concatenated along the batch dimension, every frozen layer computes once over
the whole concatenation, and each trial's adapters are applied to its own slice only:

- at each module that some trial adapts with a peft LoRA layer (found by its name, peft's
  ``.base_layer`` left out: :func:`~tune_hydra.engine.storage.frozen.canonical_name`), the frozen
  base layer runs once over all rows; then each trial's own LoRA layer runs on its rows
  with its base layer answering with that slice of the shared result, so its adapters
  (rank, alpha, dropout, DoRA ...) are peft's own code on that trial's rows, exactly as
  alone; a trial that does not adapt the module takes its slice as it is;
- outputs are split back per trial, and a backward from every trial's output gradients
  at once leaves each trial's adapter gradients in its own parameters and its input
  gradients in its own input leaves (the concatenation's backward splits them).

A group is **batchable** (:func:`why_not_batchable` says why not) when:

- its modules have the same structure apart from the adapters (same module names and
  types, same training flags) and every parameter outside the adapters is frozen and the
  *same* tensor in all of them (same storage, shape, strides: the pool's), the buffers
  equal;
- nothing outside the adapters draws random numbers: no dropout module with ``p > 0``
  and no ``*dropout*`` rate attribute above 0 (transformers' attention dropout) in a
  module in training mode (one pass over the concatenation would draw other numbers than
  each trial alone), and no BatchNorm updating running statistics; an adapter's dropout
  draws from its trial's own generator (:func:`use_generator` (registration/factory.py);
  CPU only: on a GPU a trial whose adapter dropout is active is not batchable);
- the adapters are LoRA (not merged, no hooks on the adapted modules);
- the shard computes no loss: a model's head (``HeadStage``) is never batched, and an
  output that needs a gradient but lacks the concatenated batch dimension (a reduction
  over all trials' rows) is refused when it appears. One without a gradient and without
  the batch dimension (rotary ``cos``/``sin`` computed from the positions) is taken as
  computed from what the trials share, and handed to each.

Inputs: each trial's input is a tensor or a nest of them of one structure. A tensor
whose first dimension is its trial's batch size (that of the trial's first tensor) is
concatenated; another tensor must be equal in all trials and is passed once (rotary
``cos``/``sin`` of shape ``(1, T, d)``, position ids), except that one which needs a
gradient and has a first dimension of 1 is expanded to each trial's batch size and
concatenated (same values under broadcasting), so that each trial gets its own gradient
for it; any other shared tensor that needs a gradient is refused. Caveat: a tensor that
is not batched but whose first dimension happens to equal the batch size is taken as
batched. Non-tensor values must be equal.

Parity (float64, tests/engine/dispatch/test_batched.py): outputs, input gradients and adapter
gradients equal each trial's shard run alone within 1e-12 relative. They are not always
bitwise equal: the frozen GEMMs run over more rows (the BLAS may block them otherwise)
and an input's gradient contributions may be summed in another order.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from tune_hydra.engine.registration.factory import use_generator
from tune_hydra.engine.storage.frozen import address, canonical_name
from tune_hydra.exceptions import NotBatchableError
from tune_hydra.models.hf import HeadStage

log = logging.getLogger(__name__)
_NO_NUMBER = object()


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (``lora.Linear``, ``lora.Embedding`` ...),
    without importing peft."""
    return any(
        c.__name__ == "LoraLayer" and c.__module__.startswith("peft") for c in type(module).__mro__
    )


def _is_peft_tuner_layer(module: nn.Module) -> bool:
    return any(
        c.__name__ == "BaseTunerLayer" and c.__module__.startswith("peft")
        for c in type(module).__mro__
    )


@dataclass
class _Trial:
    """One trial's module, as the batched pass sees it."""

    module: nn.Module
    loras: dict[str, nn.Module]  # canonical name -> its LoRA layer
    frozen: dict[str, nn.Parameter]  # canonical name -> parameter outside the adapters
    buffers: dict[str, torch.Tensor]
    structure: list[tuple[str, type, bool]]  # modules outside the adapters: name, type, mode
    draws: bool  # an adapter dropout is active (draws from the trial's generator)


def _describe(index: int, module: nn.Module) -> _Trial:
    """Split ``module``'s parameters and modules into adapters and the rest."""
    adapter_params: set[int] = set()
    adapter_modules: set[int] = set()
    loras: dict[str, nn.Module] = {}
    draws = False
    for name, m in module.named_modules():
        if not is_lora_layer(m):
            if _is_peft_tuner_layer(m):
                raise NotBatchableError(
                    f"trial {index}: {name} is a peft {type(m).__name__}, not a LoRA layer; "
                    f"only LoRA adapters are applied per trial's rows (others change the "
                    f"base layer's input or output as a whole)"
                )
            continue
        base: nn.Module = m.base_layer
        if getattr(m, "merged", False):
            raise NotBatchableError(
                f"trial {index}: the LoRA layer {name} is merged into its base layer"
            )
        for hooked in (m, base):
            if hooked._forward_hooks or hooked._forward_pre_hooks:
                raise NotBatchableError(
                    f"trial {index}: {name} has forward hooks; the batched pass calls its "
                    f"base layer once for all trials"
                )
        loras[canonical_name(name)] = m
        adapter_params.update(id(p) for p in m.parameters())
        adapter_params.difference_update(id(p) for p in base.parameters())
        adapter_modules.update(id(x) for x in m.modules())
        adapter_modules.difference_update(id(x) for x in base.modules())
        adapter_modules.discard(id(m))
        if m.training:
            for d in m.lora_dropout.values():
                draws = draws or (isinstance(d, nn.Dropout) and d.p > 0)
    frozen: dict[str, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in adapter_params:
            continue
        if p.requires_grad:
            raise NotBatchableError(
                f"trial {index}: it trains {name}, a parameter outside its LoRA adapters "
                f"(a head or modules_to_save); only frozen layers are shared by a batch"
            )
        frozen[canonical_name(name)] = p
    buffers = {canonical_name(n): b for n, b in module.named_buffers(remove_duplicate=False)}
    structure: list[tuple[str, type, bool]] = []
    for name, m in module.named_modules():
        if id(m) in adapter_modules:
            continue
        if isinstance(m, HeadStage):
            raise NotBatchableError(
                f"trial {index}: the shard holds the model's head ({name or 'the shard'}), "
                f"which computes the loss: a loss over the concatenated batches is not each "
                f"trial's; the last shard is run per trial"
            )
        _check_randomness(index, name, m)
        if not is_lora_layer(m):  # its base layer comes next, under the same name
            structure.append((canonical_name(name), type(m), m.training))
    return _Trial(module, loras, frozen, buffers, structure, draws)


def _check_randomness(index: int, name: str, m: nn.Module) -> None:
    """Refuse a module outside the adapters that draws random numbers or updates
    statistics in training mode."""
    if not m.training:
        return
    where = f"trial {index}: {name or 'the shard'} ({type(m).__name__})"
    if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
        raise NotBatchableError(
            f"{where} is an active dropout (p={m.p}) outside the adapters: one pass over "
            f"the concatenated batches would draw other numbers than each trial alone. Set "
            f"the base's dropout to 0 (config), or run the trials one after another"
        )
    for attr, value in vars(m).items():
        if "dropout" in attr and isinstance(value, float) and value > 0:
            raise NotBatchableError(
                f"{where} has {attr}={value} in training mode: one pass over the "
                f"concatenated batches would draw other numbers than each trial alone. "
                f"Set it to 0 in the base's config, or run the trials one after another"
            )
    if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
        raise NotBatchableError(
            f"{where} updates running statistics over its whole batch; not batchable"
        )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Not data_ptr(): the tasks' parameters are copy-on-write aliases of the pool's
    # tensor (frozen.alias), and asking for a writable pointer would copy each.
    return (
        address(a) == address(b)
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def why_not_batchable(modules: Sequence[nn.Module]) -> str | None:
    """Why ``modules`` (one per trial, the same shard) cannot run as one pass, or
    ``None`` when they can (see the module docstring)."""
    try:
        BatchedShard(modules)
    except NotBatchableError as err:
        return str(err)
    return None


@dataclass
class BatchedRun:
    """One batched forward: each trial's outputs, and what its backward needs."""

    outputs: list[Any]
    # (output leaf position, full tensor) of the computed outputs split per trial
    split: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # output leaf positions handing each trial its own input tensor back
    passed: list[int] = field(default_factory=list)
    bounds: list[tuple[int, int]] = field(default_factory=list)
    spec: TreeSpec | None = None


class BatchedShard:
    """N trials' modules of one aligned shard, run as one pass (see the module docstring).

    Args:
        modules: one module per trial (a shard's ``nn.Sequential``); the first one's
            frozen layers run (all trials' are the same tensors).

    Raises:
        NotBatchableError: the modules cannot run as one pass; the message says why.

    Example:
        >>> import peft, torch
        >>> from torch import nn
        >>> base = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> trials = []
        >>> for r, target in [(2, ["0"]), (3, ["2"])]:
        ...     m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        ...     for mine, shared in zip(m.parameters(), base.parameters()):
        ...         mine.data = shared.data  # as the frozen pool shares them
        ...     trials.append(peft.get_peft_model(m, peft.LoraConfig(r=r, target_modules=target)))
        >>> run = BatchedShard(trials).forward([torch.ones(3, 4), torch.ones(2, 4)])
        >>> [tuple(o.shape) for o in run.outputs]
        [(3, 2), (2, 2)]
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        if len(modules) < 2:
            raise NotBatchableError("a batch needs at least 2 trials' modules")
        self.trials = [_describe(i, m) for i, m in enumerate(modules)]
        first = self.trials[0]
        for i, t in enumerate(self.trials[1:], 1):
            if t.structure != first.structure:
                diff = (
                    next(
                        (a, b) for a, b in zip(t.structure, first.structure, strict=False) if a != b
                    )
                    if len(t.structure) == len(first.structure)
                    else ("modules", "count")
                )
                raise NotBatchableError(
                    f"trial {i}'s shard is not trial 0's apart from the adapters "
                    f"(first difference: {diff[0]} vs {diff[1]})"
                )
            if t.frozen.keys() != first.frozen.keys():
                names = sorted(t.frozen.keys() ^ first.frozen.keys())[:3]
                raise NotBatchableError(f"trial {i} and trial 0 differ in parameters {names}")
            for name, p in t.frozen.items():
                if not _same_tensor(p, first.frozen[name]):
                    raise NotBatchableError(
                        f"trial {i}'s frozen {name} is not trial 0's tensor: the batched pass "
                        f"runs one copy of the base for all trials, so its frozen tensors "
                        f"must be shared (Engine(share_frozen=True), equal bases)"
                    )
            if t.buffers.keys() != first.buffers.keys() or not all(
                _same_tensor(b, first.buffers[n]) or torch.equal(b, first.buffers[n])
                for n, b in t.buffers.items()
            ):
                raise NotBatchableError(f"trial {i}'s buffers differ from trial 0's")
        self.device = next(iter(first.frozen.values())).device if first.frozen else None
        if self.device is not None and self.device.type != "cpu":
            drawing = [i for i, t in enumerate(self.trials) if t.draws]
            if drawing:
                raise NotBatchableError(
                    f"trials {drawing} have active LoRA dropout on {self.device}: per-trial "
                    f"generators are routed on the CPU only"
                )
        # Every module some trial adapts: the first trial's module there runs the base.
        self.sites: dict[str, list[nn.Module | None]] = {}
        for i, t in enumerate(self.trials):
            for name in t.loras:
                self.sites.setdefault(name, [None] * len(self.trials))[i] = t.loras[name]

    @property
    def draws(self) -> list[bool]:
        """Per trial, whether its adapters draw random numbers (active LoRA dropout): its
        generator must be given to :meth:`forward` (and replayed for a recompute)."""
        return [t.draws for t in self.trials]

    # -- forward ------------------------------------------------------------------------

    def forward(
        self, inputs: Sequence[Any], generators: Sequence[torch.Generator | None] | None = None
    ) -> BatchedRun:
        """Run the shard once over all trials' inputs.

        Args:
            inputs: each trial's input (tensors or a nest of them, one structure); leaves
                that require grad collect that trial's input gradient in :meth:`backward`.
            generators: per trial, the CPU generator its adapters' dropout draws from
                (needed where :attr:`draws`; the caller saves their states to replay a
                recompute).

        Returns:
            A :class:`BatchedRun` whose ``outputs`` are each trial's outputs (in the graph
            when grad is enabled).

        Raises:
            NotBatchableError: the inputs do not concatenate, a generator is missing, or
                an output has no batch dimension.
        """
        n = len(self.trials)
        if len(inputs) != n:
            raise NotBatchableError(f"{len(inputs)} inputs for {n} trials")
        gens: list[torch.Generator | None] = list(generators or [None] * n)
        missing = [i for i, t in enumerate(self.trials) if t.draws and gens[i] is None]
        if missing:
            raise NotBatchableError(
                f"trials {missing} have active LoRA dropout: give their generators"
            )
        flat, spec, kinds, bounds = self._concatenate(inputs)
        total = bounds[-1][1]
        batched_input = tree_unflatten(flat, spec)
        with self._sites(bounds, gens):
            out = self.trials[0].module(batched_input)
        return self._split(out, inputs, flat, kinds, bounds, total)

    def _concatenate(
        self, inputs: Sequence[Any]
    ) -> tuple[list[Any], TreeSpec, list[str], list[tuple[int, int]]]:
        flats: list[list[Any]] = []
        spec: TreeSpec | None = None
        for i, x in enumerate(inputs):
            leaves, s = tree_flatten(x)
            if spec is None:
                spec = s
            elif s != spec:
                raise NotBatchableError(f"trial {i}'s input is not structured as trial 0's")
            flats.append(leaves)
        assert spec is not None
        sizes: list[int] = []
        for i, leaves in enumerate(flats):
            first = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
            if first is None or first.dim() == 0:
                raise NotBatchableError(f"trial {i}'s input has no batched tensor")
            sizes.append(first.shape[0])
        bounds, lo = [], 0
        for b in sizes:
            bounds.append((lo, lo + b))
            lo += b
        out: list[Any] = []
        kinds: list[str] = []
        for k, column in enumerate(zip(*flats, strict=True)):
            tensors = [isinstance(v, torch.Tensor) for v in column]
            if not any(tensors):
                if not all(_same_value(column[0], v) for v in column[1:]):
                    raise NotBatchableError(f"input value {k} differs between the trials")
                out.append(column[0])
                kinds.append("value")
                continue
            if not all(tensors):
                raise NotBatchableError(f"input {k} is a tensor in some trials only")
            ts: list[torch.Tensor] = list(column)
            if all(t.dim() > 0 and t.shape[0] == b for t, b in zip(ts, sizes, strict=True)):
                out.append(torch.cat(ts))
                kinds.append("cat")
                continue
            first = ts[0]
            equal = all(
                t.shape == first.shape and t.dtype == first.dtype and torch.equal(t, first)
                for t in ts[1:]
            )
            if not equal:
                raise NotBatchableError(
                    f"input tensor {k} (shape {tuple(first.shape)}) neither has the batch "
                    f"dimension nor is equal in all trials"
                )
            if any(t.requires_grad for t in ts):
                if first.dim() == 0 or first.shape[0] != 1:
                    raise NotBatchableError(
                        f"input tensor {k} (shape {tuple(first.shape)}) is shared by the "
                        f"trials and needs a gradient: its per-trial gradients cannot be told "
                        f"apart"
                    )
                out.append(
                    torch.cat([t.expand(b, *t.shape[1:]) for t, b in zip(ts, sizes, strict=True)])
                )
                kinds.append("expand")
                continue
            out.append(first)
            kinds.append("shared")
        return out, spec, kinds, bounds

    def _split(
        self,
        out: Any,
        inputs: Sequence[Any],
        flat_in: list[Any],
        kinds: list[str],
        bounds: list[tuple[int, int]],
        total: int,
    ) -> BatchedRun:
        leaves, spec = tree_flatten(out)
        own = [tree_flatten(x)[0] for x in inputs]
        position = {id(v): k for k, v in enumerate(flat_in)}
        per: list[list[Any]] = [[] for _ in inputs]
        run = BatchedRun([], bounds=bounds, spec=spec)
        for j, leaf in enumerate(leaves):
            k = position.get(id(leaf))
            if k is not None and (isinstance(leaf, torch.Tensor) or kinds[k] == "value"):
                # Handed through (an input passed on): each trial gets its own back.
                for i, mine in enumerate(own):
                    per[i].append(mine[k])
                if isinstance(leaf, torch.Tensor):
                    run.passed.append(j)
                continue
            if not isinstance(leaf, torch.Tensor):
                for p in per:
                    p.append(leaf)
                continue
            if (leaf.dim() == 0 or leaf.shape[0] != total) and not leaf.requires_grad:
                # Computed from what the trials share (rotary cos/sin from the positions):
                # each trial alone computed the same.
                for p in per:
                    p.append(leaf)
                continue
            if leaf.dim() == 0 or leaf.shape[0] != total:
                raise NotBatchableError(
                    f"output {j} (shape {tuple(leaf.shape)}) has no concatenated batch "
                    f"dimension: a reduction over all trials' rows (a loss) is not batched"
                )
            for i, (lo, hi) in enumerate(bounds):
                per[i].append(leaf[lo:hi])
            run.split.append((j, leaf))
        run.outputs = [tree_unflatten(p, spec) for p in per]
        return run

    @contextlib.contextmanager
    def _sites(
        self, bounds: list[tuple[int, int]], gens: list[torch.Generator | None]
    ) -> Iterator[None]:
        """Replace the ``forward`` of the first trial's module at each adapted site (on
        the instance: whoever calls it, a block or a model's own forward) by a
        :class:`_Site`."""
        driver = self.trials[0].module
        patched: list[nn.Module] = []
        try:
            for name, layers in self.sites.items():
                current = driver.get_submodule(name)
                current.forward = _Site(current, layers, self.trials, bounds, gens)
                patched.append(current)
            yield
        finally:
            for current in patched:
                del current.forward

    # -- backward -----------------------------------------------------------------------

    @staticmethod
    def backward(run: BatchedRun, grad_outputs: Sequence[Any]) -> None:
        """Back-propagate each trial's output gradients (structured as its outputs, None
        where none) through the batched pass at once: each trial's adapter gradients
        accumulate in its own parameters, its input gradients in its input leaves."""
        outs, gs = BatchedShard._roots(run, grad_outputs)
        if outs:
            torch.autograd.backward(outs, gs)

    @staticmethod
    def gradients(
        run: BatchedRun, grad_outputs: Sequence[Any], wrt: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """As :meth:`backward`, but returns the gradients of ``wrt`` (the trials'
        trainable parameters and input leaves; None where a tensor is not reached)
        instead of accumulating them in ``.grad``: nothing changes until the caller,
        once the whole pass succeeded, adds them
        (:func:`~tune_hydra.engine.runtime.boundary.accumulate_grad`)."""
        outs, gs = BatchedShard._roots(run, grad_outputs)
        if not outs or not wrt:
            return [None] * len(wrt)
        return list(torch.autograd.grad(outs, list(wrt), gs, allow_unused=True))

    @staticmethod
    def _roots(
        run: BatchedRun, grad_outputs: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs to back-propagate from, and their gradients."""
        grads = [tree_flatten(g)[0] for g in grad_outputs]
        outs: list[torch.Tensor] = []
        gs: list[torch.Tensor] = []
        for j, full in run.split:
            column = [g[j] for g in grads]
            if not full.requires_grad or all(g is None for g in column):
                continue
            parts = [
                g if g is not None else full.new_zeros((hi - lo, *full.shape[1:]))
                for g, (lo, hi) in zip(column, run.bounds, strict=True)
            ]
            outs.append(full)
            gs.append(torch.cat(parts))
        for j in run.passed:
            for i, g in enumerate(grads):
                mine = tree_flatten(run.outputs[i])[0][j]
                if g[j] is not None and mine.requires_grad:
                    outs.append(mine)
                    gs.append(g[j])
        return outs, gs


def _same_value(a: Any, b: Any) -> bool:
    """Whether two non-tensor input values are interchangeable (a recorded argument of a
    transformers block, a flag ...)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    slots = getattr(type(a), "__slots__", None)
    if slots and type(a).__eq__ is object.__eq__:
        return all(getattr(a, s, _NO_NUMBER) == getattr(b, s, _NO_NUMBER) for s in slots)
    try:
        return bool(a == b)
    except Exception:
        return False


class _Site:
    """An adapted module's ``forward`` during a batched pass: the frozen base layer once
    over all rows, then each trial's LoRA layer on its rows."""

    def __init__(
        self,
        module: nn.Module,
        layers: list[nn.Module | None],
        trials: list[_Trial],
        bounds: list[tuple[int, int]],
        gens: list[torch.Generator | None],
    ) -> None:
        self.module = module  # the first trial's module there (a LoRA layer or its base)
        self.layers = layers
        self.trials = trials
        self.bounds = bounds
        self.gens = gens

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        total = self.bounds[-1][1]
        if x.dim() == 0 or x.shape[0] != total:
            raise NotBatchableError(
                f"an adapted layer got an input of shape {tuple(x.shape)}, not batch-major "
                f"over the {total} concatenated rows"
            )
        m = self.module
        if is_lora_layer(m):
            y = m.base_layer(x, *args, **kwargs)  # type: ignore[operator]
        else:  # its own forward (the instance's is this site)
            y = type(m).forward(m, x, *args, **kwargs)
        parts = []
        for i, (layer, (lo, hi)) in enumerate(zip(self.layers, self.bounds, strict=True)):
            if layer is None:
                parts.append(y[lo:hi])
                continue
            inner = cast(nn.Module, layer.base_layer)
            # The trial's own LoRA code (its class's forward: the first trial's instance
            # forward is this site), its base layer answering with its rows' result.
            inner.forward = _Answer(y[lo:hi])
            try:
                gen = self.gens[i]
                scope: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
                if gen is not None and self.trials[i].draws:
                    scope = use_generator(gen)
                with scope:
                    parts.append(type(layer).forward(layer, x[lo:hi], *args, **kwargs))
            finally:
                del inner.forward
        return torch.cat(parts)


class _Answer:
    """A base layer's ``forward`` answering with a result computed already."""

    __slots__ = ("result",)

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.result


# -- the engine's batched ops (Engine(batch_shared=True)) ------------------------------------


@dataclass(eq=False)  # by identity (a ledger key)
class _Group:
    """The ops of one assignment: its own (the lead's, first) and those run along with
    it; open to more until it starts."""

    w: Any  # the device worker it is queued on
    a: Any  # the lead's Assignment
    kind: Any  # OpKind
    shard: int
    key: frozenset[int]
    members: list[tuple[Any, Any]]  # (task record, op)
    started: bool = False
    # Under a device budget: the activations of the ops run along, held on the device
    # from the first join to the group's end (one batched pass holds them all at once).
    reserved: int = 0


class SharedBatcher:
    """Runs ops of several tasks on the same shared frozen shard as one batched op
    (``Engine(batch_shared=True)``): ops of the same kind (a forward, or a recomputing
    backward), on the same shard index, whose stores hold the same shared frozen
    tensors (:func:`shared_key`), run as one pass of :class:`BatchedShard` on one
    device, and each task advances as if it had run alone. The last shard's ops of a
    task factory (the loss) are grouped the same way but run one after another (never
    over the concatenation): the group stays together for the backward that follows.

    A group forms in two ways, both under the engine's lock: as an op is assigned, the
    matching ops ready then go along (:meth:`open`); and a matching op that becomes
    ready while the group waits in its device's queue joins it while no device is idle
    (:meth:`join`: loops' threads ask for their ops one by one). A group
    closes as it starts. Its other stores are counted as queued on the device
    (``Assignment.along``), so a device budget holds: an op joins only if its state
    fits there beside what is queued and leased (``DeviceWorker.fits``), and is leased
    as the group starts.

    Works for every runner that implements the batch steps (``batch_key``, ``batchable``,
    ``op_lock``, ``open_op``, ``run_op``, ``close_op``, ``op_start``, ``take_forward``,
    ``take_backward``, ``scratch_buffers``; optionally ``op_scope``). Limits (each op
    outside them runs alone, as without batching): recompute mode only; no autocast; no
    disk tier. Groups hold at most the live tasks per device. A group whose ops are not
    all ``batchable`` (a model head's, a shard that writes its input), or that turns out
    not batchable on the device (:func:`why_not_batchable`), runs its ops one after
    another in the one assignment, and so does one whose batched pass raised (it changed
    no task's state): only the task whose own op raises fails. The group stays together
    all the same, so the next shard's ops are ready together again.
    """

    def __init__(self, max_group: int = 8) -> None:
        self.max_group = max_group
        self.batched_ops = 0  # ops run inside a batched pass (the lead's included)
        self.passes = 0  # batched passes run
        self._open: list[_Group] = []  # queued groups not started (under the engine's lock)
        # Per extra task of a group run now: an error of its own.
        self._errors: dict[str, BaseException] = {}

    @staticmethod
    def _key(e: Any, o: Any) -> frozenset[int] | None:
        key = getattr(e.runner, "batch_key", None)  # runners that batch have one
        return None if key is None else key(o)

    def _limit(self, dispatcher: Any) -> int:
        # Groups no larger than the live tasks per device: every device gets a group.
        live = sum(1 for e in dispatcher.tasks_along() if e.error is None and e.runner.current)
        return min(self.max_group, max(2, -(-live // max(1, len(dispatcher.workers)))))

    def _add(self, dispatcher: Any, g: _Group, e: Any, o: Any) -> bool:
        """Put ``e``'s op ``o`` in ``g`` if its state fits on ``g``'s device beside what
        is queued and leased there."""
        store = e.runner.store_of(o.shard)
        w = g.w
        if w.budget is not None:
            acts = store.activation_bytes
            if not w.fits(store, extra=acts):
                return False
            g.reserved += acts
            w.hold_along(g, g.reserved)
        dispatcher.assign_along(e, w)
        g.a.along.append(store)
        g.members.append((e, o))
        return True

    def open(self, dispatcher: Any, w: Any, entry: Any, op: Any, a: Any) -> None:
        """Called as the dispatcher assigns ``op`` of ``entry`` to worker ``w`` (under the
        engine's lock): ``a`` runs as a group, with the matching ops ready now."""
        from tune_hydra.core.ops import OpKind

        if op.kind not in (OpKind.FORWARD, OpKind.BACKWARD, OpKind.LAST) or op.count != 1:
            return
        if dispatcher.host.active:
            return
        key = self._key(entry, op)
        if key is None:
            return
        g = _Group(w, a, op.kind, op.shard, key, [(entry, op)])
        limit = self._limit(dispatcher)
        for e in dispatcher.tasks_along():
            if len(g.members) >= limit:
                break
            o = e.runner.current
            if (
                e is entry
                or e.assigned is not None
                or e.error is not None
                or e.cancelled
                or o is None
                or o.kind is not op.kind
                or o.shard != op.shard
                or o.count != 1
                or self._key(e, o) != key
            ):
                continue
            self._add(dispatcher, g, e, o)
        lead_done = a.done
        a.run = lambda device: self._run(dispatcher, g, device)
        a.done = lambda a, err: self._done(dispatcher, g, lead_done, a, err)
        self._open.append(g)

    def join(self, dispatcher: Any, entry: Any, op: Any) -> bool:
        """Called for ``entry``'s ready ``op`` before the dispatcher offers it (under the
        engine's lock): run it along with a queued group of the same kind, shard and
        shared base that has room. True: it joined (it is assigned there)."""
        if not self._open or op.count != 1 or dispatcher.host.active:
            return False
        key: frozenset[int] | None = None
        limit = 0
        for g in self._open:
            if g.started or g.kind is not op.kind or g.shard != op.shard:
                continue
            if key is None:
                key = self._key(entry, op)
                if key is None:
                    return False
                limit = self._limit(dispatcher)
            if g.key == key and len(g.members) < limit and self._add(dispatcher, g, entry, op):
                return True
        return False

    def _run(self, dispatcher: Any, g: _Group, device: torch.device) -> None:
        """The group's op on ``device`` (on its worker's run thread): closed to joins;
        alone, the lead's op as ever; else the extra shards leased there, each runner's
        prologue, one batched pass, each runner's epilogue."""
        from tune_hydra.core.trace import TraceEvent

        with dispatcher.locked():
            g.started = True
            if g in self._open:
                self._open.remove(g)
        if len(g.members) == 1:
            entry, op = g.members[0]
            entry.runner.execute(op, device)
            return
        w = g.w
        leases = []
        ok = False
        errors: dict[str, BaseException] = {}
        extras: list[tuple[Any, Any]] = []
        t0 = w.clock()
        try:
            for e, o in list(g.members[1:]):
                lease = self._lease_along(dispatcher, g, e, o)
                if lease is not None:
                    extras.append((e, o))
                    leases.append(lease)
                    e.runner.store_of(o.shard).begin_op(o.kind)
            # The pass (and the activations of the ops along) starts once their states
            # are leased: the evictions that made room for them come before it.
            t0 = w.clock()
            runners = [e.runner for e, _ in g.members]
            errors = run_together(runners, [o for _, o in g.members], device, self)
            ok = True
        finally:
            self._errors.update(errors)
            for (e, o), lease in zip(extras, leases, strict=True):
                store = e.runner.store_of(o.shard)
                try:
                    store.end_op(failed=not ok or e.name in errors)
                except BaseException as err:  # a shared frozen tensor it changed: its own
                    self._errors.setdefault(e.name, err)
                lease.release()
                w.trace.add(
                    TraceEvent(
                        w.label, o.task, o.shard, o.kind.value, t0, w.clock(), lease.moved,
                        o.iteration, o.batch, along=True,
                    )
                )  # fmt: skip

    def _lease_along(self, dispatcher: Any, g: _Group, e: Any, o: Any) -> Any:
        """Lease ``e``'s state for ``o`` run along in ``g`` (on its worker's run thread),
        or, if it cannot be leased at once, take the op out of the group: the dispatcher
        offers it again. Never waits: only ops and leases ending could make room, and the
        op of this thread is the one running (waiting hung the device)."""
        w = g.w
        store = e.runner.store_of(o.shard)
        lease = w.lease(store, ahead_of=g.a, blocking=False, room_now=True)
        if lease is not None:
            return lease
        with dispatcher.locked():
            g.members.remove((e, o))
            g.a.along.remove(store)
            if g.reserved:
                g.reserved -= store.activation_bytes
                w.hold_along(g, g.reserved or None)
            dispatcher.drop_along(e)
        log.debug("%s: %s runs after the batched pass, not in it (no room now)", w.label, o)
        return None

    def _done(
        self, dispatcher: Any, g: _Group, lead_done: Any, a: Any, err: BaseException | None
    ) -> None:
        """The group's op ended: every task of it advances before the next decision (its
        next ops are ready together: a task factory's group runs together again)."""
        from tune_hydra.engine.dispatch.workers import Assignment

        with dispatcher.locked():
            g.started = True  # it failed before starting (its lease): closed all the same
            if g in self._open:
                self._open.remove(g)
            if g.reserved:
                g.w.hold_along(g, None)
        entry = g.members[0][0]
        extras = g.members[1:]
        if not extras:
            lead_done(a, err)
            return
        with dispatcher.hold():
            for e, o in extras:
                one = Assignment(o, e.runner.store_of(o.shard), run=a.run, done=a.done)
                one.duration = a.duration / len(g.members)
                failed = err or self._errors.pop(e.name, None)
                dispatcher.done_along(e, one, failed)
            lead_done(a, err or self._errors.pop(entry.name, None))


def shared_key(store: Any) -> frozenset[int] | None:
    """What a shard's ops batch on: the pool entries of the shared frozen tensors its
    store holds (ops with the same key run over the same base). ``None``: it holds none,
    or a store a batched pass cannot lease beside another (a disk tier's)."""
    from tune_hydra.engine.storage import ShardStore

    parts = store.parts()
    if any(type(p) is not ShardStore for p in parts):
        return None
    entries = frozenset(id(ref.entry) for p in parts for ref in p.frozen.values())
    return entries or None


def run_together(
    runners: list[Any], ops: list[Any], device: torch.device, stats: SharedBatcher | None = None
) -> dict[str, BaseException]:
    """Run each runner's ``op`` (a forward that is not the last shard's, or a
    recomputing backward; one micro-batch; the same shard index) as one batched pass on
    ``device``, with the steps of its ``execute`` around it per runner (``open_op``,
    ``run_op`` or ``op_start`` / ``take_forward`` / ``take_backward``, ``close_op``); one
    after another where the group is not batchable there, or where the batched pass
    raised.

    Returns:
        Per runner name, the error its own op raised (the op of each runner not named
        completed). A batched pass changes no runner's state before it succeeded, so
        after an error in it every op runs alone: only the trial whose own op raises
        fails, the others go on exactly as alone.
    """
    from tune_hydra.core.ops import OpKind

    errors: dict[str, BaseException] = {}
    with contextlib.ExitStack() as locks:
        for r in sorted(runners, key=lambda r: r.name):
            locks.enter_context(r.op_lock)
        for r in runners:  # what the runner's ops compute inside (a loop's inside_op)
            locks.enter_context(getattr(r, "op_scope", contextlib.nullcontext)())
        todo = []
        t0 = time.perf_counter()
        for r, op in zip(runners, ops, strict=True):
            try:
                if r.open_op(op, device):
                    todo.append((r, op))
            except Exception as err:  # its own (a deferred step, its data): it fails alone
                errors[r.name] = err
        if (
            len(todo) > 1
            and todo[0][1].kind is not OpKind.LAST
            and all(r.batchable(op) for r, op in todo)
        ):
            try:
                errors.update(_batched_op(todo, device))
            except Exception:
                # Not batchable here, or one trial's error (its adapter, its input): no
                # runner's state changed; each op runs alone, and fails alone.
                pass
            else:
                if stats is not None:
                    stats.passes += 1
                    stats.batched_ops += len(todo)
                todo = []
        for r, op in todo:
            try:
                r.run_op(op, device)
            except Exception as err:
                errors[r.name] = err
        spent = (time.perf_counter() - t0) / max(1, len(runners))
        for r in runners:
            r.close_op(spent)
    return errors


def _batched_op(todo: list[Any], device: torch.device) -> dict[str, BaseException]:
    """One pass for every ``(runner, op)`` of ``todo``. Raises (NotBatchableError when
    the group is not batchable, or whatever the pass raised) before changing any
    runner's state; once the pass succeeded, each runner takes its results, and an
    error doing so (its optimizer step) is returned under its name."""
    from tune_hydra.core.ops import OpKind

    batched = BatchedShard([r.shards[op.shard].module for r, op in todo])
    starts = [r.op_start(op, device) for r, op in todo]
    gens: list[torch.Generator | None] = []
    for start in starts:
        g = torch.Generator()
        g.set_state(start.stream.cpu)
        gens.append(g)
    inputs = [start.input for start in starts]
    if todo[0][1].kind is OpKind.FORWARD:
        with torch.no_grad():
            run = batched.forward(inputs, gens)
        for k, (r, op) in enumerate(todo):
            gen = gens[k]
            assert gen is not None
            r.take_forward(op, starts[k], run.outputs[k], gen.get_state())
        return {}
    with contextlib.ExitStack() as scratch:
        for r, op in todo:
            scratch.enter_context(r.scratch_buffers(op))
        with torch.enable_grad():
            run = batched.forward(inputs, gens)
    # The gradients of every trial's trainable parameters and input leaves, held back
    # from ``.grad`` until the whole pass succeeded.
    wrt = [t for start in starts for t in start.wrt]
    got = iter(BatchedShard.gradients(run, [start.grad for start in starts], wrt))
    errors: dict[str, BaseException] = {}
    for (r, op), start in zip(todo, starts, strict=True):
        mine = [next(got) for _ in start.wrt]
        try:
            r.take_backward(op, start, mine)
        except Exception as err:
            errors[r.name] = err
    return errors


__all__ = [
    "BatchedRun",
    "BatchedShard",
    "SharedBatcher",
    "is_lora_layer",
    "run_together",
    "why_not_batchable",
]
