"""``th.shard(model, optimizer)``: the user's own training loop, unchanged, on the engine.

One added line keeps a PyTorch loop as it is::

    model, optimizer = th.shard(model, optimizer)
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

The model and the optimizer stay the user's objects (their class is swapped for a
subclass, as FSDP2 does, so ``isinstance``, ``state_dict()`` keys, ``train()`` /
``eval()`` are the user's): every forward runs as shard ops that the engine schedules
among all loops and tasks sharing it, ``loss.backward()`` runs the shards' backward, and
``optimizer.step()`` steps each shard (see :mod:`tune_hydra.engine.loop`). The model is
cut on its first forward (the first batch is the probe that sizes the activations).

The user's thread may read and write the model's tensors through the model's and the
optimizer's own methods: ``parameters()``, ``named_parameters()``, ``buffers()``,
``state_dict()``, ``load_state_dict()`` (and the optimizer's ``state_dict()`` /
``load_state_dict()``) first bring every shard's state home (host memory), where it stays
until the next forward or step: so ``clip_grad_norm_(model.parameters(), c)`` between
backward and step sees and clips the real gradients. A list of parameters taken *before*
a forward is not synchronised that way: call ``model.parameters()`` where it is used.

Outside any trial the loops of one process share one embedded engine, created on the
first ``th.shard`` (``devices="auto"``), configured by :func:`configure` before that;
``engine=`` picks another. Inside a front end's call (an objective run by
``th.optimize``: :func:`engine_scope`) ``th.shard`` uses that front end's engine.

Random numbers: a loop's ops draw from a generator of their own on the engine's device
threads, never from torch's global one, so loops in threads (``study.optimize(n_jobs>1)``)
cannot take each other's numbers. On the main thread, and in a thread on a private
generator (``th.optimize``'s objectives), the ops share the user's stream, as plain
PyTorch does; on another thread they continue the global generator's stream from where
``th.shard`` found it (see :mod:`tune_hydra.engine.loop`).

A loop leaves the engine when its model is garbage-collected (nothing of the engine holds
the model: the loop and a Hugging Face model's cut reference it weakly, and what the
engine keeps of a failed loop's error has no frames), whether the loop finished or
failed, or on :func:`unshard`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import copyreg
import inspect
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.exceptions import (
    AlreadyShardedError,
    EngineConfiguredError,
    ModelOnDeviceError,
    OptimizerMismatchError,
    ShardClosedError,
    UnsupportedCallError,
)

if TYPE_CHECKING:
    from tune_hydra.engine.engine import Engine
    from tune_hydra.engine.loop import LoopRunner

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_ENGINE: Engine | None = None
_CONFIG: dict[str, Any] = {}


class EngineScope:
    """Where ``th.shard`` calls without ``engine=`` go in one context (a front end's
    trial, e.g. an objective under ``th.optimize``), and the states they made."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.states: list[_State] = []
        self.stopped = False
        # The front end's hook (on_loop): called with each loop of the scope once it is
        # cut and registered (th.optimize announces its milestones).
        self.on_loop: Callable[[LoopRunner], None] | None = None

    def stop(self) -> None:
        """From another thread (the front end gave up on the call: Ctrl-C, a timeout):
        the scope's loops refuse their next forward, and a later ``th.shard`` in it
        raises, so the user's code ends at its next batch instead of training on."""
        self.stopped = True
        for state in list(self.states):
            state.closed = True

    @property
    def sharded(self) -> int:
        """How many ``th.shard`` calls this scope saw."""
        return len(self.states)

    def close(self) -> None:
        """Take every loop of this scope off its engine (its model keeps its weights, on
        the CPU, its classes back to the user's): nothing of a finished, pruned or failed
        trial stays queued or resident."""
        for state in self.states:
            model = state.model_ref()
            if model is not None and model.__dict__.get("_th_shard") is state:
                try:
                    unshard(model)
                except Exception:  # the call is over: its last step's error is logged
                    log.warning("th.unshard of a loop of a finished call failed", exc_info=True)
            else:
                state.finalizer.detach()
                _close_state(state, raise_errors=False)
        self.states.clear()


# A context variable, not a global: each Optuna thread (or task) has its own trial.
_SCOPE: contextvars.ContextVar[EngineScope | None] = contextvars.ContextVar(
    "tune_hydra_engine_scope", default=None
)


@contextlib.contextmanager
def engine_scope(engine: Engine) -> Iterator[EngineScope]:
    """Inside, ``th.shard`` without ``engine=`` uses ``engine`` (not the embedded one);
    the scope lists the loops made. Used by ``th.optimize`` around each objective call;
    the caller decides when to :meth:`EngineScope.close` it."""
    scope = EngineScope(engine)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def configure(**engine_options: Any) -> None:
    """Set the embedded engine's options (the keywords of ``th.Engine``: ``devices``,
    ``device_memory``, ``policy``, ``copy_on_cpu`` ...), before the first ``th.shard``.

    Raises:
        EngineConfiguredError: the embedded engine was started already.
        InvalidOptionError: a bad option (checked here, not at the first ``th.shard``).
        UnknownOptionError: an option ``th.Engine`` does not take (named with the closest).
        UnknownDeviceError: a device this machine does not have (``devices=["cuda"]``
            without CUDA), as the engine would refuse it.
    """
    from tune_hydra.engine.units import resolve_devices
    from tune_hydra.options import ENGINE_OPTIONS, EngineOptions, check_option_names

    with _LOCK:
        if _ENGINE is not None:
            raise EngineConfiguredError(
                "th.configure() must come before the first th.shard(): the embedded engine "
                "is running with its options already. Call th.configure at the top of the "
                "script, or pass engine=th.Engine(...) to th.shard"
            )
        check_option_names(engine_options, ENGINE_OPTIONS, where="th.configure")
        options = EngineOptions(**engine_options, where="th.configure")
        if not (isinstance(options.devices, str) and options.devices == "auto"):
            resolve_devices(options.devices)  # the engine's check ("auto" warns there)
        _CONFIG.clear()
        _CONFIG.update(engine_options)


def default_engine() -> Engine:
    """The process's embedded engine, created on first use with :func:`configure`'s
    options (``devices="auto"`` by default) and closed at exit."""
    global _ENGINE
    with _LOCK:
        if _ENGINE is None:
            from tune_hydra.engine import Engine

            _ENGINE = Engine(**{"devices": "auto", **_CONFIG})
            atexit.register(_ENGINE.close)
        return _ENGINE


_WARNED_HOME = False


def _bring_home(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, devices: list[str]
) -> None:
    """Move a model that the user put on an accelerator (and its optimizer's state) to
    host memory, keeping every ``Parameter`` object (the optimizer holds them): the engine
    promotes its shards to the devices itself, and the model's outputs come back on the
    device of its inputs, so ``model.to(device)`` before ``th.shard`` changes nothing."""
    global _WARNED_HOME
    cpu = torch.device("cpu")
    with torch.no_grad():
        for param in model.parameters():
            if param.device != cpu:
                param.data = param.data.to(cpu)
            if param.grad is not None and param.grad.device != cpu:
                param.grad = param.grad.to(cpu)
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != cpu:
                    module._buffers[name] = buf.to(cpu)
        if optimizer is not None:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device != cpu:
                        state[key] = value.to(cpu)
    if not _WARNED_HOME:
        _WARNED_HOME = True
        log.warning(
            "th.shard: the model was on %s; it was moved to host memory, from where the "
            "engine places its shards on its devices (its outputs come back on the device "
            "of its inputs). Building it on the CPU saves the round trip.",
            ", ".join(devices),
        )


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    engine: Engine | None = None,
) -> Any:
    """Run ``model`` (and ``optimizer``) as shard ops on ``engine`` (default: the process's
    embedded engine), keeping the user's loop as it is.

    Copies: ``copy.deepcopy(model)`` (an EMA or best-model snapshot), ``pickle`` and
    ``torch.save(model)`` give the user's own class, not sharded, with the current weights
    (brought home from the shards first) in tensors of its own, frozen ones the engine
    shares with other loops included; ``copy.deepcopy(optimizer)`` / ``torch.save
    (optimizer)`` give the optimizer's own class with the shards' state. The original
    trains on, on the engine.

    Sizes and hooks: the model is cut on its first forward, whose batch is the probe that
    sizes the activations; a later training batch larger than it is counted at its size
    (the probe's activations scaled by its input bytes) when the cut still fits
    ``device_memory``, else refused before it runs (``BatchTooLargeError``): give the first
    forward a batch of the largest size. The probe, and every backward that recomputes its
    shard's forward (``recompute=True``, the default on devices that copy), run the
    model's layers again, so forward hooks and pre-hooks on its submodules run once more
    for the probe batch and again in each such backward, as under
    ``torch.utils.checkpoint``: keep them free of effects that must happen once a batch.

    Args:
        model: the user's ``nn.Module`` (an ``nn.Sequential``, a module whose ``forward``
            torch.fx can trace, a Hugging Face ``PreTrainedModel``). One already moved to
            an accelerator (``model.to(device)`` before this line, as Ray's examples do)
            is brought back to host memory first, with one warning: the engine places
            its shards.
        optimizer: the user's optimizer over (some of) the model's parameters, of a
            per-parameter kind (SGD, Adam, AdamW, RMSprop, Adagrad ...).
        engine: the engine to run on. ``None``: the one of the enclosing front end
            (an objective run by ``th.optimize`` trains on its engine), else the
            process's embedded one.

    Returns:
        ``(model, optimizer)``, the same objects, sharded; ``model`` alone without an
        optimizer.

    Raises:
        AlreadyShardedError: the model (or the optimizer) was sharded already.
        OptimizerMismatchError: the optimizer steps parameters the model does not have.
        ModelOnDeviceError: a parameter or buffer is on the meta device (no data).
        InvalidModelError: not an ``nn.Module``.
        SharedShardModelError: (a ``SharedModelError``, at the first forward) the model
            trains a parameter, or holds a buffer, of another model the engine trains
            (``b.layer = a.layer``, both sharded): deepcopy the shared module, or put both
            models in one module and shard it once. Frozen tensors equal across models
            are shared by the engine on purpose (its frozen pool), not refused.
    """
    from tune_hydra.exceptions import InvalidModelError

    if not isinstance(model, nn.Module):
        raise InvalidModelError(
            f"th.shard takes the model (an nn.Module) first, not {type(model).__name__}"
        )
    if isinstance(model, _ShardedModule):
        raise AlreadyShardedError(
            f"this {type(model).__name__} was given to th.shard already; call th.shard once "
            f"per model and keep using what it returned"
        )
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UnsupportedCallError(
                f"th.shard's optimizer must be a torch.optim.Optimizer, not "
                f"{type(optimizer).__name__}"
            )
        if isinstance(optimizer, _ShardedOptimizer):
            raise AlreadyShardedError(
                "this optimizer was given to th.shard already (with another model?); build "
                "one optimizer per model"
            )
        _check_optimizer(model, optimizer)
    on = sorted(
        {str(t.device) for t in [*model.parameters(), *model.buffers()] if t.device.type != "cpu"}
    )
    if "meta" in on:
        raise ModelOnDeviceError(
            "the model has tensors on the meta device (shapes, no data): th.shard trains "
            "real weights. Build it with its weights (e.g. model.to_empty(device='cpu') "
            "then load_state_dict) before th.shard"
        )
    if on:
        _bring_home(model, optimizer, on)
    if optimizer is not None and "step" in optimizer.__dict__:
        # An lr scheduler made before th.shard wrapped the class's step on the instance,
        # which would bypass the sharded step: drop the wrapper (the class's step counts).
        del optimizer.__dict__["step"]
    scope = _SCOPE.get() if engine is None else None
    if scope is not None:
        if scope.stopped:
            raise ShardClosedError(
                "the front end running this function stopped it (th.optimize was "
                "interrupted, or the call ran past factory_timeout_s): it trains no more"
            )
        engine = scope.engine
    # A task factory's op (in an engine shared with task factories) swaps its stream into
    # the global generator: a torch.manual_seed on any thread waits for it, not undone by it.
    from tune_hydra.engine.factory import patch_rng_functions

    patch_rng_functions()
    state = _State(model, optimizer, engine)
    if scope is not None:
        scope.states.append(state)
        state.on_loop = scope.on_loop
    cls = type(model)
    model.__dict__["_th_shard"] = state
    model.__class__ = _sharded_class(cls, _ShardedModule)
    if optimizer is not None:
        opt_cls = type(optimizer)
        optimizer.__dict__["_th_shard"] = state
        optimizer.__class__ = _sharded_class(opt_cls, _ShardedOptimizer)
        state.optimizer_class = opt_cls
    state.model_class = cls
    _start_remover()
    state.finalizer = weakref.finalize(model, _forget, state)
    return model if optimizer is None else (model, optimizer)


def unshard(model: nn.Module) -> nn.Module:
    """Take a sharded model (and its optimizer) off the engine: pending steps applied,
    every state home for good, the classes back to the user's. Returns the model.

    The optimizer keeps every shard's state (moments, step counts) and its param
    groups: plain training goes on from where the sharded one was.

    Raises:
        UnsupportedCallError: the model was not sharded.
        Exception: the last ``optimizer.step()`` (deferred to the shards' next op)
            raised: its own error, after the model and the optimizer are unsharded (as
            the next forward would have raised it).
    """
    state = model.__dict__.get("_th_shard")
    if state is None:
        raise UnsupportedCallError(f"this {type(model).__name__} was not given to th.shard")
    state.finalizer.detach()
    try:
        _close_state(state)
    finally:  # unsharded whatever the pending step did
        model.__class__ = state.model_class
        del model.__dict__["_th_shard"]
        opt = state.optimizer
        if opt is not None:
            opt.__class__ = state.optimizer_class
            opt.__dict__.pop("_th_shard", None)
    return model


def _close_state(state: _State, *, raise_errors: bool = True) -> None:
    loop = state.loop
    state.closed = True
    if loop is None:
        return
    if loop.closed:
        # Its model was collected (_forget queued the removal for the remover thread):
        # removed here too, so that the loop has left when the front end's call returns.
        loop.engine.remove_task(loop.name)
        return
    loop.close(raise_errors=raise_errors)


def _forget(state: _State) -> None:
    """The model was garbage-collected: remove its loop from the engine, on the remover
    thread (a collection may run on any thread, the engine's included, holding any lock:
    only a queue's ``put`` is safe there; starting a thread is not, and may fail)."""
    state.closed = True
    loop = state.loop
    if loop is not None:
        loop.closed = True
        _REMOVALS.put((loop.engine, loop.name))


# The loops whose model was garbage-collected, removed from their engines by one thread
# (started by th.shard, again after a fork).
_REMOVALS: queue.SimpleQueue[tuple[Engine, str]] = queue.SimpleQueue()
_REMOVER: threading.Thread | None = None


def _start_remover() -> None:
    global _REMOVER
    with _LOCK:
        if _REMOVER is None or not _REMOVER.is_alive():
            _REMOVER = threading.Thread(target=_remove_forgotten, name="hydra-unshard", daemon=True)
            _REMOVER.start()


def _remove_forgotten() -> None:
    while True:
        engine, name = _REMOVALS.get()
        try:
            engine.remove_task(name)
        except Exception:  # the next ones go on
            log.warning("th.shard: removing loop %r from its engine failed", name, exc_info=True)
        engine = None  # type: ignore[assignment]  # not kept alive while waiting


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    mine = {id(p) for p in model.parameters()}
    foreign = [
        (gi, i, tuple(p.shape))
        for gi, g in enumerate(optimizer.param_groups)
        for i, p in enumerate(g["params"])
        if id(p) not in mine
    ]
    if foreign:
        gi, i, shape = foreign[0]
        raise OptimizerMismatchError(
            f"the optimizer steps {len(foreign)} parameter(s) that are not the model's (the "
            f"first: param_groups[{gi}]['params'][{i}], shape {list(shape)}); build it from "
            f"this model's parameters, e.g. {type(optimizer).__name__}(model.parameters(), "
            f"...)"
        )


_CLASSES: dict[tuple[type, type], type] = {}


def _sharded_class(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin``'s methods first (one class per pair, made once)."""
    key = (cls, mixin)
    with _LOCK:
        made = _CLASSES.get(key)
        if made is None:
            made = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
            made.__qualname__ = cls.__qualname__
            _CLASSES[key] = made
    return made


def _plain_reduce(rv: Any, sharded: type, user: type, state: Any = None) -> Any:
    """``rv`` (what the user's class's ``__reduce_ex__`` gave for a sharded object) made
    to rebuild the user's plain object: its class instead of the sharded one (copyreg's
    ``__newobj__`` / ``_reconstructor`` take it first), without ``_th_shard`` (the engine,
    the loop) in its state; ``state``, when given, replaces the state. The pickle names
    only the user's class and the standard library (no tune_hydra to load it)."""
    if not isinstance(rv, tuple) or len(rv) < 2:
        return rv
    parts = list(rv)
    args = parts[1]
    if parts[0] is getattr(copyreg, "__newobj__", None) and args == (sharded,):
        # pickle wants __newobj__'s class to be the object's: copyreg's protocol 0 form
        # (object.__new__ of the user's class) instead.
        parts[0], parts[1] = copyreg._reconstructor, (user, object, None)  # type: ignore[attr-defined]
    elif isinstance(args, tuple) and args and args[0] is sharded:
        parts[1] = (user, *args[1:])
    if state is not None:
        parts[2:3] = [state]
    elif len(parts) > 2 and isinstance(parts[2], dict) and "_th_shard" in parts[2]:
        parts[2] = {k: v for k, v in parts[2].items() if k != "_th_shard"}
    return tuple(parts)


class _State:
    """What one ``th.shard`` call shares between the model and the optimizer."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, engine: Engine | None
    ) -> None:
        self.model_ref = weakref.ref(model)
        self.optimizer = optimizer
        self.engine = engine
        self.loop: LoopRunner | None = None
        self.closed = False
        self.model_class: type[nn.Module] = type(model)
        self.optimizer_class: type[torch.optim.Optimizer] | None = None
        self.finalizer: Any = None
        self.hf = False
        self.on_loop: Callable[[LoopRunner], None] | None = None  # its scope's hook
        # Where the loop's own stream starts (used by loops in threads that draw from the
        # global generator; see tune_hydra.engine.loop): the generator's state now.
        self.rng_start = torch.get_rng_state()

    def check(self) -> None:
        if self.closed:
            raise ShardClosedError(
                "this model's loop was closed (th.unshard, or its engine closed); call "
                "th.shard on it again to train it on an engine"
            )

    def cut(self, model: nn.Module, inputs: Any) -> LoopRunner:
        """Cut the model on its first batch and register its loop."""
        from tune_hydra.engine.loop import build_loop, inside_op
        from tune_hydra.engine.task import model_layers

        engine = self.engine if self.engine is not None else default_engine()
        sharded = type(model)
        model.__class__ = self.model_class  # the cut traces the user's own forward
        try:
            with inside_op():
                layers = model_layers(model)
        finally:
            model.__class__ = sharded
        self.loop = build_loop(
            engine,
            model,
            self.optimizer,
            self.optimizer_class,
            layers,
            inputs,
            hf=self.hf,
            rng_start=self.rng_start,
        )
        if self.on_loop is not None:
            self.on_loop(self.loop)
        return self.loop


class _ShardedModule(nn.Module):
    """The methods a sharded model overrides (the user's class comes after it)."""

    _th_shard: _State

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from tune_hydra.engine.loop import in_op

        state: _State = self.__dict__["_th_shard"]
        user_forward = state.model_class.forward
        if in_op():  # a stage of the cut runs the model's own forward (Hugging Face)
            return user_forward(self, *args, **kwargs)
        state.check()
        inputs = self._th_inputs(state, args, kwargs)
        loop = state.loop
        if loop is None:
            loop = state.cut(self, inputs)
        return loop.forward(inputs)

    def _th_inputs(self, state: _State, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The first stage's input: the one argument, or a Hugging Face model's keyword
        arguments as one dict (positional ones bound to their names)."""
        from tune_hydra.models import is_hf_model

        if is_hf_model(self):
            state.hf = True
            if args:
                sig = inspect.signature(state.model_class.forward)
                bound = sig.bind_partial(self, *args, **kwargs)
                kwargs = {k: v for k, v in bound.arguments.items() if k != "self"}
            return dict(kwargs)
        if len(args) == 1 and not kwargs:
            return args[0]
        if not args and len(kwargs) == 1:
            return next(iter(kwargs.values()))
        raise UnsupportedCallError(
            f"a sharded {state.model_class.__name__} takes one input (model(x)); it was "
            f"called with {len(args)} positional and {len(kwargs)} keyword argument(s). Pack "
            f"them into one tuple or dict that forward unpacks"
        )

    # -- placement is the engine's ---------------------------------------------------------

    def to(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, torch.dtype) for a in [*args, *kwargs.values()]) or any(
            isinstance(a, torch.Tensor) for a in args
        ):
            raise UnsupportedCallError(
                "a sharded model keeps its dtype: convert it (model.to(dtype)) before "
                "th.shard; the engine places it on devices itself"
            )
        log.debug("%s.to(%s): placement is the engine's; ignored", type(self).__name__, args)
        return self

    def cuda(self, device: Any = None) -> Any:
        log.debug("%s.cuda(): placement is the engine's; ignored", type(self).__name__)
        return self

    def cpu(self) -> Any:
        return self

    # -- copies: the user's plain module -------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> Any:
        """``copy.deepcopy(model)``, ``pickle`` / ``torch.save(model)``: the user's plain
        module (its own class, not sharded), with the weights brought home first; a deep
        copy's tensors are its own (``Parameter.__deepcopy__`` clones, shared frozen
        tensors too). Neither the engine nor the loop is copied."""
        state: _State = self.__dict__["_th_shard"]
        self._th_sync()
        return _plain_reduce(super().__reduce_ex__(protocol), type(self), state.model_class)

    # -- the user's views of the state: brought home first -----------------------------

    def _th_sync(self, write: bool = False) -> None:
        from tune_hydra.engine.loop import in_op

        state: _State | None = self.__dict__.get("_th_shard")
        if state is None or state.loop is None or in_op():
            return
        state.loop.sync()
        if write:
            state.loop.touched()

    def parameters(self, recurse: bool = True) -> Any:
        self._th_sync(write=True)  # clip_grad_norm_ writes the gradients it gets
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        self._th_sync(write=True)
        return super().named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Any:
        self._th_sync(write=True)
        return super().buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        self._th_sync(write=True)
        return super().named_buffers(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._th_sync()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        from tune_hydra.engine.loop import in_op

        self._th_sync(write=True)
        state: _State | None = self.__dict__.get("_th_shard")
        loop = None if state is None or in_op() else state.loop
        if loop is None:
            return super().load_state_dict(state_dict, *args, **kwargs)
        # Frozen tensors shared with other loops: written only in this model's own copy.
        same = loop.before_load(state_dict)
        try:
            return super().load_state_dict(state_dict, *args, **kwargs)
        finally:
            loop.after_load(same)

    def zero_grad(self, set_to_none: bool = True) -> None:
        state: _State = self.__dict__["_th_shard"]
        if state.loop is None:
            super().zero_grad(set_to_none)
        else:
            state.loop.zero_grad(set_to_none)


class _ShardedOptimizer(torch.optim.Optimizer):
    """The methods a sharded optimizer overrides (the user's class comes after it)."""

    def _th_loop(self) -> LoopRunner | None:
        state: _State = self.__dict__["_th_shard"]
        state.check()
        return state.loop

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise UnsupportedCallError(
                "a sharded optimizer steps without a closure (LBFGS-style step(closure) "
                "re-runs the whole model inside the step); use a per-parameter optimizer"
            )
        loop = self._th_loop()
        if loop is None:  # no forward yet: nothing to step but what plain would
            return super().step()
        loop.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        loop = self._th_loop()
        if loop is None:
            super().zero_grad(set_to_none)
        else:
            loop.zero_grad(set_to_none, optimizer=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As the user's class's (gradual unfreezing); after the cut the shards'
        optimizers follow at once (``LoopRunner.follow_groups``).

        Raises:
            OptimizerMismatchError: the group has parameters that are not the model's
                (the optimizer is left as it was).
        """
        super().add_param_group(param_group)
        state: _State | None = self.__dict__.get("_th_shard")
        model = None if state is None else state.model_ref()
        if state is None or model is None:
            return
        try:
            _check_optimizer(model, self)
            if state.loop is not None and not state.loop.closed:
                state.loop.follow_groups()
        except OptimizerMismatchError:
            self.param_groups.pop()
            raise

    def state_dict(self) -> dict[str, Any]:
        loop = self._th_loop()
        if loop is None:
            return super().state_dict()
        loop.sync()
        own = self.state
        self.state = loop.optimizer_state()  # type: ignore[assignment]
        try:
            return super().state_dict()
        finally:
            self.state = own

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        loop = self._th_loop()
        if loop is None:
            super().load_state_dict(state_dict)
            return
        loop.sync()
        super().load_state_dict(state_dict)
        loop.load_optimizer_state()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """``copy.deepcopy(optimizer)``, ``pickle`` / ``torch.save(optimizer)``: the
        user's plain optimizer class with the state the shards' optimizers hold (brought
        home first), keyed by the model's parameters (a copy of both in one call, or one
        ``torch.save`` of both, keeps them together)."""
        state: _State = self.__dict__["_th_shard"]
        rv = super().__reduce_ex__(protocol)
        own = rv[2] if isinstance(rv, tuple) and len(rv) > 2 else None
        loop = state.loop
        if loop is None or not isinstance(own, dict) or "state" not in own:
            return _plain_reduce(rv, type(self), state.optimizer_class or type(self))
        loop.sync()
        own = {k: v for k, v in own.items() if k != "_th_shard"}
        own["state"] = collections.defaultdict(dict, loop.optimizer_state())
        return _plain_reduce(rv, type(self), state.optimizer_class or type(self), own)


__all__ = ["configure", "default_engine", "shard", "unshard"]
