"""The user's description of one model to train: :class:`ModelTask`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tune_hydra.engine.runtime.metrics import check_lr_scheduler, check_metrics
from tune_hydra.engine.storage.frozen import address
from tune_hydra.exceptions import InvalidModelError, InvalidTaskError

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class ModelTask:
    """One model to train, with its loss, optimizer and data.

    Args:
        model: any ``nn.Module``, kept as it is (after training it is your module,
            trained, with your state-dict keys). An ``nn.Sequential`` is cut between its
            layers (nested ``nn.Sequential`` children finer); any other module is cut by
            tracing its ``forward`` with torch.fx (see :mod:`tune_hydra.models`); a list /
            ``nn.ModuleList`` of modules executed in order is wrapped in an
            ``nn.Sequential`` (state-dict keys ``"0.weight"`` ...).
        loss_fn: ``(output, target) -> scalar tensor``; or ``None``: the model computes
            its own loss (a Hugging Face model given ``labels``), read as ``output.loss``
            or ``output["loss"]``.
        optimizer: a callable that builds a torch optimizer from a list of parameters. The
            engine calls it once per shard with that shard's parameters, which equals one
            optimizer over the whole model for every per-parameter optimizer (SGD, Adam,
            AdamW, RMSprop, Adagrad, ...).
        train_data: a re-iterable of batches (a ``DataLoader``, a list ...), iterated
            once per epoch, in order. A batch is an ``(inputs, targets)`` pair
            (``output = model(inputs)``, ``loss = loss_fn(output, targets)``) or a dict,
            as Hugging Face collators make (``output = model(**batch)``; the target of
            ``loss_fn`` and ``metrics`` is ``batch["labels"]``).
        eval_data: optional, like ``train_data``; gives ``val_loss`` each epoch.
        seed: this task's seed, overriding the one given to ``train_models``.
        metrics: optional ``{name: fn(output, target) -> float | 0-dim tensor}``, computed
            on every ``eval_data`` batch (needs ``eval_data``); each epoch reports under
            ``name`` the mean over batches weighted by batch size (the target's first
            dimension). A metric named ``loss`` is the task's own: its results report it
            as ``loss`` and the mean training loss as ``train_loss``. Other names the
            engine reports itself (``val_loss``, ``train_loss``, ``epoch`` ...) are
            refused.
        lr_scheduler: optional ``fn(optimizer) -> torch.optim.lr_scheduler.LRScheduler``
            (``StepLR``, ``LambdaLR``, ``OneCycleLR``, ``transformers.get_scheduler``
            ...), stepped after every optimizer step (every batch, or every
            ``accumulate_steps`` batches). The engine builds one per shard optimizer; each
            follows the schedule one scheduler over the whole model would.
        extra: free-form values kept with the task.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
        >>> task = th.ModelTask(
        ...     model=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
        ...     loss_fn=nn.MSELoss(),
        ...     optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        ...     train_data=data,
        ... )
        >>> history = th.train_models({"a": task}, devices=["cpu"], epochs=1)
        >>> sorted(history["a"][0])[:3]
        ['batches', 'bytes_spilled', 'device_time_s']
    """

    model: nn.Module | Sequence[nn.Module]
    loss_fn: LossFn | None
    optimizer: OptimizerFactory
    train_data: Iterable[Any]
    eval_data: Iterable[Any] | None = None
    seed: int | None = None
    metrics: dict[str, Callable[[Any, Any], Any]] | None = None
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.model, (list, tuple, nn.ModuleList)):
            mods = list(self.model)
            if not all(isinstance(m, nn.Module) for m in mods):
                raise InvalidModelError(
                    "model must be an nn.Module or a list of nn.Modules; the list holds "
                    f"{sorted({type(m).__name__ for m in mods if not isinstance(m, nn.Module)})}"
                )
            self.model = nn.Sequential(*mods)
        if not isinstance(self.model, nn.Module):
            raise InvalidModelError(
                f"model must be an nn.Module (an nn.Sequential, any module whose forward "
                f"torch.fx can trace) or a list of modules, not {type(self.model).__name__}"
            )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise InvalidTaskError(
                "loss_fn must be callable as loss_fn(output, target), or None for a model "
                "that computes its own loss (output.loss)"
            )
        if not callable(self.optimizer) or isinstance(self.optimizer, torch.optim.Optimizer):
            raise InvalidTaskError(
                "optimizer must be a factory such as "
                "lambda params: torch.optim.AdamW(params, lr=1e-3), not an optimizer instance: "
                "the engine builds one optimizer per shard"
            )
        for name in ("train_data", "eval_data"):
            data = getattr(self, name)
            if data is None and name == "eval_data":
                continue
            if not isinstance(data, Iterable) or hasattr(data, "__next__"):
                raise InvalidTaskError(
                    f"{name} must be re-iterable (a DataLoader, a list of (inputs, targets) "
                    f"...), not a one-shot {type(data).__name__}: it is iterated every epoch"
                )
        self.metrics = check_metrics(self.metrics, self.eval_data is not None)
        check_lr_scheduler(self.lr_scheduler)

    def compute_loss(self, output: Any, target: Any, name: str = "task") -> Any:
        """``loss_fn(output, target)``, or with ``loss_fn=None`` the model's own loss
        (``output.loss`` / ``output["loss"]``).

        Raises:
            InvalidLossError: ``loss_fn`` is ``None`` and ``output`` carries no loss.
        """
        if self.loss_fn is not None:
            return self.loss_fn(output, target)
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None:
            from tune_hydra.exceptions import InvalidLossError

            raise InvalidLossError(
                name,
                f"loss_fn is None, so the loss is the model's own (output.loss), but the "
                f"model returned {type(output).__name__} without one. Put the labels in the "
                f"batch (a dict with 'labels', for a Hugging Face model), or give a loss_fn",
            )
        return loss


def model_layers(
    model: nn.Module, task: str | None = None, *, call: Any = None
) -> list[tuple[str, nn.Module]]:
    """The model's layers in execution order, as ``(name, module)``.

    An ``nn.Sequential`` is cut as written (:func:`~tune_hydra.models.sequential_layers`:
    its children, nested ``nn.Sequential`` flattened, named by their state-dict prefix);
    a Hugging Face ``PreTrainedModel`` at its list of blocks
    (:func:`~tune_hydra.models.hf_layers`: ``embed``, one stage per block, ``head``);
    a peft ``PeftModel`` (LoRA ...) as its base model is, adapters inside their layers
    (:func:`~tune_hydra.models.peft.peft_layers`);
    any other module by tracing its ``forward`` with torch.fx
    (:func:`~tune_hydra.models.trace_layers`: one stage per submodule call, named after
    that submodule, with the values live across the cut carried by the boundary).

    Args:
        model: the task's model.
        task: the task's name, for errors.
        call: for a traced model, the call to trace (a ``TracedCall``: ``th.shard``'s
            first forward, with its arguments as the model takes them).

    Raises:
        InvalidModelError: not an ``nn.Module``, no layers, or a ``forward`` that cannot
            be traced (the message names the construct and the fix).
    """
    from tune_hydra.models import (
        hf_layers,
        is_hf_model,
        is_peft_model,
        peft_layers,
        sequential_layers,
        trace_layers,
    )

    if isinstance(model, nn.Sequential):
        return sequential_layers(model, task)
    if is_peft_model(model):  # cut at its base model's layers (see tune_hydra.models.peft)
        return peft_layers(model, task)
    if is_hf_model(model):  # cut at its blocks, not traced (see tune_hydra.models.hf)
        return hf_layers(model, task)
    if not isinstance(model, nn.Module):
        of = f"task {task!r}: " if task is not None else ""
        raise InvalidModelError(
            f"{of}model must be an nn.Module (or a list of modules executed in order), not "
            f"{type(model).__name__}"
        )
    return trace_layers(model, task, call=call)


# -- which tensors a model holds (to refuse two tasks training the same ones) -------------

TensorKey = tuple[Any, ...]


@dataclass
class OwnedTensors:
    """What a task trains, as keys that two models sharing a tensor have in common.

    Keys are ``("param", id)`` for a parameter object, ``("slot", id(module), name)`` for
    a module's buffer slot, ``("buffer", id)`` for a buffer tensor object and
    ``("storage", data_ptr)`` for the memory of a tensor on the CPU (so that two
    parameter objects viewing one storage are caught too). ``refs`` holds the objects the
    keys were taken from, so that no id or address is reused while the keys are kept.

    Attributes:
        keys: key -> the tensor's qualified name in the model (the first one, for a
            tensor tied within the model).
        refs: the keyed objects, kept alive.
    """

    keys: dict[TensorKey, str] = field(default_factory=dict)
    refs: list[Any] = field(default_factory=list)

    def add(self, key: TensorKey, name: str, obj: Any) -> None:
        if key not in self.keys:
            self.keys[key] = name
            self.refs.append(obj)

    def add_storage(self, t: torch.Tensor, name: str) -> None:
        """Key the CPU memory behind ``t`` (not on devices: a shard's device copies are
        the engine's own, and other tasks reach them only through shared objects)."""
        if t.device.type != "cpu" or t.layout is not torch.strided:
            return
        storage = t.untyped_storage()
        # Not storage.data_ptr(): it copies a copy-on-write storage (a finished task's
        # model sharing a frozen pool tensor, see tune_hydra.engine.storage.frozen.lazy_clone).
        ptr = address(t) - t.storage_offset() * t.element_size()
        if ptr and storage.nbytes():
            self.add(("storage", ptr), name, storage)

    def shared_with(self, other: OwnedTensors) -> list[tuple[str, str]]:
        """``(name here, name there)`` of every tensor both hold, in this model's order."""
        pairs: dict[tuple[str, str], None] = {}
        for key, name in self.keys.items():
            theirs = other.keys.get(key)
            if theirs is not None:
                pairs[(name, theirs)] = None
        return list(pairs)


def owned_tensors(
    model: nn.Module, host: Iterable[tuple[Any, torch.Tensor]] = (), *, frozen: bool = True
) -> OwnedTensors:
    """The parameters and buffers ``model`` holds now, keyed (see :class:`OwnedTensors`).

    Args:
        model: the task's model.
        host: more tensors of the model's, as ``(parameter or (module, buffer name),
            tensor)``: the host copies of shards that are on a device right now.
        frozen: with its frozen parameters (``requires_grad=False``); ``False``: without
            them (a ``th.shard`` loop's claim: the engine's frozen pool shares equal ones
            between tasks on purpose, and nothing steps them).

    Example:
        >>> from torch import nn
        >>> a = nn.Sequential(nn.Linear(2, 2))
        >>> b = nn.Sequential(nn.ReLU(), a[0])
        >>> owned_tensors(b).shared_with(owned_tensors(a))
        [('1.weight', '0.weight'), ('1.bias', '0.bias')]
    """
    owned = OwnedTensors()
    names: dict[int, str] = {}  # id(parameter) / id(module) -> qualified name
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        names.setdefault(id(module), prefix)
        for pname, p in module._parameters.items():
            if p is None or not (frozen or p.requires_grad):
                continue
            qual = names.setdefault(id(p), dot + pname)
            owned.add(("param", id(p)), qual, p)
            owned.add_storage(p.data, qual)
        for bname, b in module._buffers.items():
            qual = dot + bname
            owned.add(("slot", id(module), bname), qual, module)
            if b is not None:
                owned.add(("buffer", id(b)), qual, b)
                owned.add_storage(b, qual)
    for holder, t in host:
        if isinstance(holder, tuple):
            module, bname = holder
            prefix = names.get(id(module), "?")
            qual = f"{prefix}.{bname}" if prefix else bname
            owned.add(("buffer", id(t)), qual, t)
        else:
            qual = names.get(id(holder), "?")
        owned.add_storage(t, qual)
    return owned


# -- describing data, for errors ------------------------------------------------------------


def describe(obj: Any, limit: int = 4) -> str:
    """``float32[6, 8]`` for a tensor; a tuple / list / dict of them likewise (short)."""
    if isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).removeprefix("torch.")
        return f"{dtype}{list(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        parts = [describe(o, limit) for o in obj[:limit]]
        more = ", ..." if len(obj) > limit else ""
        return (
            f"({', '.join(parts)}{more})"
            if isinstance(obj, tuple)
            else f"[{', '.join(parts)}{more}]"
        )
    if isinstance(obj, dict):
        items = [f"{k!r}: {describe(v, limit)}" for k, v in list(obj.items())[:limit]]
        more = ", ..." if len(obj) > limit else ""
        return "{" + ", ".join(items) + more + "}"
    return f"a {type(obj).__name__}"


def _floating_dtypes(obj: Any) -> set[torch.dtype]:
    leaves, _ = tree_flatten(obj)
    return {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}


def mismatch_hint(inputs: Any, layer: nn.Module, *, shapes: bool = True) -> str:
    """What about ``inputs`` does not fit ``layer``, when that can be told: a floating
    dtype other than the layer's parameters', or (with ``shapes``: ``inputs`` are what
    the layer got) a ``Linear`` / ``Conv`` input of another width; ``""`` otherwise."""
    got = _floating_dtypes(inputs)
    want = {p.dtype for p in layer.parameters() if p.is_floating_point()}
    if len(got) == 1 and len(want) == 1 and got != want:
        g = str(next(iter(got))).removeprefix("torch.")
        w = str(next(iter(want))).removeprefix("torch.")
        return (
            f"The inputs are {g} but the model is {w}: convert one of them (the data with "
            f".to(torch.{w}), or the model with model.to(torch.{g}))."
        )
    if not shapes or not isinstance(inputs, torch.Tensor):
        return ""
    if isinstance(layer, nn.Linear) and inputs.dim() >= 1 and inputs.shape[-1] != layer.in_features:
        return (
            f"The layer takes {layer.in_features} features in the last dimension, the input "
            f"has {inputs.shape[-1]}: fix the data's shape or the layer's in_features."
        )
    if isinstance(layer, nn.modules.conv._ConvNd):
        dims = len(layer.kernel_size)
        if inputs.dim() not in (dims + 1, dims + 2):
            return (
                f"The layer takes {dims + 2}-d inputs (batch, channels, {dims} spatial), the "
                f"input is {inputs.dim()}-d: fix the data's shape."
            )
        channels = inputs.shape[inputs.dim() - dims - 1]
        if channels != layer.in_channels:
            return (
                f"The layer takes {layer.in_channels} channels, the input has {channels}: "
                f"fix the data's shape or the layer's in_channels."
            )
    return ""
