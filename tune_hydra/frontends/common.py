"""What every front end (Ray Tune, Optuna) shares: the result keys a trial reports and
the checkpoint's file names.

Importing this module imports neither torch nor Ray: the Ray trial processes and the
Optuna driver both read it before anything heavy is loaded.

Example:
    >>> from tune_hydra.frontends.common import LOSS_METRICS, RESULT_KEYS
    >>> [k for k in RESULT_KEYS if k in LOSS_METRICS]
    ['loss', 'val_loss']
"""

from __future__ import annotations

# The file format is checkpoint.py's; the names are re-exported for the front ends.
from tune_hydra.frontends.checkpoint import META_FILE, MODEL_FILE, STATE_FILE

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

__all__ = ["LOSS_METRICS", "META_FILE", "MODEL_FILE", "RESULT_KEYS", "STATE_FILE"]
