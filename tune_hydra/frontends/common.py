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

LOSS_METRICS = {
    "loss": "the epoch's mean training loss",
    "val_loss": "the mean loss on the task's eval_data after the epoch",
}
"""The losses every trial reports (keys of the engine's per-iteration results), each
lower-is-better. A task's own ``ModelTask(metrics=...)`` are reported beside them."""

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
TASK_METRICS = "each metric the task declares in th.ModelTask(metrics={name: fn})"
"""What a trial reports beside :data:`REPORTED`, as messages say it."""


def declare_metric(name: str) -> str:
    """How a task declares metric ``name``, as messages say it.

    Example:
        >>> declare_metric("accuracy")
        "th.ModelTask(..., eval_data=..., metrics={'accuracy': fn(output, target)})"
    """
    return f"th.ModelTask(..., eval_data=..., metrics={{{name!r}: fn(output, target)}})"


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
        f"'val_loss'. Pass metric='val_loss' to rank by the held-out loss (a function "
        f"trainable that calls th.shard reports its own 'loss' instead)"
    )


def trial_result(
    figures: Mapping[str, Any], metrics: Iterable[str], *, num_shards: int | None = None
) -> dict[str, Any]:
    """What a trial reports for one iteration: the engine's :data:`RESULT_KEYS` and the
    task's own ``metrics`` that ``figures`` (the engine's result of that iteration)
    holds, and ``num_shards`` when the engine's result does not say.
    """
    out = {k: figures[k] for k in (*RESULT_KEYS, *metrics) if k in figures}
    if num_shards is not None:
        out.setdefault("num_shards", num_shards)
    return out


__all__ = [
    "LOSS_METRICS",
    "REPORTED",
    "RESULT_KEYS",
    "TASK_METRICS",
    "declare_metric",
    "training_loss_ranked",
    "trial_result",
]
