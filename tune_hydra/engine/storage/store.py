"""The shard store: a shard's state lives in a storage tier and visits a device to run.

A :class:`ShardStore` owns one shard's parameters, gradients, buffers and optimizer
state. ``promote(device)`` copies them onto the device and points the live
``nn.Parameter`` objects at the copies (so the optimizer, keyed by parameter, keeps
working); ``demote()`` copies them back into the tier's host buffers, allocated once (and
pinned, with CUDA) and reused on every visit. Round trips are bitwise exact. A visit
that changed nothing (see :meth:`ShardStore.begin_op`) is not copied back: the device
copy is dropped and the host buffers (or the disk tier's file) keep the values.

With CUDA, copies run on a caller-supplied copy stream and are ordered against compute
with events; on the CPU they are plain synchronous copies (or skipped entirely when the
"device" is the host itself and ``copy=False``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from tune_hydra.core.ops import OpKind
from tune_hydra.engine.frozen import address, alias, checksum
from tune_hydra.engine.storage.disk import SpillFile
from tune_hydra.engine.storage.residency import Residency, ShardResidency
from tune_hydra.engine.storage.tiers import HostTier, Key, PinnedHostTier, StorageTier
from tune_hydra.exceptions import FrozenTensorModifiedError, SpillReadError

if TYPE_CHECKING:
    from tune_hydra.engine.frozen import FrozenRef


class HostAccount(Protocol):
    """What a store tells the engine's host memory manager (``tune_hydra.engine.host``).

    The store calls it under its own lock; the manager never waits on a store's lock
    while holding its own (it only *tries* other stores' locks to spill them).
    """

    def reserve(self, store: ShardStore, nbytes: int, *, speculative: bool = False) -> bool:
        """Count ``nbytes`` of ``store`` in host memory, spilling colder stores to disk
        first if they would not fit. ``speculative``: only stores colder than ``store``
        may go, and if that is not enough nothing is counted and ``False`` is returned."""
        ...

    def release(self, store: ShardStore) -> None:
        """``store``'s host buffers were freed."""
        ...

    def busy(self, store: ShardStore) -> bool:
        """Whether an op assigned to a device uses ``store`` (it must not be spilled)."""
        ...

    def note_io(self, store: ShardStore, op: str, nbytes: int, start: float) -> None:
        """``op`` (``"to_disk"`` or ``"from_disk"``) moved ``nbytes`` since ``start``
        (``time.perf_counter()``)."""
        ...

    def note_wait(self, store: ShardStore, owner: object, start: float) -> None:
        """``owner`` (a worker) waited for ``store``'s disk read since ``start``."""
        ...


def _param_shaped(value: Any) -> bool:
    # Optimizer scalars (Adam's "step") stay on the host, as torch keeps them there unless
    # the optimizer is capturable/fused.
    return isinstance(value, torch.Tensor) and value.dim() > 0


class ShardStore:
    """Home of one shard's tensors in a storage tier, with promote/demote to a device.

    Args:
        modules: the shard's modules (their parameters and buffers move).
        optimizer: the shard's optimizer (its param-shaped state moves), may be set later.
        pin: keep the host buffers in pinned memory (CUDA only; ignored without CUDA or
            when ``tier`` is given).
        name: ``(task, shard)``, for the trace of its copies.
        footprint: the plan's ``(state_bytes, activation_bytes)`` of the shard, which the
            device workers keep within the device budget.
        tier: where the host buffers live (default: a :class:`PinnedHostTier` if ``pin``
            and CUDA, else a :class:`HostTier`, whose buffers start as the model's own
            tensors).
        params: the parameters to hold, if not every parameter of ``modules`` (a
            parameter several shards share has a store of its own, see
            :class:`~tune_hydra.engine.storage.linked.LinkedStore`).
        host: the engine's host memory manager, with a disk tier below host memory
            (``None``: host memory is unlimited, nothing goes to disk).
        spill_file: the file of the disk tier this store spills to (with ``host``).
    """

    def __init__(
        self,
        modules: list[nn.Module],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        pin: bool = False,
        name: tuple[str, int] = ("", -1),
        footprint: tuple[int, int] = (0, 0),
        tier: StorageTier | None = None,
        params: list[nn.Parameter] | None = None,
        host: HostAccount | None = None,
        spill_file: SpillFile | None = None,
    ) -> None:
        self.name = name
        self.state_bytes, self.activation_bytes = footprint
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for p in params if params is not None else (p for m in modules for p in m.parameters()):
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.buffer_slots: list[tuple[nn.Module, str]] = [
            (sub, name)
            for m in modules
            for sub in m.modules()
            for name, b in sub._buffers.items()
            if b is not None
        ]
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_hook: Any = None
        self._tracked = True  # whether its optimizer's steps are seen (see begin_op)
        self.optimizer = optimizer
        if tier is None:
            tier = PinnedHostTier() if pin and torch.cuda.is_available() else HostTier()
        self._tier = tier
        self._residency = ShardResidency()
        self.last_nbytes = 0  # nbytes() at the last promotion
        self.moved_total = 0  # bytes copied host<->device over the store's life
        self._event: Any = None  # CUDA event after the last demote (host buffers valid)
        # Gradients set aside while a shared parameter's uses in other shards add up theirs
        # (see stash_grad): moved with the rest of the state.
        self._stash: dict[int, torch.Tensor] = {}
        self.lock = threading.RLock()  # promote/demote may come from two devices' threads
        self.host = host
        self.spill_file = spill_file
        self._file_valid = False  # the file holds the current values (loaded, untouched)
        # On a device: the tier's host buffers still hold the values it was copied from,
        # and nothing changed them on the device (see begin_op): demoting drops the copy.
        self._host_copy = False
        # The live tensors' (key, data pointer, version) when last known unchanged, while
        # a host copy or the file is still valid (None: nothing to keep): a change no op
        # announced (a module writing a buffer in eval) shows here.
        self._sig: tuple[tuple[Any, ...], ...] | None = None
        # An op announced itself read-only since the promotion (begin_op): a visit no op
        # vouched for (a lease whose user said nothing) counts as a change.
        self._vouched = False
        self._loading = False  # a disk read is under way (a promotion waiting counts it)
        # Parameters whose host tensor is a frozen pool's, shared with other tasks (see
        # share_frozen): outside the store's own state (never counted, copied back or
        # spilled with it); each with the shared tensor it points at now (the pool's host
        # tensor or device copy: the parameter holds a copy-on-write alias of it where
        # torch can make one, see frozen.alias) and its version then.
        self._frozen: dict[int, FrozenRef] = {}
        self._frozen_live: dict[int, tuple[torch.Tensor, int]] = {}
        # A change found as a slot was re-pointed (promotion, demotion) that wrote the
        # shared tensor itself: raised at the next check.
        self._frozen_bad: dict[int, str] = {}
        self._frozen_dev: dict[int, tuple[str, int]] = {}  # its pool device copy's key
        for key, t in list(self._live()):
            home = tier.keep(key, t)
            if home is not t:
                self._set(key, home)
        tier.flush()
        # The live tensors' identities when they were last pointed at the tier's buffers
        # (None: the tier was cleared since).
        self._home: tuple[tuple[Any, ...], ...] | None = self._identity()

    def host_charge(self) -> int:
        """Host bytes this state takes in RAM: the plan's state bytes (gradients and
        optimizer state appear while it trains), or more if it holds more now; shared
        frozen tensors are the frozen pool's (counted once, there)."""
        return max(self.state_bytes - self.frozen_bytes(), self.nbytes())

    # -- frozen tensors shared across tasks (tune_hydra.engine.frozen) --------------------

    def frozen_bytes(self) -> int:
        """Bytes of the parameters whose host tensor is a frozen pool's."""
        return sum(r.entry.nbytes for r in self._frozen.values())

    @property
    def shared_parts(self) -> tuple[tuple[object, int], ...]:
        """The frozen pool's tensors inside :attr:`state_bytes`, as ``(key, bytes)``: one
        device copy serves every resident shard using them, so the device ledger counts
        each once (``tune_hydra.core.ledger.state_of``). Empty if they would exceed the
        plan's state bytes (then counted as the plan says: conservative)."""
        return shared_parts([self], self.state_bytes)

    @property
    def frozen(self) -> dict[int, FrozenRef]:
        """Parameter index -> its reference into the frozen pool."""
        return self._frozen

    def share_frozen(self, index: int, ref: FrozenRef) -> None:
        """Point parameter ``index`` (frozen, at home) at the pool's tensor ``ref.entry.host``
        and leave it out of the store's own state from now on."""
        with self.lock:
            assert self._residency.state is Residency.HOST, "shared at registration only"
            p = self.params[index]
            p.data = alias(ref.entry.host)
            self._frozen[index] = ref
            self._frozen_live[index] = (ref.entry.host, p._version)
            self._tier.drop(("p", index))
            self._home = self._identity()

    def leave_frozen(self) -> None:
        """The task leaves: drop every reference into the pool (see ``FrozenPool.release``;
        the state is at home)."""
        with self.lock:
            for i, ref in list(self._frozen.items()):
                self._frozen_home(i)
                del self._frozen[i]
                self._frozen_live.pop(i, None)
                self._frozen_bad.pop(i, None)
                ref.pool.release(ref, self.params[i])

    def check_frozen(
        self, when: str, *, values: bool = False, during: bool = False, settle: bool = False
    ) -> None:
        """Whether the shared frozen parameters are as the store left them (see the
        module docstring of ``tune_hydra.engine.frozen``); ``values``: their values too
        (a checksum: one pass over each, where it is).

        A slot only this task uses that changed becomes its own (:meth:`_unshare`). One
        other tasks use too: if the write reached only this task's copy-on-write alias
        (its tensor is at another address now: the shared tensor and the others' aliases
        are untouched) and was made between ops (``during`` false: the user's thread,
        ``merge_adapter()``), the task's tensor becomes its own, with its written values,
        and it goes on as plain PyTorch does (:meth:`_take_own`; equal values, as after a
        ``data_ptr()`` that copied it, are shared again). Otherwise the task fails alone:
        a change by its op (``during``: a recomputed forward would repeat it), unfreezing,
        a gradient, or a write into the shared tensor itself (no alias: a CUDA device
        copy, a view of the disk tier; a device copy is repaired from the host tensor
        first, so the tasks resident with it do not read the write).

        Args:
            settle: never raise (a promotion or demotion re-points the slots): a failing
                change is kept for the next check to raise.

        Raises:
            FrozenTensorModifiedError: one another task also uses was changed.
        """
        for i, ref in list(self._frozen.items()):
            pending = self._frozen_bad.get(i)
            what = pending or self._frozen_change(i, values)
            if what is None:
                continue
            p = self.params[i]
            shared = self._frozen_live[i][0]
            isolated = pending is None and (
                address(p.data) != address(shared)
                or p.data.shape != shared.shape
                or p.data.dtype != shared.dtype
            )
            if (
                isolated
                and not p.requires_grad
                and p.grad is None
                and p.data.shape == shared.shape
                and p.data.dtype == shared.dtype
                and p._version == self._frozen_live[i][1]
                and torch.equal(p.data, shared)
            ):  # copied by a pointer request (data_ptr(), numpy()), not written
                p.data = alias(shared)
                self._frozen_live[i] = (shared, p._version)
                continue
            others = ref.pool.others(ref)
            if not others:
                self._frozen_bad.pop(i, None)
                self._unshare(i)
                continue
            if isolated and not during and not p.requires_grad and p.grad is None:
                self._take_own(i)
                continue
            if pending is None:
                what = f"{what} {when}"
                if not isolated:
                    # A device copy other resident tasks use gets its values back before
                    # their next op (a device runs one op at a time).
                    ref.pool.repair(ref.entry, shared)
            if settle:
                self._frozen_bad[i] = what
                continue
            self._frozen_bad.pop(i, None)
            raise FrozenTensorModifiedError(ref.task, ref.name, what, others)

    def _frozen_change(self, i: int, values: bool) -> str | None:
        p = self.params[i]
        live, version = self._frozen_live[i]
        if p.requires_grad:
            return "unfrozen (requires_grad=True)"
        if p.grad is not None:
            return "given a gradient"
        t = p.data
        if p._version != version:
            return "written in place"
        # Not data_ptr(): a pool tensor is copy-on-write (the tasks' aliases, a finished
        # task's model share it), and asking for a writable pointer would copy it.
        if address(t) != address(live) or t.shape != live.shape or t.dtype != live.dtype:
            # A write through .data into the task's alias copied it (moving no version
            # counter), or the user's thread set .data.
            return "replaced or written through .data"
        if values and checksum(t) != self._frozen[i].entry.checksum:
            return "written in place through .data"
        return None

    def _unshare(self, i: int) -> None:
        """Parameter ``i`` changed, and no other task uses its entry: it becomes the
        store's own again (as if never shared), the entry leaves the pool."""
        with self.lock:
            ref = self._frozen.pop(i)
            shared, _ = self._frozen_live.pop(i)
            self._frozen_bad.pop(i, None)
            key = self._frozen_dev.pop(i, None)
            if key is not None:  # its device copy is the store's own now
                ref.pool.off_device(ref.entry, key)
            p = self.params[i]
            if address(p.data) == address(shared):  # the tensor itself, not an alias of it
                p.data = shared
            if self._residency.state is not Residency.DEVICE:
                # At home (or in place): its tensor is the entry's, now the store's own
                # (released first: one the pool had on disk is read into RAM for it).
                ref.pool.release(ref, p, keep=True)
                self._tier.keep(("p", i), p.data)
            else:
                # On a device: the entry's tensor is its host buffer, filled at demotion
                # (a RAM copy of one on disk: the store writes its buffer).
                host = ref.entry.host
                self._tier.keep(("p", i), host.clone() if ref.entry.on_disk else host)
                self._changed()
                ref.pool.release(ref, p, keep=True)
            self._home = None
            self._changed()

    def _take_own(self, i: int) -> None:
        """Parameter ``i`` was written between ops into the task's own copy-on-write
        alias (now a private tensor, see :meth:`check_frozen`) while other tasks use its
        entry: that tensor becomes the store's own state, the others keep the entry."""
        with self.lock:
            ref = self._frozen.pop(i)
            self._frozen_live.pop(i, None)
            self._frozen_bad.pop(i, None)
            key = self._frozen_dev.pop(i, None)
            if key is not None:  # the shared device copy stays the others'
                ref.pool.off_device(ref.entry, key)
            p = self.params[i]
            ref.pool.release(ref, p)  # p.data is at another address: left as it is
            if self._residency.state is not Residency.DEVICE:
                self._tier.keep(("p", i), p.data)
            # (On a device its host buffer is allocated at the demotion, which copies it.)
            self._home = None
            self._changed()

    def own_frozen(self, index: int) -> None:
        """Shared parameter ``index`` (at home) leaves the pool for the store's own state,
        before the user's thread writes other values into it (``load_state_dict`` on a
        ``th.shard`` model): with a private copy while other tasks use its entry."""
        with self.lock:
            assert self._residency.state is not Residency.DEVICE, "at home only"
            ref = self._frozen.pop(index)
            self._frozen_live.pop(index, None)
            p = self.params[index]
            ref.pool.release(ref, p, keep=not ref.pool.others(ref))
            self._tier.keep(("p", index), p.data)
            self._home = None
            self._changed()

    def frozen_rewritten(self, index: int) -> None:
        """The user's thread wrote shared parameter ``index`` (at home) with the values it
        had (``load_state_dict`` of a checkpoint of the same base): only its version counter
        moved, which the next op's check must not take for a change."""
        with self.lock:
            live, _ = self._frozen_live[index]
            p = self.params[index]
            if address(p.data) != address(live):  # the write copied its alias: share again
                p.data = alias(live)
            self._frozen_live[index] = (live, p._version)

    def frozen_moved(self, index: int) -> None:
        """The pool moved shared parameter ``index``'s entry (to a view of its spill file,
        or back into RAM): point the parameter at its tensor now (the store is at home;
        the caller holds its lock)."""
        ref = self._frozen[index]
        if self._residency.state is Residency.DEVICE:
            return  # its device copy stays; its demotion points it at the entry's tensor
        if self._frozen_live[index][0] is not ref.entry.host:
            self._point_frozen(index, ref.entry.host)

    def _point_frozen(self, i: int, shared: torch.Tensor) -> None:
        """Point shared parameter ``i`` at (an alias of) ``shared``, unless the task wrote
        its alias since the last check (the next check takes that tensor as the task's
        own): the slot now refers to ``shared``, its version as it was."""
        p = self.params[i]
        live, version = self._frozen_live[i]
        if i not in self._frozen_bad and address(p.data) != address(live):
            self._frozen_live[i] = (shared, version)
            return
        p.data = alias(shared)
        self._frozen_live[i] = (shared, version if i in self._frozen_bad else p._version)

    def _frozen_ready(self) -> list[Any]:
        """Before a visit: the shared entries pinned (not spilled during it) and in host
        memory (read back once from the pool's spill file if they were on disk), the
        parameters pointed at them. Returns the entries, to unpin after the promotion.

        Raises:
            SpillReadError: an entry cannot be read back (unpinned again)."""
        entries = [ref.entry for ref in self._frozen.values()]
        if not entries:
            return entries
        pool = next(iter(self._frozen.values())).pool
        pool.pin(entries, 1)
        try:
            for i, ref in self._frozen.items():
                if ref.entry.on_disk:
                    pool.load(ref.entry, self)
                self.frozen_moved(i)
        except BaseException:
            pool.pin(entries, -1)
            raise
        return entries

    def host_frozen_pinned(self, entries: list[Any], delta: int) -> None:
        """Unpin ``entries`` (see :meth:`_frozen_ready`)."""
        if entries:
            next(iter(self._frozen.values())).pool.pin(entries, delta)

    @property
    def at_home(self) -> bool:
        """Whether no device holds copies of the live tensors (at home, on disk, or lent
        in place to a CPU device: not in use unless busy, see ``HostAccount.busy``)."""
        return self._residency.state is not Residency.DEVICE

    def _frozen_home(self, i: int) -> None:
        ref = self._frozen[i]
        key = self._frozen_dev.pop(i, None)
        if key is not None:
            ref.pool.off_device(ref.entry, key)
        self._point_frozen(i, ref.entry.host)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The shard's optimizer (its param-shaped state moves with the shard)."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._optimizer = optimizer
        register = getattr(optimizer, "register_step_pre_hook", None)
        self._tracked = optimizer is None or register is not None
        if register is not None:
            self._step_hook = register(_changed_by_step(weakref.ref(self)))
        if not self._tracked:
            self._changed()

    # -- did a visit change the state? ----------------------------------------------------

    def begin_op(self, kind: OpKind) -> None:
        """An op of ``kind`` is about to compute with the live tensors (whoever computes
        with them says so first, under the op's busy mark). An eval, or a forward of a
        shard without buffers, leaves the state as it was; any other op (a forward in
        train mode updating BatchNorm statistics, a backward writing gradients, a step)
        changes it: its host copy and file are stale from here on. An optimizer step
        during any op (a deferred one, at the start of a visit) is seen through a step
        hook; :meth:`end_op` checks the rest.

        Raises:
            FrozenTensorModifiedError: a frozen tensor shared with other tasks was changed
                since the last op.
        """
        if self._frozen:
            self.check_frozen(f"before its {kind.value} of shard {self.name[1]}")
        if kind is OpKind.EVAL or (kind is OpKind.FORWARD and not self.buffer_slots):
            self._vouched = self._sig is not None
            return
        self._changed()

    def end_op(self, failed: bool = False) -> None:
        """The op begun with :meth:`begin_op` ended (``failed``: it raised; whatever it
        did counts as a change). A read-only op that replaced or wrote into a live tensor
        anyway (a user module writing a buffer in eval) makes the state changed.

        Raises:
            FrozenTensorModifiedError: the op changed a frozen tensor shared with other
                tasks (the op's task fails; the others' copies are untouched).
        """
        if failed:
            self._changed()
            return
        if self._frozen:
            self.check_frozen(f"by an op on shard {self.name[1]}", values=True, during=True)
        if self._sig is not None:
            with self.lock:
                if self._sig is not None and self._signature() != self._sig:
                    self._changed()

    def _changed(self) -> None:
        """The live values differ from the host copy's and the file's (if any)."""
        self._file_valid = False
        self._host_copy = False
        self._sig = None
        self._vouched = False

    def _unchanged(self) -> bool:
        """Whether the visit since the promotion left the state as it was: every op said
        so (at least one did) and no live tensor was replaced or written in place."""
        return self._vouched and self._sig is not None and self._signature() == self._sig

    def _signature(self) -> tuple[tuple[Any, ...], ...]:
        # A parameter's .data is a new tensor with a version counter of its own: the
        # parameter's counts its in-place writes.
        return tuple(
            (key, t.data_ptr(), t.shape, (self.params[key[1]] if key[0] == "p" else t)._version)
            for key, t in self._live()
        )

    def _identity(self) -> tuple[tuple[Any, ...], ...]:
        """Which tensors are live (not their versions)."""
        return tuple((key, t.data_ptr(), t.shape) for key, t in self._live())

    def _point_home(self, tensors: dict[Key, torch.Tensor]) -> None:
        """Point every live slot at the tier's buffer ``tensors[key]``, and remember which
        they are: while they stay live (and the tier keeps them), they are its values."""
        self._point_at(tensors)
        self._home = self._identity()

    # -- residency, as the store's own record of it ---------------------------------------

    @property
    def residency(self) -> Residency:
        return self._residency.state

    @property
    def device(self) -> torch.device:
        """The device the live tensors are used on (the host's, at home)."""
        return self._residency.device

    @property
    def owner(self) -> object:
        """The worker holding the live tensors (see :meth:`demote`)."""
        return self._residency.owner

    @property
    def copied(self) -> bool:
        """Whether the live tensors are device copies of the host buffers."""
        return self._residency.state is Residency.DEVICE

    @property
    def retired(self) -> bool:
        """Brought home for good until the next :meth:`promote`: a speculative prefetch
        still in a queue must not take it back to a device (the task left, or is
        checkpointed)."""
        return self._residency.state is Residency.RETIRED

    @property
    def tier(self) -> StorageTier:
        return self._tier

    # -- the tensors, addressed by stable keys ------------------------------------------

    def _live(self) -> Iterator[tuple[Key, torch.Tensor]]:
        frozen = self._frozen
        for i, p in enumerate(self.params):
            if i in frozen:
                continue  # the frozen pool's (it has no gradient, no optimizer state)
            yield ("p", i), p.data
            if p.grad is not None:
                yield ("g", i), p.grad
        for j, (mod, name) in enumerate(self.buffer_slots):
            yield ("b", j), mod._buffers[name]  # type: ignore[misc]
        if self.optimizer is not None:
            for i, p in enumerate(self.params):
                if i in frozen:
                    continue
                for k, v in self.optimizer.state.get(p, {}).items():
                    if _param_shaped(v):
                        yield ("o", i, k), v
        for i, t in self._stash.items():
            yield ("s", i), t

    def _set(self, key: Key, t: torch.Tensor) -> None:
        kind = key[0]
        if kind == "p":
            p = self.params[key[1]]
            grad = p.grad
            p.grad = None  # the grad must follow the data to the new device
            p.data = t
            if grad is not None and grad.device == t.device:
                p.grad = grad
        elif kind == "g":
            self.params[key[1]].grad = t
        elif kind == "b":
            mod, name = self.buffer_slots[key[1]]
            mod._buffers[name] = t
        elif kind == "s":
            self._stash[key[1]] = t
        else:
            assert self.optimizer is not None
            self.optimizer.state[self.params[key[1]]][key[2]] = t

    def nbytes(self) -> int:
        """Bytes this shard's state occupies now (parameters, grads, buffers, moments)."""
        return sum(t.numel() * t.element_size() for _, t in self._live())

    def host_tensors(self) -> list[tuple[nn.Parameter | tuple[nn.Module, str], torch.Tensor]]:
        """The host tensors of the shard's parameters and buffers, as ``(parameter,
        tensor)`` and ``((module, buffer name), tensor)``: the live ones at home, their
        last demoted values while on a device."""
        with self.lock:  # a demotion may be adding host buffers right now
            if self._residency.state is Residency.DISK:
                items = list(self._live())  # views of the spill file
            else:
                items = self._tier.items()
        host: list[tuple[nn.Parameter | tuple[nn.Module, str], torch.Tensor]] = []
        for key, t in items:
            if key[0] == "p":
                host.append((self.params[key[1]], t))
            elif key[0] == "b":
                host.append((self.buffer_slots[key[1]], t))
        return host

    # -- a shared parameter's gradient over one batch ----------------------------------

    def stash_grad(self, index: int) -> None:
        """Set parameter ``index``'s gradient aside (``.grad`` becomes ``None``) before the
        first of its uses in a batch back-propagates: plain autograd sums the uses of one
        batch first and adds that sum to the gradient accumulated so far
        (:meth:`unstash_grad` does the same)."""
        with self.lock:
            p = self.params[index]
            if p.grad is not None:
                self._stash[index] = p.grad
                p.grad = None

    def unstash_grad(self, index: int) -> None:
        """After the last use's backward: the set-aside gradient plus this batch's sum."""
        with self.lock:
            old = self._stash.pop(index, None)
            if old is None:
                return
            p = self.params[index]
            new = p.grad
            if new is None:
                p.grad = old.to(p.device)
            else:
                p.grad = old.to(new.device).add_(new)

    # -- moving -------------------------------------------------------------------------

    def promote(
        self,
        device: torch.device,
        stream: Any = None,
        *,
        copy: bool = True,
        owner: object = None,
    ) -> int:
        """Copy the shard's state onto ``device``; returns the bytes moved.

        Args:
            device: the target device.
            stream: a CUDA stream to issue the copies on (the caller orders compute after
                it with an event); ``None`` copies on the current stream.
            copy: for a CPU device, whether to really copy (``False``: the host buffers
                are used in place, as the CPU "device" is host memory).
            owner: the worker taking the state (see :meth:`demote`).
        """
        start = time.perf_counter()
        loading = self._loading
        with self.lock:
            if loading and self.host is not None:
                self.host.note_wait(self, owner, start)
            if not copy and self._residency.lends(device, owner):
                if any(ref.entry.on_disk for ref in self._frozen.values()):
                    # The pool spilled a shared tensor between its ops: back into RAM.
                    self.host_frozen_pinned(self._frozen_ready(), -1)
                return 0  # in use in place there already: the common case on a CPU device
            if self._residency.state is Residency.DISK:
                start = time.perf_counter()
                self._load(speculative=False)
                if self.host is not None:
                    self.host.note_wait(self, owner, start)
            return self._promote(device, stream, copy, owner)

    def try_promote(
        self, device: torch.device, stream: Any = None, *, copy: bool = True, owner: object
    ) -> int | None:
        """:meth:`promote`, unless another owner holds the state (it may be computing with
        it) or it was retired: then nothing happens and ``None`` is returned. For
        speculative prefetches."""
        with self.lock:
            if not self._residency.may_speculate(owner):
                return None
            if self._residency.state is Residency.DISK and not self._load(speculative=True):
                return None  # no room in host memory without spilling something hotter
            return self._promote(device, stream, copy, owner)

    def _promote(self, device: torch.device, stream: Any, copy: bool, owner: object) -> int:
        residency = self._residency
        if residency.state is Residency.DEVICE:
            if residency.holds(device, owner):
                return 0
            # From another GPU: ``stream`` belongs to the new device, and a copy issued
            # under it would still run on the old device's current stream, unordered
            # with the promotion below. Rare (LRTF keeps tasks put), so copy back blocking.
            self._demote(stream if residency.device == device else None, to_disk=False)
        if self._frozen:  # a write since the last op: that tensor is the task's (or pending)
            self.check_frozen("between its ops", settle=True)
        # Whether the values it leaves behind stay valid: the host buffers (a device copy
        # that changes nothing is dropped at its demotion) or the file (not rewritten).
        # (The live tensors are the tier's buffers, unless an op in place replaced one.)
        host_copy = copy and self._tracked and self._home is not None
        host_copy = host_copy and self._identity() == self._home
        if not self._tracked:
            self._file_valid = False
        self._vouched = False
        if device.type == "cpu" and not copy:
            if self._frozen:  # computed with in place: in host memory, as counted
                self.host_frozen_pinned(self._frozen_ready(), -1)
            residency.lend(device, owner)
            self._sig = self._signature() if self._file_valid else None
            return 0
        if stream is None:
            self._synchronize()
        pinned = self._frozen_ready()  # before any tensor moves: it may raise
        try:
            moved = 0
            ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
            with ctx:
                if self._event is not None and stream is not None:
                    stream.wait_event(self._event)
                # Read every live tensor first: _set on a parameter detaches its grad.
                live = list(self._live())
                grads = {key: t for key, t in live if key[0] == "g"}
                for key, host in live:
                    if key[0] == "g":
                        continue
                    dev = torch.empty(host.shape, dtype=host.dtype, device=device)
                    dev.copy_(host, non_blocking=self._tier.pinned)
                    moved += host.numel() * host.element_size()
                    self._set(key, dev)
                for key, host in grads.items():
                    dev = torch.empty(host.shape, dtype=host.dtype, device=device)
                    dev.copy_(host, non_blocking=self._tier.pinned)
                    moved += host.numel() * host.element_size()
                    self._set(key, dev)
                for i, ref in self._frozen.items():
                    # One copy per device for every task resident there (never copied back:
                    # the pool's host tensor keeps the values).
                    dev, copied, key = ref.pool.to_device(ref.entry, device, owner, stream)
                    self._frozen_dev[i] = key
                    moved += copied
                    self._point_frozen(i, dev)
        finally:  # on the device now (its copy keeps it there), or failed
            self.host_frozen_pinned(pinned, -1)
        residency.arrive(device, owner)
        self._host_copy = host_copy
        self._sig = self._signature() if host_copy or self._file_valid else None
        self.moved_total += moved
        return moved

    def demote(self, stream: Any = None, *, only_owner: object = None) -> int:
        """Copy the shard's state back into its host buffers; returns the bytes moved (0
        when the visit changed nothing: the device copy is dropped, the host buffers or
        the disk tier's file keep the values).

        Args:
            stream: CUDA stream for the copies (``None``: the current stream).
            only_owner: demote only if this owner still holds the state (a worker evicting
                its copy must not demote one another worker took meanwhile and may be
                computing with).
        """
        with self.lock:
            if only_owner is not None and self._residency.owner is not only_owner:
                return 0
            return self._demote(stream)

    def _demote(self, stream: Any, *, to_disk: bool = True) -> int:
        if self._residency.state is not Residency.DEVICE:
            if self._residency.state is Residency.IN_PLACE and not self._unchanged():
                self._changed()
            self._residency.home()
            return 0
        self.check_frozen("between its ops", settle=True)  # a write since the last op
        for i in self._frozen:  # the device copies are dropped, as unchanged ones are
            self._frozen_home(i)
        if not self._unchanged():
            self._changed()  # an op changed it, or none vouched for the visit
        self._sig = None
        self._vouched = False
        if self._host_copy:
            # Nothing changed on the device: the host buffers hold its values. Drop the
            # device copy (its memory is free once the caller's compute is done).
            self._host_copy = False
            self._point_home({key: self._tier.get(key) for key, _ in list(self._live())})
            self._residency.home()
            return 0
        if self._file_valid and to_disk and self._drop_to_disk():
            return 0
        moved = 0
        if self.host is not None:
            # Room first: its stale host buffers may have been freed while it was on the
            # device, and its gradients and optimizer state may have grown there.
            self.host.reserve(self, self.host_charge())
        # Asynchronous only on a copy stream, whose event tells when the host buffers are
        # complete; without one nothing would (the caller reads them right after).
        asynchronous = self._tier.pinned and stream is not None
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            live = list(self._live())
            for key, dev in live:
                host = self._tier.put(key, dev)
                host.copy_(dev, non_blocking=asynchronous)
                if stream is not None and dev.is_cuda:
                    # Gradients and optimizer moments were allocated by the compute stream:
                    # without this the allocator could hand their memory to a compute
                    # kernel while this copy still reads it.
                    dev.record_stream(stream)
                moved += dev.numel() * dev.element_size()
            self._point_home({key: self._tier.get(key) for key, _ in live})
            if asynchronous:
                self._event = torch.cuda.Event()
                self._event.record(stream)
            else:
                self._tier.flush()
        self._residency.home()
        self.moved_total += moved
        return moved

    def _drop_to_disk(self) -> bool:
        """Unchanged on its device, and its host copy was dropped meanwhile: back to disk
        without a write (the file holds these values). False if the file cannot be mapped
        (the caller copies the state home instead)."""
        assert self.host is not None and self.spill_file is not None
        try:
            views = self.spill_file.views()
        except SpillReadError:
            return False
        self._point_at(views)
        if self._tier.nbytes():  # stale buffers (none expected: they were dropped)
            self._synchronize()
            self._tier.clear()
            self.host.release(self)
        self._home = None
        self._residency.drop_to_disk()
        return True

    def retire(self, *, load: bool = False) -> int:
        """:meth:`demote` for good: until the next :meth:`promote`, :meth:`try_promote`
        leaves the state on the host. Returns the bytes moved.

        Args:
            load: the task leaves the engine, whose runner (and optimizer) is discarded:
                read the model's tensors of a state on disk (parameters, gradients,
                buffers) back into plain RAM tensors, and drop its optimizer state there
                (never read): nothing of it then maps the spill file, whose disk space is
                freed when the file is removed. Otherwise a state on disk stays there,
                readable through its views.

        Raises:
            SpillReadError: the file cannot be read (the state stays on disk).
        """
        with self.lock:
            moved = self._demote(None)
            if load and self._residency.state is Residency.DISK:
                self._load(speculative=False, model_only=True)
            self._residency.retire()
            self._synchronize()  # an earlier asynchronous demote, too
            return moved

    # -- the disk tier --------------------------------------------------------------------

    @property
    def on_disk(self) -> bool:
        """Whether the state is in the disk tier (not in host memory, not on a device)."""
        return self._residency.state is Residency.DISK

    @property
    def host_copy_valid(self) -> bool:
        """On a device: whether its host buffers still hold its values (no op changed it
        there so far), so that demoting it would drop the device copy."""
        return self._residency.state is Residency.DEVICE and self._host_copy

    @property
    def in_host(self) -> bool:
        """Whether host memory holds buffers of this state (current or stale)."""
        return self._residency.state is not Residency.DISK and bool(self._tier.nbytes())

    def try_spill(self) -> bool:
        """Free this state's host memory if nobody is using it: write it to the disk tier
        (not needed if the file already holds these values), or, on a device, drop its
        stale host copy. Never waits for the store's lock. Returns whether memory was
        freed.

        Raises:
            SpillWriteError: the write failed (``SpillDiskFullError``: the disk is full);
                the state stays in host memory.
            SpillReadError: the written file cannot be mapped; the state stays in host
                memory.
        """
        if not self.lock.acquire(blocking=False):
            return False
        try:
            return self._spill()
        finally:
            self.lock.release()

    def _spill(self) -> bool:
        assert self.host is not None and self.spill_file is not None
        state = self._residency.state
        if state is Residency.DISK:
            return False
        if state is Residency.DEVICE:  # computing on its device copy: drop the stale one
            if not self._tier.nbytes():
                return False
            self._synchronize()
            self._tier.clear()
            self._home = None
            self._host_copy = False
            self.host.release(self)
            return True
        if self.host.busy(self):  # a device computes with the host tensors themselves
            return False
        if state is Residency.IN_PLACE and not self._unchanged():
            self._changed()
        self._synchronize()
        live = list(self._live())
        if not self._file_valid:
            start = time.perf_counter()
            nbytes = self.spill_file.write(live)
            self.host.note_io(self, "to_disk", nbytes, start)
        views = self.spill_file.views()
        self._point_at(views)
        self._tier.clear()
        self._home = None
        self._residency.spill()
        self._file_valid = True
        self.host.release(self)
        return True

    def load(self, *, speculative: bool = True) -> bool:
        """Read the state back from the disk tier into host memory (the disk thread's
        read-ahead). ``speculative``: never wait for the store's lock, and only if room
        can be made by spilling colder states. Returns whether it was loaded.

        Raises:
            SpillReadError: the file cannot be read (the state stays on disk)."""
        if not self.lock.acquire(blocking=not speculative):
            return False
        try:
            if self._residency.state is not Residency.DISK:
                return False
            return self._load(speculative=speculative)
        finally:
            self.lock.release()

    def _load(self, *, speculative: bool, model_only: bool = False) -> bool:
        assert self.host is not None and self.spill_file is not None
        templates = self.spill_file.templates()
        if model_only:  # see retire(load=True): the optimizer's state is dropped, not read
            dropped = [key for key in templates if key[0] == "o"]
            templates = {k: t for k, t in templates.items() if k[0] != "o"}
        nbytes = sum(t.numel() * t.element_size() for t in templates.values())
        charge = max(self.state_bytes - self.frozen_bytes(), nbytes)  # the pool counts its own
        if not self.host.reserve(self, charge, speculative=speculative):
            return False
        self._loading = True
        try:
            start = time.perf_counter()
            bufs = {}
            # Read through the file's descriptor (no mapping, no name: the spill folder may
            # have been deleted under the engine).
            try:
                for key, like in templates.items():
                    buf = self._tier.put(key, like)
                    self.spill_file.read_into(key, buf)
                    bufs[key] = buf
            except BaseException:
                self._tier.clear()  # the state stays on disk, its views untouched
                self._home = None
                self.host.release(self)
                raise
            self._tier.flush()
            self._point_home(bufs)
            if model_only and self.optimizer is not None:
                for key in dropped:
                    param = self.params[key[1]]  # type: ignore[call-overload]
                    self.optimizer.state[param].pop(key[2], None)
            self._residency.load()
            self.host.note_io(self, "from_disk", nbytes, start)
        finally:
            self._loading = False
        return True

    def _point_at(self, tensors: dict[Key, torch.Tensor]) -> None:
        """Point every live slot at ``tensors[key]`` (gradients last: a parameter's data
        change detaches its gradient)."""
        for key, t in tensors.items():
            if key[0] != "g":
                self._set(key, t)
        for key, t in tensors.items():
            if key[0] == "g":
                self._set(key, t)

    def synchronize(self) -> None:
        """Wait until host buffers hold the demoted values (CUDA non-blocking copies)."""
        with self.lock:
            self._synchronize()

    def _synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._tier.flush()


def shared_parts(stores: list[ShardStore], state_bytes: int) -> tuple[tuple[object, int], ...]:
    """The frozen pool entries ``stores`` use, each once, as ``(ledger key, bytes)``;
    empty if they add up to more than ``state_bytes``."""
    parts: dict[object, int] = {}
    for store in stores:
        for ref in list(store._frozen.values()):
            parts[ref.entry.ledger_key] = ref.entry.nbytes
    if sum(parts.values()) > state_bytes:
        return ()
    return tuple(parts.items())


def _changed_by_step(ref: weakref.ReferenceType[ShardStore]) -> Any:
    """An optimizer step pre-hook: the store's state changes (whichever op steps it)."""

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        store = ref()
        if store is not None:
            store._changed()

    return hook


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
