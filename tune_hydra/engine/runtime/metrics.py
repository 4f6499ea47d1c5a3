"""A task's eval metrics and learning-rate schedule (``ModelTask(metrics=...,
lr_scheduler=...)``), shared by the engine and :func:`~tune_hydra.train_plain` so that both
compute them in the same order, bit for bit.

- A metric is ``fn(output, target) -> float | 0-dim tensor``, evaluated on every batch of
  ``eval_data``; the epoch's value is the mean over batches weighted by each batch's size
  (the first dimension of its target): :class:`MetricTotals`.
- A metric named ``loss`` is the task's own: its results report it as ``loss``, and the
  engine's mean training loss as ``train_loss`` (:func:`add_metrics`).
- A schedule is ``lr_scheduler(optimizer) -> LRScheduler``; the engine builds one per
  shard optimizer (:func:`build_scheduler`) and steps it after every step of that
  optimizer, so every shard follows the schedule one scheduler over the whole model would.

Example:
    >>> import torch
    >>> totals = MetricTotals({"acc": lambda out, y: (out.argmax(1) == y).float().mean()})
    >>> totals.add(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([1, 1]), "t", "b0")
    >>> totals.add(torch.tensor([[0.0, 1.0]]), torch.tensor([1]), "t", "b1")
    >>> totals.means()
    {'acc': 0.6666666666666666}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tune_hydra.exceptions import InvalidSchedulerError, InvalidTaskError, MetricError
from tune_hydra.options import ENGINE_KEYS, TRAIN_LOSS

MetricFn = Callable[[Any, Any], Any]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def check_metrics(metrics: Any, has_eval_data: bool) -> dict[str, MetricFn] | None:
    """Validate ``ModelTask.metrics``.

    Args:
        metrics: ``None`` or ``{name: fn(output, target)}``.
        has_eval_data: whether the task has ``eval_data`` (metrics are computed on it).

    Returns:
        ``None``, or the metrics as a new dict.

    Raises:
        InvalidTaskError: not a dict of callables under string names, a name the engine
            reports itself (``val_loss``, ``train_loss``, ``epoch`` ...; ``loss`` is
            allowed, see :func:`add_metrics`), or no ``eval_data``.
    """
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise InvalidTaskError(
            f"metrics must be a dict {{name: fn(output, target) -> float}}, not "
            f"{type(metrics).__name__}; e.g. metrics={{'accuracy': accuracy}}"
        )
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name:
            raise InvalidTaskError(f"metrics names must be non-empty strings, got {name!r}")
        if name == TRAIN_LOSS:
            raise InvalidTaskError(
                f"metric name {name!r} is where the engine reports its mean training loss "
                f"when the task has a metric named 'loss' of its own; rename the metric "
                f"(e.g. {'eval_' + name!r})"
            )
        # "loss" is the user's to take: the engine's training loss then moves aside.
        if (name in ENGINE_KEYS and name != "loss") or name.startswith("config/"):
            raise InvalidTaskError(
                f"metric name {name!r} is a result the engine (or Ray Tune) reports itself; "
                f"rename the metric (e.g. {'eval_' + name!r})"
            )
        if not callable(fn):
            raise InvalidTaskError(
                f"metrics[{name!r}] must be callable as fn(output, target) -> float, not "
                f"{type(fn).__name__}"
            )
    if metrics and not has_eval_data:
        raise InvalidTaskError(
            f"metrics {sorted(metrics)} are computed on eval_data, but the task has none; "
            f"pass eval_data=... (a re-iterable of (inputs, targets) batches)"
        )
    return dict(metrics)


def add_metrics(record: dict[str, Any], means: Mapping[str, float]) -> None:
    """Add a task's metric values of one epoch (``means``) to the engine's ``record`` of
    that epoch, in place. A metric named ``loss`` is the task's own and wins: the record's
    ``loss`` (the mean training loss) moves to ``train_loss`` first.

    Example:
        >>> record = {"loss": 0.5, "val_loss": 0.75}
        >>> add_metrics(record, {"loss": 0.25, "acc": 0.9})
        >>> record
        {'loss': 0.25, 'val_loss': 0.75, 'train_loss': 0.5, 'acc': 0.9}
    """
    if "loss" in means:
        record[TRAIN_LOSS] = record["loss"]
    record.update(means)


def check_lr_scheduler(factory: Any) -> None:
    """Validate ``ModelTask.lr_scheduler`` (a factory, not a scheduler instance).

    Raises:
        InvalidTaskError: not callable, or already a scheduler.
    """
    if factory is None:
        return
    if isinstance(factory, torch.optim.lr_scheduler.LRScheduler) or not callable(factory):
        raise InvalidTaskError(
            f"lr_scheduler must be a factory such as lambda opt: "
            f"torch.optim.lr_scheduler.StepLR(opt, step_size=10), not a "
            f"{type(factory).__name__}: the engine builds one optimizer (and one scheduler) "
            f"per shard"
        )


def build_scheduler(
    factory: SchedulerFactory, optimizer: torch.optim.Optimizer, task: str, what: str
) -> torch.optim.lr_scheduler.LRScheduler:
    """``factory(optimizer)``, checked to be a scheduler stepped without arguments.

    Args:
        factory: the task's ``lr_scheduler``.
        optimizer: one shard's optimizer (or the whole model's, in plain training).
        task: the task's name, for errors.
        what: which optimizer, for errors.

    Raises:
        InvalidSchedulerError: the factory raised or returned something else (a
            ``ReduceLROnPlateau`` included: it needs a metric at each step).
    """
    try:
        scheduler = factory(optimizer)
    except Exception as err:
        raise InvalidSchedulerError(
            task,
            f"lr_scheduler(optimizer) raised {type(err).__name__}: {err} (for {what}). It is "
            f"called with each shard's optimizer; build the schedule from that argument",
        ) from err
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or isinstance(
        scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
    ):
        raise InvalidSchedulerError(
            task,
            f"lr_scheduler(optimizer) returned a {type(scheduler).__name__}, not a "
            f"torch.optim.lr_scheduler.LRScheduler stepped without arguments (StepLR, "
            f"LambdaLR, OneCycleLR, transformers.get_scheduler(...)); ReduceLROnPlateau is "
            f"not supported",
        )
    if scheduler.optimizer is not optimizer:
        raise InvalidSchedulerError(
            task,
            "lr_scheduler(optimizer) returned a scheduler of another optimizer; build it "
            "over the optimizer it is given",
        )
    return scheduler


def batch_size(target: Any) -> int:
    """The weight of one eval batch: the first dimension of its target (its length for
    a list; 1 for a scalar)."""
    if isinstance(target, torch.Tensor):
        return int(target.shape[0]) if target.dim() else 1
    try:
        return len(target)
    except TypeError:
        return 1


class MetricTotals:
    """Running batch-size-weighted sums of a task's metrics over one eval pass.

    Args:
        metrics: ``{name: fn(output, target)}``.
    """

    def __init__(self, metrics: Mapping[str, MetricFn] | None) -> None:
        self.metrics = dict(metrics or {})
        self.sums = dict.fromkeys(self.metrics, 0.0)
        self.count = 0

    def add(self, output: Any, target: Any, task: str, where: str) -> None:
        """Evaluate every metric on one batch and add it, weighted by the batch size.

        Raises:
            MetricError: a metric raised, or gave no number.
        """
        n = batch_size(target)
        for name, fn in self.metrics.items():
            try:
                value = fn(output, target)
            except Exception as err:
                raise MetricError(
                    task,
                    f"metric {name!r} raised {type(err).__name__}: {err} on {where}. Fix "
                    f"metrics[{name!r}]: it is called as fn(output, target) with the model's "
                    f"output and the batch's target",
                ) from err
            self.sums[name] += _number(value, name, task, where) * n
        self.count += n

    def means(self) -> dict[str, float]:
        """``{name: weighted mean}`` (NaN for an empty pass)."""
        if not self.count:
            return dict.fromkeys(self.sums, math.nan)
        return {name: total / self.count for name, total in self.sums.items()}


def _number(value: Any, name: str, task: str, where: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    shown = (
        f"a tensor of shape {list(value.shape)}"
        if isinstance(value, torch.Tensor)
        else (f"a {type(value).__name__}")
    )
    raise MetricError(
        task,
        f"metric {name!r} returned {shown} on {where}, not a number; return a float or a "
        f"0-dim tensor (e.g. (output.argmax(1) == target).float().mean())",
    )
