"""``clip_grad_norm_(model.parameters(), c)`` on a ``th.shard``-ed model, shard by shard
(and Lightning's clipping over the sharded optimizer's parameters).

A sharded model's ``parameters()`` is a generator that brings every shard's state home
when its first parameter is taken (the user's thread may read or write any of them). For
clipping, that is a whole-model round trip per step: Hugging Face ``Trainer`` clips every
step by default (``max_grad_norm=1.0``). So ``th.shard`` wraps
``torch.nn.utils.clip_grad_norm_`` and, once Accelerate is loaded,
``Accelerator.clip_grad_norm_`` (Trainer's way to it): given such a generator not started
yet, of the whole model, they clip with the gradients left on their devices instead
(``LoopRunner.clip_grad_norm``: the scaling recorded before each shard's step; the norms
are those each shard's last backward op took, once the loop has clipped: the first clip
takes them by an op per shard), with the arithmetic of the function they stand for, so
the step is bit-equal to plain PyTorch's (or Accelerate's). Lightning clips through its
precision plugin's ``main_params(optimizer)``, which ``HydraStrategy`` makes such a
generator too: clipped shard by shard, in the optimizer's order. ``clip_grad_value_``
over such a generator clamps each shard's gradients before its step (elementwise: the
same numbers). Anything else (a list of parameters, another norm, an explicit
``foreach``, another distributed setting, a state already at home) goes to the function
itself, unchanged.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from tune_hydra.engine.runtime.loop import LoopRunner

log = logging.getLogger(__name__)
_LOCK = threading.Lock()


def optimizer_parameters(
    main_params: Callable[[Any], Iterable[nn.Parameter]], sync: Callable[[], None], optimizer: Any
) -> Iterator[nn.Parameter]:
    """``main_params(optimizer)`` (Lightning's precision plugin's: the optimizer's
    parameters), as a generator that calls ``sync`` (brings the sharded networks' state
    home) when its first parameter is taken: clipping over it unstarted may run shard by
    shard instead (:func:`loop_of`)."""
    sync()
    yield from main_params(optimizer)


def loop_of(
    parameters: Any, norm_type: Any = 2.0
) -> tuple[LoopRunner, list[nn.Parameter] | None] | None:
    """The loop whose gradients ``parameters`` stands for, to clip shard by shard, and the
    parameters in the order clipping takes them (``None``: the model's): an unstarted
    generator of a sharded model's ``parameters()`` (``recurse=True``) or of
    ``HydraStrategy``'s ``main_params(optimizer)`` over the sharded optimizer's
    parameters (all of them the sharded model's), the 2-norm, the loop's state not at
    home; ``None`` otherwise. The generator is closed (nothing is brought home)."""
    from tune_hydra.engine.runtime.loop import in_op
    from tune_hydra.frontends.shard import sharded_parameters_code

    if (
        type(parameters) is not types.GeneratorType
        or parameters.gi_code not in (sharded_parameters_code(), _OPTIMIZER_PARAMETERS)
        or inspect.getgeneratorstate(parameters) != inspect.GEN_CREATED
    ):
        return None
    try:
        two = float(norm_type) == 2.0
    except (TypeError, ValueError):
        return None
    frame = parameters.gi_frame
    if frame is None or not two or in_op():
        return None
    local = frame.f_locals
    params: list[nn.Parameter] | None = None
    if parameters.gi_code is _OPTIMIZER_PARAMETERS:
        # Lightning's clipping: the optimizer's parameters, as its own main_params gives
        # them (its param groups: no sync), every one the sharded model's.
        state = getattr(local["optimizer"], "_th_shard", None)
        loop = None if state is None else state.loop
        if loop is None or loop.closed:
            return None
        params = list(local["main_params"](local["optimizer"]))
        own = {id(p) for _, p in nn.Module.named_parameters(loop.model)}  # no sync
        if not all(id(p) in own for p in params):
            return None
    else:
        state = local["self"].__dict__.get("_th_shard")
        loop = None if state is None else state.loop
        if not local.get("recurse", True) or loop is None or loop.closed:
            return None
    if loop.at_home:  # brought home already (a GradScaler's unscale_): clipped there
        return None
    parameters.close()
    return loop, params


def _finite(norm_type: Any, total: torch.Tensor) -> torch.Tensor:
    """``error_if_nonfinite=True``: torch's error for a non-finite total, raised before
    any gradient is scaled."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    return total


def _stacked(total: torch.Tensor) -> torch.Tensor:
    """Accelerate's total over its one (non-distributed) group of norms."""
    return torch.linalg.vector_norm(torch.stack([total]), 2.0)


def patch_clip() -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_`` and, if Accelerate is
    loaded, ``Accelerator.clip_grad_norm_`` (idempotent; see the module docstring)."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    with _LOCK:
        original = clip_grad.clip_grad_norm_
        if not getattr(original, "_th_patched", False):

            @functools.wraps(original)
            def clip_grad_norm_(
                parameters: Any,
                max_norm: float,
                norm_type: float = 2.0,
                error_if_nonfinite: bool = False,
                foreach: bool | None = None,
            ) -> torch.Tensor:
                # An explicit foreach picks torch's kernels: at home, as asked.
                found = loop_of(parameters, norm_type) if foreach is None else None
                if found is None:
                    return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
                loop, params = found
                finish = functools.partial(_finite, norm_type) if error_if_nonfinite else None
                return loop.clip_grad_norm(float(max_norm), finish=finish, params=params)

            clip_grad_norm_._th_patched = True  # type: ignore[attr-defined]
            clip_grad.clip_grad_norm_ = clip_grad_norm_
            utils.clip_grad_norm_ = clip_grad_norm_
        by_value = clip_grad.clip_grad_value_
        if not getattr(by_value, "_th_patched", False):

            @functools.wraps(by_value)
            def clip_grad_value_(
                parameters: Any, clip_value: float, foreach: bool | None = None
            ) -> None:
                found = loop_of(parameters) if foreach is None else None
                if found is None:
                    return by_value(parameters, clip_value, foreach)
                loop, params = found
                loop.clip_grad_value(float(clip_value), params=params)
                return None

            clip_grad_value_._th_patched = True  # type: ignore[attr-defined]
            clip_grad.clip_grad_value_ = clip_grad_value_
            utils.clip_grad_value_ = clip_grad_value_
        if "accelerate" in sys.modules:
            _patch_accelerate()


def _patch_accelerate() -> None:
    import accelerate
    from accelerate.utils import DistributedType

    original = accelerate.Accelerator.clip_grad_norm_
    if getattr(original, "_th_patched", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: Any = 2) -> Any:
        single = self.distributed_type == DistributedType.NO
        found = loop_of(parameters, norm_type) if single else None
        if found is None:
            return original(self, parameters, max_norm, norm_type=norm_type)
        loop, params = found
        self.unscale_gradients()
        # As Accelerate computes it: its dtensor-aware path (torch.distributed available)
        # stacks the one group's total and takes its norm again; it skips an infinite
        # max_norm's scaling, which would multiply by 1.0.
        finish = _stacked if torch.distributed.is_available() else None
        clip = max_norm if not math.isinf(max_norm) else None
        return loop.clip_grad_norm(clip, finish=finish, params=params)

    clip_grad_norm_._th_patched = True  # type: ignore[attr-defined]
    accelerate.Accelerator.clip_grad_norm_ = clip_grad_norm_


_OPTIMIZER_PARAMETERS = optimizer_parameters.__code__

__all__ = ["loop_of", "optimizer_parameters", "patch_clip"]
