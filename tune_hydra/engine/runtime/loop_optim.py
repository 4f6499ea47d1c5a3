"""The user's optimizer of a ``th.shard`` loop, split per shard: :class:`LoopOptimizer`.

The user's optimizer is split per shard (same class, same hyperparameter groups, see
"optimizer" in :mod:`tune_hydra.engine.runtime.loop`); ``step()`` and ``zero_grad()`` are
recorded per shard and applied at the start of the shard's next op, each step with the
hyperparameters its groups had when ``step()`` was called. Groups added after the cut
are split the same way (:meth:`LoopOptimizer.follow_groups`), and leaving hands every
shard's state back to the user's optimizer (:meth:`LoopOptimizer.hand_back`).

Bringing the states home (the loop's ``sync``) runs ops, which the loop does: the methods
that need it take it as ``sync``.

Clipping (:meth:`LoopOptimizer.clip_grad_norm`) leaves every gradient where it is: each
shard's gradient norms are computed by an op on its device, the total norm from them as
``torch.nn.utils.clip_grad_norm_`` computes it (the same per-tensor norms, stacked in its
order), and the scaling is recorded per shard like a step (before it). Bringing every
state home instead would hold a whole task's state in host memory at once.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._foreach_utils import _has_foreach_support

from tune_hydra.core.ops import OpKind
from tune_hydra.engine.runtime.compiled import GATE as COMPILE_GATE
from tune_hydra.exceptions import OptimizerMismatchError, UnsupportedCallError

if TYPE_CHECKING:
    from tune_hydra.engine.runtime.loop import LoopShard


class LoopOptimizer:
    """The optimizer's part of one loop: records the user's ``step()`` and
    ``zero_grad()`` per shard, applies them at each shard's next op, and keeps the shards'
    optimizers following the user's.

    Args:
        shards: the loop's shards (their ``optimizer``, ``group_map``, ``zeroes`` and
            ``pending``).
        user_optimizer: the user's optimizer (``None``: the loop steps nothing).
        optimizer_class: the user's optimizer's class: a shard gets one of it when a
            group added after the cut (``add_param_group``) has parameters it steps.
    """

    def __init__(
        self,
        shards: list[LoopShard],
        user_optimizer: torch.optim.Optimizer | None,
        optimizer_class: type[torch.optim.Optimizer] | None,
    ) -> None:
        self._shards = shards
        self.user_optimizer = user_optimizer
        self.optimizer_class = optimizer_class
        # How many parameters each of the user's groups had when the shards' optimizers
        # last followed them (see follow_groups), and what its zero_grad() zeroes per shard.
        self._group_sizes = [
            len(g["params"]) for g in (user_optimizer.param_groups if user_optimizer else [])
        ]
        self._opt_zeroes: list[list[nn.Parameter]] = []
        self._note_optimizer_params()
        # Once the loop clips (clip_grad_norm), each backward op takes its shard's
        # gradient norms, so a clip after it needs no op of its own (a shard evicted
        # since its backward is not copied in again for them).
        self.clips = False
        self._owned: list[list[nn.Parameter]] | None = None

    def step(self, sync: Callable[[], None]) -> None:
        """Record an optimizer step for every shard, with the hyperparameters the user's
        param groups have now (``sync``: see :meth:`follow_groups`)."""
        assert self.user_optimizer is not None
        self.follow_groups(sync)
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.user_optimizer.param_groups
        ]
        for s in self._shards:
            if s.optimizer is not None:
                s.pending.append(("step", [groups[i] for i in s.group_map]))

    def clip_grad_norm(
        self,
        model: nn.Module,
        max_norm: float | None,
        run: Callable[[OpKind, int, Callable[[torch.device], Any]], Any],
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        params: Sequence[nn.Parameter] | None = None,
    ) -> torch.Tensor | None:
        """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (2-norm; ``params``
        ``None``: ``model.parameters()``, in their order) with the gradients left on their
        devices: each shard's norms by a step op of its own
        (``run``: the loop's; one op per shard, as a sync has), the scaling recorded
        with its pending work. ``finish``: what the caller's clipping does to the total
        before it scales (Accelerate's); ``max_norm`` ``None``: the norm only.

        Returns:
            The total norm, as ``clip_grad_norm_`` returns it; ``None`` if a parameter of
            ``model`` is in no shard (the caller clips at home instead).
        """
        found = self._by_shard(model, params)
        if found is None:
            return None
        given, mine = found
        self.clips = True
        norms: dict[int, torch.Tensor] = {}
        for index, ps in mine.items():
            s = self._shards[index]
            if ps and s.norms is not None and s.norms_at == s.ops and not s.pending:
                norms.update((id(p), s.norms[id(p)]) for p in ps if id(p) in s.norms)
            elif ps:
                norms.update(run(OpKind.STEP, index, functools.partial(_norms_op, ps)))
        # As torch's _get_total_norm: grouped by dtype (one device in plain training), in
        # order of first appearance, stacked on the first one's device.
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in given:
            if id(p) in norms:
                groups.setdefault(norms[id(p)].dtype, []).append(norms[id(p)])
        ordered = [n for ns in groups.values() for n in ns]
        if not ordered:
            return torch.tensor(0.0)
        first = ordered[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in ordered]), 2.0)
        if finish is not None:
            total = finish(total)
        _settle(total)  # the shards' ops read it on their devices' streams
        for index, ps in mine.items():
            if ps and max_norm is not None:
                self._shards[index].pending.append(("clip", (ps, max_norm, total)))
        return total

    def clip_grad_value(
        self, model: nn.Module, clip_value: float, params: Sequence[nn.Parameter] | None
    ) -> bool:
        """``torch.nn.utils.clip_grad_value_(params, clip_value)`` (``None``:
        ``model.parameters()``) recorded for each shard's next op, before its step: a
        clamp of each gradient, the same numbers shard by shard. False (nothing recorded)
        if a parameter is in no shard."""
        found = self._by_shard(model, params)
        if found is None:
            return False
        for index, ps in found[1].items():
            if ps:
                self._shards[index].pending.append(("clamp", (ps, clip_value)))
        return True

    def _by_shard(
        self, model: nn.Module, params: Sequence[nn.Parameter] | None
    ) -> tuple[list[nn.Parameter], dict[int, list[nn.Parameter]]] | None:
        """``params`` (``None``: the model's, in its order) and, by shard index, those
        whose gradient each shard holds whole, in their order; ``None`` if one is in no
        shard."""
        owned = self._owned_params()
        owner = {id(p): s.index for s, ps in zip(self._shards, owned, strict=True) for p in ps}
        # torch's own named_parameters, not a sharded model's (a sync)
        given = [p for _, p in nn.Module.named_parameters(model)] if params is None else params
        if any(id(p) not in owner for p in given):
            return None
        mine: dict[int, list[nn.Parameter]] = {s.index: [] for s in self._shards}
        for p in given:
            mine[owner[id(p)]].append(p)
        return list(given), mine

    def _owned_params(self) -> list[list[nn.Parameter]]:
        """Each shard's parameters whose gradient it holds whole: a parameter two shards
        share is its first shard's."""
        if self._owned is None:
            seen: set[int] = set()
            self._owned = []
            for s in self._shards:
                ps = [p for p in s.module.parameters() if id(p) not in seen]
                seen.update(id(p) for p in ps)
                self._owned.append(ps)
        return self._owned

    def take_norms(self, shard: LoopShard) -> None:
        """After a backward op of ``shard`` (its compute, on its device), once the loop
        clips: the norms of the gradients it holds, for a clip before its next op."""
        if self.clips:
            shard.norms = _grad_norms(self._owned_params()[shard.index])
            shard.norms_at = shard.ops

    def zero_grad(self, set_to_none: bool, optimizer: bool, sync: Callable[[], None]) -> None:
        """Record ``zero_grad`` for every shard (applied at its next op, or by sync): of
        every parameter (the model's), or with ``optimizer`` of the user's optimizer's
        parameters only (``sync``: see :meth:`follow_groups`)."""
        if optimizer:
            self.follow_groups(sync)
        for i, s in enumerate(self._shards):
            params = self._opt_zeroes[i] if optimizer else s.zeroes
            s.pending.append(("zero", (set_to_none, params)))

    def _note_optimizer_params(self) -> None:
        """Which gradients the user's ``optimizer.zero_grad()`` zeroes, per shard."""
        user = self.user_optimizer
        ids = {id(p) for g in user.param_groups for p in g["params"]} if user else set()
        self._opt_zeroes = [[p for p in s.zeroes if id(p) in ids] for s in self._shards]

    def follow_groups(self, sync: Callable[[], None]) -> None:
        """Give the shards' optimizers the param groups the user's optimizer gained since
        they last followed it (``add_param_group`` after the cut: gradual unfreezing),
        each parameter in the shard that steps it (a shard without an optimizer gets one
        like the user's). The steps recorded before are applied first, with the groups
        they were recorded with, by ``sync`` (the loop's: it runs them as ops and brings
        every state home).

        Raises:
            UnsupportedCallError: a group was removed, or parameters were added to or
                removed from a group in place (``param_groups[i]["params"]``).
            OptimizerMismatchError: an added group has a parameter that is not the
                model's.
        """
        user = self.user_optimizer
        if user is None:
            return
        groups = user.param_groups
        sizes = self._group_sizes
        if len(groups) == len(sizes) and all(
            len(g["params"]) == n for g, n in zip(groups, sizes, strict=True)
        ):
            return  # the common case: one cheap check per step
        if len(groups) < len(sizes):
            raise UnsupportedCallError(
                f"{len(sizes) - len(groups)} param group(s) were removed from the optimizer "
                f"of a sharded model: its shards' optimizers cannot follow that. Keep the "
                f"groups and set their lr to 0 to stop stepping them, or build a new "
                f"optimizer before th.shard"
            )
        edited = [i for i, n in enumerate(sizes) if len(groups[i]["params"]) != n]
        if edited:
            raise UnsupportedCallError(
                f"param_groups[{edited[0]}]['params'] of a sharded model's optimizer was "
                f"changed in place: its shards' optimizers cannot follow that. Put new "
                f"parameters in a group of their own with optimizer.add_param_group"
                f"({{'params': ...}})"
            )
        owner: dict[int, LoopShard] = {}
        for s in self._shards:  # a shared parameter's lowest-index user steps it
            for p in s.module.parameters():
                owner.setdefault(id(p), s)
        foreign = [p for g in groups[len(sizes) :] for p in g["params"] if id(p) not in owner]
        if foreign:
            raise OptimizerMismatchError(
                f"an added param group has {len(foreign)} parameter(s) that are not the "
                f"sharded model's (the first of shape {list(foreign[0].shape)}); add only "
                f"this model's parameters"
            )
        sync()  # the steps recorded so far step the groups as they were
        cls = self.optimizer_class or type(user)
        for gi in range(len(sizes), len(groups)):
            hyper = {k: v for k, v in groups[gi].items() if k != "params"}
            for s in self._shards:
                ps = [p for p in groups[gi]["params"] if owner[id(p)] is s]
                if not ps:
                    continue
                if s.optimizer is None:
                    s.optimizer = optimizer_like(user, cls, [{**hyper, "params": ps}])
                    for part in s.store.parts():  # its own store, and those it steps
                        if part.name[1] == s.index:
                            part.optimizer = s.optimizer
                else:
                    s.optimizer.add_param_group({**hyper, "params": ps})
                s.group_map.append(gi)
        self._group_sizes = [len(g["params"]) for g in groups]
        self._note_optimizer_params()

    def apply_pending(self, shard: LoopShard) -> None:
        """Apply what ``shard``'s ``step()`` and ``zero_grad()`` recorded, in order (at
        the start of its op, its state on the op's device)."""
        pending = shard.pending
        while pending:
            # Taken off first: a step that raises is raised once (at this op), not again
            # at every later one, and one applied is never applied twice.
            what, arg = pending.pop(0)
            if what == "clip":
                params, max_norm, total = arg
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
            elif what == "clamp":
                params, clip_value = arg
                torch.nn.utils.clip_grad.clip_grad_value_(params, clip_value)
            elif what == "zero":
                set_to_none, params = arg
                for p in params:
                    if p.grad is None:
                        continue
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_()
                        p.grad.zero_()
            else:
                opt = shard.optimizer
                assert opt is not None
                for group, hyper in zip(opt.param_groups, arg, strict=True):
                    group.update(hyper)
                # Not while another thread compiles: torch.optim reads the process-wide
                # torch.compiler.is_compiling() and rounds otherwise then (see GATE).
                with COMPILE_GATE.running():
                    opt.step()
                shard.steps += 1

    def load_state(self, sync: Callable[[], None]) -> None:
        """Move the state the user's optimizer holds (after its ``load_state_dict``) into
        the shards' optimizers (``sync``: see :meth:`follow_groups`)."""
        opt = self.user_optimizer
        assert opt is not None
        self.follow_groups(sync)
        for s in self._shards:
            if s.optimizer is None:
                continue
            for group in s.optimizer.param_groups:
                for p in group["params"]:
                    s.optimizer.state.pop(p, None)
                    if p in opt.state:
                        s.optimizer.state[p] = opt.state[p]
        opt.state = collections.defaultdict(dict)

    def state(self) -> dict[Any, Any]:
        """Every shard optimizer's per-parameter state, keyed by parameter."""
        state: dict[Any, Any] = {}
        for s in self._shards:
            if s.optimizer is not None:
                state.update(s.optimizer.state)
        return state

    def hand_back(self) -> None:
        """The shards' optimizers' state (at home) into the user's optimizer."""
        user = self.user_optimizer
        if user is None:
            return
        for s in self._shards:
            if s.optimizer is None:
                continue
            # A state in the disk tier is views of its spill file, which leaving removes.
            disk = any(part.on_disk for part in s.store.parts())
            for p, st in s.optimizer.state.items():
                user.state[p] = {
                    k: v.clone() if disk and isinstance(v, torch.Tensor) else v
                    for k, v in st.items()
                }


def _grad_norms(params: list[nn.Parameter]) -> dict[int, torch.Tensor]:
    """The 2-norm of each of ``params``' gradients (by id; those without one left out),
    each computed as ``clip_grad_norm_`` computes it (``torch._foreach_norm`` where torch
    has it for the device and dtype; a tensor's norm does not depend on the others in
    the list): an op's compute, on the gradients' device."""
    grads = [(p, p.grad) for p in params if p.grad is not None]
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[nn.Parameter, torch.Tensor]]] = {}
    for p, g in grads:
        groups.setdefault((g.device, g.dtype), []).append((p, g))
    norms: dict[int, torch.Tensor] = {}
    for (device, _), pairs in groups.items():
        tensors = [g for _, g in pairs]
        if _has_foreach_support(tensors, device):
            found = list(torch._foreach_norm(tensors, 2.0))
        else:
            found = [torch.linalg.vector_norm(g, 2.0) for g in tensors]
        norms.update({id(p): n for (p, _), n in zip(pairs, found, strict=True)})
        _settle(found[0])  # computed on the op's stream, read on the user's thread
    return norms


def _norms_op(params: list[nn.Parameter], device: torch.device) -> dict[int, torch.Tensor]:
    return _grad_norms(params)


def _settle(t: torch.Tensor) -> None:
    """Wait for the current stream of ``t``'s device, a GPU's (its result is read on
    another stream next)."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


def optimizer_like(
    user: torch.optim.Optimizer | None,
    cls: type[torch.optim.Optimizer],
    groups: list[dict[str, Any]],
) -> torch.optim.Optimizer:
    """An optimizer of ``cls`` over ``groups`` with the user's defaults (and whatever else
    its constructor set), without running ``cls.__init__`` (whose keywords vary by class)."""
    opt = cls.__new__(cls)
    defaults = dict(user.defaults) if user is not None else {}
    torch.optim.Optimizer.__init__(opt, groups, defaults)
    if user is not None:
        for k, v in vars(user).items():
            # Not a method wrapped on the instance (an lr scheduler wraps ``step``: it would
            # call the user's sharded step from the shard's).
            if k not in vars(opt) and not k.startswith("_th_") and not callable(v):
                setattr(opt, k, v)
    return opt


__all__ = ["LoopOptimizer", "optimizer_like"]
