"""The training options shared by the engine and the front ends, and their validation.

One set of rules, so that ``train_models``, ``Engine``, ``HydraExecutor`` and
``th.optimize`` accept and refuse the same values, and refuse them where they are given
(``HydraExecutor(...)`` itself, not each trial later). :class:`TrainOptions` (one task's,
resolved) and :class:`EngineOptions` (an engine's) are frozen dataclasses checked when
built; the ``check_*`` functions check single options. This module imports neither torch
nor Ray: the Tune front end validates its options without loading torch.

Example:
    >>> from tune_hydra.options import check_task_options
    >>> opts = check_task_options(seed=3, precision="fp32", accumulate_steps=2)
    >>> opts["seed"], opts["precision"], opts["accumulate_steps"]
    (3, None, 2)
    >>> try:
    ...     check_task_options(precision="fp8", where="HydraExecutor")
    ... except ValueError as err:
    ...     print(str(err)[:43])
    HydraExecutor: precision='fp8' is not valid
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import os
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Any

from tune_hydra.core.trace import DEFAULT_WINDOW as DEFAULT_TRACE_WINDOW
from tune_hydra.exceptions import InvalidOptionError, SpillDirError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tune_hydra.core.policies import BasePolicy

#: Result keys of the engine (and of Ray Tune) that a ``ModelTask`` metric may not take.
ENGINE_KEYS = (
    "loss",
    "val_loss",
    "num_shards",
    "iteration",
    "epoch",
    "batches",
    "device_time_s",
    "bytes_spilled",
    "training_iteration",
    "time_total_s",
    "time_this_iter_s",
    "time_since_restore",
    "iterations_since_restore",
    "timestamp",
    "done",
    "trial_id",
    "config",
    "should_checkpoint",
)
#: ``torch.manual_seed`` takes seeds in this range.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
#: Accepted ``precision`` values; the first three all mean full precision (no autocast).
PRECISIONS = (None, "fp32", "float32", "bf16")


def _integer(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer (numpy's included), not a bool."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_seed(seed: Any, *, option: str = "seed", where: str = "") -> int | None:
    """A seed: ``None`` or an integer ``torch.manual_seed`` takes.

    Args:
        seed: the value given.
        option: its name in the message (``"seed"``, ``"ModelTask.seed"``).
        where: who got it, for the message (``"task 'a'"``).

    Returns:
        ``None``, or the seed as a Python int.

    Raises:
        InvalidOptionError: not an integer in ``[-2**63, 2**64 - 1]``.
    """
    if seed is None:
        return None
    value = _integer(seed)
    if value is None or not SEED_MIN <= value <= SEED_MAX:
        hint = (
            f"; convert it: {option}=int({seed!r})"
            if isinstance(seed, str) and seed.strip().lstrip("+-").isdigit()
            else ""
        )
        raise InvalidOptionError(
            option,
            seed,
            f"give an int in [-2**63, 2**64 - 1] (such as {option}=0), or None{hint}",
            where,
        )
    return value


def check_max_grad_norm(value: Any, *, where: str = "") -> float | None:
    """``max_grad_norm``: ``None`` (no clipping) or a positive number.

    Raises:
        InvalidOptionError: a string, a bool, zero, a negative number or NaN.
    """
    if value is None:
        return None
    number = float(value) if isinstance(value, numbers.Real) else math.nan
    if isinstance(value, bool) or not number > 0:
        hint = f"; convert it: max_grad_norm=float({value!r})" if isinstance(value, str) else ""
        raise InvalidOptionError(
            "max_grad_norm",
            value,
            f"give a number > 0 (such as max_grad_norm=1.0), or None for no clipping{hint}",
            where,
        )
    return number


def check_positive_int(
    value: Any, option: str, *, allow_none: bool = False, meaning: str = "", where: str = ""
) -> int | None:
    """An option that is an int ``>= 1`` (or ``None``, with ``allow_none``).

    Args:
        value: the value given.
        option: its name.
        allow_none: whether ``None`` is accepted (and returned).
        meaning: what ``None`` means, or what the number counts, for the message.
        where: who got it, for the message.

    Raises:
        InvalidOptionError: anything else (a string, a float, a bool, 0, -1).
    """
    if value is None and allow_none:
        return None
    number = _integer(value)
    if number is None or number < 1:
        alt = " or None" if allow_none else ""
        raise InvalidOptionError(
            option,
            value,
            f"give an int >= 1{alt}{f' ({meaning})' if meaning else ''}",
            where,
        )
    return number


def check_precision(value: Any, *, where: str = "") -> str | None:
    """``precision``: ``None`` / ``"fp32"`` / ``"float32"`` (full precision, returned as
    ``None``) or ``"bf16"`` (bfloat16 autocast).

    Raises:
        InvalidOptionError: anything else (``"fp8"``, ``"fp16"``, ``16``).
    """
    if value is None or (isinstance(value, str) and value in ("fp32", "float32")):
        return None
    if isinstance(value, str) and value == "bf16":
        return value
    raise InvalidOptionError(
        "precision",
        value,
        "give None or 'fp32' (full precision) or 'bf16' (bfloat16 autocast); no other "
        "precision is supported",
        where,
    )


def check_task_options(
    *,
    seed: Any = None,
    max_grad_norm: Any = None,
    accumulate_steps: Any = 1,
    precision: Any = None,
    iteration_batches: Any = None,
    where: str = "",
) -> dict[str, Any]:
    """Validate the per-task training options (those of ``Engine.add_task``).

    Args:
        seed: ``None`` or an int.
        max_grad_norm: ``None`` or a number > 0.
        accumulate_steps: an int >= 1.
        precision: ``None``, ``"fp32"``, ``"float32"`` or ``"bf16"``.
        iteration_batches: ``None`` (an iteration is an epoch) or an int >= 1.
        where: who got them, for the messages (``"task 'a'"``, ``"HydraExecutor"``).

    Returns:
        The options normalized (ints as Python ints, full precision as ``None``).

    Raises:
        InvalidOptionError: the first bad option, naming it, its value and the fix.
    """
    return {
        "seed": check_seed(seed, where=where),
        "max_grad_norm": check_max_grad_norm(max_grad_norm, where=where),
        "accumulate_steps": check_positive_int(
            accumulate_steps,
            "accumulate_steps",
            meaning="batches whose gradients add up before one optimizer step; 1: none",
            where=where,
        ),
        "precision": check_precision(precision, where=where),
        "iteration_batches": check_positive_int(
            iteration_batches,
            "iteration_batches",
            allow_none=True,
            meaning="batches per iteration; None: one epoch",
            where=where,
        ),
    }


def check_max_layers_per_shard(value: Any, *, where: str = "") -> int | None:
    """``max_layers_per_shard``: ``None`` (the budget alone decides) or an int >= 1.

    Raises:
        InvalidOptionError: anything else (``0``, ``-1``, ``"3"``).
    """
    return check_positive_int(
        value,
        "max_layers_per_shard",
        allow_none=True,
        meaning="the most layers in one shard; None: as many as the budget allows",
        where=where,
    )


@dataclass(frozen=True)
class TrainOptions:
    """One task's training options, checked and normalized (see ``train_models``).

    ``seed`` is the task's resolved seed (``Engine.add_task`` picks it from
    ``ModelTask.seed``, its ``seed`` argument or ``torch.initial_seed()``), so it is an
    int here. Frozen: derive a changed copy with ``dataclasses.replace``.

    Args:
        seed: the seed of the task's random stream, an int ``torch.manual_seed`` takes.
        max_grad_norm: ``None`` or a number > 0.
        accumulate_steps: an int >= 1.
        precision: ``None`` / ``"fp32"`` / ``"float32"`` (stored as ``None``) or ``"bf16"``.
        iteration_batches: ``None`` (an iteration is an epoch) or an int >= 1.
        recompute: re-run forward in backward instead of keeping the graph.
        where: who got them, for the messages (``"task 'a'"``); not stored.

    Raises:
        InvalidOptionError: the first bad option (``seed=None`` included), naming it, its
            value and the fix.

    Example:
        >>> TrainOptions(seed=3, precision="fp32", accumulate_steps=2)
        TrainOptions(seed=3, max_grad_norm=None, accumulate_steps=2, precision=None, \
iteration_batches=None, recompute=False)
    """

    seed: int = 0
    max_grad_norm: float | None = None
    accumulate_steps: int = 1
    precision: str | None = None
    iteration_batches: int | None = None
    recompute: bool = False
    where: InitVar[str] = ""

    def __post_init__(self, where: str) -> None:
        checked = check_task_options(
            seed=self.seed,
            max_grad_norm=self.max_grad_norm,
            accumulate_steps=self.accumulate_steps,
            precision=self.precision,
            iteration_batches=self.iteration_batches,
            where=where,
        )
        if checked["seed"] is None:
            raise InvalidOptionError(
                "seed",
                None,
                "give an int in [-2**63, 2**64 - 1] (Engine.add_task resolves seed=None to one)",
                where,
            )
        for name, value in checked.items():  # normalized: ints as ints, fp32 as None
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class EngineOptions:
    """The options of an :class:`~tune_hydra.engine.Engine`, as given (``Engine`` resolves
    ``devices``, ``device_memory``, ``policy`` and ``recompute`` itself: that takes torch).

    Front ends build one where the user gives them and hand it down; ``kwargs()`` are the
    keyword arguments of ``Engine(...)``. Frozen: derive a changed copy with
    ``dataclasses.replace``.

    Args:
        devices, device_memory, policy, prefetch, recompute, copy_on_cpu: see ``Engine``.
        max_layers_per_shard: ``None`` or an int >= 1 (checked here).
        host_memory, spill_dir: the host-memory budget and the folder of the disk tier
            below it (see ``Engine``); ``host_memory`` needs ``spill_dir`` (checked here;
            the folder itself is checked when the engine starts).
        trace_window: the most trace events the engine keeps (``None``: all); older
            ones are folded into the trace's running totals (see ``Engine``).
        where: who got them, for the messages (``"Engine"``, ``"train_models"``); not
            stored.

    Raises:
        InvalidOptionError: a bad ``max_layers_per_shard``, or a ``spill_dir`` that is not a
            path.
        SpillDirError: ``host_memory`` without ``spill_dir``.

    Example:
        >>> EngineOptions(devices="cpu", max_layers_per_shard=2).kwargs()["max_layers_per_shard"]
        2
    """

    devices: str | Sequence[Any] = "auto"
    device_memory: int | str | None = None
    policy: str | BasePolicy = "lrtf"
    prefetch: bool = True
    recompute: bool | None = None
    copy_on_cpu: bool = False
    max_layers_per_shard: int | None = None
    host_memory: int | str | None = None
    spill_dir: str | os.PathLike[str] | None = None
    trace_window: int | None = DEFAULT_TRACE_WINDOW
    where: InitVar[str] = "Engine"

    def __post_init__(self, where: str) -> None:
        object.__setattr__(
            self,
            "max_layers_per_shard",
            check_max_layers_per_shard(self.max_layers_per_shard, where=where),
        )
        check_spill(self.host_memory, self.spill_dir, where=where)
        window = check_positive_int(
            self.trace_window, "trace_window", allow_none=True, meaning="None: keep all"
        )
        object.__setattr__(self, "trace_window", window)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``Engine(...)`` (a shallow copy: a policy instance is
        passed as itself, not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def check_spill(host_memory: Any, spill_dir: Any, *, where: str = "") -> None:
    """Check the disk tier's options as given (the budget's format and the folder itself
    are checked by the engine, which parses budgets and owns the folder).

    Raises:
        InvalidOptionError: ``spill_dir`` is not a ``str`` or ``os.PathLike``.
        SpillDirError: ``host_memory`` is given without ``spill_dir``.
    """
    if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
        raise InvalidOptionError(
            "spill_dir", spill_dir, "give a folder path (str or pathlib.Path)", where
        )
    if host_memory is not None and spill_dir is None:
        prefix = f"{where}: " if where else ""
        raise SpillDirError(
            f"{prefix}host_memory={host_memory!r} needs spill_dir=: the folder (on a local "
            f"NVMe disk, not a tmpfs) where the state of shards beyond host_memory goes"
        )


__all__ = [
    "ENGINE_KEYS",
    "PRECISIONS",
    "SEED_MAX",
    "SEED_MIN",
    "EngineOptions",
    "TrainOptions",
    "check_max_grad_norm",
    "check_max_layers_per_shard",
    "check_positive_int",
    "check_precision",
    "check_seed",
    "check_spill",
    "check_task_options",
]
