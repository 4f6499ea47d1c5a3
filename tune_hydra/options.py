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
import difflib
import math
import numbers
import operator
import os
import re
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

from tune_hydra.core.trace import DEFAULT_WINDOW as DEFAULT_TRACE_WINDOW
from tune_hydra.exceptions import (
    BudgetFormatError,
    InvalidOptionError,
    SpillDirError,
    UnknownDeviceError,
    UnknownOptionError,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from tune_hydra.core.policies import BasePolicy

#: Where a task's results hold the engine's mean training loss when the task declares a
#: metric named ``loss`` of its own (the task's name wins: its ``loss`` is that metric).
TRAIN_LOSS = "train_loss"
#: Result keys of the engine (and of Ray Tune) that a ``ModelTask`` metric may not take
#: (``loss`` excepted: see :data:`TRAIN_LOSS`).
ENGINE_KEYS = (
    "loss",
    TRAIN_LOSS,
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


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str | None, *, option: str = "device_memory") -> int | None:
    """Turn a budget such as ``"512MiB"``, ``"8GiB"``, ``"1.5GB"`` or ``4096`` into bytes:
    the one validator of ``device_memory`` and ``host_memory`` (torch-free, so the Ray
    driver checks a budget without loading the engine).

    ``None`` stays ``None`` (meaning: no limit, such as the whole device).

    Args:
        value: the budget given.
        option: its name in the messages (``"device_memory"``, ``"host_memory"``).

    Raises:
        BudgetFormatError: not a positive int or a number with a known unit.

    Example:
        >>> parse_bytes("1.5KiB")
        1536
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise BudgetFormatError(f"{option} must be bytes or a string like '8GiB', not {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise BudgetFormatError(f"{option} must be positive, got {value}")
        return value
    if isinstance(value, str):
        match = _BYTES_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            # device_memory keeps its historical wording; other budgets are named.
            what = "the memory budget" if option == "device_memory" else f"the {option} budget"
            raise BudgetFormatError(
                f"cannot parse {what} {value!r}; write a number of bytes or a number "
                f"with a unit such as '512MiB', '8GiB' or '1.5GB'"
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
        if nbytes <= 0:
            raise BudgetFormatError(f"{option} must be positive, got {value!r}")
        return nbytes
    raise BudgetFormatError(
        f"{option} must be an int (bytes), a string like '8GiB', or None; got "
        f"{type(value).__name__}"
    )


_DEVICE_RE = re.compile(r"^(cpu|cuda)(:\d+)?$")
DEVICE_TYPES = ("cpu", "cuda")


def _is_torch_device(value: Any) -> bool:
    """Whether ``value`` is a ``torch.device`` (told without importing torch)."""
    kind = type(value)
    return kind.__module__ == "torch" and kind.__name__ == "device"


def check_devices(devices: Any) -> None:
    """``devices`` as written: ``"auto"`` (or ``None``), ``"cpu"``, ``"cuda"``,
    ``"cuda:N"``, a ``torch.device`` of those types, or a non-empty list of them.

    Torch-free: whether a CUDA device is there is the engine's to check
    (``tune_hydra.engine.units.resolve_devices``), on the node it runs on.

    Raises:
        UnknownDeviceError: an empty list, or a device of another spelling or type.
    """
    if devices is None or (isinstance(devices, str) and devices == "auto"):
        return
    names = [devices] if isinstance(devices, str) or _is_torch_device(devices) else devices
    try:
        names = list(names)
    except TypeError:
        names = [devices]
    if not names:
        raise UnknownDeviceError(
            "devices is empty; pass 'auto', 'cpu', or a list such as ['cuda:0', 'cuda:1']"
        )
    for dev in names:
        if isinstance(dev, str) and _DEVICE_RE.match(dev):
            continue
        if not _is_torch_device(dev):
            raise UnknownDeviceError(
                f"unknown device {dev!r}; use 'cpu', 'cuda', 'cuda:N' or 'auto'"
            )
        if dev.type not in DEVICE_TYPES:
            raise UnknownDeviceError(
                f"device {dev!r} is not supported; use 'cpu', 'cuda:N' or 'auto'"
            )


def check_policy(policy: Any) -> Any:
    """``policy``: ``"auto"``, a name (``"lrtf"``, ``"fifo"``, ``"round_robin"``,
    ``"milestone"``) or a ``BasePolicy`` instance, returned as given (each engine makes
    its own instance from a name; ``"auto"`` is resolved by the front end that knows
    the run, see :func:`tune_hydra.core.policies.resolve_policy`).

    Raises:
        UnknownPolicyError: anything else (the message lists the names).
    """
    from tune_hydra.core.policies import AUTO, BasePolicy, get_policy

    if isinstance(policy, str) and policy == AUTO:
        return policy  # checked without resolving: resolving logs the choice
    if not isinstance(policy, BasePolicy):
        get_policy(policy)  # the one message of an unknown policy
    return policy


def check_flag(value: Any, option: str, *, allow_none: bool = False, where: str = "") -> Any:
    """An on/off option (``prefetch``, ``copy_on_cpu``; ``recompute`` also takes ``None``:
    the engine's default for its devices).

    Raises:
        InvalidOptionError: anything but ``True`` / ``False`` (numpy's bools included)
            (or ``None`` with ``allow_none``): a string such as ``"no"`` would be true.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    alt = ", or None (the default for the devices)" if allow_none else ""
    raise InvalidOptionError(option, value, f"give True or False{alt}", where)


def check_seconds(
    value: Any, option: str, *, meaning: str, allow_zero: bool = False, where: str = ""
) -> float | None:
    """A duration in seconds, or ``None`` (no limit).

    Args:
        value: the value given.
        option: its name.
        meaning: what it bounds, for the message.
        allow_zero: whether 0 is accepted (``th.optimize(timeout=0)``: start no trial).
        where: who got it, for the message.

    Raises:
        InvalidOptionError: a string, a bool, NaN, a negative number, or 0 without
            ``allow_zero``.
    """
    if value is None:
        return None
    number = float(value) if isinstance(value, numbers.Real) else math.nan
    ok = number >= 0 if allow_zero else number > 0
    if isinstance(value, bool) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidOptionError(
            option, value, f"give a number of seconds {bound} ({meaning}), or None for no limit",
            where,
        )  # fmt: skip
    return number


def check_factory_timeout(value: Any, *, where: str = "") -> float | None:
    """``factory_timeout_s``: how long one call of the task factory may take, seconds > 0,
    or ``None`` (no limit). The same rule for ``HydraExecutor`` and ``th.optimize``: 0
    would fail every trial before its factory ran.

    Raises:
        InvalidOptionError: 0, a negative number, NaN, a string or a bool.
    """
    return check_seconds(
        value,
        "factory_timeout_s",
        meaning="the most one call of the task factory may take",
        where=where,
    )


def check_trace_window(value: Any, *, where: str = "") -> int | None:
    """``trace_window``: the most trace events an engine keeps, an int >= 1, or ``None``
    (all).

    Raises:
        InvalidOptionError: anything else.
    """
    return check_positive_int(
        value, "trace_window", allow_none=True, meaning="None: keep all", where=where
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
    """Validate the per-task training options (those of ``TaskLoop``).

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

    ``seed`` is the task's resolved seed (``TaskLoop`` picks it from
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
                "give an int in [-2**63, 2**64 - 1] (TaskLoop resolves seed=None to one)",
                where,
            )
        for name, value in checked.items():  # normalized: ints as ints, fp32 as None
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class EngineOptions:
    """The options of an :class:`~tune_hydra.engine.Engine`, checked: the one place where
    every entry point's engine options are documented, defaulted and judged (``Engine``,
    ``th.configure``, ``train_models``, ``HydraExecutor``, ``th.run``, ``th.optimize``
    take them as keywords and build one with :func:`engine_options`), each by the one
    validator of its option.

    The fields keep the values as given (a policy name stays a name: each engine makes
    its own instance); the budgets are parsed once, here, into :attr:`device_bytes` and
    :attr:`host_bytes`. What takes torch (the device list, ``recompute``'s default) the
    engine resolves when it starts. ``Engine(options=...)`` takes one as it is;
    ``kwargs()`` are the keyword arguments of ``Engine(...)``. Frozen: derive a changed
    copy with ``dataclasses.replace`` (checked again).

    Args:
        devices: ``"auto"``, ``"cpu"``, or a list such as ``["cuda:0", "cuda:1"]``;
            ``"cpu"`` may repeat (each is an emulated device with its own worker thread,
            and torch's intra-op threads are divided among them).
        device_memory: per-device budget (bytes, or ``"512MiB"``); ``None`` is the whole
            device (on a GPU the plans budget 90% of it; on the CPU: no limit, one shard).
        policy: ``"auto"`` (default: the milestone policy, which decides as LRTF until a
            front end announces milestones with ``Engine.set_milestone``; ``train_models``
            resolves it to LRTF), ``"lrtf"``, ``"milestone"``, ``"fifo"``,
            ``"round_robin"`` or a ``BasePolicy``.
        prefetch: double-buffer: promote the next assigned shard while one computes (on
            devices that copy; a CPU device that copies nothing queues one op at a time).
        recompute: re-run forward in backward instead of keeping activations; default
            (``None``) ``True`` on GPUs (activations would occupy device memory) and
            ``False`` on the CPU (where the "device" is host memory and recomputing only
            costs time). Without it, on a device that copies, each batch's kept graphs are
            reserved in ``device_memory`` (see ``tune_hydra.engine.runtime.kept``).
        copy_on_cpu: really copy shard state on CPU "devices": they then run the way a
            GPU does (spills, budgets, and ``recompute`` on by default); a test aid.
        max_layers_per_shard: cut finer than the budget requires (an int >= 1, or None).
        host_memory: host-memory budget for the shard states of all tasks (bytes, or
            ``"64GiB"``); the coldest states beyond it go to files under ``spill_dir``
            and are read back ahead of their visits, with the same results (see
            ``tune_hydra.engine.storage.host``). ``None``: unlimited, nothing goes to
            disk. Smaller than one shard's state fails that task with
            ``HostBudgetError``. The engine may go over it by up to (devices + 1) x the
            largest shard's state unless it is at least (devices + 2) x that.
        spill_dir: an existing folder on a local disk (NVMe; not a tmpfs, which is RAM,
            nor a network file system) for the disk tier, needed with ``host_memory``;
            the engine works in a folder of its own there, removed when it closes (or,
            after a crash, by the next engine started with the same ``spill_dir``).
        trace_window: the most events the engine's trace keeps (default 200,000, 35-55
            MiB; ``None``: all, growing with the run); older ones are folded into running
            totals, so the trace's figures (``trace.summary()``) still cover the run.
        share_frozen: hold frozen tensors equal across tasks (a fine-tuning search's
            base) once in host memory (see ``tune_hydra.engine.storage.frozen``);
            ``False``: each task keeps its own (a benchmark switch).
        batch_shared: run the ops of several tasks on the same shared frozen shard (LoRA
            trials over one base: task factories and ``th.shard`` loops) as one batched
            pass on one device: the frozen layers once over their concatenated batches,
            each task's adapters on its own rows (see ``tune_hydra.engine.dispatch.batched``;
            off by default: within 1e-12 relative of running them alone in float64, not
            always bitwise; recompute mode only, no autocast, no disk tier; within
            ``device_memory``). ``Engine.summary()`` counts the batched passes.
        where: who got them, for the messages (``"Engine"``, ``"train_models"``); not
            stored.

    Raises:
        UnknownDeviceError, BudgetFormatError, UnknownPolicyError: a bad device, budget or
            policy.
        InvalidOptionError: a bad flag, ``max_layers_per_shard`` or ``trace_window``, or
            a ``spill_dir`` that is not a path.
        SpillDirError: ``host_memory`` without ``spill_dir``.

    Example:
        >>> opts = EngineOptions(devices="cpu", device_memory="1KiB", max_layers_per_shard=2)
        >>> opts.device_bytes, opts.kwargs()["device_memory"], opts.kwargs()["max_layers_per_shard"]
        (1024, '1KiB', 2)
    """

    devices: str | Sequence[Any] = "auto"
    device_memory: int | str | None = None
    policy: str | BasePolicy = "auto"
    prefetch: bool = True
    recompute: bool | None = None
    copy_on_cpu: bool = False
    max_layers_per_shard: int | None = None
    host_memory: int | str | None = None
    spill_dir: str | os.PathLike[str] | None = None
    trace_window: int | None = DEFAULT_TRACE_WINDOW
    share_frozen: bool = True
    batch_shared: bool = False
    where: InitVar[str] = "Engine"
    #: ``device_memory`` in bytes (``None``: the whole device).
    device_bytes: int | None = field(init=False, repr=False, compare=False, default=None)
    #: ``host_memory`` in bytes (``None``: no limit, no disk tier).
    host_bytes: int | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self, where: str) -> None:
        check_devices(self.devices)
        checked = {
            "device_bytes": parse_bytes(self.device_memory),
            "policy": check_policy(self.policy),
            "prefetch": check_flag(self.prefetch, "prefetch", where=where),
            "recompute": check_flag(self.recompute, "recompute", allow_none=True, where=where),
            "copy_on_cpu": check_flag(self.copy_on_cpu, "copy_on_cpu", where=where),
            "max_layers_per_shard": check_max_layers_per_shard(
                self.max_layers_per_shard, where=where
            ),
            "host_bytes": parse_bytes(self.host_memory, option="host_memory"),
            "trace_window": check_trace_window(self.trace_window, where=where),
            "share_frozen": check_flag(self.share_frozen, "share_frozen", where=where),
            "batch_shared": check_flag(self.batch_shared, "batch_shared", where=where),
        }
        check_spill(self.host_memory, self.spill_dir, where=where)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``Engine(...)`` (a shallow copy: a policy instance is
        passed as itself, not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


#: The fields of :class:`EngineOptions`, in order: what ``Engine(...)`` takes.
ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineOptions) if f.init)
#: The per-task options of ``TaskLoop`` (:func:`check_task_options`), in order.
TASK_OPTIONS = ("seed", "max_grad_norm", "accumulate_steps", "precision", "iteration_batches")
#: The engine options ``Engine(...)`` also takes by position, in this order.
POSITIONAL_OPTIONS = ("devices", "device_memory", "policy")


def offered(where: str) -> tuple[str, ...]:
    """The engine options entry point ``where`` takes: :data:`ENGINE_OPTIONS` but those
    :data:`NOT_OFFERED` names for it."""
    return tuple(k for k in ENGINE_OPTIONS if k not in NOT_OFFERED.get(where, {}))


def engine_options(
    given: Mapping[str, Any],
    *,
    where: str,
    positional: Sequence[Any] = (),
    takes: Iterable[str] = (),
) -> EngineOptions:
    """An entry point's engine options (its ``**engine_options``), checked once: the
    names (a misspelt one is named with the closest option; one this entry point does
    not take, with the reason), then every value by :class:`EngineOptions`, whose
    defaults are the only ones.

    Args:
        given: the engine options given by name.
        where: the entry point (``"Engine"``, ``"train_models"``, ``"HydraExecutor"``).
        positional: values given by position (``Engine("cpu", "1GiB")``), in the order
            of :data:`POSITIONAL_OPTIONS`.
        takes: the entry point's own keywords (a typo of one of them is named too).

    Raises:
        UnknownOptionError: a name that is no option of ``where``.
        InvalidOptionError: more than three values by position, or an option given both
            by position and by name; a bad value (and EngineOptions' other errors).

    Example:
        >>> engine_options({"prefetch": False}, where="Engine", positional=["cpu"]).devices
        'cpu'
    """
    check_option_names(
        given, [*offered(where), *takes], where=where, not_offered=NOT_OFFERED.get(where)
    )
    if len(positional) > len(POSITIONAL_OPTIONS):
        raise InvalidOptionError(
            "options",
            tuple(positional),
            f"give at most {', '.join(POSITIONAL_OPTIONS)} by position, the others by name",
            where,
        )
    named = dict(zip(POSITIONAL_OPTIONS, positional, strict=False))
    for key in named.keys() & given.keys():
        raise InvalidOptionError(
            key, given[key], "given by position and by name: give it once", where
        )
    return EngineOptions(**named, **given, where=where)


def check_option_names(
    given: Iterable[str],
    known: Sequence[str] = ENGINE_OPTIONS,
    *,
    where: str = "Engine",
    not_offered: Mapping[str, str] | None = None,
) -> None:
    """Refuse keyword options that are not in ``known`` (a typo, an option of another
    front end), naming the closest known one: the one check of option names that every
    entry point shares (``Engine(...)``, ``th.configure``, ``train_models``,
    ``HydraExecutor``, ``th.optimize``). An option in ``not_offered`` (an engine option
    this entry point does not take, see :data:`NOT_OFFERED`) is refused with the reason.

    Raises:
        UnknownOptionError: naming each unknown option (with the closest known one) and
            the options ``where`` takes.

    Example:
        >>> check_option_names(["devices", "device_memory"])
        >>> try:
        ...     check_option_names(["polcy"])
        ... except UnknownOptionError as err:
        ...     print(str(err).split(";")[0])
        Engine got unknown option(s) 'polcy' (did you mean 'policy'?)
    """
    unknown = [k for k in given if k not in known]
    if not unknown:
        return
    for key in unknown:
        if not_offered and key in not_offered:
            raise UnknownOptionError(f"{where} does not take {key}: {not_offered[key]}")
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise UnknownOptionError(
        f"{where} got unknown option(s) {', '.join(hints)}; it takes {', '.join(known)}"
    )


#: The one place that says which engine and task option a front end does not offer, and
#: why; it takes every other one, with the default of ``EngineOptions`` /
#: ``check_task_options``, and hands it on unchanged (``tests/test_options.py`` holds each
#: front end's signature to this).
NOT_OFFERED: dict[str, dict[str, str]] = {
    "train_models": {
        "iteration_batches": "it trains whole epochs (epochs=)",
        "trace_window": "its History holds the engine's trace with the default window; "
        "drive an Engine(trace_window=...) yourself for another",
        "share_frozen": "frozen tensors equal across tasks are always held once; "
        "Engine(share_frozen=False) turns it off (a benchmark switch)",
    },
    "optimize": {
        "iteration_batches": "a trial reports to Optuna once per epoch (the epoch is the step)",
        "trace_window": "pass engine=Engine(trace_window=...) for another window",
        "share_frozen": "frozen tensors equal across tasks are always held once; "
        "Engine(share_frozen=False) turns it off (a benchmark switch)",
    },
    "HydraExecutor": {
        "copy_on_cpu": "a test aid of the engine's copy path on CPU 'devices' "
        "(Engine / train_models); a node's engine computes on its devices",
        "trace_window": "each engine keeps the default window; executor.trace() gathers them",
        "share_frozen": "frozen tensors equal across tasks are always held once; "
        "Engine(share_frozen=False) turns it off (a benchmark switch)",
    },
}


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
    "DEVICE_TYPES",
    "ENGINE_KEYS",
    "ENGINE_OPTIONS",
    "NOT_OFFERED",
    "POSITIONAL_OPTIONS",
    "PRECISIONS",
    "SEED_MAX",
    "SEED_MIN",
    "TASK_OPTIONS",
    "TRAIN_LOSS",
    "EngineOptions",
    "TrainOptions",
    "check_devices",
    "check_factory_timeout",
    "check_flag",
    "check_max_grad_norm",
    "check_max_layers_per_shard",
    "check_option_names",
    "check_policy",
    "check_positive_int",
    "check_precision",
    "check_seconds",
    "check_seed",
    "check_spill",
    "check_task_options",
    "check_trace_window",
    "engine_options",
    "offered",
    "parse_bytes",
]
