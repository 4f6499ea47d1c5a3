"""``torch.compile`` and ``th.shard``: each shard's forward compiled with the user's settings.

Every form compiles what an op runs, each shard's forward, with the engine's hooks outside
the compiled code (see :mod:`tune_hydra.engine.runtime.compiled`):

- ``model, opt = th.shard(torch.compile(model, **kw), opt)``: the original module (the
  ``OptimizedModule``'s ``_orig_mod``) is sharded and the user keeps their
  ``OptimizedModule``: calling it runs the sharded model, its shards compiled with that
  ``torch.compile``'s own settings (its dynamo context: mode, backend, fullgraph,
  dynamic, options, exactly). ``state_dict()`` keys keep their ``_orig_mod.`` prefix, as
  plain PyTorch's do for that object;
- ``compiled = torch.compile(sharded_model, **kw)`` after ``th.shard``: the same, from
  its first call (which finds the ``OptimizedModule`` calling the model);
- ``sharded_model.compile(**kw)`` (``nn.Module.compile``, in place): the shards are
  compiled with those keywords.

The last compile given wins, and it holds for every call of the model (the sharded model
is one loop: a ``torch.compile`` of it and the model itself call the same shards).
Anything else that would make dynamo trace into a sharded model (a compiled function or
module that calls it, ``model.compile()`` before ``th.shard``) raises
:class:`~tune_hydra.exceptions.UnsupportedCompileError` rather than run uncompiled.

This module imports ``torch._dynamo`` (seconds): it is imported only where
``torch.compile`` is in use.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from tune_hydra.exceptions import UnsupportedCompileError

if TYPE_CHECKING:
    from tune_hydra.engine.runtime.compiled import Compiler
    from tune_hydra.frontends.shard import _State

SUPPORTED = (
    "th.shard(torch.compile(model, ...), optimizer), torch.compile(model, ...) of the "
    "model th.shard returned, or model.compile(...) on it"
)


def compiler_of(wrapper: OptimizedModule) -> Compiler:
    """The settings of the ``torch.compile`` that made ``wrapper``: its dynamo context,
    which compiles a function as that call would have."""
    return wrapper.dynamo_ctx


def adopt(wrapper: nn.Module, state: _State) -> None:
    """Make ``wrapper`` (a ``torch.compile`` of the sharded model ``state`` is of) call the
    sharded model, and compile the model's shards with its settings."""
    if not isinstance(wrapper, _ShardedCompiled):
        state.wrappers.append((weakref.ref(wrapper), type(wrapper)))
        from tune_hydra.frontends.shard import _sharded_class

        wrapper.__class__ = _sharded_class(type(wrapper), _ShardedCompiled)
        cast(OptimizedModule, wrapper)._initialize()
    compiler = compiler_of(cast(OptimizedModule, wrapper))
    if state.compiler is not compiler:  # (compiling again would recompile every shard)
        state.set_compiler(compiler)


def release(state: _State) -> None:
    """The wrappers :func:`adopt` changed back to plain ``OptimizedModule`` s (``th.unshard``:
    calling them compiles the plain model again)."""
    for ref, cls in state.wrappers:
        wrapper = ref()
        if wrapper is not None:
            wrapper.__class__ = cls
            cast(OptimizedModule, wrapper)._initialize()
    state.wrappers.clear()


def _calling_wrapper(model: nn.Module) -> OptimizedModule | None:
    """The ``OptimizedModule`` of ``model`` whose call this is, found on the stack (its
    ``__call__`` frame: dynamo hands no reference to it)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, OptimizedModule) and obj._modules.get("_orig_mod") is model:
            return obj
        frame = frame.f_back
    return None


@torch.compiler.disable
def traced_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A sharded model's ``forward`` reached by dynamo (which runs this eagerly, as a graph
    break): dynamo cannot trace the engine (threads hand each shard op to a device), so

    - called by a ``torch.compile`` of the model (``torch.compile(sharded)``): that
      ``OptimizedModule`` is adopted (:func:`adopt`): from now on calling it runs the
      sharded model, whose shards are compiled with its settings; this call too;
    - inside an op (a Hugging Face stage, compiled in its shard, runs the model's own
      ``forward``): the model's ``forward``, eagerly;
    - otherwise (a compiled function or module that calls the model): refused.

    Raises:
        UnsupportedCompileError: a compiled function or module calls the sharded model.
    """
    from tune_hydra.engine.runtime.loop import in_op

    state: _State = model.__dict__["_th_shard"]
    if in_op():
        return state.model_class.forward(model, *args, **kwargs)
    wrapper = _calling_wrapper(model)
    if wrapper is None:
        raise UnsupportedCompileError(
            f"a torch.compile'd function or module calls this sharded "
            f"{state.model_class.__name__}: dynamo cannot trace the engine that runs its "
            f"shards, and would run it uncompiled. Compile the model itself: {SUPPORTED} "
            f"(each shard's forward is compiled); keep the code around it outside compiled "
            f"functions, or compile that code separately"
        )
    adopt(wrapper, state)
    return model.forward(*args, **kwargs)


class _ShardedCompiled(nn.Module):
    """The methods a ``torch.compile`` of a sharded model overrides (``OptimizedModule``
    comes after): calling it runs the sharded model (whose shards are compiled), not
    dynamo over the engine; the views of the state are brought home first, as the sharded
    model's are."""

    _orig_mod: nn.Module

    def _initialize(self) -> None:
        # OptimizedModule's own makes forward dynamo over _orig_mod's call.
        self.forward = self._orig_mod.__call__

    def __reduce__(self) -> Any:
        """``copy.deepcopy``: a plain ``OptimizedModule`` of a plain copy of the model."""
        state: _State = self._orig_mod.__dict__["_th_shard"]
        plain = next(cls for ref, cls in state.wrappers if ref() is self)
        return (plain, (self._orig_mod, self.dynamo_ctx))

    def compile(self, *args: Any, **kwargs: Any) -> None:
        self._orig_mod.compile(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Any:
        self._orig_mod._th_sync(write=True)  # type: ignore[operator]
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        self._orig_mod._th_sync(write=True)  # type: ignore[operator]
        return super().named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Any:
        self._orig_mod._th_sync(write=True)  # type: ignore[operator]
        return super().buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        self._orig_mod._th_sync(write=True)  # type: ignore[operator]
        return super().named_buffers(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """As plain (keys with ``_orig_mod.``), into the sharded model's state at home."""
        from tune_hydra.engine.runtime.loop import in_op

        inner = self._orig_mod
        inner._th_sync(write=True)  # type: ignore[operator]
        state: _State = inner.__dict__["_th_shard"]
        loop = None if in_op() else state.loop
        if loop is None:
            return super().load_state_dict(state_dict, *args, **kwargs)
        prefix = "_orig_mod."
        same = loop.before_load(
            {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        )
        try:
            return super().load_state_dict(state_dict, *args, **kwargs)
        finally:
            loop.after_load(same)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._orig_mod.zero_grad(set_to_none)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        self._orig_mod.to(*args, **kwargs)  # the sharded model's rules
        return self

    def cuda(self, device: Any = None) -> Any:
        self._orig_mod.cuda(device)
        return self

    def cpu(self) -> Any:
        return self


__all__ = ["SUPPORTED", "adopt", "compiler_of", "release", "traced_call"]
