"""The user's autocast, carried to the engine threads that run a loop's shard ops.

``torch.autocast`` is thread-local: a forward the user's thread runs under it becomes
shard ops on the engine's device threads, where nothing is enabled, so without this the
sharded loop would silently compute in full precision. A loop takes the state where each
op is asked for and enters it around the op:

- a forward (or evaluation) op: the user's thread's state at ``model(x)``;
- a backward op: the state of autograd's thread, which holds what ``loss.backward()`` was
  called under (autograd carries it to its threads), as plain autograd's ops see it;
- a recomputing backward: the *forward's* state for the recompute, then the backward's
  for the back-propagation, as ``torch.utils.checkpoint`` does.

Entering a state also disables what the running thread has enabled beyond it, so a
recompute sees exactly the forward's. The weight-cast cache lives for one op (each op
exits its autocast); a cast is deterministic, so values equal plain PyTorch's, whose cache
lives until the user's ``autocast`` exits.

Example:
    >>> import torch
    >>> from tune_hydra.engine.runtime import amp
    >>> amp.current() is None
    True
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     state = amp.current()
    >>> print(state)
    autocast(cpu=torch.bfloat16)
    >>> with amp.entered(state):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from tune_hydra.exceptions import UnsupportedPrecisionError

log = logging.getLogger(__name__)
_PATCH_LOCK = threading.Lock()

# The device types whose autocast a loop carries (the engine's devices are CPUs and GPUs).
DEVICE_TYPES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Autocast:
    """An autocast state: the device types enabled, each with its dtype, and whether the
    weight-cast cache is on."""

    enabled: tuple[tuple[str, torch.dtype], ...]
    cache: bool = True

    def dtype(self, device_type: str) -> torch.dtype | None:
        """The dtype ``device_type``'s ops are autocast to; ``None`` if not enabled."""
        return dict(self.enabled).get(device_type)

    def __str__(self) -> str:
        inner = ", ".join(f"{t}={d}" for t, d in self.enabled)
        return f"autocast({inner}{'' if self.cache else ', cache=False'})"


def current() -> Autocast | None:
    """This thread's autocast state; ``None`` where no device type is enabled (the
    common case: one cheap check a device type)."""
    on = tuple(
        (t, torch.get_autocast_dtype(t)) for t in DEVICE_TYPES if torch.is_autocast_enabled(t)
    )
    if not on:
        return None
    return Autocast(on, torch.is_autocast_cache_enabled())


def check_device(state: Autocast | None, device: torch.device) -> None:
    """Raise where ``state`` would not reach ops on ``device``: the user asked for mixed
    precision, the engine runs the shard where that autocast has no effect.

    Raises:
        UnsupportedPrecisionError: autocast is enabled, but not for ``device``'s type.
    """
    if state is None or state.dtype(device.type) is not None:
        return
    asked = ", ".join(f"torch.autocast({t!r}, dtype={d})" for t, d in state.enabled)
    raise UnsupportedPrecisionError(
        f"the model's shards run on {device.type} devices, where {asked} has no effect: "
        f"the sharded forward would compute in full precision. Enter "
        f"torch.autocast({device.type!r}, dtype=...) around the forward (the engine's "
        f"devices are {device.type}), or give th.configure(devices=...) the device type "
        f"the autocast is for"
    )


@contextlib.contextmanager
def entered(state: Autocast | None) -> Iterator[None]:
    """This thread under ``state``: its device types enabled with their dtypes, every
    other type this thread has enabled disabled for the block."""
    want = dict(state.enabled) if state is not None else {}
    on = [t for t in DEVICE_TYPES if t in want or torch.is_autocast_enabled(t)]
    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for t in on:
            if t in want:
                assert state is not None
                stack.enter_context(torch.autocast(t, dtype=want[t], cache_enabled=state.cache))
            else:
                stack.enter_context(torch.autocast(t, enabled=False))
        yield


def patch_grad_scaler() -> None:
    """Let ``torch.amp.GradScaler`` see a sharded optimizer's gradients (idempotent).

    The scaler reads ``param.grad`` of the optimizer's parameters in the user's thread
    (``unscale_``, and the inf check of ``step``); a sharded model's gradients are the
    shards' until they are brought home. Before it reads them, an optimizer with a
    ``_th_sync_grads`` method (a sharded one) brings them home and marks them written
    (the scaler unscales them in place); other optimizers are untouched. Sharded
    optimizers report ``_step_supports_amp_scaling`` false, so the scaler always unscales
    through this path (never hands a fused step its scale: the shards' steps would not
    see it).
    """
    scaler = torch.amp.GradScaler
    with _PATCH_LOCK:
        original = scaler.__dict__.get("_unscale_grads_")
        if original is None:
            log.warning(
                "torch.amp.GradScaler has no _unscale_grads_ in this torch version: a "
                "GradScaler over a sharded optimizer would read gradients that are not "
                "home; call model.parameters() before scaler.unscale_/step"
            )
            return
        if getattr(original, "_th_patched", False):
            return

        @functools.wraps(original)
        def _unscale_grads_(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            sync = getattr(optimizer, "_th_sync_grads", None)
            if sync is not None:
                sync()
            return original(self, optimizer, *args, **kwargs)

        _unscale_grads_._th_patched = True  # type: ignore[attr-defined]
        scaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]


__all__ = ["DEVICE_TYPES", "Autocast", "check_device", "current", "entered", "patch_grad_scaler"]
