"""A trial's failure as every front end reports it: the error for a factory that built no
task, for a model whose type cannot be cut, the text of an error for a study's records,
and an error made fit to cross a process boundary.

Each message is written here once; the Ray Tune front end (``HydraExecutor``), the Optuna
front end (``th.optimize``) and the next one raise what these functions build.

Importing this module imports neither torch nor Ray.

Example:
    >>> from tune_hydra.frontends.failures import error_text, not_a_task
    >>> err = not_a_task("3", None, takes="trial", systematic=False)
    >>> error_text(err, limit=52)[:52]
    'TaskFactoryError: trial 3: the task factory returned'
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any

from tune_hydra.exceptions import (
    EngineError,
    InvalidModelError,
    NotATaskError,
    TaskFactoryError,
    UncuttableModelError,
)

RUNS_THE_LOOP = "tune_hydra runs the training loop and reports loss and val_loss itself"
"""Why a task factory returns a task rather than training: said wherever one does not."""


def not_a_task(
    trial: str,
    task: Any,
    *,
    takes: str = "config",
    trainable: str = "",
    systematic: bool = True,
) -> TaskFactoryError:
    """The error for a task factory that returned ``task``, which is no ``ModelTask``.

    Args:
        trial: the trial whose factory it was.
        task: what the factory returned.
        takes: what the factory is called with (``"config"``, ``"trial"``).
        trainable: how a function trainable passed as the factory reports, when one was
            (``"tune.report"``): its training loop just ran, with nothing to report to;
            ``""``: not known to be one.
        systematic: every trial would repeat it (the factory is the same for all):
            a :class:`~tune_hydra.exceptions.NotATaskError`; otherwise (a define-by-run
            factory may return something else for one trial only) a
            :class:`~tune_hydra.exceptions.TaskFactoryError` of that trial alone.

    Returns:
        The error, to raise.
    """
    problem = f"the task factory returned {type(task).__name__}, not a tune_hydra.ModelTask"
    fix = (
        f"make_task({takes}) must build and return th.ModelTask(model=..., loss_fn=..., "
        f"optimizer=..., train_data=..., eval_data=...); {RUNS_THE_LOOP}"
    )
    if trainable or (task is None and systematic):
        ran = (
            f"it calls {trainable}(...): it is a function trainable, whose training loop "
            f"just ran inside the engine with no Tune session to report to"
            if trainable
            else "a function trainable passed by mistake returns None like this"
        )
        problem += f" ({ran})"
        fix += (
            ". A function trainable runs under a HydraExecutor when tune_hydra sees its "
            "tune.report (read from the function and the functions of its module that it "
            "calls, not from other modules): call tune.report there and add "
            "model, optimizer = th.shard(model, optimizer) after building them. To run it "
            "as plain Tune does, drop trial_executor (th.run then is tune.run)"
        )
    if systematic:
        return NotATaskError(trial, problem, fix)
    return TaskFactoryError(f"trial {trial}: {problem}. {fix}.")


def uncuttable(trial: str, model: Any, err: Exception) -> Exception:
    """``err`` (the engine refused to cut ``model``) as an
    :class:`~tune_hydra.exceptions.UncuttableModelError` when the model's *type* cannot
    be cut, else ``err`` itself (a cut that fails for this config's sizes). Either fails
    this trial alone: a search space may choose the architecture."""
    from tune_hydra.engine.task import model_layers

    try:
        model_layers(model, trial)
    except InvalidModelError:
        return UncuttableModelError(
            trial,
            f"the model the task factory built cannot be cut into shards: {err}",
            "Build a model of another type for this config in make_task (an "
            "nn.Sequential, a traced nn.Module or a Hugging Face model); the other "
            "trials go on",
        )
    return err


def error_text(err: BaseException, limit: int | None = 20_000) -> str:
    """``"<type>: <message>"`` of a trial's error, cut to ``limit`` characters (a study
    keeps it as a trial attribute; the log keeps it whole: ``limit=None``).

    Example:
        >>> error_text(ValueError("x" * 10), limit=14)
        'ValueError: xx ... (truncated; the whole error is in the log)'
    """
    text = f"{type(err).__name__}: {err}"
    if limit is not None and len(text) > limit:
        text = text[:limit] + " ... (truncated; the whole error is in the log)"
    return text


def check_task(
    task: Any,
    trial: str,
    *,
    takes: str = "config",
    trainable: Callable[[], str | None] | None = None,
    systematic: bool = True,
) -> Any:
    """``task`` if it is a :class:`~tune_hydra.ModelTask`, else the error of
    :func:`~tune_hydra.frontends.failures.not_a_task` (``trainable()`` tells how a
    function trainable passed as the factory reports, if it was one; asked only then).

    Raises:
        NotATaskError: with ``systematic`` (every trial would repeat it).
        TaskFactoryError: without (that trial alone fails).
    """
    from tune_hydra.engine.task import ModelTask

    if isinstance(task, ModelTask):
        return task
    call = trainable() if trainable is not None else None
    raise not_a_task(trial, task, takes=takes, trainable=call or "", systematic=systematic)


def portable(err: BaseException) -> BaseException:
    """``err`` if it survives pickling (Ray ships it to the trial's process), else an
    :class:`~tune_hydra.exceptions.EngineError` carrying its type, message and the
    traceback of its cause (the user's code that raised inside the engine).

    Example:
        >>> class Local(Exception):
        ...     def __reduce__(self):
        ...         raise TypeError("no")
        >>> type(portable(ValueError("x"))).__name__, type(portable(Local("y"))).__name__
        ('ValueError', 'EngineError')
    """
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        text = f"{type(err).__name__}: {err}"
        cause = err.__cause__
        if cause is not None and cause.__traceback__ is not None:
            tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
            text += f"\n\nOriginal traceback:\n{tb}"
        return EngineError(text)


__all__ = ["RUNS_THE_LOOP", "check_task", "error_text", "not_a_task", "portable", "uncuttable"]
