"""``torch.compile`` inside a loop's shards: each shard's forward is compiled, the engine's
hooks (the op hand-off, the RNG stream, autocast, the backward's recompute) stay outside.

A sharded model's forward hands each shard to a device's thread (futures, locks, the
scheduler): dynamo cannot trace across that, and compiling the whole sharded model would
graph-break at every op. So, as torchtitan compiles per block with its hooks outside,
:class:`ShardCompiler` compiles what an op runs, ``shard.module(arg)``, with the
user's ``torch.compile`` settings (``th.shard(torch.compile(model, **kw))`` or
``model.compile(**kw)``, see :mod:`tune_hydra.frontends.shard`): the shard's module gets
a compiled call (``_compiled_call_impl``, the slot ``nn.Module.compile`` fills), so
every op that calls it, forward, recompute and evaluation, runs compiled code.

Why not ``torch.compile(shard)`` as it is: a shard is an ``nn.Sequential``, and dynamo
keeps the compiled graphs of every compiled ``torch.nn`` module of the process on one
code object (``torch._dynamo.external_utils.wrap_inline``'s), at most
``torch._dynamo.config.recompile_limit`` (8) of them: a model of 3 shards in 3 modes
(forward without grad, its recompute with grad, evaluation) would fill it and run the
rest eagerly, with only a log line. Identical blocks do not share a graph either (a
transformers block's ``layer_idx`` is guarded as a constant). So each compiled module
gets a code object of its own: its graphs (one per mode) stay far below the limit, no
loop fills another's (or the user's) cache, and they go when the loop does.

Random numbers: compiled code draws from torch's global CPU generator (inductor's seeds,
aot's ``rand``), which the dispatch mode that gives a loop's eager ops their stream
(:func:`use_generator` (registration/factory.py)) does not see. A compiled loop's op on a
CPU device therefore runs with its stream installed in the global generator instead
(:func:`global_cpu_stream`, under ``CPU_RNG_LOCK``, as a task factory's op does), eager
parts of it too, so that its draws come from one stream in the order plain compiled code
makes them, and a recompute replays them. A thread that draws from the global generator
without a private stream while such an op runs shares it, as with task factories.

Threads: torch's compile-time flags are process-wide, so a call that may compile runs
alone (:data:`GATE`): loops of one process that compile at once stay exact.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tune_hydra.engine.runtime.rng import CPU_RNG_LOCK

log = logging.getLogger(__name__)

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Compiles a function with the user's settings: a ``torch.compile``'d module's own
dynamo context (``OptimizedModule.dynamo_ctx``: exactly the user's ``torch.compile``
keywords), or ``torch.compile`` with ``model.compile()``'s keywords."""


def _call_shard(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The template of each compiled module's function (a copy of its code object each,
    # see the module docstring): the module's call, hooks and all, as traced by dynamo
    # (nn.Module.compile compiles the same _call_impl).
    return module._call_impl(*args, **kwargs)


def compile_targets(shard: nn.Module) -> list[nn.Module]:
    """What of a shard is compiled: the shard, or, of a Hugging Face model's cut, each
    block (the user's ``GPT2Block`` ...), as torchtitan compiles per block. Its ``embed``
    and ``head`` stages run the model's own ``forward`` (recording what the blocks get,
    stopping before the final norm), which dynamo cannot trace whole: compiled, they
    graph-break, and dynamo then compiles the blocks as frames of one code object, whose
    recompile limit they fill (and run eagerly); so they run eagerly, the blocks
    compiled."""
    from tune_hydra.models.hf import BlockStage, EmbedStage, HeadStage

    stages = [m for m in shard.children() if isinstance(m, (BlockStage, EmbedStage, HeadStage))]
    if not stages:
        return [shard]
    return [m.block for m in stages if isinstance(m, BlockStage)]


class Gate:
    """Lets a call that may compile run alone.

    While dynamo compiles, torch holds process-wide flags, not per thread:
    ``torch.compiler.is_compiling()`` is True (``torch.optim``'s Adam, stepping eagerly in
    another thread then, computes its bias correction on tensors and rounds otherwise),
    and AOT autograd's tracing marks FX tracing, so that another thread's call of a
    compiled function raises "Detected that you are using FX to symbolically trace a
    dynamo-optimized function". So a compiled call that may compile (:meth:`alone`)
    waits until no other thread is inside :meth:`running` (every other compiled call,
    and every shard optimizer's step: ``LoopOptimizer.apply_pending``), and holds them off
    until it is done. Only the first calls in each mode compile (the warm-up): the others
    pay two lock round trips.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[int, int] = {}  # thread -> depth inside running()
        self._compiling: int | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around an optimizer step or a compiled call that does not compile."""
        me = threading.get_ident()
        with self._cond:
            depth = self._active.get(me, 0)
            # Only on the way in: one inside (an op calling a compiled call) goes on, the
            # thread that will compile waits for it to leave.
            while not depth and self._compiling not in (None, me):
                self._cond.wait()
            self._active[me] = depth + 1
        try:
            yield
        finally:
            with self._cond:
                depth = self._active.pop(me) - 1
                if depth:
                    self._active[me] = depth
                self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Around a compiled call that may compile: no other thread runs meanwhile.

        It takes ``CPU_RNG_LOCK`` first (dynamo's compile saves and restores the global
        generator's state through it, and a drawing op holds it while it runs): the one
        order of the two, so that a thread holding the lock never waits for the gate."""
        me = threading.get_ident()
        if self._compiling == me:  # nested (only this thread sets it to itself)
            yield
            return
        with self._cond:
            # Out of running() while waiting: a thread waiting here inside an op must not
            # hold off the one compiling.
            mine = self._active.pop(me, 0)
            self._cond.notify_all()
        with CPU_RNG_LOCK:
            with self._cond:
                while self._compiling is not None:
                    self._cond.wait()
                self._compiling = me
                deadline = time.monotonic() + _DRAIN_S
                while self._active and self._cond.wait(max(0.0, deadline - time.monotonic())):
                    pass
                if self._active:
                    # A thread inside running() waiting for something this one holds
                    # (a recompile dynamo makes in a mode _mode did not tell apart): go on.
                    log.warning(
                        "torch.compile under th.shard: compiling while %d other thread(s) "
                        "run compiled code; an eager optimizer step there may round as "
                        "under compilation",
                        len(self._active),
                    )
            try:
                yield
            finally:
                with self._cond:
                    self._compiling = None
                    if mine:
                        self._active[me] = mine
                    self._cond.notify_all()


_DRAIN_S = 30.0  # how long a compile waits for the other threads' compiled calls


GATE = Gate()
"""The process's gate (every engine's compiled calls share torch's flags)."""


def _mode(args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module) -> tuple[Any, ...]:
    """What a compiled call's graphs depend on that changes between calls (dynamo's
    guards): grad mode, training flag, autocast, the tensors' shapes, dtypes, devices and
    requires_grad. A call in a mode not seen before may compile."""
    leaves, _ = tree_flatten((args, kwargs))
    tensors = tuple(
        (tuple(t.shape), t.dtype, t.device, t.requires_grad)
        for t in leaves
        if isinstance(t, torch.Tensor)
    )
    autocast = tuple(
        (d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    )
    return torch.is_grad_enabled(), module.training, autocast, tensors


class _CompiledCall:
    """A module's compiled call (its ``_compiled_call_impl``): alone while it may compile
    (see :class:`Gate`); eager while a Hugging Face cut's embed stage records what the
    block is called with (the block's ``forward`` is a recorder then, on the instance):
    that call is not the block's computation, and tracing it (no ops) would make dynamo
    skip the compiled function for good."""

    __slots__ = ("compiled", "module", "seen")

    def __init__(self, module: nn.Module, compiled: Callable[..., Any]) -> None:
        self.module = module
        self.compiled = compiled
        self.seen: set[tuple[Any, ...]] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        patched = self.module.__dict__.get("forward")
        if patched is not None and getattr(patched, "__qualname__", "").startswith(
            "_recording."
        ):  # (tune_hydra.models.hf._recording's recorder)
            return self.module._call_impl(*args, **kwargs)
        mode = _mode(args, kwargs, self.module)
        if mode in self.seen:
            with GATE.running():
                return self.compiled(self.module, *args, **kwargs)
        with GATE.alone():
            out = self.compiled(self.module, *args, **kwargs)
        self.seen.add(mode)
        return out


class ShardCompiler:
    """Compiles one loop's shards with ``compiler`` (the user's ``torch.compile``
    settings).

    Args:
        compiler: see :data:`Compiler`.
        name: the loop's name: dynamo's logs and recompile messages name the shards'
            compiled functions after it (``loop_Net_0_shard_2``).
    """

    def __init__(self, compiler: Compiler, name: str) -> None:
        self.compiler = compiler
        self._name = re.sub(r"\W", "_", name)
        # (module, the compiled call it had before): uninstall puts that back.
        self._installed: list[tuple[nn.Module, Any]] = []

    def install(self, shard: nn.Module, index: int) -> int:
        """Make calling the shard (or each of its blocks) run its compiled call (compiled
        at its first call). Returns how many modules were compiled."""
        targets = compile_targets(shard)
        for i, target in enumerate(targets):
            name = f"{self._name}_shard_{index}" + (f"_block_{i}" if len(targets) > 1 else "")
            code = _call_shard.__code__.replace(co_name=name)
            if hasattr(code, "co_qualname"):  # Python >= 3.11
                code = code.replace(co_qualname=name)
            compiled = self.compiler(types.FunctionType(code, _call_shard.__globals__, name))
            self._installed.append((target, target.__dict__.get("_compiled_call_impl")))
            target._compiled_call_impl = _CompiledCall(target, compiled)
        return len(targets)

    def uninstall(self) -> None:
        """Every module :meth:`install` compiled calls as it did before."""
        for target, before in reversed(self._installed):
            target._compiled_call_impl = before
        self._installed.clear()


class Drew:
    """Whether a block drew from its generator (set when the block ends)."""

    drew = False


@contextlib.contextmanager
def global_cpu_stream(gen: torch.Generator) -> Iterator[Drew]:
    """Run a block with ``gen``'s stream in torch's global CPU generator, under
    ``CPU_RNG_LOCK``: ``gen`` goes on from where the block left it, the global generator
    is as it was. Yields a :class:`Drew` (set on exit)."""
    # torch.default_generator itself: the module functions (torch.get_rng_state ...) are
    # routed to a private generator inside an op (see tune_hydra.engine.registration.factory).
    default = torch.default_generator
    drew = Drew()
    with CPU_RNG_LOCK:
        saved = default.get_state()
        start = gen.get_state()
        default.set_state(start)
        try:
            yield drew
        finally:
            end = default.get_state()
            drew.drew = not torch.equal(end, start)
            gen.set_state(end)
            default.set_state(saved)


def recompile(
    current: ShardCompiler | None,
    compiler: Compiler | None,
    shards: Sequence[tuple[nn.Module, int]],
    name: str,
    hf: bool,
) -> ShardCompiler | None:
    """A loop's shards (``(module, index)``) compiled with ``compiler`` (the user's
    ``torch.compile`` settings; ``None``: eager again) instead of ``current``: what an op
    calls, ``shard.module(arg)``, runs compiled code; the engine's steps around it stay
    eager. Returns the loop's new compiler."""
    if current is not None:
        current.uninstall()
    if compiler is None:
        return None
    new = ShardCompiler(compiler, name)
    blocks = sum(new.install(module, index) for module, index in shards)
    if hf:
        log.info(
            "%s: torch.compile compiles each of the model's %d blocks (its embed and head "
            "stages run its own forward eagerly; see tune_hydra.engine.runtime.compiled)",
            name,
            blocks,
        )
    return new


__all__ = [
    "GATE",
    "Compiler",
    "Drew",
    "Gate",
    "ShardCompiler",
    "compile_targets",
    "global_cpu_stream",
    "recompile",
]
