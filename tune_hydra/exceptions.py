"""Errors raised by tune_hydra.

Every error derives from :class:`TuneHydraError`, and also from the built-in exception a
caller would naturally catch (``ValueError``, ``TypeError``, ...), so both
``except TuneHydraError`` and ``except ValueError`` work. Errors that share a meaning
share a base too: :class:`ConfigurationError` (an option of the engine or a front end),
:class:`InvalidTaskError` (a task's inputs), :class:`MemoryBudgetError` (something does
not fit a memory budget), :class:`SpillError` (the disk tier), :class:`CheckpointError`,
:class:`LeaseError`, :class:`ShardError` (``th.shard``), :class:`SystematicTaskError`.

Every error pickles intact (Ray ships it between processes): :class:`_Picklable` restores
its ``args`` and attributes without calling its constructor again.

Example:
    >>> import tune_hydra as th
    >>> import tune_hydra.engine  # th.engine, also where nothing imported it yet
    >>> try:
    ...     th.engine.parse_bytes("lots")
    ... except th.TuneHydraError as err:
    ...     print(type(err).__name__)
    BudgetFormatError
"""

from __future__ import annotations

import errno
import math
from typing import Any, ClassVar

_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def _restore(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    """A ``cls`` holding ``args``, made without running ``cls.__init__`` (whose parameters
    are not the message that ``args`` holds); ``pickle`` then sets its attributes."""
    # The built-in type whose __new__ lays out cls: its first built-in base along
    # __base__, not along the MRO (MemoryError.__new__ refuses a TuneHydraError first).
    base: type = cls
    while base.__flags__ & _HEAPTYPE:
        base = base.__base__  # type: ignore[assignment]  # only object has None
    err = base.__new__(cls)  # type: ignore[call-overload]
    err.args = args
    return err


class _Picklable:
    """Mixin: an exception that pickles with its ``args`` and attributes, whatever its
    ``__init__`` takes.

    ``BaseException.__reduce__`` rebuilds an error as ``cls(*err.args)``, which fails (or
    makes another message) for an ``__init__`` that takes fields and builds the message
    from them. This rebuilds it from its state instead: same type, ``args``, ``str()`` and
    attributes. Attributes named in ``_reprs`` are pickled as their ``repr`` (a value the
    user gave that may not pickle, such as a lambda).

    Example:
        >>> import pickle
        >>> err = InvalidOptionError("seed", lambda: 0, "give an int")
        >>> back = pickle.loads(pickle.dumps(err))
        >>> type(back).__name__, str(back) == str(err), back.option
        ('InvalidOptionError', True, 'seed')
    """

    _reprs: ClassVar[tuple[str, ...]] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        state = {k: _Shown(repr(v)) if k in self._reprs else v for k, v in vars(self).items()}
        return (_restore, (type(self), self.args), state)  # type: ignore[attr-defined]


class TuneHydraError(_Picklable, Exception):
    """Root of every error raised by tune_hydra."""


class ConfigurationError(TuneHydraError):
    """An option of the engine or of a front end (a budget, a device, a policy, a keyword,
    a training option) is not valid; the message says what it takes."""


class MemoryBudgetError(TuneHydraError, MemoryError):
    """Something does not fit a memory budget (``device_memory``, ``host_memory``): raise
    the budget, or make that thing smaller (the message says which and by how much)."""


class SpillError(TuneHydraError, OSError):
    """The disk tier (``spill_dir``) cannot be used, written or read back."""


class InvalidModelError(TuneHydraError, TypeError):
    """The model is not something the engine can cut into sequential shards."""


class InvalidTaskError(TuneHydraError, ValueError):
    """A :class:`~tune_hydra.ModelTask` or a ``train_models`` argument is invalid."""


class EmptyDataError(InvalidTaskError):
    """``train_data`` yielded no batch."""


class BudgetFormatError(ConfigurationError, ValueError):
    """A memory budget string or number could not be parsed."""


class UnknownDeviceError(ConfigurationError, ValueError):
    """A device name is not valid or not available on this machine."""


class ShardTooLargeError(MemoryBudgetError):
    """One layer alone needs more memory than the per-device budget.

    Attributes:
        layer: the first layer found over the budget.
        nbytes: what that layer needs (bytes).
        budget: the per-device budget it was cut for (bytes).
        detail: what ``nbytes`` is made of.
        min_device_memory: the smallest per-device budget (bytes) at which every layer of
            the model fits, by the engine's cost model (state, activations, the prefetch
            room); ``None`` where it was not worked out.
    """

    def __init__(
        self,
        layer: str,
        nbytes: int,
        budget: int,
        detail: str = "",
        min_device_memory: int | None = None,
    ) -> None:
        self.layer = layer
        self.nbytes = nbytes
        self.budget = budget
        self.detail = detail
        self.min_device_memory = min_device_memory
        fix = (
            "Raise device_memory,"
            if min_device_memory is None
            else f"Raise device_memory: give device_memory >= "
            f"{format_bytes_up(min_device_memory)} ({min_device_memory} bytes), the "
            f"smallest at which every layer fits; or"
        )
        super().__init__(
            f"layer {layer!r} needs {format_bytes(nbytes)} ({nbytes} bytes){detail}, more than "
            f"the per-device budget of {format_bytes(budget)} ({budget} bytes). {fix} "
            f"lower the batch size, or split that layer into smaller modules."
        )


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


class MissingDependencyError(TuneHydraError, ImportError):
    """An optional package (e.g. matplotlib for plots) is not installed."""


class UnknownPolicyError(ConfigurationError, ValueError):
    """A scheduling policy name is not known."""


class ScheduleError(TuneHydraError, RuntimeError):
    """A policy or a schedule broke the engine's rules (e.g. picked an operation that is
    not ready)."""


class LeaseError(TuneHydraError, RuntimeError):
    """A lease on a shard's state (``Engine.acquire``) cannot be taken or used."""


class LeaseConflictError(LeaseError):
    """The shard cannot be leased now: its task is being trained by the engine
    (``train()``), or another lease holds its task on another device."""


class LeaseTimeoutError(LeaseError, TimeoutError):
    """No room for the shard on the device (or the shard was leased) within the
    ``timeout`` given to ``Engine.acquire``."""


class LeaseEndedError(LeaseError):
    """A lease was used after ``release()``, after its task left the engine (or was
    checkpointed or restored), or after the engine closed."""


class TaskFactoryError(TuneHydraError, RuntimeError):
    """The user's task factory raised inside the engine's process, or returned something
    that is not a :class:`~tune_hydra.ModelTask`. The message holds the factory's
    traceback."""


class TaskFactoryTimeoutError(TaskFactoryError, TimeoutError):
    """The user's task factory did not return within the configured timeout
    (``HydraExecutor(factory_timeout_s=...)``)."""

    def __init__(self, what: str, timeout_s: float) -> None:
        self.what = what
        self.timeout_s = timeout_s
        super().__init__(
            f"the task factory for {what} did not return within {timeout_s:g} s, so that "
            f"trial failed; the other trials go on. Make make_task faster (load data once, "
            f"outside it, or cache it on disk), or raise HydraExecutor(factory_timeout_s=...)."
            f" The call keeps running in the background; its result will be dropped."
        )


_BUILD_INSIDE = (
    "a module-level MODEL = Net() is shared by every trial in the engine's process, so "
    "build the model inside make_task(config)"
)


class SharedModelError(InvalidTaskError):
    """A task's model shares parameters or buffers with another task the same engine is
    training (two tasks would then train one set of weights and corrupt each other).

    Attributes:
        task: the task that was refused.
        owner: the registered task that already trains those tensors.
        tensors: ``(name in task's model, name in owner's model)`` of each shared tensor.
    """

    def __init__(self, task: str, owner: str, tensors: list[tuple[str, str]]) -> None:
        self.task = task
        self.owner = owner
        self.tensors = list(tensors)
        shown, more = self._shown()
        super().__init__(
            f"task {task!r}: its model shares {len(self.tensors)} tensor(s) with task "
            f"{owner!r}, which this engine is training: {shown}{more}. Two tasks training "
            f"the same tensors corrupt each other. Build a new model for every task: "
            f"{_BUILD_INSIDE} (or copy.deepcopy a template per task); or remove task "
            f"{owner!r} before reusing its model."
        )

    def _shown(self) -> tuple[str, str]:
        """The first shared tensors' names for the message, and how many more."""
        shown = ", ".join(
            f"{mine!r}" if mine == theirs else f"{mine!r} ({theirs!r} there)"
            for mine, theirs in self.tensors[:6]
        )
        more = f" and {len(self.tensors) - 6} more" if len(self.tensors) > 6 else ""
        return shown, more


class ReusedModelError(SharedModelError):
    """The task factory returned a model (or a submodule of one) that an earlier trial of
    the same engine already trained: a module-level model, reused after that trial ended.
    In plain Tune each trial imports the module afresh; here the new trial would start
    from the old trial's trained weights.

    Attributes:
        task: the trial that was refused.
        owner: the earlier trial that trained the model.
        tensors: ``(module name in the new model, "")`` of each reused module.
    """

    def __init__(self, task: str, owner: str, tensors: list[tuple[str, str]]) -> None:
        self.task = task
        self.owner = owner
        self.tensors = list(tensors)
        names = ", ".join(repr(m or "<the whole model>") for m, _ in self.tensors[:6])
        InvalidTaskError.__init__(
            self,
            f"task {task!r}: the task factory returned modules that trial {owner!r} already "
            f"trained ({names}): it would start from that trial's weights, not from a fresh "
            f"model. {_BUILD_INSIDE[0].upper()}{_BUILD_INSIDE[1:]}.",
        )


class FrozenTensorModifiedError(TuneHydraError, RuntimeError):
    """A task wrote a frozen tensor it shares with other tasks (the engine holds one copy
    of frozen tensors equal across tasks, see ``tune_hydra.engine.storage.frozen``).

    Attributes:
        task: the task that wrote it (it fails; the others go on).
        tensor: the tensor's name in the task's model.
        what: what changed (written in place, replaced, unfrozen, given a gradient).
    """

    def __init__(self, task: str, tensor: str, what: str, others: int) -> None:
        self.task = task
        self.tensor = tensor
        self.what = what
        self.others = others
        super().__init__(
            f"task {task!r}: the frozen tensor {tensor!r}, held once for it and "
            f"{others} other task(s) with an equal one, was {what}. A shared frozen "
            f"tensor must stay as loaded: keep it frozen (requires_grad=False, no "
            f"gradient, not stepped), merge adapters only after training and into a copy "
            f"(merge_and_unload(safe_merge=True) on a deepcopy), or train this task with "
            f"its own copy: Engine(share_frozen=False), or load a "
            f"base that differs."
        )


class NotBatchableError(TuneHydraError, ValueError):
    """Several trials' ops on one shared shard cannot run as one batched pass
    (``tune_hydra.engine.dispatch.batched``): the message says why; run them one after another."""


class _Shown(str):
    """A value's ``repr`` standing in for the value once an error is pickled (the value
    itself may not pickle: a lambda given as a seed)."""

    def __repr__(self) -> str:
        return str(self)


class InvalidOptionError(InvalidTaskError, ConfigurationError):
    """A training option (``seed``, ``max_grad_norm``, ``accumulate_steps``,
    ``precision``, ``iteration_batches``, ``max_layers_per_shard`` ...) has a bad value.

    Attributes:
        option: the option's name.
        value: the value given (after pickling: its ``repr``).
        expected: what the option takes, and how to fix the call.
        where: who got it (``"task 'a'"``, ``"HydraExecutor"``, ``"train_models"``), or ``""``.
    """

    _reprs = ("value",)

    def __init__(self, option: str, value: Any, expected: str, where: str = "") -> None:
        self.option = option
        self.value = value
        self.expected = expected
        self.where = where
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{option}={value!r} is not valid: {expected}")


class SpillDirError(SpillError):
    """``spill_dir`` cannot hold the disk tier: it is missing, not a folder, not writable,
    on a full disk, or ``host_memory`` was given without it."""


class HostBudgetError(MemoryBudgetError):
    """``host_memory`` is smaller than one shard's state: that shard could never be in
    host memory to run or to come back from a device."""

    def __init__(self, task: str, shard: int, nbytes: int, budget: int) -> None:
        self.task = task
        self.shard = shard
        self.nbytes = nbytes
        self.budget = budget
        super().__init__(
            f"task {task!r}: shard {shard} holds {format_bytes(nbytes)} ({nbytes} bytes) of "
            f"state, more than host_memory={format_bytes(budget)} ({budget} bytes). Raise "
            f"host_memory to at least {format_bytes(nbytes)} (a few times that keeps the "
            f"devices busy), or lower device_memory so that shards are smaller"
        )


class SpillWriteError(SpillError):
    """A shard's state could not be written to ``spill_dir`` mid-run (the folder became
    unwritable or read-only, was removed, an I/O error; a full disk is the subclass
    :class:`SpillDiskFullError`): its task fails, the others go on, and the state stays in
    host memory. ``code`` is the ``errno`` of the failed call (``None`` if unknown)."""

    def __init__(
        self, task: str, shard: int, nbytes: int, path: str, detail: str, code: int | None = None
    ) -> None:
        self.task = task
        self.shard = shard
        self.nbytes = nbytes
        self.path = path
        self.detail = detail
        self.code = code
        super().__init__(
            f"task {task!r}: writing shard {shard}'s state ({format_bytes(nbytes)}) to the "
            f"spill folder {path!r} failed ({detail}). {self._advice()}; restore the task "
            f"from its last checkpoint"
        )

    def _advice(self) -> str:
        if self.code in (errno.EACCES, errno.EPERM):
            return (
                "The folder is not writable by this process (its permissions or attributes "
                "changed): give it write permission back, or point spill_dir at a writable "
                "folder on a local disk"
            )
        if self.code == errno.EROFS:
            return (
                "The file system became read-only (often after disk errors): check the disk, "
                "or point spill_dir at a writable folder on another disk"
            )
        if self.code == errno.ENOENT:
            return (
                "The spill folder was removed while the engine used it (a cleaner of old "
                "files, or someone, deleted it): keep other programs out of spill_dir"
            )
        return "Check the disk under spill_dir, or point spill_dir at another local disk"


class SpillDiskFullError(SpillWriteError):
    """A shard's state could not be written to ``spill_dir`` because the disk (or the
    user's quota) is full: its task fails, the others go on, and the state stays in host
    memory."""

    def __init__(
        self,
        task: str,
        shard: int,
        nbytes: int,
        path: str,
        detail: str,
        code: int | None = errno.ENOSPC,
    ) -> None:
        super().__init__(task, shard, nbytes, path, detail, code)

    def _advice(self) -> str:
        return "Free space there, point spill_dir at a larger disk, or raise host_memory"


class SpillReadError(SpillError):
    """A shard's state in ``spill_dir`` could not be read back (an I/O error, a file
    changed under the engine): its task fails, the others go on."""

    def __init__(self, task: str, shard: int, path: str, detail: str) -> None:
        self.task = task
        self.shard = shard
        self.path = path
        self.detail = detail
        super().__init__(
            f"task {task!r}: reading shard {shard}'s state back from the spill folder "
            f"{path!r} failed ({detail}). Check the disk under spill_dir and keep other "
            f"programs out of it; restore the task from its last checkpoint"
        )


class _TaskInputError(InvalidTaskError):
    """A task's input is unusable; the message names the task, the input and the fix."""

    def __init__(self, task: str, detail: str) -> None:
        self.task = task
        self.detail = detail
        super().__init__(f"task {task!r}: {detail}")


class InvalidOptimizerError(_TaskInputError, TypeError):
    """A task's optimizer factory raised, or returned something that is not a
    ``torch.optim.Optimizer`` (``None``, an object without ``step``)."""


class DataMismatchError(_TaskInputError):
    """A batch does not fit the model: a layer raised on it (inputs of another dtype or
    shape than the model takes)."""


class InvalidLossError(_TaskInputError):
    """``loss_fn`` raised, or did not return a scalar tensor that autograd can
    back-propagate (a per-sample loss, a detached value, a Python float)."""


class MetricError(_TaskInputError):
    """A metric of the task's ``metrics`` raised on an eval batch, or returned something
    other than a number or a one-element tensor; the message names the metric."""


class InvalidSchedulerError(_TaskInputError, TypeError):
    """A task's ``lr_scheduler`` factory raised, or returned something that is not a
    ``torch.optim.lr_scheduler.LRScheduler`` stepped without arguments."""


class ResumeStateError(_TaskInputError):
    """A resume state (``TaskLoop.state()``, a checkpoint) does not fit the task it is
    restored into: it names parameters the model does not have or lacks some, or it is of
    the older per-shard layout and the model is now cut into another number of shards.
    The message says which, and what to restore it into instead."""


class CheckpointError(TuneHydraError, ValueError):
    """A checkpoint could not be written, or failed verification when read: its manifest is
    missing (an interrupted save) or wrong, a file differs from the manifest (stale,
    truncated or foreign), or a file holds objects that safe loading refuses (a planted
    pickle payload). Nothing of such a checkpoint is loaded.

    Attributes:
        checkpoint: the checkpoint directory.
        file: the file at fault (``None``: the directory itself).
        problem: what is wrong with it.
        fix: what to do about it.
    """

    RESTORE_FIX = "Restore the trial from an earlier checkpoint (or start it afresh)"
    """The fix of a checkpoint that cannot be trusted (the default ``fix``)."""

    def __init__(
        self, checkpoint: str, file: str | None, problem: str, fix: str | None = None
    ) -> None:
        self.checkpoint = checkpoint
        self.file = file
        self.problem = problem
        self.fix = self.RESTORE_FIX if fix is None else fix
        fix = self.fix
        what = file if file is not None else "the directory"
        super().__init__(f"checkpoint {checkpoint}: {what} {problem}. {fix}.")


class ForeignCheckpointFileError(CheckpointError):
    """A checkpoint folder holds a file or folder that tune_hydra never writes (it writes
    only ``model.pt``, ``hydra_state.pt`` and ``hydra_meta.json``), such as Ray's
    ``_dict_checkpoint.pkl``, which Ray's ``Trainable.restore`` would unpickle (running
    any code planted in it). Refused before Ray or tune_hydra reads anything there."""


class EngineError(TuneHydraError, RuntimeError):
    """An error raised in an engine's process whose original type could not cross the
    process boundary (it does not pickle); the message names the original type and holds
    the traceback of its cause."""


class UnknownMetricError(TuneHydraError, ValueError):
    """``th.optimize(metric=...)`` names a value that training does not report each epoch
    (the message lists those it does), or the study's direction does not suit it."""


class InvalidStudyError(TuneHydraError, TypeError):
    """``th.optimize`` got something other than a single-objective ``optuna.Study``, or a
    task factory that is not callable."""


class UnknownOptionError(ConfigurationError, TypeError):
    """A keyword option that the function does not take (a typo, or an option of another
    front end); the message lists the options it takes."""


class SystematicTaskError(TuneHydraError, RuntimeError):
    """A mistake that every trial of an experiment would repeat, whatever its config: the
    task factory is not one (it returns no ``ModelTask``, or it is a function trainable
    that calls ``tune.report``), or the trials lost their engine slots. The Tune front
    end stops the experiment at the first trial that hits one and ``th.run`` raises it,
    instead of failing every trial with the same traceback. Mistakes that depend on the
    config (a layer over budget for one width, a factory raising for one config, a NaN
    loss, a model type that cannot be cut) fail that trial alone.

    Attributes:
        trial: the trial that hit it first (``""``: found before any trial started).
        problem: what is wrong.
        fix: what to change.
    """

    def __init__(self, trial: str, problem: str, fix: str) -> None:
        self.trial = trial
        self.problem = problem
        self.fix = fix
        text = f"{problem}. {fix}."
        if trial:
            text = (
                f"trial {trial}: {text} Every trial would fail the same way, so the "
                f"experiment stops at the first one."
            )
        super().__init__(text)


class NotATaskError(SystematicTaskError, TaskFactoryError, TypeError):
    """The task factory returned something that is not a :class:`~tune_hydra.ModelTask`
    (a function trainable passed by mistake returns None after running its own training
    loop and calling ``tune.report``)."""


class UncuttableModelError(InvalidModelError):
    """The model the task factory built for one trial is of a type the engine cannot cut
    into sequential shards (the engine's :class:`InvalidModelError`, saying so of the
    type). It fails that trial alone: a search space may choose the architecture, and
    the other architectures still run (``fail_fast=True`` in ``th.run`` stops at the
    first failed trial where every config builds the same type).

    Attributes:
        trial: the trial whose model it was.
        problem: what is wrong.
        fix: what to change.
    """

    def __init__(self, trial: str, problem: str, fix: str) -> None:
        self.trial = trial
        self.problem = problem
        self.fix = fix
        super().__init__(f"trial {trial}: {problem}. {fix}.")


class UndeclaredMetricError(SystematicTaskError, UnknownMetricError):
    """The experiment optimises (or schedules on) a metric that the trials' tasks do not
    declare in ``ModelTask(metrics=...)`` and the engine does not report."""


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_bytes_up(n: int) -> str:
    """:func:`format_bytes` of ``n`` rounded up to the figure shown, not to the nearest:
    a budget to give (``device_memory="2.1 MiB"`` is then at least ``n``).

    Example:
        >>> format_bytes(2138112), format_bytes_up(2138112)
        ('2.0 MiB', '2.1 MiB')
    """
    unit = 1
    while abs(n) >= 1024 * unit and unit < 1024**4:
        unit *= 1024
    step = unit / 10 if unit > 1 else 1  # format_bytes shows one decimal above bytes
    return format_bytes(math.ceil(n / step) * step)


# -- th.shard: the user's own training loop (tune_hydra.frontends.shard) -------------------


class ShardError(TuneHydraError, ValueError):
    """``th.shard`` was given something it cannot shard, or used out of order."""


class AlreadyShardedError(ShardError):
    """``th.shard`` was called twice on one model."""


class OptimizerMismatchError(ShardError):
    """The optimizer given to ``th.shard`` steps parameters that are not the model's."""


class ModelOnDeviceError(ShardError):
    """The model given to ``th.shard`` is on an accelerator: the engine places it."""


class UnsupportedCallError(ShardError, TypeError):
    """A sharded model or optimizer was called in a way it does not support."""


class UnsupportedCompileError(UnsupportedCallError):
    """A ``torch.compile`` of a sharded model that ``th.shard`` cannot honour (a compiled
    function or module that calls the sharded model, ``model.compile()`` before
    ``th.shard``): raised rather than run uncompiled. The message names the forms that
    compile each shard."""


class UnsupportedPrecisionError(ShardError, RuntimeError):
    """A precision the sharded loop cannot honour (an autocast that would not reach the
    devices the engine runs the shards on): raised rather than computed in another
    precision."""


class EngineConfiguredError(ShardError, RuntimeError):
    """``th.configure`` came after the embedded engine was started."""


class ShardClosedError(ShardError, RuntimeError):
    """A sharded model was used after its loop was closed (``unshard``)."""


class ModelChangedError(ShardError, RuntimeError):
    """A submodule of a sharded model was replaced or removed after its cut (``model[2] =
    other``, ``b.block = a.block``, ``del model.head``): the engine trains the modules it
    cut, so the model would silently train something else than the user's code says.
    Change the model before its first forward, or ``th.unshard`` it, change it and
    ``th.shard`` it again."""


class NotShardedError(ShardError):
    """A function for sharded models (``th.shard_count``) got a model that is not sharded:
    never given to ``th.shard``, or given back by ``th.unshard``."""


class ModelNotCutError(ShardError, RuntimeError):
    """A sharded model was asked about its shards before its first forward: ``th.shard``
    cuts it there (the first batch sizes the activations)."""


class BatchTooLargeError(ShardError, MemoryBudgetError):
    """A sharded model got a training batch larger than the one its cut was sized on (its
    first forward's), and the cut's shards cannot hold that batch's activations within
    ``device_memory``."""


class SharedShardModelError(SharedModelError, ShardError):
    """A sharded model shares trainable parameters or buffers with another model (or
    task) the same engine trains: ``b.layer = a.layer`` and ``th.shard`` on both.

    Attributes:
        task: the loop that was refused.
        owner: the registered loop (or task) that already trains those tensors.
        tensors: ``(name in task's model, name in owner's model)`` of each shared tensor.
    """

    def __init__(self, task: str, owner: str, tensors: list[tuple[str, str]]) -> None:
        self.task = task
        self.owner = owner
        self.tensors = list(tensors)
        shown, more = self._shown()
        modules = sorted({m.rpartition(".")[0] or "<the whole model>" for m, _ in self.tensors})
        InvalidTaskError.__init__(
            self,
            f"th.shard: the model of loop {task!r} shares {len(self.tensors)} tensor(s) "
            f"with {owner!r}, which this engine trains: {shown}{more} (module(s) "
            f"{', '.join(map(repr, modules))}). Two sharded models stepping one tensor "
            f"corrupt each other (each applies its own steps to it at its own next op). To "
            f"train two copies, copy.deepcopy the shared module before th.shard (b.layer = "
            f"copy.deepcopy(a.layer)); to train one module in both, put both models in one "
            f"nn.Module and th.shard it once, with one optimizer",
        )
