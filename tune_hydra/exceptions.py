"""Errors raised by tune_hydra.

Every error derives from :class:`TuneHydraError`, and also from the built-in exception a
caller would naturally catch (``ValueError``, ``TypeError``, ...), so both
``except TuneHydraError`` and ``except ValueError`` work.

Example:
    >>> import tune_hydra as th
    >>> try:
    ...     th.engine.parse_bytes("lots")
    ... except th.TuneHydraError as err:
    ...     print(type(err).__name__)
    BudgetFormatError
"""

from __future__ import annotations

from typing import Any


class TuneHydraError(Exception):
    """Root of every error raised by tune_hydra."""


class InvalidModelError(TuneHydraError, TypeError):
    """The model is not something the engine can cut into sequential shards."""


class InvalidTaskError(TuneHydraError, ValueError):
    """A :class:`~tune_hydra.ModelTask` or a ``train_models`` argument is invalid."""


class EmptyDataError(InvalidTaskError):
    """``train_data`` yielded no batch."""


class BudgetFormatError(TuneHydraError, ValueError):
    """A memory budget string or number could not be parsed."""


class UnknownDeviceError(TuneHydraError, ValueError):
    """A device name is not valid or not available on this machine."""


class ShardTooLargeError(TuneHydraError, MemoryError):
    """One layer alone needs more memory than the per-device budget."""

    def __init__(self, layer: str, nbytes: int, budget: int, detail: str = "") -> None:
        self.layer = layer
        self.nbytes = nbytes
        self.budget = budget
        self.detail = detail
        super().__init__(
            f"layer {layer!r} needs {format_bytes(nbytes)} ({nbytes} bytes){detail}, more than "
            f"the per-device budget of {format_bytes(budget)} ({budget} bytes). Raise "
            f"device_memory, lower the batch size, or split that layer into smaller modules."
        )

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (Ray) intact
        return (type(self), (self.layer, self.nbytes, self.budget, self.detail))


class NonFiniteLossError(TuneHydraError, FloatingPointError):
    """A task's training loss became NaN or infinite."""

    def __init__(self, task: str, epoch: int, batch: int, value: float) -> None:
        self.task = task
        self.epoch = epoch
        self.batch = batch
        self.value = value
        super().__init__(
            f"task {task!r}: loss became {value} at epoch {epoch}, batch {batch}. Lower the "
            f"learning rate, set max_grad_norm, or check the data; the other tasks go on."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.task, self.epoch, self.batch, self.value))


class TaskFailedError(TuneHydraError, RuntimeError):
    """One task raised while it trained; wraps the original error as ``__cause__``.

    The original traceback is also kept as text (``original_traceback``, shown in the
    message), since ``__cause__`` does not survive pickling to another process.
    """

    def __init__(self, task: str, message: str, original_traceback: str = "") -> None:
        self.task = task
        self.message = message
        self.original_traceback = original_traceback
        text = f"task {task!r} failed: {message}"
        if original_traceback:
            text += f"\n\nOriginal traceback:\n{original_traceback}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.task, self.message, self.original_traceback))


class TrainingError(TuneHydraError, RuntimeError):
    """Some tasks of a ``train_models`` call failed; the others finished.

    Attributes:
        errors: task name -> the exception that stopped it.
        history: every task's history, the failed ones up to their last whole epoch.
    """

    def __init__(self, errors: dict[str, BaseException], history: dict[str, list[Any]]) -> None:
        self.errors = errors
        self.history = history
        lines = "; ".join(f"{name}: {err}" for name, err in errors.items())
        ok = sorted(set(history) - set(errors))
        super().__init__(
            f"{len(errors)} of {len(history)} tasks failed ({lines}). The others finished "
            f"({', '.join(ok) or 'none'}); their results are in .history and their models "
            f"are trained."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.errors, self.history))


class MissingDependencyError(TuneHydraError, ImportError):
    """An optional package (e.g. matplotlib for plots) is not installed."""


class UnknownPolicyError(TuneHydraError, ValueError):
    """A scheduling policy name is not known."""


class ScheduleError(TuneHydraError, RuntimeError):
    """A policy or a schedule broke the engine's rules (e.g. picked an operation that is
    not ready)."""


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
