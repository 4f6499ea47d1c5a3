"""The results every front end (Ray Tune, Optuna) reports for a trial: the keys of the
engine's per-iteration figures, which of them are losses, the result a trial reports,
and the words every message about a metric uses.

Importing this module imports neither torch nor Ray: the Ray trial processes and the
Optuna driver both read it before anything heavy is loaded.

Example:
    >>> from tune_hydra.frontends.common import LOSS_METRICS, RESULT_KEYS, trial_result
    >>> [k for k in RESULT_KEYS if k in LOSS_METRICS]
    ['loss', 'val_loss']
    >>> trial_result({"loss": 0.5, "iteration": 3, "acc": 0.9}, ["acc"], num_shards=2)
    {'loss': 0.5, 'acc': 0.9, 'num_shards': 2}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tune_hydra.options import TRAIN_LOSS

LOSS_METRICS = {
    "loss": "the epoch's mean training loss",
    "val_loss": "the mean loss on the task's eval_data after the epoch",
}
"""The losses every trial reports (keys of the engine's per-iteration results), each
lower-is-better. A task's own ``ModelTask(metrics=...)`` are reported beside them; one
named ``loss`` takes that key, and the training loss is then ``train_loss``
(:func:`task_reports`)."""

RESULT_KEYS = (
    *LOSS_METRICS,
    "num_shards",
    "epoch",
    "batches",
    "device_time_s",
    "bytes_spilled",
)
"""The engine's per-iteration figures a trial reports (``val_loss`` only with
``eval_data``), before the task's own metrics."""

REPORTED = ", ".join(k if k != "val_loss" else "val_loss (with eval_data)" for k in RESULT_KEYS)
"""The figures a trial reports, as messages list them."""
TASK_METRICS = (
    "each metric the task declares in th.ModelTask(metrics={name: fn}) (one named 'loss' "
    f"takes that key, and the training loss is then {TRAIN_LOSS!r})"
)
"""What a trial reports beside :data:`REPORTED`, as messages say it."""


def declare_metric(name: str) -> str:
    """How a task declares metric ``name``, as messages say it (``train_loss`` comes with
    a metric named ``loss``).

    Example:
        >>> declare_metric("accuracy")
        "th.ModelTask(..., eval_data=..., metrics={'accuracy': fn(output, target)})"
    """
    if name == TRAIN_LOSS:
        return (
            f"th.ModelTask(..., eval_data=..., metrics={{'loss': fn(output, target)}}) (with "
            f"a metric named 'loss' of its own, a task reports its training loss as "
            f"{TRAIN_LOSS!r})"
        )
    return f"th.ModelTask(..., eval_data=..., metrics={{{name!r}: fn(output, target)}})"


def task_reports(metrics: Iterable[str]) -> tuple[str, ...]:
    """The names a trial of a task with these own ``metrics`` reports beside
    :data:`RESULT_KEYS`: those metrics, and ``train_loss`` (the engine's training loss)
    when one of them is named ``loss`` (the task's ``loss`` is then that metric).

    Example:
        >>> task_reports(["acc"]), task_reports(["loss", "acc"])
        (('acc',), ('loss', 'acc', 'train_loss'))
    """
    names = tuple(metrics)
    return (*names, TRAIN_LOSS) if "loss" in names else names


def ranks_training_loss(metric: Any, result: Mapping[str, Any]) -> bool:
    """Whether ranking by ``metric`` ranks the engine's ``result`` of a task's trial by its
    training loss although the task has eval data: ``metric`` is ``loss``, ``result``
    holds ``val_loss``, and ``loss`` is no metric of the task's own (its result would
    then hold ``train_loss``).

    Example:
        >>> ranks_training_loss("loss", {"loss": 0.5, "val_loss": 0.75})
        True
        >>> ranks_training_loss("loss", {"loss": 0.25, "val_loss": 0.75, "train_loss": 0.5})
        False
    """
    return metric == "loss" and "val_loss" in result and TRAIN_LOSS not in result


def training_loss_ranked(what: str) -> str:
    """The words for ``what`` ranking a task's trials by ``loss``, which is the epoch's
    *training* loss, although the task has ``eval_data`` (so ``val_loss`` is reported).

    Example:
        >>> training_loss_ranked("metric='loss'").split(":")[0]
        "metric='loss' ranks the trials by their training loss"
    """
    return (
        f"{what} ranks the trials by their training loss: tune_hydra reports "
        f"{LOSS_METRICS['loss']} as 'loss', and the task has eval_data, whose loss is "
        f"'val_loss'. Pass metric='val_loss' to rank by the held-out loss, or declare "
        f"{declare_metric('loss')} to rank by a loss of your own (a function trainable "
        f"that calls th.shard reports its own 'loss' instead)"
    )


def trial_result(
    figures: Mapping[str, Any], metrics: Iterable[str], *, num_shards: int | None = None
) -> dict[str, Any]:
    """What a trial reports for one iteration: the engine's :data:`RESULT_KEYS` and what
    the task's own ``metrics`` add (:func:`task_reports`) that ``figures`` (the engine's
    result of that iteration) holds, and ``num_shards`` when the engine's result does not
    say.
    """
    out = {k: figures[k] for k in (*RESULT_KEYS, *task_reports(metrics)) if k in figures}
    if num_shards is not None:
        out.setdefault("num_shards", num_shards)
    return out


__all__ = [
    "LOSS_METRICS",
    "REPORTED",
    "RESULT_KEYS",
    "TASK_METRICS",
    "declare_metric",
    "ranks_training_loss",
    "task_reports",
    "training_loss_ranked",
    "trial_result",
]
