"""The shard store: a shard's state lives in a storage tier and visits a device to run.

A :class:`ShardStore` owns one shard's parameters, gradients, buffers and optimizer
state. ``promote(device)`` copies them onto the device and points the live
``nn.Parameter`` objects at the copies (so the optimizer, keyed by parameter, keeps
working); ``demote()`` copies them back into the tier's host buffers, allocated once (and
pinned, with CUDA) and reused on every visit. Round trips are bitwise exact. A visit
that changed nothing (see :meth:`ShardStore.begin_op`) is not copied back: the device
copy is dropped and the host buffers (or the disk tier's file) keep the values.

The store owns its residency (:class:`ShardResidency`), its tier's buffers, its lock and
its parts: the live tensors by key (``slots``, a :class:`LiveSlots`), whether a visit
changed them (``changes``, a :class:`ChangeTracker`), the parameters shared through the
engine's frozen pool (``frozen``, a :class:`~tune_hydra.engine.storage.frozen.FrozenSlots`) and
its moves to and from the disk tier (a :class:`DiskSpill`, handed its residency). The
frozen slots change the store's own state only through its ``param_shared`` and
``param_owned``.

With CUDA, copies run on a caller-supplied copy stream and are ordered against compute
with events; on the CPU they are plain synchronous copies (or skipped entirely when the
"device" is the host itself and ``copy=False``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container
from typing import Any

import torch
from torch import nn

from tune_hydra.core.ops import OpKind
from tune_hydra.engine.storage.changes import ChangeTracker
from tune_hydra.engine.storage.disk import SpillFile
from tune_hydra.engine.storage.frozen import FrozenSlots, shared_parts
from tune_hydra.engine.storage.residency import Residency, ShardResidency
from tune_hydra.engine.storage.slots import LiveSlots, held_params
from tune_hydra.engine.storage.spill import DiskSpill, HostAccount
from tune_hydra.engine.storage.tiers import HostTier, Key, PinnedHostTier, StorageTier


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
        self.lock = threading.RLock()  # promote/demote may come from two devices' threads
        held = held_params(modules, params)
        self.frozen = FrozenSlots(held, self)  # the frozen pool's: not in the live slots
        self.slots = LiveSlots(modules, held, self.frozen)
        self.changes = ChangeTracker(self.slots)
        self.optimizer = optimizer
        if tier is None:
            tier = PinnedHostTier() if pin and torch.cuda.is_available() else HostTier()
        self._tier = tier
        self._residency = ShardResidency()
        self.last_nbytes = 0  # nbytes() at the last promotion
        self.moved_total = 0  # bytes copied host<->device over the store's life
        self._event: Any = None  # CUDA event after the last demote (host buffers valid)
        self.host = host
        self.spill_file = spill_file
        self._disk = DiskSpill(self, self._residency)  # its moves to and from spill_file
        for key, t in list(self.slots.items()):
            kept = tier.keep(key, t)
            if kept is not t:
                self.slots.set(key, kept)
        tier.flush()
        self.changes.mark_home()

    # -- the parts' views ----------------------------------------------------------------

    @property
    def params(self) -> list[nn.Parameter]:
        return self.slots.params

    @property
    def buffer_slots(self) -> list[tuple[nn.Module, str]]:
        return self.slots.buffer_slots

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The shard's optimizer (its param-shaped state moves with the shard)."""
        return self.slots.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.slots.optimizer = optimizer
        self.changes.track(optimizer)

    def parts(self) -> list[ShardStore]:
        """The shard stores this store moves together: itself."""
        return [self]

    def nbytes(self) -> int:
        """Bytes this shard's state occupies now (parameters, grads, buffers, moments)."""
        return self.slots.nbytes()

    def host_charge(self) -> int:
        """Host bytes this state takes in RAM: the plan's state bytes (gradients and
        optimizer state appear while it trains), or more if it holds more now; shared
        frozen tensors are the frozen pool's (counted once, there)."""
        return max(self.state_bytes - self.frozen.nbytes(), self.nbytes())

    # -- frozen tensors shared across tasks (tune_hydra.engine.storage.frozen) --------------------

    @property
    def shared_parts(self) -> tuple[tuple[object, int], ...]:
        """The frozen pool's tensors inside :attr:`state_bytes`, as ``(key, bytes)``: one
        device copy serves every resident shard using them, so the device ledger counts
        each once (``tune_hydra.core.ledger.state_of``). Empty if they would exceed the
        plan's state bytes (then counted as the plan says: conservative)."""
        return shared_parts([self.frozen], self.state_bytes)

    def param_shared(self, index: int) -> None:
        """Parameter ``index`` (frozen, at home) points at a pool tensor now (see
        ``FrozenSlots.share``): out of the store's own state from now on."""
        assert self._residency.state is Residency.HOST, "shared at registration only"
        self._tier.drop(("p", index))
        self.changes.mark_home()

    def param_owned(self, index: int, host: torch.Tensor | None) -> None:
        """Shared parameter ``index`` is the store's own state again (see
        ``FrozenSlots``): its host tensor ``host`` (``None``: on a device, its host buffer
        is allocated at the demotion, which copies it); the state changed."""
        if host is not None:
            self._tier.keep(("p", index), host)
        self.changes.forget_home()
        self.changes.changed()

    def leave_frozen(self) -> None:
        """The task leaves: see ``FrozenSlots.leave``."""
        self.frozen.leave()

    def own_frozen(self, index: int) -> None:
        """Shared parameter ``index`` becomes the store's own: see ``FrozenSlots.own``."""
        self.frozen.own(index)

    def frozen_rewritten(self, index: int) -> None:
        """Shared ``index`` was written with its values: see ``FrozenSlots.rewritten``."""
        self.frozen.rewritten(index)

    # -- did a visit change the state? (storage.changes) ----------------------------------

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
        if self.frozen:
            self.frozen.check(f"before its {kind.value} of shard {self.name[1]}")
        self.changes.begin(kind)

    def end_op(self, failed: bool = False) -> None:
        """The op begun with :meth:`begin_op` ended (``failed``: it raised; whatever it
        did counts as a change). A read-only op that replaced or wrote into a live tensor
        anyway (a user module writing a buffer in eval) makes the state changed.

        Raises:
            FrozenTensorModifiedError: the op changed a frozen tensor shared with other
                tasks (the op's task fails; the others' copies are untouched).
        """
        if failed:
            self.changes.changed()
            return
        if self.frozen:
            self.frozen.check(f"by an op on shard {self.name[1]}", values=True, during=True)
        if self.changes.watching:
            with self.lock:
                self.changes.recheck()

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
    def at_home(self) -> bool:
        """Whether no device holds copies of the live tensors (at home, on disk, or lent
        in place to a CPU device: not in use unless busy, see ``HostAccount.busy``)."""
        return self._residency.state is not Residency.DEVICE

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

    def host_tensors(self) -> list[tuple[nn.Parameter | tuple[nn.Module, str], torch.Tensor]]:
        """The host tensors of the shard's parameters and buffers, as ``(parameter,
        tensor)`` and ``((module, buffer name), tensor)``: the live ones at home, their
        last demoted values while on a device."""
        with self.lock:  # a demotion may be adding host buffers right now
            if self._residency.state is Residency.DISK:
                items = list(self.slots.items())  # views of the spill file
            else:
                items = self._tier.items()
        return self.slots.named(items)

    # -- a shared parameter's gradient over one batch ----------------------------------

    def stash_grad(self, index: int) -> None:
        """Set parameter ``index``'s gradient aside (``.grad`` becomes ``None``) before the
        first of its uses in a batch back-propagates: plain autograd sums the uses of one
        batch first and adds that sum to the gradient accumulated so far
        (:meth:`unstash_grad` does the same)."""
        with self.lock:
            self.slots.stash_grad(index)

    def unstash_grad(self, index: int) -> None:
        """After the last use's backward: the set-aside gradient plus this batch's sum."""
        with self.lock:
            self.slots.unstash_grad(index)

    # -- moving -------------------------------------------------------------------------

    def promote(
        self, device: torch.device, stream: Any = None, *, copy: bool = True, owner: object = None
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
        loading = self._disk.loading
        with self.lock:
            if loading and self.host is not None:
                self.host.note_wait(self, owner, start)
            if not copy and self._residency.lends(device, owner):
                if self.frozen.on_disk:
                    # The pool spilled a shared tensor between its ops: back into RAM.
                    self.frozen.unpin(self.frozen.ready())
                return 0  # in use in place there already: the common case on a CPU device
            if self._residency.state is Residency.DISK:
                self._disk.read_for(owner)
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
            if self._residency.state is Residency.DISK and not self._disk.read(speculative=True):
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
        if self.frozen:  # a write since the last op: that tensor is the task's (or pending)
            self.frozen.check("between its ops", settle=True)
        # Whether the values it leaves behind stay valid: the host buffers (a device copy
        # that changes nothing is dropped at its demotion) or the file (not rewritten).
        host_copy = self.changes.visit(copy)
        if device.type == "cpu" and not copy:
            if self.frozen:  # computed with in place: in host memory, as counted
                self.frozen.unpin(self.frozen.ready())
            residency.lend(device, owner)
            self.changes.lent()
            return 0
        if stream is None:
            self._synchronize()
        pinned = self.frozen.ready()  # before any tensor moves: it may raise
        try:
            moved = 0
            ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
            with ctx:
                if self._event is not None and stream is not None:
                    stream.wait_event(self._event)
                moved += self.slots.copy_to(device, non_blocking=self._tier.pinned)
                moved += self.frozen.to_device(device, owner, stream)
        finally:  # on the device now (its copy keeps it there), or failed
            self.frozen.unpin(pinned)
        residency.arrive(device, owner)
        self.changes.arrived(host_copy)
        self.moved_total += moved
        return moved

    def demote(
        self, stream: Any = None, *, only_owner: object = None, keep: Container[int] = ()
    ) -> int:
        """Copy the shard's state back into its host buffers; returns the bytes moved (0
        when the visit changed nothing: the device copy is dropped, the host buffers or
        the disk tier's file keep the values).

        Args:
            stream: CUDA stream for the copies (``None``: the current stream).
            only_owner: demote only if this owner still holds the state (a worker evicting
                its copy must not demote one another worker took meanwhile and may be
                computing with).
            keep: for ``LinkedStore.demote``'s signature (its shared parts that stay); a
                store demoted itself goes.
        """
        with self.lock:
            if only_owner is not None and self._residency.owner is not only_owner:
                return 0
            return self._demote(stream)

    def _demote(self, stream: Any, *, to_disk: bool = True) -> int:
        if self._residency.state is not Residency.DEVICE:
            if self._residency.state is Residency.IN_PLACE:
                self.changes.settle()
            self._residency.home()
            return 0
        self.frozen.check("between its ops", settle=True)  # a write since the last op
        self.frozen.home()  # the device copies are dropped, as unchanged ones are
        if self.changes.leave():
            # Nothing changed on the device: the host buffers hold its values. Drop the
            # device copy (its memory is free once the caller's compute is done).
            self._point_home({key: self._tier.get(key) for key, _ in list(self.slots.items())})
            self._residency.home()
            return 0
        if self.changes.file_valid and to_disk and self._disk.drop_to_disk():
            return 0
        if self.host is not None:
            # Room first: its stale host buffers may have been freed while it was on the
            # device, and its gradients and optimizer state may have grown there.
            self.host.reserve(self, self.host_charge())
        # Asynchronous only on a copy stream, whose event tells when the host buffers are
        # complete; without one nothing would (the caller reads them right after).
        asynchronous = self._tier.pinned and stream is not None
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            live = list(self.slots.items())
            moved = self._tier.fill(live, non_blocking=asynchronous, stream=stream)
            self._point_home({key: self._tier.get(key) for key, _ in live})
            if asynchronous:
                self._event = torch.cuda.Event()
                self._event.record(stream)
            else:
                self._tier.flush()
        self._residency.home()
        self.moved_total += moved
        return moved

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
                self._disk.read(speculative=False, model_only=True)
            self._residency.retire()
            self._synchronize()  # an earlier asynchronous demote, too
            return moved

    # -- the disk tier (storage.spill) ----------------------------------------------------

    @property
    def on_disk(self) -> bool:
        """Whether the state is in the disk tier (not in host memory, not on a device)."""
        return self._residency.state is Residency.DISK

    @property
    def host_copy_valid(self) -> bool:
        """On a device: whether its host buffers still hold its values (no op changed it
        there so far), so that demoting it would drop the device copy."""
        return self._residency.state is Residency.DEVICE and self.changes.host_copy

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
        return self._disk.spill()

    def load(self, *, speculative: bool = True) -> bool:
        """Read the state back from the disk tier into host memory (the disk thread's
        read-ahead). ``speculative``: never wait for the store's lock, and only if room
        can be made by spilling colder states. Returns whether it was loaded.

        Raises:
            SpillReadError: the file cannot be read (the state stays on disk)."""
        return self._disk.load(speculative=speculative)

    def _point_home(self, tensors: dict[Key, torch.Tensor]) -> None:
        """Point every live slot at the tier's buffer ``tensors[key]``, and remember which
        they are: while they stay live (and the tier keeps them), they are its values."""
        self.slots.point_at(tensors)
        self.changes.mark_home()

    def synchronize(self) -> None:
        """Wait until host buffers hold the demoted values (CUDA non-blocking copies)."""
        with self.lock:
            self._synchronize()

    def _synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._tier.flush()


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
