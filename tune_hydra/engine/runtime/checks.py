"""Errors that name the input at fault: a task's data, or its ``loss_fn``.

A layer that fails on a batch unlike the one the model was probed with, or a loss that
is not a scalar tensor, is the data's or the loss function's fault rather than the
model's. These functions turn such failures of a ``TaskLoop``'s batches into
:class:`~tune_hydra.exceptions.DataMismatchError` or
:class:`~tune_hydra.exceptions.InvalidLossError`, naming the batch and epoch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from tune_hydra.engine.registration.partition import layer_error
from tune_hydra.engine.task import ModelTask, describe, mismatch_hint
from tune_hydra.exceptions import (
    DataMismatchError,
    InvalidLossError,
    TuneHydraError,
)


def data_mismatch(
    name: str,
    layers: list[tuple[str, torch.nn.Module]],
    arg: Any,
    err: BaseException,
    where: str,
    probed: tuple[Any, str] | None,
) -> DataMismatchError | None:
    """The error to raise for ``err``, raised by the forward of the model's first layers
    (``layers``: names and modules of the first shard) on the batch inputs ``arg``, when
    the data can be told to be at fault (the layer's dtype or width, or a batch unlike the
    one ``probed``: its :func:`batch_signature` and description); ``None`` otherwise (it
    is raised as is)."""
    if _not_ours(err):
        return None
    by_id = {id(m): (n, m) for n, m in layers}
    found = None
    tb = err.__traceback__
    while tb is not None:  # the innermost frame of one of the shard's layers
        obj = tb.tb_frame.f_locals.get("self")
        hit = by_id.get(id(obj))
        if hit is not None and hit[1] is obj:
            found = hit
        tb = tb.tb_next
    if found is None:
        return None
    layer_name, module = found
    first = module is layers[0][1]
    hint = mismatch_hint(arg, module, shapes=first)
    unlike = probed is not None and batch_signature(arg) != probed[0]
    if not hint and not unlike:
        return None
    note = f"; the batch probed when the task was added: {probed[1]}" if probed and unlike else ""
    return layer_error(name, layer_name, module, arg, err, arg, where, note=note)


def backward_mismatch(
    name: str, err: BaseException, out: Any, target: Any, where: str
) -> DataMismatchError | None:
    """The error to raise for ``err`` from the loss's backward when the targets do not
    fit the output; ``None`` otherwise (it is raised as is)."""
    hint = "" if _not_ours(err) else _target_hint(out, target)
    if not hint:
        return None
    return DataMismatchError(
        name, f"the backward of the loss raised {_what(err)} on {where}: {hint}"
    )


def checked_loss(
    name: str, task: ModelTask, out: Any, target: Any, where: str, train: bool
) -> torch.Tensor:
    """Task ``name``'s loss (``task.compute_loss(out, target)``) on the batch ``where``
    names, checked to be a scalar tensor (that requires grad, in training).

    Raises:
        DataMismatchError: ``loss_fn`` failed on targets that do not fit the output.
        InvalidLossError: the loss is not a tensor, not a scalar, or (in training) does
            not require grad.
    """
    try:
        loss = task.compute_loss(out, target, name)
    except Exception as err:
        hint = "" if _not_ours(err) else _target_hint(out, target)
        if not hint:
            raise
        raise DataMismatchError(
            name, f"loss_fn(output, target) raised {_what(err)} on {where}: {hint}"
        ) from err
    if not isinstance(loss, torch.Tensor):
        raise InvalidLossError(
            name,
            f"loss_fn returned a {type(loss).__name__}, not a tensor, on {where}. Return the "
            f"loss tensor itself (not loss.item() or a number): the engine back-propagates it",
        )
    if loss.numel() != 1:
        raise InvalidLossError(
            name,
            f"loss_fn returned a tensor of shape {list(loss.shape)}, not a scalar, on "
            f"{where}. Reduce it to one number (loss.mean(), or reduction='mean': "
            f"reduction='none' gives one loss per sample)",
        )
    if train and not loss.requires_grad:
        raise InvalidLossError(
            name,
            f"loss_fn returned a tensor that does not require grad on {where}, so nothing "
            f"can be back-propagated. Compute it from the model's output, without "
            f".detach(), torch.no_grad() or a detour through numbers",
        )
    return loss


def _not_ours(err: BaseException) -> bool:
    """Errors passed on as they are: tune_hydra's own, and running out of memory."""
    return isinstance(err, (TuneHydraError, MemoryError, torch.OutOfMemoryError))


def _what(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def batch_signature(obj: Any) -> Any:
    """A batch's structure, dtypes and shapes but for the batch dimension (the last
    batch of an epoch may be smaller)."""
    flat, spec = tree_flatten(obj)
    return (
        str(spec),
        [(t.dtype, tuple(t.shape[1:])) if isinstance(t, torch.Tensor) else type(t) for t in flat],
    )


def _target_hint(out: Any, target: Any) -> str:
    """What about ``target`` does not fit ``out`` (batch size, floating dtype), or ``""``."""
    if not isinstance(out, torch.Tensor) or not isinstance(target, torch.Tensor):
        return ""
    shown = f"the model's output is {describe(out)}, the target {describe(target)}"
    if out.dim() and target.dim() and out.shape[0] != target.shape[0]:
        return (
            f"{shown}: a batch of {target.shape[0]} targets for {out.shape[0]} inputs. Give "
            f"every batch one target per input"
        )
    if out.is_floating_point() and target.is_floating_point() and out.dtype != target.dtype:
        o = str(out.dtype).removeprefix("torch.")
        return (
            f"{shown}: the targets are another dtype than the model's output. Convert them "
            f"(target.to(torch.{o}) in the data)"
        )
    return ""
