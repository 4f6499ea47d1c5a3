"""Whether a function reports to Tune (:func:`tune_report_call`), read from its code
without running it: a function trainable passed where a task factory belongs is told
apart before any trial runs, and a factory that reports is named in its trial's error.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

from tune_hydra.frontends.ray.factories import BoundFactory, closure


def _ray_object(obj: Any) -> bool:
    """Whether ``obj`` is a module or function of Ray."""
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        name = getattr(obj, "__module__", None) or ""
    return name == "ray" or name.startswith("ray.")


def _callable_function(obj: Any) -> types.FunctionType | None:
    """The Python function behind a callable (a partial, a bound method, a wrapper, a
    :class:`BoundFactory`, a callable instance), or None."""
    for _ in range(8):
        if isinstance(obj, types.FunctionType):
            return obj
        if isinstance(obj, BoundFactory):
            obj = obj.fn
        elif isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif getattr(obj, "__wrapped__", None) is not None:
            obj = obj.__wrapped__
        elif callable(obj) and not isinstance(obj, type):
            obj = type(obj).__call__
        else:
            return None
    return None


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def tune_report_call(fn: Any, depth: int = 2) -> str | None:
    """How ``fn`` calls Ray's ``report`` (``"tune.report"``, ``"train.report"``,
    ``"report"`` ...), read from its code without running it; None if it does not.

    A function trainable (``def train(config): ... tune.report(...)``) passed where a
    task factory belongs would run its whole training loop inside the engine's process,
    with no Tune session to report to. The check reads the names the function's code
    (and its nested functions) uses: ``report`` reached through one of Ray's modules or
    imported from one. Functions of the same module that it calls, the methods of classes
    of that module that it names (a Hugging Face ``TrainerCallback`` whose ``on_log``
    reports), and functions it closes over (``tune.with_parameters`` keeps the wrapped
    function in a closure), are read too, ``depth`` calls deep. Cheap: nothing is run or
    imported.

    Example:
        >>> from ray import tune
        >>> def train_fn(config):
        ...     tune.report({"loss": 1.0})
        >>> tune_report_call(train_fn)
        'tune.report'
        >>> tune_report_call(lambda config: None) is None
        True
    """
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> str | None:
        func = _callable_function(obj)
        if func is None or id(func.__code__) in seen:
            return None
        seen.add(id(func.__code__))
        closed = closure(func)
        scope = getattr(func, "__globals__", {})

        def lookup(name: str) -> Any:
            if name in closed:
                return closed[name]
            if name in scope:
                return scope[name]
            # ``from ray import tune`` / ``import ray.train`` inside the function
            return sys.modules.get(name) if name.split(".")[0] == "ray" else None

        callees: list[Any] = []
        for code in _code_objects(func.__code__):
            names = code.co_names
            if "report" in names:
                # co_freevars: a module imported in an enclosing function (`import
                # ray.tune` in transformers' run_hp_search_ray, used by its _objective)
                for name in names + code.co_freevars:
                    module = lookup(name)
                    if not isinstance(module, types.ModuleType) or not _ray_object(module):
                        continue
                    if callable(getattr(module, "report", None)):
                        return f"{name}.report"
                    for attr in names:
                        sub = getattr(module, attr, None)
                        if isinstance(sub, types.ModuleType) and callable(
                            getattr(sub, "report", None)
                        ):
                            return f"{name}.{attr}.report"
                found = lookup("report")
                if callable(found) and _ray_object(found):
                    return "report"
            for found in map(lookup, names + code.co_freevars):
                if getattr(found, "__module__", None) != func.__module__:
                    continue
                if isinstance(found, types.FunctionType):
                    callees.append(found)
                elif isinstance(found, type):  # e.g. a TrainerCallback that reports
                    callees.extend(
                        v for v in vars(found).values() if isinstance(v, types.FunctionType)
                    )
        callees.extend(v for v in closed.values() if callable(v) and not _ray_object(v))
        # A functools.wraps wrapper (Hugging Face's Ray backend wraps Tune's
        # with_parameters function this way): read what it wraps, even Ray's.
        wrapped = getattr(func, "__wrapped__", None)
        if callable(wrapped):
            callees.append(wrapped)
        if level > 0:
            for callee in callees:
                hit = visit(callee, level - 1)
                if hit is not None:
                    return hit
        return None

    return visit(fn, depth)


__all__ = ["tune_report_call"]
