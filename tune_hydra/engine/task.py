"""The user's description of one model to train: :class:`ModelTask`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tune_hydra.exceptions import InvalidModelError, InvalidTaskError

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class ModelTask:
    """One model to train, with its loss, optimizer and data.

    Args:
        model: an ``nn.Sequential`` (nested ``nn.Sequential`` children are cut finer), or
            a list / ``nn.ModuleList`` of modules executed in order (it is wrapped in an
            ``nn.Sequential``, so state-dict keys are ``"0.weight"`` ...).
        loss_fn: ``(output, target) -> scalar tensor``.
        optimizer: a callable that builds a torch optimizer from a list of parameters. The
            engine calls it once per shard with that shard's parameters, which equals one
            optimizer over the whole model for every per-parameter optimizer (SGD, Adam,
            AdamW, RMSprop, Adagrad, ...).
        train_data: a re-iterable of ``(inputs, targets)`` batches (a ``DataLoader``, a
            list ...). It is iterated once per epoch, in order.
        eval_data: optional, like ``train_data``; gives ``val_loss`` each epoch.
        seed: this task's seed, overriding the one given to ``train_models``.

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
    loss_fn: LossFn
    optimizer: OptimizerFactory
    train_data: Iterable[Any]
    eval_data: Iterable[Any] | None = None
    seed: int | None = None
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
                f"model must be an nn.Sequential or a list of modules, not "
                f"{type(self.model).__name__}"
            )
        if not callable(self.loss_fn):
            raise InvalidTaskError("loss_fn must be callable as loss_fn(output, target)")
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


def model_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in execution order, as ``(qualified name, module)``.

    Nested ``nn.Sequential`` containers are flattened so the partitioner may cut inside
    them; any other module is one indivisible layer.
    """
    if not isinstance(model, nn.Sequential):
        raise InvalidModelError(
            f"model must be an nn.Sequential (or a list of modules executed in order), not "
            f"{type(model).__name__}: the engine cuts the model into sequential shards. Wrap "
            f"your layers in nn.Sequential(...) in the order forward() runs them"
        )
    layers: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, seq: nn.Sequential) -> None:
        for name, child in seq.named_children():
            qual = f"{prefix}{name}"
            if type(child) is nn.Sequential:
                visit(qual + ".", child)
            else:
                layers.append((qual, child))

    visit("", model)
    if not layers:
        raise InvalidModelError("model has no layers; give it at least one module")
    return layers
