""":func:`patch_tune`: make ``ray.tune.run(..., trial_executor=HydraExecutor(...))`` work.

Ray removed custom trial executors (deprecated in 2.3, ``RayTrialExecutor`` gone in 2.7), so
in current Ray ``tune.run(train, ..., trial_executor=X)`` raises ``TypeError: run() got an
unexpected keyword argument 'trial_executor'``. :func:`tune_hydra.run` takes that call form
as it is. For code that is written against ``tune.run`` itself, :func:`patch_tune` is an
explicit, shallow opt-in (like ``nest_asyncio.apply()``): it replaces the public function
``ray.tune.run`` (and ``ray.tune.tune.run``, where Ray defines it) with
:func:`patched_run`, which

* with ``trial_executor=HydraExecutor(...)`` forwards every argument to
  :func:`tune_hydra.run`, so the first argument is a task factory
  ``make_task(config) -> th.ModelTask``;
* without ``trial_executor`` (or with ``trial_executor=None``) calls Ray's own ``tune.run``
  with the arguments unchanged.

Nothing inside Tune is touched (the trial controller is Ray's), and :func:`unpatch_tune`
puts Ray's function object back.

:func:`hook_tuner` is the ``tune.Tuner`` counterpart, installed by
``HydraExecutor.trainable()`` itself (the trainable is the user's opt-in): it wraps the
public constructor ``tune.Tuner.__init__`` so that a Tuner over an executor's trainable
gets that executor's scheduler wrapper, stopper, callbacks and ``max_concurrent_trials``
(:func:`tune_hydra.frontends.ray.run.tuner_configs`); any other Tuner is built exactly as
Ray builds it. :func:`unhook_tuner` restores Ray's constructor.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import Any

import ray.tune
import ray.tune.tune

from tune_hydra.frontends.ray.run import executor_of, tuner_configs
from tune_hydra.frontends.ray.run import run as hydra_run

# The modules whose ``run`` attribute is Ray's public ``tune.run``: the package users import
# it from, and the module that defines it.
_MODULES: tuple[ModuleType, ...] = (ray.tune, ray.tune.tune)
_ATTR = "run"

_LOCK = threading.RLock()
_replaced: dict[str, Any] = {}  # module name -> the object patch_tune replaced there


def _ray_run() -> Callable[..., Any]:
    """The ``tune.run`` that :func:`patched_run` calls without an executor: the object
    :func:`patch_tune` replaced, or, where this process never patched (a Ray worker that
    unpickled :func:`patched_run`), the one ``ray.tune.tune`` defines."""
    saved = _replaced.get(ray.tune.__name__)
    return saved if saved is not None else ray.tune.tune.run


def patched_run(*args: Any, trial_executor: Any = None, **kwargs: Any) -> Any:
    """``ray.tune.run`` while :func:`patch_tune` is in effect.

    With ``trial_executor`` (a :class:`~tune_hydra.HydraExecutor`) the call is
    ``tune_hydra.run(*args, trial_executor=trial_executor, **kwargs)``; without it, Ray's own
    ``tune.run(*args, **kwargs)``, unchanged. ``inspect.signature`` shows Ray's parameters
    plus ``trial_executor``; ``help(ray.tune.run.__wrapped__)`` shows Ray's documentation.

    Args:
        *args: ``tune.run``'s positional argument (``run_or_experiment``).
        trial_executor: None (Ray's ``tune.run``) or a :class:`~tune_hydra.HydraExecutor`
            (:func:`tune_hydra.run`).
        **kwargs: ``tune.run``'s keyword arguments.

    Returns:
        What ``tune.run`` returns: an ``ExperimentAnalysis``.
    """
    if trial_executor is None:
        return _ray_run()(*args, **kwargs)
    return hydra_run(*args, trial_executor=trial_executor, **kwargs)


def _signature(original: Callable[..., Any]) -> inspect.Signature | None:
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):
        return None
    if "trial_executor" in sig.parameters:
        return sig
    params = list(sig.parameters.values())
    extra = inspect.Parameter(
        "trial_executor", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Any"
    )
    if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
        params.insert(len(params) - 1, extra)
    else:
        params.append(extra)
    return sig.replace(parameters=params)


class TunePatch:
    """What :func:`patch_tune` returns; as a context manager it undoes that call's patch.

    ``applied`` is True when this call replaced ``ray.tune.run`` and False when it was
    already patched. On leaving a ``with`` block the patch is undone only if this call
    applied it: a ``with th.patch_tune():`` inside code that had already called
    ``th.patch_tune()`` (or inside another such block) leaves ``ray.tune.run`` patched,
    as it found it.
    """

    def __init__(self, applied: bool) -> None:
        self.applied = applied

    def __enter__(self) -> TunePatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.applied:
            unpatch_tune()
            self.applied = False

    def __repr__(self) -> str:
        return f"TunePatch(applied={self.applied})"


def patch_tune() -> TunePatch:
    """Make ``ray.tune.run`` accept ``trial_executor=HydraExecutor(...)``.

    Replaces the public function ``ray.tune.run`` (and ``ray.tune.tune.run``, the module
    that defines it) with :func:`patched_run`: with a ``trial_executor`` the call goes to
    :func:`tune_hydra.run` (the first argument is then a task factory
    ``make_task(config) -> th.ModelTask``), without one to Ray's own ``tune.run``, with the
    arguments unchanged. Calling it again while patched changes nothing (there is one
    wrapper, around Ray's function). :func:`unpatch_tune` restores Ray's function object.

    Only the attribute is replaced: code that did ``from ray.tune import run`` **before**
    the patch keeps Ray's function in its own name (and its ``trial_executor=`` still
    raises ``TypeError``); call ``tune.run(...)`` through the module, import after
    patching, or call :func:`tune_hydra.run`. ``tune.Tuner`` needs no patch: a Tuner over
    ``HydraExecutor.trainable(...)`` completes its configs itself (:func:`hook_tuner`).

    Returns:
        A :class:`TunePatch`; used as a context manager (``with th.patch_tune(): ...``) it
        unpatches at the end of the block, unless ``ray.tune.run`` was already patched
        when the block began (then it stays patched: the block does not undo what it did
        not do).

    Example:
        >>> import inspect
        >>> import tune_hydra as th
        >>> from ray import tune
        >>> ray_run = tune.run
        >>> with th.patch_tune():
        ...     "trial_executor" in inspect.signature(tune.run).parameters
        True
        >>> tune.run is ray_run
        True
    """
    with _LOCK:
        if ray.tune.run is patched_run:
            return TunePatch(applied=False)
        original = ray.tune.run
        sig = _signature(original)
        if sig is not None:
            patched_run.__signature__ = sig  # type: ignore[attr-defined]
        patched_run.__wrapped__ = original  # type: ignore[attr-defined]
        for module in _MODULES:
            _replaced[module.__name__] = getattr(module, _ATTR)
            setattr(module, _ATTR, patched_run)
        return TunePatch(applied=True)


def unpatch_tune() -> bool:
    """Undo :func:`patch_tune`: ``ray.tune.run`` is Ray's function object again.

    Idempotent: without a patch in effect it does nothing. If other code replaced
    ``ray.tune.run`` after :func:`patch_tune`, its replacement is left in place (with a
    warning) rather than overwritten.

    Returns:
        True if something was restored, False if nothing was patched.

    Example:
        >>> import tune_hydra as th
        >>> from ray import tune
        >>> ray_run = tune.run
        >>> _ = th.patch_tune()
        >>> th.unpatch_tune(), tune.run is ray_run
        (True, True)
        >>> th.unpatch_tune()
        False
    """
    with _LOCK:
        restored = False
        for module in _MODULES:
            if module.__name__ not in _replaced:
                continue
            current = getattr(module, _ATTR)
            if current is patched_run:
                setattr(module, _ATTR, _replaced.pop(module.__name__))
                restored = True
            else:  # keep what we saved: unpatching again after they undo theirs restores it
                warnings.warn(
                    f"tune_hydra.unpatch_tune: {module.__name__}.run was replaced by "
                    f"{current!r} after th.patch_tune(); leaving that in place. Undo that "
                    f"replacement first, then call th.unpatch_tune() again",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return restored


def hook_tuner() -> bool:
    """Make ``tune.Tuner(executor.trainable(...), ...)`` complete its configs itself.

    Wraps ``ray.tune.Tuner.__init__`` (once per process; idempotent): when the trainable
    was made by an active :class:`~tune_hydra.HydraExecutor`, its ``tune_config`` and
    ``run_config`` are replaced by copies completed by
    :func:`~tune_hydra.frontends.ray.run.tuner_configs`; otherwise, and for
    ``Tuner.restore`` (whose configs come from the experiment folder), the arguments
    reach Ray's constructor unchanged.

    Returns:
        True if this call installed the hook, False if it was in place.
    """
    with _LOCK:
        original = ray.tune.Tuner.__init__
        if getattr(original, "_tune_hydra_hook", False):
            return False

        @functools.wraps(original)
        def __init__(self: Any, trainable: Any = None, **kwargs: Any) -> None:
            ex = executor_of(trainable)
            if ex is not None and kwargs.get("_tuner_internal") is None:
                kwargs["tune_config"], kwargs["run_config"] = tuner_configs(
                    ex, kwargs.get("tune_config"), kwargs.get("run_config"), trainable
                )
            original(self, trainable, **kwargs)

        __init__._tune_hydra_hook = True  # type: ignore[attr-defined]
        ray.tune.Tuner.__init__ = __init__  # type: ignore[method-assign]
        return True


def unhook_tuner() -> bool:
    """Undo :func:`hook_tuner`: ``tune.Tuner.__init__`` is Ray's again.

    Returns:
        True if something was restored, False if no hook was in place.
    """
    with _LOCK:
        current = ray.tune.Tuner.__init__
        if not getattr(current, "_tune_hydra_hook", False):
            return False
        ray.tune.Tuner.__init__ = current.__wrapped__  # type: ignore[attr-defined,method-assign]
        return True
