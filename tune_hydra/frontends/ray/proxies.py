"""The proxy trainables :meth:`~tune_hydra.HydraExecutor.trainable` makes, one kind per
kind of trial: what the user passed is told apart here (:func:`check_task_factory`) and
wrapped in its proxy class (:func:`proxy_class`) that reserves one engine slot per trial
(:func:`slotted`).

* a task factory ``make_task(config) -> ModelTask``:
  :class:`~tune_hydra.frontends.ray.trainable.HydraTrainable`, the proxy of a canned
  class trainable (:class:`~tune_hydra.frontends.ray.task_trainable.TaskTrainable`,
  whose instance in the engine process builds and trains the task),
* a function trainable ``train(config)`` that reports:
  :class:`~tune_hydra.frontends.ray.function.HydraFunctionTrainable` (the function runs
  in the engine process),
* a ``tune.Trainable`` subclass:
  :class:`~tune_hydra.frontends.ray.classes.HydraClassTrainable` (its instance lives in
  the engine process).

A ``tune.with_resources`` request inside or around the trainable is dropped with one
warning (:func:`warn_resources_dropped`): every trial holds one engine slot and no CPU.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from ray import tune

from tune_hydra.frontends.ray.errors import NotATaskFactoryError
from tune_hydra.frontends.ray.factories import closure, unwrap_with_parameters
from tune_hydra.frontends.ray.reports import tune_report_call


def check_task_factory(make_task: Any) -> bool:
    """Raise unless ``make_task`` looks like ``make_task(config) -> ModelTask``, a
    function trainable ``train(config)`` that calls ``tune.report``, or a ``tune.Trainable``
    subclass; True for what reports its own results: a function trainable (read from its
    code, see :func:`~tune_hydra.frontends.ray.reports.tune_report_call`) or a class.

    ``tune.with_parameters(make_task, data=...)`` is called as ``make_task(config,
    data=...)``.

    Raises:
        NotATaskFactoryError: not callable with a config, a class that is no
            ``tune.Trainable`` (or is one of Tune's function wrappers, or a trainable
            ``HydraExecutor.trainable`` made), or a string.

    A ``tune.with_resources`` request on it is no mistake:
    :meth:`~tune_hydra.HydraExecutor.trainable` drops it with one warning (see
    :func:`warn_resources_dropped`).
    """
    fix = (
        "HydraExecutor needs a task factory (a function make_task(config) -> th.ModelTask "
        "that builds the model, loss, optimizer and data for one config), a function "
        "trainable train(config) that calls th.shard(model, optimizer) and tune.report, or "
        "a tune.Trainable subclass whose setup() calls th.shard. To run another Tune "
        "trainable, drop trial_executor (th.run then forwards to tune.run)."
    )
    if inspect.isclass(make_task) and issubclass(make_task, tune.Trainable):
        from ray.tune.trainable import FunctionTrainable

        from tune_hydra.frontends.ray.client import EngineClient

        if make_task is tune.Trainable:
            raise NotATaskFactoryError(
                f"got the class Trainable, Tune's base class itself: subclass it (setup, "
                f"step, save_checkpoint, load_checkpoint). {fix}"
            )
        if issubclass(make_task, EngineClient):
            raise NotATaskFactoryError(
                f"the class {make_task.__name__} was made by HydraExecutor.trainable() "
                f"already: pass it to tune.Tuner / tune.run as it is, or give trainable() "
                f"the function or class it was made from"
            )
        if issubclass(make_task, FunctionTrainable):
            raise NotATaskFactoryError(
                f"the class {make_task.__name__} is Tune's wrapper of a function trainable "
                f"(tune.Trainable of a function): pass the function itself. {fix}"
            )
        return True
    if isinstance(make_task, str) or inspect.isclass(make_task) or not callable(make_task):
        kind = (
            f"the string {make_task!r}"
            if isinstance(make_task, str)
            else f"the class {make_task.__name__}"
            if inspect.isclass(make_task)
            else f"a {type(make_task).__name__}"
        )
        if inspect.isclass(make_task):
            kind += ", which is not a ray.tune.Trainable subclass"
        raise NotATaskFactoryError(f"got {kind}. {fix}")
    name = getattr(make_task, "__name__", make_task)
    unwrapped = unwrap_with_parameters(make_task)
    fn, params = unwrapped if unwrapped is not None else (make_task, {})
    try:
        inspect.signature(fn).bind({}, **dict.fromkeys(params))
    except TypeError:
        with_params = f" and the keyword arguments {sorted(params)}" if params else ""
        raise NotATaskFactoryError(
            f"{name!r} cannot be called with one argument (the config){with_params}. {fix}"
        ) from None
    except ValueError:
        pass  # no signature (a builtin): let the engine actor find out
    return tune_report_call(fn) is not None


def class_resources(cls: Any) -> Any:
    """The resource request a ``tune.Trainable`` class makes of its own (the subclass
    ``tune.with_resources`` makes of it, or a ``default_resource_request`` of the user's):
    a ``PlacementGroupFactory``, a function of the config, or None."""
    for klass in cls.__mro__:
        if klass is tune.Trainable:
            return None
        own = klass.__dict__.get("default_resource_request")
        if own is None:
            continue
        func = getattr(own, "__func__", own)
        cells = closure(func)
        if "pgf" in cells:  # tune.with_resources: the request it closes over
            return cells["pgf"]
        try:
            return func(cls, {})
        except Exception:  # a request per config: it cannot be read without one
            return own
    return None


def warn_resources_dropped(resources: Any, where: str) -> None:
    """One warning that a ``tune.with_resources`` request (``resources``: a
    ``PlacementGroupFactory`` or a function of the config) ``where`` is dropped."""
    required = getattr(resources, "required_resources", None)
    asked = dict(required) if required is not None else "a request per config"
    warnings.warn(
        f"tune_hydra: the tune.with_resources request {asked} {where} is dropped: every "
        f"trial of a HydraExecutor holds one engine slot and no CPU, and the engine places "
        f"the model on its devices (a CPU count or a GPU fraction means nothing there). "
        f"Size the engines with HydraExecutor(devices=..., device_memory=...) and the "
        f"concurrent trials with slots_per_node",
        UserWarning,
        stacklevel=3,
    )


def proxy_class(
    make_task: Any,
    *,
    reports: bool,
    factory_id: str,
    run_id: str,
    secret: str,
    slot_resource: str,
    checkpoint: str | None,
) -> type:
    """The proxy trainable class of ``make_task``'s kind (see the module docstring), for
    the stored factory ``factory_id`` of the executor ``run_id``.

    Args:
        make_task: what the user passed (checked by :func:`check_task_factory`).
        reports: what :func:`check_task_factory` returned: it reports its own results
            (a function trainable, or a class).
        factory_id: its id in the experiment's factory store.
        run_id, secret: the executor's id and secret.
        slot_resource: the slot resource of the engine nodes ("" without slots).
        checkpoint: the executor's ``checkpoint`` option (task factories only).
    """
    name = getattr(make_task, "__name__", "make_task")
    if inspect.isclass(make_task):  # a tune.Trainable: its instance lives in the engine process
        from tune_hydra.frontends.ray.classes import HydraClassTrainable

        return HydraClassTrainable.for_class(
            make_task,
            factory_id=factory_id,
            run_id=run_id,
            secret=secret,
            slot_resource=slot_resource,
        )
    if reports:  # it trains and reports itself, in the engine process
        from tune_hydra.frontends.ray.function import HydraFunctionTrainable

        return HydraFunctionTrainable.for_function(
            name,
            factory_id=factory_id,
            run_id=run_id,
            secret=secret,
            slot_resource=slot_resource,
        )
    from tune_hydra.frontends.ray.trainable import HydraTrainable

    return HydraTrainable.for_factory(
        name,
        factory_id=factory_id,
        run_id=run_id,
        secret=secret,
        slot_resource=slot_resource,
        checkpoint=checkpoint,
    )


def slotted(cls: type, resources: dict[str, float]) -> type:
    """``cls`` reserving ``resources`` per trial (one engine slot and no CPU), also under
    a ``tune.with_resources`` put around it later: that request is dropped, with one
    warning (:func:`warn_resources_dropped`)."""
    with_resources = tune.with_resources(cls, resources)
    own = with_resources.__dict__["default_resource_request"]

    def __init_subclass__(sub: type, **kwargs: Any) -> None:
        super(keep, sub).__init_subclass__(**kwargs)  # type: ignore[arg-type]
        # Tune's with_resources subclasses a class trainable to override this; a
        # class rebuilt from its pickle (a trial process) has no dict here yet.
        theirs = sub.__dict__.get("default_resource_request")
        if theirs is not None and theirs is not own:
            sub.default_resource_request = own  # type: ignore[attr-defined]
            pgf = getattr(theirs, "__func__", theirs)
            try:
                asked = pgf(sub, {})
            except Exception:  # a function of the config: no config here
                asked = None
            warn_resources_dropped(asked, "around executor.trainable(...)")

    keep: type = type(
        with_resources.__name__,
        (with_resources,),
        {"__init_subclass__": __init_subclass__, "__module__": cls.__module__},
    )
    return keep
