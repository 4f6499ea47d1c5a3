"""Plain PyTorch training: the reference every engine path must equal exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tune_hydra.engine.runtime.boundary import split_batch
from tune_hydra.engine.runtime.metrics import MetricTotals, add_metrics, build_scheduler
from tune_hydra.engine.task import ModelTask


def train_plain(
    task: ModelTask,
    epochs: int = 1,
    *,
    seed: int = 0,
    max_grad_norm: float | None = None,
    accumulate_steps: int = 1,
    precision: str | None = None,
    device: str | torch.device = "cpu",
) -> list[dict[str, Any]]:
    """Train ``task.model`` in place the plain way; returns one dict per epoch.

    Exactly: ``torch.manual_seed(seed)``, ``model.train()``, then per epoch, per batch:
    ``zero_grad`` at the start of each group of ``accumulate_steps`` batches,
    ``loss = loss_fn(model(x), y)`` (under bf16 autocast if asked; for a dict batch
    ``model(**batch)`` and ``batch["labels"]``, and with ``loss_fn=None`` the model's own
    ``output.loss``), ``(loss / k).backward()``,
    and at the end of each group (and of a partial last group) ``clip_grad_norm_`` (if
    ``max_grad_norm``), ``step`` and the ``lr_scheduler``'s ``step`` (one scheduler built
    over the one optimizer). ``loss`` is the mean of ``loss.item()``; ``val_loss`` the mean
    eval loss under ``model.eval()`` and ``no_grad``, and each of ``task.metrics`` the
    batch-size-weighted mean of its values over ``eval_data`` (a metric named ``loss`` takes
    that key, and the training loss is then ``train_loss``). The engine's ``seed`` gives
    each task this same stream.

    Example:
        >>> import copy, torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> task = th.ModelTask(nn.Sequential(nn.Linear(2, 1)), nn.MSELoss(),
        ...                     lambda p: torch.optim.SGD(p, lr=0.1),
        ...                     [(torch.ones(1, 2), torch.zeros(1, 1))])
        >>> round(train_plain(task, 1)[0]["loss"], 6) >= 0
        True
    """
    model = task.model
    assert isinstance(model, nn.Module)
    device = torch.device(device)
    model.to(device)
    opt = task.optimizer(list(model.parameters()))
    sched = (
        build_scheduler(task.lr_scheduler, opt, "plain", "the model's optimizer")
        if task.lr_scheduler is not None
        else None
    )
    k = accumulate_steps
    torch.manual_seed(seed)
    model.train()

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step() -> None:
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        if sched is not None:
            sched.step()

    history = []
    for _ in range(epochs):
        losses = []
        i = -1
        for i, batch in enumerate(task.train_data):
            x, y = split_batch(batch, "plain")
            if i % k == 0:
                opt.zero_grad()
            with autocast():
                loss = task.compute_loss(_call(model, _to(x, device)), _to(y, device), "plain")
            (loss / k).backward()
            losses.append(loss.item())
            if (i + 1) % k == 0:
                step()
        if (i + 1) % k != 0:
            step()
        record: dict[str, Any] = {"loss": sum(losses) / len(losses)}
        if task.eval_data is not None:
            model.eval()
            totals = MetricTotals(task.metrics)
            vals = []
            with torch.no_grad(), autocast():
                for e, batch in enumerate(task.eval_data):
                    x, y = split_batch(batch, "plain")
                    out, target = _call(model, _to(x, device)), _to(y, device)
                    vals.append(task.compute_loss(out, target, "plain").item())
                    if totals.metrics:
                        totals.add(out, target, "plain", f"batch {e} of eval_data")
            model.train()
            record["val_loss"] = sum(vals) / len(vals)
            add_metrics(record, totals.means())
        history.append(record)
    return history


def _call(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict batch (a Hugging Face collator's), else ``model(inputs)``."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def _to(obj: Any, device: torch.device) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, obj)
