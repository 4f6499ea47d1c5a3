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
``optimizer.step()`` steps each shard (see :mod:`tune_hydra.engine.runtime.loop`). The model is
cut on its first forward (the first batch is the probe that sizes the activations).

The user's thread may read and write the model's tensors through the model's and the
optimizer's own methods: ``parameters()``, ``named_parameters()``, ``buffers()``,
``state_dict()``, ``load_state_dict()`` (and the optimizer's ``state_dict()`` /
``load_state_dict()``) first bring every shard's state home (host memory), where it stays
until the next forward or step: so ``clip_grad_norm_(model.parameters(), c)`` between
backward and step sees and clips the real gradients. A module holding the sharded model
(a LightningModule) reaches them the same way: its ``parameters()``, ``zero_grad()``,
``modules()`` and ``load_state_dict()`` recurse through the sharded model's. A list of
parameters taken *before* a forward is not synchronised that way: call
``model.parameters()`` where it is used. ``model.double()`` / ``model.to(dtype)`` (or a
parent's) convert the model before its first forward, and raise after it; placement
(``model.to(device)``) is the engine's. ``optimizer.step(closure)`` runs the closure, then
steps every shard (Lightning's automatic optimization).

Outside any trial the loops of one process share one embedded engine, created on the
first ``th.shard`` (``devices="auto"``), configured by :func:`configure` before that;
``engine=`` picks another. Inside a front end's call (an objective run by
``th.optimize``: :func:`engine_scope`) ``th.shard`` uses that front end's engine.

Random numbers: a loop's ops draw from a generator of their own on the engine's device
threads, never from torch's global one, so loops in threads (``study.optimize(n_jobs>1)``)
cannot take each other's numbers. On the main thread, and in a thread on a private
generator (``th.optimize``'s objectives), the ops share the user's stream, as plain
PyTorch does; on another thread they continue the global generator's stream from where
``th.shard`` found it (see :mod:`tune_hydra.engine.runtime.loop`).

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
import functools
import inspect
import logging
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.exceptions import (
    AlreadyShardedError,
    EngineConfiguredError,
    ModelChangedError,
    ModelNotCutError,
    ModelOnDeviceError,
    NotShardedError,
    OptimizerMismatchError,
    ShardClosedError,
    ShardError,
    UnsupportedCallError,
)

if TYPE_CHECKING:
    from tune_hydra.engine.engine import Engine
    from tune_hydra.engine.runtime.compiled import Compiler
    from tune_hydra.engine.runtime.loop import LoopRunner
    from tune_hydra.models.traced import TracedCall

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_SWAP = threading.Lock()  # a model's class swap (taken before _LOCK, never after)
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
    the caller decides when to :meth:`EngineScope.close` it.

    The scope's thread is one trial of several in the process: libraries' process-wide
    training state is made per thread first (:mod:`tune_hydra.frontends.threads`)."""
    from tune_hydra.frontends.threads import isolate_library_state

    isolate_library_state()
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

    # A misspelt name is the first thing to fix, engine running or not.
    check_option_names(engine_options, ENGINE_OPTIONS, where="th.configure")
    with _LOCK:
        if _ENGINE is not None:
            raise EngineConfiguredError(
                "th.configure() must come before the first th.shard(): the embedded engine "
                "is running with its options already. Call th.configure at the top of the "
                "script, or pass engine=th.Engine(...) to th.shard"
            )
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
    name: str | None = None,
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
            its shards. A ``torch.compile(model, ...)``: its original module is sharded,
            each shard's forward compiled with that call's settings, and the user's
            ``OptimizedModule`` is returned (see :mod:`tune_hydra.frontends.shard_compile`;
            ``torch.compile`` of the returned model and its ``compile()`` do the same).
        optimizer: the user's optimizer over (some of) the model's parameters, of a
            per-parameter kind (SGD, Adam, AdamW, RMSprop, Adagrad ...); its
            ``step(closure)`` runs the closure, then steps. An optimizer built after
            ``th.shard(model)`` (Lightning's ``configure_optimizers``) is given by
            calling ``th.shard(model, optimizer)`` again (see :func:`attach_optimizer`).
        engine: the engine to run on. ``None``: the one of the enclosing front end
            (an objective run by ``th.optimize`` trains on its engine), else the
            process's embedded one.
        name: the loop's name in the engine (its trace, ``Engine.summary()``, errors);
            ``None``: ``loop-<model class>-<n>``.

    Returns:
        ``(model, optimizer)``, the same objects, sharded; ``model`` alone without an
        optimizer.

    Raises:
        AlreadyShardedError: the model (or the optimizer) was sharded already (the
            model: with an optimizer, or without one given now).
        UnsupportedCallError: an optimizer whose step re-evaluates its closure (LBFGS
            and its subclasses) cannot step shard by shard.
        OptimizerMismatchError: the optimizer steps parameters the model does not have.
        ModelOnDeviceError: a parameter or buffer is on the meta device (no data).
        InvalidModelError: not an ``nn.Module``.
        UnsupportedCompileError: ``model.compile()`` was called before ``th.shard``
            (call it on the sharded model instead).
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
    if _is_compiled(model):  # th.shard(torch.compile(model)): the original is sharded
        from tune_hydra.frontends.shard_compile import adopt

        inner = model.get_submodule("_orig_mod")
        done = shard(inner, optimizer, engine=engine)
        adopt(model, inner.__dict__["_th_shard"])  # the user keeps their OptimizedModule
        return model if isinstance(done, nn.Module) else (model, done[1])
    if model.__dict__.get("_compiled_call_impl") is not None and not isinstance(
        model, _ShardedModule
    ):
        from tune_hydra.exceptions import UnsupportedCompileError

        raise UnsupportedCompileError(
            f"model.compile() was called on this {type(model).__name__} before th.shard: "
            f"its compiled call would trace the engine. Call model.compile(...) on the model "
            f"th.shard returns (each shard's forward is compiled with those settings), or "
            f"give th.shard(torch.compile(model, ...), optimizer)"
        )
    if isinstance(model, _ShardedModule):
        state = model.__dict__["_th_shard"]
        if optimizer is None or state.optimizer is not None:
            raise AlreadyShardedError(
                f"this {type(model).__name__} was given to th.shard already; call th.shard "
                f"once per model and keep using what it returned (th.shard(model, optimizer) "
                f"again only gives an optimizer built later to a model sharded without one)"
            )
        if engine is not None and engine is not state.engine:
            raise AlreadyShardedError(
                "this model was given to th.shard already, on another engine: give its "
                "optimizer without engine= (it trains where the model does)"
            )
        attach_optimizer(model, optimizer)
        return model, optimizer
    if optimizer is not None:
        _check_new_optimizer(model, optimizer)
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
    scope = _SCOPE.get()
    if scope is not None and engine is not None and engine is not scope.engine:
        scope = None  # another engine than the front end's: not the front end's loop
    if scope is not None:
        if scope.stopped:
            raise ShardClosedError(
                "the front end running this function stopped it (th.optimize was "
                "interrupted, or the call ran past factory_timeout_s): it trains no more"
            )
        engine = scope.engine
    # A task factory's op (in an engine shared with task factories) swaps its stream into
    # the global generator: a torch.manual_seed on any thread waits for it, not undone by it.
    from tune_hydra.engine.registration.factory import patch_rng_functions

    patch_rng_functions()
    from tune_hydra.engine.runtime.amp import patch_grad_scaler

    patch_grad_scaler()  # a GradScaler reads the shards' gradients at home
    from tune_hydra.frontends.shard_clip import patch_clip

    patch_clip()  # clip_grad_norm_(model.parameters(), c): shard by shard
    from tune_hydra.frontends.threads import isolate_library_state

    isolate_library_state()  # loops in threads: a Trainer's Accelerate state per thread
    state = _State(model, optimizer, engine)
    state.name = name
    with _SWAP:  # two threads sharding one model (a module-level model): one wins
        if isinstance(model, _ShardedModule):
            raise AlreadyShardedError(
                f"this {type(model).__name__} was given to th.shard already (by another "
                f"thread, just now); call th.shard once per model"
            )
        cls = type(model)
        model.__dict__["_th_shard"] = state
        model.__class__ = _sharded_class(cls, _ShardedModule)
    if scope is not None:
        scope.states.append(state)
        state.on_loop = scope.on_loop
    if optimizer is not None:
        _install_optimizer(state, optimizer)
    else:
        _watch_for_optimizer(state, model)
    state.model_class = cls
    _start_remover()
    state.finalizer = weakref.finalize(model, _forget, state)
    return model if optimizer is None else (model, optimizer)


# A model sharded without an optimizer, by its parameters' ids: an optimizer built over
# them afterwards and never given to th.shard (Hugging Face Trainer's, made in its
# create_optimizer) is adopted at its first step. torch's global step hooks see every
# plain optimizer's step (a sharded optimizer's step is its class's own, unhooked): one
# dict lookup a step for the others.
# > 0: this thread reads only shapes (num_parameters): nothing is brought home.
_IN_PLACE = threading.local()
_UNOWNED: weakref.WeakValueDictionary[int, _State] = weakref.WeakValueDictionary()
_STEP_HOOKS: list[Any] = []


def _watch_for_optimizer(state: _State, model: nn.Module) -> None:
    for p in nn.Module.parameters(model):
        _UNOWNED[id(p)] = state
    with _LOCK:
        if not _STEP_HOOKS:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            _STEP_HOOKS.append(register_optimizer_step_pre_hook(_before_plain_step))
            _STEP_HOOKS.append(register_optimizer_step_post_hook(_after_plain_step))


def _adoptable(optimizer: torch.optim.Optimizer) -> _State | None:
    """The state of the sharded model (without an optimizer) whose parameters this plain
    optimizer steps, if any."""
    from tune_hydra.engine.runtime.loop import in_op

    if "_th_shard" in optimizer.__dict__ or "_th_plain" in optimizer.__dict__ or in_op():
        return None
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    state = None if first is None else _UNOWNED.get(id(first))
    if state is None or state.optimizer is not None or state.closed:
        return None
    model = state.model_ref()
    if model is None or not any(p is first for p in nn.Module.parameters(model)):
        return None  # an id reused by another tensor
    return state


def sharded_parameters_code() -> Any:
    """The code of a sharded model's ``parameters()`` generator (``shard_clip`` tells its
    generators by it)."""
    return _ShardedModule.parameters.__code__


def _before_plain_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    state = _adoptable(optimizer)
    if state is not None and state.loop is not None:
        state.loop.sync()  # this first step runs plain, on the state brought home
        from tune_hydra.frontends.shard_clip import patch_clip

        patch_clip()  # Accelerate is loaded by now if a Trainer drives the loop


def _after_plain_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After the first plain step of an optimizer over a sharded model's parameters:
    shard it (:func:`attach_optimizer`), so its state is the engine's and its next steps
    are the shards'; where it cannot be, it stays plain, stepping at home, with a warning."""
    state = _adoptable(optimizer)
    if state is None:
        return
    model = state.model_ref()
    assert model is not None
    if state.loop is not None:
        state.loop.touched()  # the step wrote the weights at home
    try:
        attach_optimizer(model, optimizer)
    except ShardError as err:
        optimizer.__dict__["_th_plain"] = True
        log.warning(
            "the %s built after th.shard over a sharded %s stays a plain optimizer (its "
            "state is not the engine's): %s. Give it to th.shard(model, optimizer) to "
            "see why, or build one over this model's parameters only",
            type(optimizer).__name__,
            type(model).__name__,
            err,
        )


def _is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile``'d module (an ``OptimizedModule``, which
    exists only once ``torch._dynamo`` is loaded: not imported here for nothing)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def unshard(model: nn.Module) -> nn.Module:
    """Take a sharded model (and its optimizer) off the engine: pending steps applied,
    every state home for good, the classes back to the user's. Returns the model.

    The optimizer keeps every shard's state (moments, step counts) and its param
    groups: plain training goes on from where the sharded one was. A ``torch.compile``
    of the model (``th.shard(torch.compile(model))``, given here or not) compiles the
    plain model again.

    Raises:
        UnsupportedCallError: the model was not sharded.
        Exception: the last ``optimizer.step()`` (deferred to the shards' next op)
            raised: its own error, after the model and the optimizer are unsharded (as
            the next forward would have raised it).
    """
    given = model
    if _is_compiled(model) and "_th_shard" in model.get_submodule("_orig_mod").__dict__:
        model = model.get_submodule("_orig_mod")
    state = model.__dict__.get("_th_shard")
    if state is None:
        raise UnsupportedCallError(f"this {type(model).__name__} was not given to th.shard")
    state.finalizer.detach()
    try:
        _close_state(state)
    finally:  # unsharded whatever the pending step did
        model.__class__ = state.model_class
        del model.__dict__["_th_shard"]
        if state.wrappers:  # after the class: torch.compile's wrapper looks at it
            from tune_hydra.frontends.shard_compile import release

            release(state)
        opt = state.optimizer
        if opt is not None:
            opt.__class__ = state.optimizer_class
            opt.__dict__.pop("_th_shard", None)
    return given


def shard_count(model: nn.Module) -> int:
    """The number of shards ``th.shard`` cut ``model`` into (on its first forward).

    Args:
        model: a model given to ``th.shard`` (a ``torch.compile`` of one is looked
            through), after its first forward.

    Returns:
        How many shards the engine runs the model as: what ``th.plan(model, sample)``
        foretells for the same budget.

    Raises:
        NotShardedError: the model was not given to ``th.shard`` (or was given back by
            ``th.unshard``).
        ModelNotCutError: the model is sharded but has not run its first forward yet.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x = torch.randn(8, 64)
        >>> th.plan(model, x, optimizer=opt, device_memory="150KiB")[0].num_shards  # foretold
        2
        >>> engine = th.Engine("cpu", device_memory="150KiB")
        >>> model, opt = th.shard(model, opt, engine=engine)
        >>> loss = model(x).square().mean()  # the first forward cuts it
        >>> th.shard_count(model)
        2
        >>> engine.close()
    """
    inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(inner, nn.Module) and "_th_shard" not in model.__dict__:
        model = inner
    state = model.__dict__.get("_th_shard") if isinstance(model, nn.Module) else None
    if state is None:
        raise NotShardedError(
            f"this {type(model).__name__} is not sharded (never given to th.shard, or given "
            f"back by th.unshard): call th.shard(model, optimizer) first, then run its "
            f"first forward, which cuts it"
        )
    loop = state.loop
    if loop is None:
        raise ModelNotCutError(
            f"this {type(model).__name__} is sharded but not cut yet: the model is cut on "
            f"its first forward (its batch sizes the activations); call "
            f"th.shard_count after one, or th.plan(model, sample, device_memory=...) before "
            f"th.shard to know the cut in advance"
        )
    return len(loop.shards)


def forward_loss(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_of: Callable[[Any, torch.device], torch.Tensor],
    k: int = 1,
) -> torch.Tensor:
    """``(loss / k).backward()`` of ``loss = loss_of(model(*args, **kwargs), device)`` on a
    sharded model, with the last shard's forward, the loss and its backward in one op
    (:func:`~tune_hydra.engine.runtime.loop_chain.train_batch`): how
    :class:`~tune_hydra.frontends.task_loop.TaskLoop` trains a batch. The model is cut on
    its first call, as by its forward. Returns the loss, detached.
    """
    state: _State = model.__dict__["_th_shard"]
    state.check()
    inputs = _ShardedModule._th_inputs(model, state, args, kwargs)  # type: ignore[arg-type]
    loop = state.loop
    if loop is None:
        loop = state.cut(model, inputs)
    else:
        state.check_tree()
    from tune_hydra.engine.runtime.loop_chain import train_batch

    return train_batch(loop, inputs, loss_of, k)


def cut_now(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LoopRunner:
    """Cut a sharded ``model`` now, as its first forward ``model(*args, **kwargs)`` would
    (nothing runs but the cut's probe), and return its loop; the loop it has if it was
    cut already."""
    state: _State = model.__dict__["_th_shard"]
    state.check()
    if state.loop is not None:
        return state.loop
    inputs = _ShardedModule._th_inputs(model, state, args, kwargs)  # type: ignore[arg-type]
    return state.cut(model, inputs)


def first_cut(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[tuple[str, nn.Module]], Any]:
    """The layers and the first stage's input that ``th.shard``'s first forward
    ``model(*args, **kwargs)`` would cut ``model`` from (:meth:`_State.cut`), for a model
    not sharded: what ``th.plan(model, sample)`` probes. Nothing is registered.

    Raises:
        InvalidModelError: a model that cannot be cut.
        TypeError, UnsupportedCallError: arguments the sharded model would refuse.
    """
    from tune_hydra.engine.runtime.loop import inside_op
    from tune_hydra.engine.task import model_layers

    state = _State(model, None, None)
    inputs = _ShardedModule._th_inputs(model, state, args, kwargs)  # type: ignore[arg-type]
    with inside_op():
        layers = model_layers(model, call=state.call)
    return layers, inputs


def _close_state(state: _State, *, raise_errors: bool = True) -> None:
    loop = state.loop
    state.closed = True
    if loop is None:
        return
    if loop.closed:
        # Its model was collected (_forget queued the removal for the remover thread):
        # removed here too, so that the loop has left when the front end's call returns.
        loop.engine.remove_task(loop.name, runner=loop)
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
        # By identity: the name may belong to another loop by the time it is removed.
        _REMOVALS.put((loop.engine, loop.name, weakref.ref(loop)))


# The loops whose model was garbage-collected, removed from their engines by one thread
# (started by th.shard, again after a fork).
_REMOVALS: queue.SimpleQueue[tuple[Engine, str, weakref.ref[LoopRunner]]] = queue.SimpleQueue()
_REMOVER: threading.Thread | None = None


def _start_remover() -> None:
    global _REMOVER
    with _LOCK:
        if _REMOVER is None or not _REMOVER.is_alive():
            _REMOVER = threading.Thread(target=_remove_forgotten, name="hydra-unshard", daemon=True)
            _REMOVER.start()


def _remove_forgotten() -> None:
    while True:
        engine, name, ref = _REMOVALS.get()
        loop = ref()  # gone: it was no longer registered (the engine holds its runners)
        try:
            if loop is not None:
                engine.remove_task(name, runner=loop)
        except Exception:  # the next ones go on
            log.warning("th.shard: removing loop %r from its engine failed", name, exc_info=True)
        engine = loop = None  # type: ignore[assignment]  # not kept alive while waiting


def attach_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, replace: bool = False
) -> None:
    """Give a model sharded without an optimizer (``th.shard(model)``) the optimizer built
    afterwards over its parameters (Lightning's ``configure_optimizers``): it is sharded
    as ``th.shard(model, optimizer)`` would have. ``th.shard(model, optimizer)`` on such a
    model calls this.

    A model already cut (it ran a forward: Lightning's ``validate`` before ``fit``) was
    sized without this optimizer's state: its loop leaves the engine (every state home,
    the previous optimizer's state handed back to it) and the next forward cuts it again,
    sized with the optimizer; the numbers trained are the same.

    Args:
        model: a model given to ``th.shard``.
        optimizer: a per-parameter optimizer over (some of) its parameters.
        replace: whether a model that has an optimizer already takes this one instead (a
            second ``trainer.fit``: the previous optimizer goes back to its own class,
            with its state); else that raises.

    Raises:
        NotShardedError: the model is not sharded.
        AlreadyShardedError: the model has another optimizer (without ``replace``), or
            this one was given to ``th.shard`` with another model.
        OptimizerMismatchError: the optimizer steps parameters the model does not have.
        UnsupportedCallError: an optimizer that cannot step shard by shard (LBFGS).
        ShardClosedError: the model's loop was closed (``th.unshard``).
    """
    state: _State | None = model.__dict__.get("_th_shard")
    if state is None:
        raise NotShardedError(
            f"this {type(model).__name__} is not sharded: th.shard(model, optimizer) shards "
            f"both at once"
        )
    state.check()
    if optimizer is state.optimizer:
        return
    if state.optimizer is not None and not replace:
        raise AlreadyShardedError(
            "this sharded model has an optimizer already: build one optimizer per model"
        )
    _check_new_optimizer(model, optimizer)
    loop = state.loop
    if loop is not None:
        # The loop's own random stream goes on where it was in the loop cut next.
        state.rng_start = loop.random.state()
        _close_state(state)
        state.loop = None
        state.closed = False
    old = state.optimizer
    if old is not None and state.optimizer_class is not None:
        old.__class__ = state.optimizer_class
        old.__dict__.pop("_th_shard", None)
    on = sorted(
        {
            str(v.device)
            for st in optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.device.type != "cpu"
        }
    )
    if on:
        _bring_home(model, optimizer, on)
    _install_optimizer(state, optimizer)


def _check_new_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse what ``th.shard`` cannot take as the model's optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedCallError(
            f"th.shard's optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _ShardedOptimizer):
        raise AlreadyShardedError(
            "this optimizer was given to th.shard already (with another model?); build "
            "one optimizer per model"
        )
    if _reevaluates_closure(type(optimizer)):
        raise UnsupportedCallError(
            f"{type(optimizer).__name__} cannot be stepped shard by shard: its step "
            f"re-evaluates the closure (the whole model's forward and backward) several "
            f"times and updates all parameters together (LBFGS's line search), while a "
            f"sharded model steps each shard on its own. Use a per-parameter optimizer "
            f"(Adam, AdamW, SGD, RMSprop ...) with th.shard, or train this one without "
            f"th.shard"
        )
    _check_optimizer(model, optimizer)


def _reevaluates_closure(cls: type) -> bool:
    """Whether ``cls.step`` needs its closure to step (LBFGS, any subclass of it, or a
    ``step(self, closure)`` without a default): such an optimizer calls the closure
    inside the step, more than once, between updates of every parameter."""
    if issubclass(cls, torch.optim.LBFGS):
        return True
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a step without a signature: nothing to read
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _install_optimizer(state: _State, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` the sharded model's (its class swapped for the sharded one)."""
    if "step" in optimizer.__dict__:
        # An lr scheduler made before th.shard wrapped the class's step on the instance,
        # which would bypass the sharded step: drop the wrapper (the class's step counts).
        del optimizer.__dict__["step"]
    opt_cls = type(optimizer)
    optimizer.__dict__["_th_shard"] = state
    optimizer.__class__ = _sharded_class(opt_cls, _ShardedOptimizer)
    state.optimizer = optimizer
    state.optimizer_class = opt_cls


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
    """``cls`` with ``mixin``'s methods first (one class per pair, made once). A sharded
    model's class has a ``forward`` of its own that shows the user's signature
    (``inspect.signature``), as libraries reading it expect (Trainer's
    ``remove_unused_columns`` drops the batch's columns ``forward`` does not name)."""
    key = (cls, mixin)
    with _LOCK:
        made = _CLASSES.get(key)
        if made is None:
            namespace: dict[str, Any] = {"__module__": cls.__module__}
            if mixin is _ShardedModule:
                namespace["forward"] = _forward_like(cls)
                count = getattr(cls, "num_parameters", None)  # a Hugging Face model's
                if callable(count):
                    namespace["num_parameters"] = _counted_in_place(count)
            made = type(cls.__name__, (mixin, cls), namespace)
            made.__qualname__ = cls.__qualname__
            _CLASSES[key] = made
    return made


def _counted_in_place(count: Callable[..., int]) -> Callable[..., int]:
    """A Hugging Face model's ``num_parameters`` that reads the shapes where the tensors
    are: Trainer calls it every micro-batch (``floating_point_ops``), and a sync there
    would bring the whole state home each time. The shards never change a shape."""

    @functools.wraps(count)
    def num_parameters(self: nn.Module, *args: Any, **kwargs: Any) -> int:
        _IN_PLACE.depth = getattr(_IN_PLACE, "depth", 0) + 1
        try:
            return count(self, *args, **kwargs)
        finally:
            _IN_PLACE.depth -= 1

    return num_parameters


def _forward_like(cls: type) -> Callable[..., Any]:
    """``_ShardedModule.forward`` as a function with ``cls.forward``'s signature and
    docstring (not ``__wrapped__``: what unwraps a forward, such as Accelerate's, would
    then call the user's and bypass the engine)."""

    def forward(self: _ShardedModule, *args: Any, **kwargs: Any) -> Any:
        return _ShardedModule.forward(self, *args, **kwargs)

    user = cls.forward  # type: ignore[attr-defined]
    forward.__qualname__ = f"{cls.__qualname__}.forward"
    forward.__doc__ = getattr(user, "__doc__", None)
    with contextlib.suppress(TypeError, ValueError):  # a builtin: the generic one stays
        forward.__signature__ = inspect.signature(user)  # type: ignore[attr-defined]
    return forward


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
        # A traced model's call as its first forward gave it (what the cut traces), and
        # its forward's signature without self (bound on every call).
        self.call: TracedCall | None = None
        self.signature: inspect.Signature | None = None
        self.on_loop: Callable[[LoopRunner], None] | None = None  # its scope's hook
        self.name: str | None = None  # the loop's name in the engine (None: numbered)
        # Where the loop's own stream starts (used by loops in threads that draw from the
        # global generator; see tune_hydra.engine.runtime.loop): the generator's state now.
        self.rng_start = torch.get_rng_state()
        # torch.compile: the settings each shard's forward is compiled with, and the
        # OptimizedModules of the model that call it (tune_hydra.frontends.shard_compile).
        self.compiler: Compiler | None = None
        self.wrappers: list[tuple[weakref.ref[nn.Module], type]] = []
        # The model's module tree at the cut, edge by edge (path, parent, name, child):
        # the loop runs the modules it cut, so a later replacement must not pass unseen.
        # Weak: the state outlives the model (a collected model leaves the engine).
        self.tree: list[tuple[str, weakref.ref[nn.Module], str, weakref.ref[nn.Module]]] = []

    def set_compiler(self, compiler: Compiler | None) -> None:
        """Compile each shard's forward with ``compiler`` (the user's ``torch.compile``
        settings), from the cut on, or from the next op when it is cut already."""
        self.compiler = compiler
        if self.loop is not None:
            self.loop.compile(compiler)

    def check(self) -> None:
        if self.closed:
            raise ShardClosedError(
                "this model's loop was closed (th.unshard, or its engine closed); call "
                "th.shard on it again to train it on an engine"
            )

    def check_tree(self) -> None:
        """Raise if a submodule was replaced or removed since the cut (a dict lookup per
        module, once per forward)."""
        for path, parent_ref, name, child_ref in self.tree:
            parent, child = parent_ref(), child_ref()
            if parent is None:
                continue
            now = parent._modules.get(name)
            if child is None or now is not child:
                what = "removed" if now is None else f"replaced by a {type(now).__name__}"
                was = "" if child is None else f" ({type(child).__name__})"
                raise ModelChangedError(
                    f"submodule {path!r}{was} of this sharded "
                    f"{self.model_class.__name__} was {what} after th.shard cut the model "
                    f"at its first forward: the engine trains the modules it cut, so the "
                    f"new one would never be used. Change the model before its first "
                    f"forward, or call th.unshard(model) (the model comes back with its "
                    f"weights and the optimizer's state), change it, and th.shard it again"
                )

    def cut(self, model: nn.Module, inputs: Any) -> LoopRunner:
        """Cut the model on its first batch and register its loop."""
        from tune_hydra.engine.runtime.loop import build_loop, inside_op
        from tune_hydra.engine.task import model_layers

        if torch.is_inference_mode_enabled():
            return self._cut_outside_inference_mode(model, inputs)

        engine = self.engine if self.engine is not None else default_engine()
        sharded = type(model)
        model.__class__ = self.model_class  # the cut traces the user's own forward
        try:
            with inside_op():
                layers = model_layers(model, call=self.call)
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
            compiler=self.compiler,
            name=self.name,
        )
        self.tree = [
            (f"{path}.{name}" if path else name, weakref.ref(parent), name, weakref.ref(child))
            # nn.Module's own walk: the sharded class's named_modules syncs the shards first
            for path, parent in nn.Module.named_modules(model, remove_duplicate=False)
            for name, child in parent._modules.items()
            if child is not None
        ]
        if self.on_loop is not None:
            self.on_loop(self.loop)
        return self.loop

    def _cut_outside_inference_mode(self, model: nn.Module, inputs: Any) -> LoopRunner:
        """A first forward in inference mode (Lightning's ``validate``, ``test``): the
        probe reads its inputs' version counters, which inference tensors do not have,
        so the cut probes normal copies of them outside inference mode (the forward
        itself then runs as asked, in inference mode)."""
        from torch.utils._pytree import tree_map

        with torch.inference_mode(False):
            copies = tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t,
                inputs,
            )
            return self.cut(model, copies)


class _ShardedModule(nn.Module):
    """The methods a sharded model overrides (the user's class comes after it)."""

    _th_shard: _State

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # dynamo traces this call: it cannot
            # trace the engine; a graph break into this (a torch.compile of the model
            # compiles each shard instead; anything else raises). Not is_compiling(): a
            # process-wide flag, True in an eager call while another thread compiles.
            from tune_hydra.frontends.shard_compile import traced_call

            return traced_call(self, args, kwargs)
        from tune_hydra.engine.runtime.loop import in_op

        state: _State = self.__dict__["_th_shard"]
        user_forward = state.model_class.forward
        if in_op():  # a stage of the cut runs the model's own forward (Hugging Face)
            return user_forward(self, *args, **kwargs)
        state.check()
        inputs = self._th_inputs(state, args, kwargs)
        loop = state.loop
        if loop is None:
            loop = state.cut(self, inputs)
        else:
            state.check_tree()
        return loop.forward(inputs)

    def _th_inputs(self, state: _State, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The first stage's input, from the arguments as the model's ``forward`` takes
        them: a Hugging Face model's keyword arguments as one dict (positional ones bound
        to their names; its stages call its ``forward`` with them); an ``nn.Sequential``'s
        (or a peft wrapper's of another module) one argument; a traced model's tensors in
        ``forward``'s order (see :func:`~tune_hydra.models.traced.bind_call`), whose other
        arguments are constants of the cut and must be the same on every call.

        Raises:
            TypeError: the arguments do not fit a traced model's ``forward`` (as calling
                it would).
            UnsupportedCallError: a later call's non-tensor arguments (None, scalars)
                differ from those the cut was traced with; an argument is neither a
                tensor nor a constant; an ``nn.Sequential`` got more than one input.
        """
        from tune_hydra.models import is_hf_model, is_peft_model

        if is_hf_model(self):
            state.hf = True
            if args:
                sig = inspect.signature(state.model_class.forward)
                bound = sig.bind_partial(self, *args, **kwargs)
                kwargs = {k: v for k, v in bound.arguments.items() if k != "self"}
            return dict(kwargs)
        if not isinstance(self, nn.Sequential) and not is_peft_model(self):
            from tune_hydra.models.traced import bind_call

            if state.signature is None:
                sig = inspect.signature(state.model_class.forward)
                state.signature = sig.replace(parameters=list(sig.parameters.values())[1:])
            call, inputs = bind_call(state.signature, args, kwargs, state.model_class.__name__)
            if state.loop is None:
                state.call = call  # what the cut traces
            elif state.call is not None:
                state.call.check_same(call)
            return inputs
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
        """``model.to(dtype)`` converts (before the first forward, see :meth:`_apply`);
        ``model.to(device)`` is ignored: the engine places the shards on its devices and
        the outputs come back on the device of the inputs."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            if not (dtype.is_floating_point or dtype.is_complex):
                raise TypeError(
                    f"nn.Module.to only accepts floating point or complex dtypes, but got "
                    f"desired dtype={dtype}"
                )
            self._apply(lambda t: t.to(dtype) if t.is_floating_point() or t.is_complex() else t)
        if device is not None:
            log.debug("%s.to(%s): placement is the engine's; ignored", type(self).__name__, device)
        return self

    def _apply(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> Any:
        """What ``double()``, ``half()``, ``to(...)`` and a parent module's ``to(device)``
        (Lightning's ``model.to(device)``, its ``precision="64-true"``) do to the model:
        a dtype conversion applies to the tensors at home before the first forward (the
        cut then sizes the shards in the new dtype) and raises after it; a move to a
        device is ignored (placement is the engine's), so a model too large for one
        device is never copied onto it whole."""
        from tune_hydra.engine.runtime.loop import in_op

        state: _State | None = self.__dict__.get("_th_shard")
        if state is None or in_op():
            return super()._apply(fn, recurse)
        # What fn does to each dtype, read on an empty tensor (nothing is copied).
        changes: dict[torch.dtype, torch.dtype] = {}
        for dtype in {t.dtype for t in [*nn.Module.parameters(self), *nn.Module.buffers(self)]}:
            out = fn(torch.empty(0, dtype=dtype))
            if isinstance(out, torch.Tensor) and out.dtype != dtype:
                changes[dtype] = out.dtype
        if not changes:
            log.debug("%s: placement is the engine's; ignored", type(self).__name__)
            return self
        if state.loop is not None:
            change = ", ".join(f"{a} -> {b}" for a, b in changes.items())
            raise UnsupportedCallError(
                f"a sharded {state.model_class.__name__} keeps its dtype after its first "
                f"forward ({change} asked): its shards and their optimizers' state were "
                f"sized and placed in it. Convert the model (model.double(), model.to(dtype), "
                f"Lightning's precision=...) before its first forward"
            )
        return super()._apply(
            lambda t: t.to(changes[t.dtype]) if t.dtype in changes else t, recurse
        )

    def cuda(self, device: Any = None) -> Any:
        log.debug("%s.cuda(): placement is the engine's; ignored", type(self).__name__)
        return self

    def cpu(self) -> Any:
        return self

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile``, in place: each shard's forward is compiled with these
        ``torch.compile`` keywords (the engine's steps around the shards stay outside the
        compiled code; see :mod:`tune_hydra.frontends.shard_compile`)."""
        torch.compile(lambda: None, *args, **kwargs)  # bad keywords raise here, not later
        state: _State = self.__dict__["_th_shard"]
        state.set_compiler(lambda fn: torch.compile(fn, *args, **kwargs))

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
        from tune_hydra.engine.runtime.loop import in_op

        state: _State | None = self.__dict__.get("_th_shard")
        if state is None or state.loop is None or in_op() or getattr(_IN_PLACE, "depth", False):
            return
        state.loop.sync()
        if write:
            state.loop.touched()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        # A generator, as nn.Module's: the state comes home when the first parameter is
        # taken, so clip_grad_norm_(model.parameters(), c) may clip shard by shard
        # instead (tune_hydra.frontends.shard_clip).
        self._th_sync(write=True)  # clip_grad_norm_ writes the gradients it gets
        yield from super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        self._th_sync(write=True)
        return super().named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Any:
        self._th_sync(write=True)
        return super().buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        self._th_sync(write=True)
        return super().named_buffers(*args, **kwargs)

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Any:
        # A parent module reaches this model's tensors through here (its parameters(),
        # buffers(), zero_grad(), modules(): torch's recursion calls each child's
        # named_modules with its memo): Lightning zeroes the LightningModule's gradients
        # before each validation, which must not drop a step still pending in the shards.
        # A direct call (memo None: the engine's own look at a model, from any thread)
        # syncs nothing.
        if memo is not None:
            self._th_sync(write=True)
        return super().named_modules(memo, prefix, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._th_sync()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        from tune_hydra.engine.runtime.loop import in_op

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

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # A parent module's load_state_dict (Lightning restoring the LightningModule that
        # holds this model) comes here, not through load_state_dict: the state comes home
        # first, and the shards take what is written there (before this module's own
        # submodules load: torch loads a module before its children).
        self._th_sync(write=True)
        super()._load_from_state_dict(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        state: _State = self.__dict__["_th_shard"]
        if state.loop is None:
            super().zero_grad(set_to_none)
        else:
            state.loop.zero_grad(set_to_none)


class _ShardedOptimizer(torch.optim.Optimizer):
    """The methods a sharded optimizer overrides (the user's class comes after it)."""

    def _th_loop(self) -> LoopRunner | None:
        # An attribute, not __dict__: a wrapper whose class derives from this one and
        # forwards attributes (Lightning's LightningOptimizer) reaches the optimizer's.
        state: _State = self._th_shard  # type: ignore[attr-defined]
        state.check()
        return state.loop

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """False: ``GradScaler`` unscales the gradients at home (``_th_sync_grads``), never
        hands a fused step its scale (the shards' optimizers step without it)."""
        return False

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        pass  # a fused optimizer's __init__ sets it; the shards' own optimizers keep it

    def _th_sync_grads(self) -> None:
        """Bring the gradients home for ``torch.amp.GradScaler``, which reads and unscales
        them in place (see ``tune_hydra.engine.runtime.amp.patch_grad_scaler``)."""
        loop = self._th_loop()
        if loop is not None and not loop.closed:
            loop.sync()
            loop.touched()

    def step(self, closure: Any = None) -> Any:
        """As torch's per-parameter optimizers: ``closure`` (when given) runs first, with
        grad enabled (its forward and backward are the shards' ops), then every shard
        steps; the closure's loss is returned (``Optimizer.step(closure)``'s contract,
        which Lightning's automatic optimization relies on). Optimizers that re-evaluate
        the closure inside the step (LBFGS) were refused by ``th.shard``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        loop = self._th_loop()
        if loop is None:  # no forward yet: nothing to step but what plain would
            super().step()
            return loss
        loop.step()
        return loss

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


__all__ = ["attach_optimizer", "configure", "default_engine", "shard", "shard_count", "unshard"]
