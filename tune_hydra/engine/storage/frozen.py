"""Frozen tensors shared across tasks: one host copy of identical frozen weights.

Fine-tuning searches load one pretrained base per trial and freeze it (LoRA and other
adapters): every trial's frozen tensors are equal. A :class:`FrozenPool` (one per engine,
owned by its task registry) keeps one host copy of each, for all tasks:

- **At registration** (:meth:`FrozenPool.prepare`, then :meth:`FrozenPool.adopt`) every
  frozen parameter of a task (``requires_grad=False``, no gradient, no optimizer state)
  is looked up by its name (``.base_layer`` segments, which peft inserts into the modules
  it adapts, left out), shape, dtype and a digest of its bytes; a candidate is taken only
  if ``torch.equal`` says so (bitwise: the digest is of the bytes). A match points the
  parameter at the pool's tensor (the task's own copy is freed once nothing else holds
  it); no match makes the task's tensor a new entry. A base with one tensor different
  shares all the others and keeps its own copy of that one.
- **Counted once**: each entry is held in the engine's host ledger under a key of its own
  (``("frozen", n)``); its stores leave it out of their own state
  (:meth:`FrozenSlots.share`), so it is neither counted nor spilled with them.
- **Spilled once**: with a host budget the disk tier spills an entry as it spills a
  state (``HostMemory._victims``: as hot as the hottest store using it) when no store
  using it is computing (busy) or being promoted, and no CUDA copy still reads it (a
  store resident on a device between its ops keeps its device copy: only the host
  tensor goes)
  (:meth:`FrozenPool.try_spill` takes every user's lock without waiting, then writes
  the entry to a spill file of its own, once: its values never change, so later spills
  write nothing, and points every user at a view of that file; the ledger drops it). A
  new entry with no room even then goes to disk at once (its task is not registered
  yet). A store about to visit pins its entries and reads those on disk back once
  (:meth:`FrozenPool.load`, counted again; other users are pointed at the RAM copy as
  they next move, reading equal values from the view until then; a store promoted
  where the entry's device copy already is reads it back all the same). A task leaving while
  its entry is on disk gets a RAM copy (a write into the shared mapping would reach
  the file).
- **Every loop**: a runner that trains a model of its own (a ``th.shard`` loop, a
  ``TaskLoop``'s too: ``LoopRunner.frozen_model``) joins at ``add_runner``, once its loop
  is cut. A ``th.shard`` model's ``load_state_dict``
  (resuming a trial) writes only its own copy: a shared tensor given other values leaves
  the pool for that loop first (:meth:`FrozenSlots.own`), one given its own values
  stays shared (:meth:`FrozenSlots.rewritten`). Other writes by the user's thread into
  a tensor of ``parameters()`` are caught at the loop's next op, as below.
- **Aligned cuts**: a task is cut where a registered task likely to share frozen
  tensors with it was (:meth:`FrozenPool.peers`: entries named, shaped and typed as its
  frozen parameters; ``TaskRegistry.shared_cuts``, most shared bytes first): the first
  such cut of the same layers whose every shard fits the budget with this task's costs
  (``plan_shards(prefer=...)``); else its own. Shard k of both then holds the same
  frozen tensors, so their device copies are shared while both are resident.
- **Refcounted**: every store slot using an entry holds a reference; a task leaving the
  engine drops its references (:meth:`FrozenSlots.leave`, from
  ``HostMemory.discard``). While other tasks still use the entry, its parameters get a
  copy-on-write clone of the pool's tensor (:func:`lazy_clone`, ``torch._lazy_clone``):
  no bytes are copied when a trial finishes; a write by the user into that model (it is
  theirs now: ``merge_and_unload``, an optimizer step, ``numpy()`` or ``data_ptr()``,
  which may write) copies that tensor then, on the model's side, so the other tasks
  never see it. The pool's side is only read (ops, ``copy_`` to devices, checksums,
  addresses through :func:`address`, never ``data_ptr()``), so it is never copied. The
  last user keeps the pool's tensor, and the entry is freed. (Known gap: code outside the
  engine that asks a live task's shared tensor for ``data_ptr()`` copies the pool's side
  once, costing one extra host copy, never correctness.)
- **Never modified in place**: each store checks its shared slots at every visit
  (:meth:`FrozenSlots.check`, from ``ShardStore.begin_op`` / ``end_op``: the parameter's
  version counter, its data pointer, ``requires_grad`` and its gradient; after each op
  also a :func:`checksum` of its values, as ``weight.data += delta`` moves no version
  counter). A change in a slot another task also uses fails that task alone
  (:class:`~tune_hydra.exceptions.FrozenTensorModifiedError`); in an entry only this
  task uses, the slot goes back to the store's own state (it trains as it would have
  unshared: gradual unfreezing works) and the entry leaves the pool.
- **Writes reach the writer only**: a live task's parameter holds a copy-on-write alias
  (:func:`alias`) of the pool's host tensor or CPU device copy, so a write into it
  copies the writer's side first: the pool's tensor and every other task's alias keep
  the shared values. A write from the user's thread between ops (``w.add_(1)`` under
  ``no_grad``, peft's ``merge_adapter()``), found at the next op, promotion or demotion,
  makes that tensor the writer's own state, with its written values, and it goes on
  exactly as plain PyTorch (``FrozenSlots._take_own``); a write by its op fails it alone.

Devices: one copy per device holder (a device worker; emulated CPU devices are told apart
by it) for every task resident there (:meth:`FrozenPool.to_device`, refcounted: the
last store to leave frees it), so the trace's ``copy_in`` shows a shared tensor copied
once per residency; it is never copied back (the host tensor keeps the values). With
CUDA, a later user's stream waits on an event recorded after the copy. The device ledger
counts it once per device while any resident shard uses it: a store lists its pool
tensors inside its plan's state bytes (``ShardStore.shared_parts``, ``(ledger key,
bytes)``; a ``LinkedStore`` its parts' too), and ``tune_hydra.core.ledger.state_of``
sums resident, queued and incoming states with each listed part once (evicting a shard
frees its shared part only if no staying shard lists it). So shard k of several trials
fits beside each other where the sum of their plans would not. The trace's replay
(``Trace.validate``) counts each ``copy_in``'s bytes: a shared tensor already on the
device is not in a later copy's bytes, but the first copier's ``copy_out`` releases it
in the replay while another resident shard still uses it, so the replay can count less
than the worker did, never more (no false failure). Making it exact needs the copy
events to list their shared parts (a ``TraceEvent`` field the workers would fill):
not done. A worker keeps at most ``depth`` (2 with prefetch) states resident, so on the
engine the gain is in which pairs fit, not in more than two. A task that writes a shared device copy
has it repaired from the host tensor before it fails, so the tasks resident with it
(whose ops run after it on that device) are unaffected. A write into a tensor no
alias covers (a CUDA device copy, a view of the pool's spill file, a torch without
copy-on-write) is detected and fails its task; a CUDA device copy written from the
user's thread between ops may be read by the tasks resident with it before the
writer's next op finds it.

Locks: ``FrozenPool._lock`` is a leaf guarding the entries and their reference counts; it
is never held while waiting for another lock, and the host ledger is told under its own
lock after it is released. Digests and ``torch.equal`` run outside every lock (at
registration, before the engine's lock is taken); :meth:`FrozenPool.adopt` takes a
matched entry only if it is still the one indexed under its key (an entry indexed
meanwhile by a concurrent registration is compared there, under the pool's lock).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from tune_hydra.exceptions import FrozenTensorModifiedError, SpillReadError, SpillWriteError

log = logging.getLogger(__name__)

_PEFT_WRAP = ".base_layer"  # peft's wrapper of an adapted module: the same base tensor


class FrozenHost(Protocol):
    """What the pool tells the engine's host memory manager (``HostMemory``)."""

    def hold(
        self,
        key: object,
        nbytes: int,
        name: tuple[str, int],
        store: Any = None,
        spill: Any = None,
    ) -> None:
        """Count ``nbytes`` held in host memory under ``key``, making room first (never
        by spilling ``store``, whose lock the caller holds); if none can be made,
        ``spill()`` (if given) may put the tensor itself on disk instead."""
        ...

    def note_frozen_io(self, entry: Any, op: str, nbytes: int, start: float) -> None:
        """The pool moved ``entry`` to or from disk."""
        ...

    def drop(self, key: object, name: tuple[str, int]) -> None:
        """Stop counting ``key``."""
        ...


def canonical_name(name: str) -> str:
    """A parameter's name as the pool matches it: peft's ``.base_layer`` left out, so
    that trials adapting different modules share the base tensors of all of them.

    Example:
        >>> canonical_name("model.layers.0.q_proj.base_layer.weight")
        'model.layers.0.q_proj.weight'
    """
    return name.replace(_PEFT_WRAP, "")


def digest(t: torch.Tensor) -> bytes:
    """A digest of ``t``'s bytes (a candidate key; equality is checked separately)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    data = flat.view(torch.uint8).numpy()
    return hashlib.blake2b(data.data, digest_size=16).digest()  # no copy


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: torch.Tensor) -> int:
    """The sum of ``t``'s elements read as integers (wrapping): one pass on the tensor's
    own device, so a visit can tell whether a device copy was written. A change through
    ``.data`` (``weight.data += delta``, peft's unsafe merge) moves no version counter;
    it moves this sum unless it cancels out exactly."""
    flat = t.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return 0
    raw = flat.view(torch.uint8)
    if raw.numel() % 8 == 0:
        try:  # 8 bytes at a time: several times faster than widening narrower integers
            return int(raw.view(torch.int64).sum().item())
        except RuntimeError:  # a view whose offset is not 8-byte aligned
            pass
    return int(flat.view(_INT[flat.element_size()]).sum(dtype=torch.int64).item())


def address(t: torch.Tensor) -> int:
    """``t``'s data address, read without a write access: ``Tensor.data_ptr()`` of a
    copy-on-write tensor (see :func:`lazy_clone`) copies it first. A torch without
    that reader has no copy-on-write either (:func:`lazy_clone` copies): ``data_ptr()``."""
    read = getattr(torch._C, "_data_address", None)
    return int(read(t)) if read is not None else t.data_ptr()


def lazy_clone(t: torch.Tensor) -> torch.Tensor:
    """A copy-on-write clone of host tensor ``t`` (``torch._lazy_clone``): both share
    ``t``'s memory until either is written (or anything asks for a writable pointer:
    ``data_ptr()``, ``numpy()``), which copies the written side only. Reads (ops,
    ``copy_`` from it, :func:`checksum`) copy nothing. A plain clone where torch has none.
    """
    fn = getattr(torch, "_lazy_clone", None)
    if fn is None or t.device.type != "cpu":
        return t.clone()
    try:
        return fn(t)
    except RuntimeError:  # memory torch did not allocate itself (see cow_ready)
        return t.clone()


def alias(t: torch.Tensor) -> torch.Tensor:
    """What a live task's parameter points at instead of shared tensor ``t``: a
    copy-on-write clone (:func:`lazy_clone`) where torch can make one (a CPU tensor its
    allocator made), else ``t`` itself (never a copy). Reads copy nothing; a write by the
    task (``add_`` under ``no_grad``, ``weight.data += delta``, peft's ``merge_adapter``)
    copies its side first, so ``t`` and every other task's alias keep the shared values
    (:meth:`FrozenSlots.check` then finds the task's tensor at another address)."""
    fn = getattr(torch, "_lazy_clone", None)
    if fn is None or t.device.type != "cpu" or t.is_pinned():
        return t
    try:
        return fn(t)
    except RuntimeError:  # a file mapping (the disk tier's views) or other foreign memory
        return t


def cow_ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it :func:`lazy_clone` can share: torch's copy-on-write takes
    only memory its allocator made, not a file mapping (``from_pretrained`` of
    safetensors) or other foreign memory. A pool entry is made of it, once per tensor of
    the base, so that a finished task later costs no copy. Pinned memory stays as it is
    (a device copy from it is asynchronous; a finished task gets a plain clone)."""
    fn = getattr(torch, "_lazy_clone", None)
    if fn is None or t.device.type != "cpu" or t.is_pinned():
        return t
    try:
        fn(t)  # marks t's memory copy-on-write; dropped at once, so t is its only user
    except RuntimeError:
        return t.clone()
    return t


Key = tuple[str, tuple[int, ...], torch.dtype, bytes]
DeviceKey = tuple[str, int]
"""``(device, id of its holder)``: emulated CPU devices are all ``cpu``; their workers
tell them apart."""


@dataclass(eq=False)
class FrozenEntry:
    """One frozen tensor held once for every task whose equal tensor it replaced.

    Attributes:
        key: ``(name, shape, dtype, digest)``.
        host: the host tensor every user's parameter points at while at home.
        ledger_key: its key in the host ledger.
        checksum: :func:`checksum` of ``host`` (each visit's copy is checked with it).
        users: store slots using it.
        tasks: the tasks using it, with their slot counts.
        live: still in the pool (a modified or released entry is not matched again).
    """

    key: Key
    host: torch.Tensor
    ledger_key: tuple[str, int]
    checksum: int
    users: int = 0
    tasks: dict[str, int] = field(default_factory=dict)
    live: bool = True
    # Device copies: (device, holder) -> [tensor, users there, CUDA event after its copy]
    devices: dict[DeviceKey, list[Any]] = field(default_factory=dict)
    # The disk tier (see FrozenPool.try_spill): every slot's reference, its spill file
    # (written once: the values never change), whether ``host`` is a view of that file,
    # and how many promotions are bringing it to a device right now (not a victim then).
    refs: list[FrozenRef] = field(default_factory=list)
    file: Any = None
    on_disk: bool = False
    pins: int = 0
    failed: bool = False  # could not be written: never picked again

    @property
    def name(self) -> str:
        return self.key[0]

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def others(self, task: str) -> int:
        """How many other tasks use it."""
        return sum(1 for t in self.tasks if t != task)


@dataclass(eq=False)
class FrozenRef:
    """A store slot's reference to its entry (see :meth:`FrozenSlots.share`)."""

    pool: FrozenPool
    entry: FrozenEntry
    task: str
    name: str  # the parameter's name in the task's model
    store: Any = None  # the ShardStore holding the slot, and the parameter's index there
    index: int = -1


@dataclass
class Prepared:
    """A task's frozen parameters, digested and matched (:meth:`FrozenPool.prepare`)."""

    task: str
    # id(parameter) -> (name, key, checksum, entry it equals or None)
    params: dict[int, tuple[str, Key, int, FrozenEntry | None]] = field(default_factory=dict)
    refs: list[nn.Parameter] = field(default_factory=list)  # keeps the ids valid


def _frozen(p: nn.Parameter, optimizer: torch.optim.Optimizer | None) -> bool:
    if p.requires_grad or p.grad is not None or p.numel() == 0 or p.device.type != "cpu":
        return False
    if optimizer is not None and optimizer.state.get(p):
        return False
    return p.layout is torch.strided and not p.is_sparse


class FrozenPool:
    """The engine's one host copy of each frozen tensor equal across tasks.

    Args:
        host: the engine's host memory manager (``None``: nothing counted).
        enabled: share at all (``EngineOptions.share_frozen``); off, tasks keep their own
            frozen tensors in their own states, as without a pool.
    """

    def __init__(self, host: FrozenHost | None, *, enabled: bool = True) -> None:
        self.host = host
        self.enabled = enabled
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # disk reads (see load): never under _lock
        self._index: dict[Key, FrozenEntry] = {}
        self._ledger: dict[
            object, FrozenEntry
        ] = {}  # live entries by ledger key  # live entries, to match new tasks with
        self._count = itertools.count()
        self.shared_bytes = 0  # bytes of task tensors replaced by pool tensors, in all

    # -- figures --------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Host bytes the pool's live entries hold."""
        with self._lock:
            return sum(e.nbytes for e in self._index.values())

    def entries(self) -> list[FrozenEntry]:
        with self._lock:
            return list(self._index.values())

    def others(self, ref: FrozenRef) -> int:
        """How many tasks besides ``ref``'s use its entry now."""
        with self._lock:
            return ref.entry.others(ref.task)

    def peers(self, model: nn.Module) -> dict[str, int]:
        """The tasks holding entries named, shaped and typed as ``model``'s frozen
        parameters, with the bytes of those entries: likely sharers, for an aligned cut
        (a guess, cheap: no byte is read; sharing itself is decided by :meth:`prepare`)."""
        if not self.enabled:
            return {}
        mine: set[tuple[str, tuple[int, ...], torch.dtype]] = set()
        seen: set[int] = set()
        for name, p in nn.Module.named_parameters(model, remove_duplicate=False):
            if id(p) not in seen and _frozen(p, None):
                seen.add(id(p))
                mine.add((canonical_name(name), tuple(p.shape), p.dtype))
        out: dict[str, int] = {}
        with self._lock:
            for key, entry in self._index.items():
                if key[:3] in mine:
                    for task in entry.tasks:
                        out[task] = out.get(task, 0) + entry.nbytes
        return out

    # -- registration ---------------------------------------------------------------------

    def prepare(self, task: str, model: nn.Module) -> Prepared | None:
        """Digest ``model``'s frozen parameters and match them with the pool's entries
        (outside the engine's lock: this reads every frozen byte). ``None`` when the pool
        is off."""
        if not self.enabled:
            return None
        out = Prepared(task)
        seen: set[int] = set()
        # nn.Module's own: a th.shard model's override would bring its loop's state home.
        for name, p in nn.Module.named_parameters(model, remove_duplicate=False):
            if id(p) in seen or not _frozen(p, None):
                continue
            seen.add(id(p))
            t = p.data
            key: Key = (canonical_name(name), tuple(t.shape), t.dtype, digest(t))
            with self._lock:
                cand = self._index.get(key)
            match = cand if cand is not None and torch.equal(cand.host, t) else None
            out.params[id(p)] = (name, key, checksum(t), match)
            out.refs.append(p)
        return out

    def adopt(self, prepared: Prepared | None, stores: list[Any]) -> int:
        """Point the frozen slots of ``stores`` (a task's ``ShardStore`` objects) at the
        pool's tensors; returns the bytes of the task's own tensors replaced (freed once
        nothing else holds them)."""
        if prepared is None:
            return 0
        task = prepared.task
        replaced = 0
        new: list[FrozenEntry] = []
        for store in stores:
            for i, p in enumerate(store.params):
                info = prepared.params.get(id(p))
                if info is None or not _frozen(p, store.optimizer):
                    continue
                name, key, check, match = info
                # A new entry's tensor, made shareable copy-on-write outside the lock.
                host = cow_ready(p.data) if match is None else p.data
                with self._lock:
                    entry = self._index.get(key)
                    if entry is not None and entry is not match:
                        # Added meanwhile by another task (or replaced): compare now.
                        entry = entry if torch.equal(entry.host, p.data) else None
                    if entry is None:
                        entry = FrozenEntry(key, host, ("frozen", next(self._count)), check)
                        self._index[key] = entry
                        self._ledger[entry.ledger_key] = entry
                        new.append(entry)
                    else:
                        replaced += entry.nbytes
                        self.shared_bytes += entry.nbytes
                    entry.users += 1
                    entry.tasks[task] = entry.tasks.get(task, 0) + 1
                    ref = FrozenRef(self, entry, task, name, store, i)
                    entry.refs.append(ref)
                store.frozen.share(i, ref)
        if self.host is not None:
            for entry in new:
                # No room without going over: this entry goes to disk right away (its
                # task is not registered yet: nothing uses it).
                def spill(entry: FrozenEntry = entry) -> bool:
                    return self.try_spill(entry, self.host, fresh=True)

                self.host.hold(entry.ledger_key, entry.nbytes, (task, -1), spill=spill)
        return replaced

    # -- devices --------------------------------------------------------------------------

    def to_device(
        self, entry: FrozenEntry, device: torch.device, owner: object, stream: Any
    ) -> tuple[torch.Tensor, int, DeviceKey]:
        """``entry``'s copy on ``device`` held by ``owner`` (a worker), copied there by the
        first store that needs it and kept while any store using it is resident there:
        returns it, the bytes copied (0 if it was there) and the key to give back with
        :meth:`off_device`."""
        key: DeviceKey = (str(device), id(owner))
        with self._lock:
            slot = entry.devices.get(key)
            if slot is not None:
                slot[1] += 1
        if slot is not None:
            if slot[2] is not None:  # ordered after the copy, whichever stream made it
                (stream or torch.cuda.current_stream(device)).wait_event(slot[2])
            return slot[0], 0, key
        host = entry.host
        dev = torch.empty(host.shape, dtype=host.dtype, device=device)
        dev.copy_(host, non_blocking=host.is_pinned())
        event = None
        if dev.is_cuda:
            event = torch.cuda.Event()
            event.record(stream or torch.cuda.current_stream(device))
        with self._lock:
            slot = entry.devices.get(key)
            if slot is None:  # another store of this holder may have copied it meanwhile
                entry.devices[key] = [dev, 1, event]
                return dev, host.numel() * host.element_size(), key
            slot[1] += 1
        if slot[2] is not None:
            (stream or torch.cuda.current_stream(device)).wait_event(slot[2])
        return slot[0], 0, key

    def off_device(self, entry: FrozenEntry, key: DeviceKey) -> None:
        """A store using ``entry``'s device copy ``key`` left that device; the last one
        frees it (its compute is over: stores leave a device after their ops)."""
        with self._lock:
            slot = entry.devices.get(key)
            if slot is None:
                return
            slot[1] -= 1
            if slot[1] <= 0:
                del entry.devices[key]

    def repair(self, entry: FrozenEntry, tensor: torch.Tensor) -> bool:
        """Write the pool's values back into ``tensor`` if it is one of ``entry``'s device
        copies (a task wrote it: the tasks sharing it on that device must not see it);
        returns whether it was one."""
        with self._lock:
            shared = any(slot[0] is tensor for slot in entry.devices.values())
        if shared:
            with torch.no_grad():
                tensor.copy_(entry.host)
        return shared

    # -- the disk tier --------------------------------------------------------------------

    def entry_of(self, ledger_key: object) -> FrozenEntry | None:
        """The live entry counted under ``ledger_key`` in the host ledger."""
        with self._lock:
            return self._ledger.get(ledger_key)

    def stores_of(self, entry: FrozenEntry) -> list[Any]:
        """The stores using ``entry`` (each once)."""
        with self._lock:
            return list({id(r.store): r.store for r in entry.refs}.values())

    def spillable(self, entry: FrozenEntry) -> bool:
        """Whether ``entry`` may go to disk now, as far as the pool knows: in host memory,
        on no device, no promotion bringing it to one (its stores are checked by
        :meth:`try_spill`, under their locks)."""
        with self._lock:
            return (
                entry.live
                and not entry.on_disk
                and not entry.failed
                and not entry.pins
                and not _copying(entry)
            )

    def try_spill(self, entry: FrozenEntry, host: Any, *, fresh: bool = False) -> bool:
        """Write ``entry`` to its spill file (once: its values never change; later spills
        write nothing) and point every user at a view of it, freeing its host memory;
        only if every store using it is at home (or on disk) and not in use. Never waits
        for a store's lock. Returns whether host memory was freed.

        Args:
            entry: the entry.
            host: the engine's ``HostMemory`` (``busy``, ``frozen_file``, ``note_frozen_io``,
                ``drop``).
            fresh: the entry is being adopted, not counted yet: its task's stores are not
                registered (and not in use).
        """
        if not self.spillable(entry):
            return False
        stores = self.stores_of(entry)
        taken = []
        try:
            for store in stores:
                if not store.lock.acquire(blocking=False):
                    return False
                taken.append(store)
            # A store resident on a device but not in use may stay there: its device copy
            # is the pool's, never copied back, and its host tensor is read again only at
            # its next promotion (which pins the entry and reads it back first).
            if not fresh and any(host.busy(s) for s in stores):
                return False
            with self._lock:  # promotions take their stores' locks first: none now
                if not (entry.live and not entry.on_disk and not entry.pins) or _copying(entry):
                    return False
                refs = list(entry.refs)
            key = ("f",)
            if entry.file is None:
                entry.file = host.frozen_file(entry.ledger_key)
                start = time.perf_counter()
                try:
                    nbytes = entry.file.write([(key, entry.host)])
                    view = entry.file.views()[key]
                except (SpillWriteError, SpillReadError) as err:
                    log.warning("frozen tensor %s stays in host memory: %s", entry.name, err)
                    entry.file.close()
                    entry.file = None
                    entry.failed = True
                    return False
                host.note_frozen_io(entry, "to_disk", nbytes, start)
            else:
                view = entry.file.views()[key]
            with self._lock:
                entry.host = view
                entry.on_disk = True
            for ref in refs:
                ref.store.frozen.moved(ref.index)
            host.drop(entry.ledger_key, (refs[0].task if refs else "", -1))
            return True
        finally:
            for store in taken:
                store.lock.release()

    def pin(self, entries: list[FrozenEntry], delta: int) -> None:
        """A promotion brings ``entries`` to a device (``delta=1``) or is done (``-1``):
        not spilled meanwhile."""
        with self._lock:
            for entry in entries:
                entry.pins += delta

    def load(self, entry: FrozenEntry, store: Any) -> None:
        """``entry`` back into host memory if it is on disk (read once, counted once),
        for ``store`` (pinning it, and holding its lock) to use. Other users are pointed
        at the RAM copy as they next move (they read the same values from the view until
        then).

        Raises:
            SpillReadError: the file cannot be read (the entry stays on disk).
        """
        with self._load_lock:  # one reader per entry; others wait for its result
            with self._lock:
                if not entry.on_disk:
                    return
                view = entry.host
            assert self.host is not None and entry.file is not None
            self.host.hold(entry.ledger_key, entry.nbytes, (store.name[0], -1), store)
            start = time.perf_counter()
            buf = torch.empty(view.shape, dtype=view.dtype)
            try:
                entry.file.read_into(("f",), buf)
            except SpillReadError:
                self.host.drop(entry.ledger_key, (store.name[0], -1))
                raise
            buf = cow_ready(buf)
            with self._lock:
                entry.host = buf
                entry.on_disk = False
            self.host.note_frozen_io(entry, "from_disk", entry.nbytes, start)

    # -- leaving --------------------------------------------------------------------------

    def release(self, ref: FrozenRef, param: nn.Parameter, *, keep: bool = False) -> None:
        """A store slot drops its reference (its task leaves, or the slot was modified).

        Args:
            ref: the slot's reference.
            param: the slot's parameter, pointed at the pool's tensor (at home).
            keep: the slot takes the entry's tensor as its own (only when no other task
                uses it: the caller checked ``ref.entry.others``).
        """
        entry = ref.entry
        with self._lock:
            if ref in entry.refs:
                entry.refs.remove(ref)
            entry.users -= 1
            left = entry.tasks.get(ref.task, 0) - 1
            if left > 0:
                entry.tasks[ref.task] = left
            else:
                entry.tasks.pop(ref.task, None)
            last = entry.users == 0
            if last or keep:
                if self._index.get(entry.key) is entry:
                    del self._index[entry.key]
                self._ledger.pop(entry.ledger_key, None)
                entry.live = False
            private = not last and not keep
            on_disk = entry.on_disk
        if on_disk and address(param.data) == address(entry.host):
            # A view of the pool's spill file: the model gets its values in RAM (a write
            # into the shared mapping would reach the file the other tasks read).
            param.data = entry.host.clone()
        elif private and address(param.data) == address(entry.host):
            # The model is the user's again, and other tasks still use this tensor: a
            # copy-on-write clone, so that a write by the user copies it then, on the
            # user's side, and no other task sees it (no copy until then).
            param.data = lazy_clone(entry.host)
        if last or keep:
            if self.host is not None and not on_disk:
                self.host.drop(entry.ledger_key, (ref.task, -1))
            if entry.file is not None and last:
                entry.file.close()


class SlotOwner(Protocol):
    """What :class:`FrozenSlots` uses of the store whose slots it keeps (``ShardStore``)."""

    lock: Any  # re-entrant: the store's, held by every promotion and demotion

    @property
    def at_home(self) -> bool:
        """Whether no device holds copies of the store's live tensors."""
        ...

    def param_shared(self, index: int) -> None:
        """Parameter ``index`` now points at a pool tensor: out of the store's own state."""
        ...

    def param_owned(self, index: int, host: torch.Tensor | None) -> None:
        """Parameter ``index`` is the store's own state again, its host tensor ``host``
        (``None``: on a device, its host buffer comes at the demotion); it changed."""
        ...


class FrozenSlots(Mapping[int, FrozenRef]):
    """A store's parameters whose host tensor is a frozen pool's, shared with other tasks:
    parameter index -> its reference into the pool (a read-only mapping).

    They are outside the store's own state (never counted, copied back or spilled with
    it). Each slot points at the shared tensor it refers to now (the pool's host tensor or
    device copy: the parameter holds a copy-on-write alias of it where torch can make
    one, see :func:`alias`); its version then tells a write (see :meth:`check`). Changes
    of the store's own state go through its :class:`SlotOwner` methods; the store's lock
    is taken as the store would take it.

    Args:
        params: the store's parameters (indexed as the store's slots are).
        owner: the store.
    """

    def __init__(self, params: list[nn.Parameter], owner: SlotOwner) -> None:
        self._params = params
        self._owner = owner
        self._refs: dict[int, FrozenRef] = {}
        # Each slot's shared tensor now, and the parameter's version when pointed at it.
        self._live: dict[int, tuple[torch.Tensor, int]] = {}
        # A change found as a slot was re-pointed (promotion, demotion) that wrote the
        # shared tensor itself: raised at the next check.
        self._bad: dict[int, str] = {}
        self._dev: dict[int, DeviceKey] = {}  # its pool device copy's key

    def __getitem__(self, index: int) -> FrozenRef:
        return self._refs[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, index: object) -> bool:
        return index in self._refs

    # The dict's own views: ``list(slots.values())`` is one atomic read, as the device
    # ledger's (``shared_parts``) is made without the store's lock.
    def keys(self) -> KeysView[int]:
        return self._refs.keys()

    def values(self) -> ValuesView[FrozenRef]:
        return self._refs.values()

    def items(self) -> ItemsView[int, FrozenRef]:
        return self._refs.items()

    def nbytes(self) -> int:
        """Bytes of the parameters whose host tensor is a pool's."""
        return sum(r.entry.nbytes for r in self._refs.values())

    @property
    def on_disk(self) -> bool:
        """Whether an entry of a slot is in the pool's disk tier."""
        return any(ref.entry.on_disk for ref in self._refs.values())

    # -- joining and leaving the pool -----------------------------------------------------

    def share(self, index: int, ref: FrozenRef) -> None:
        """Point parameter ``index`` (frozen, at home) at the pool's tensor ``ref.entry.host``
        and leave it out of the store's own state from now on."""
        with self._owner.lock:
            p = self._params[index]
            p.data = alias(ref.entry.host)
            self._refs[index] = ref
            self._live[index] = (ref.entry.host, p._version)
            self._owner.param_shared(index)

    def leave(self) -> None:
        """The task leaves: drop every reference into the pool (see
        :meth:`FrozenPool.release`; the state is at home)."""
        with self._owner.lock:
            for i, ref in list(self._refs.items()):
                self._home(i)
                del self._refs[i]
                self._live.pop(i, None)
                self._bad.pop(i, None)
                ref.pool.release(ref, self._params[i])

    def own(self, index: int) -> None:
        """Shared parameter ``index`` (at home) leaves the pool for the store's own state,
        before the user's thread writes other values into it (``load_state_dict`` on a
        ``th.shard`` model): with a private copy while other tasks use its entry."""
        with self._owner.lock:
            assert self._owner.at_home, "at home only"
            ref = self._refs.pop(index)
            self._live.pop(index, None)
            p = self._params[index]
            ref.pool.release(ref, p, keep=not ref.pool.others(ref))
            self._owner.param_owned(index, p.data)

    def rewritten(self, index: int) -> None:
        """The user's thread wrote shared parameter ``index`` (at home) with the values it
        had (``load_state_dict`` of a checkpoint of the same base): only its version counter
        moved, which the next op's check must not take for a change."""
        with self._owner.lock:
            live, _ = self._live[index]
            p = self._params[index]
            if address(p.data) != address(live):  # the write copied its alias: share again
                p.data = alias(live)
            self._live[index] = (live, p._version)

    # -- checks ---------------------------------------------------------------------------

    def check(
        self, when: str, *, values: bool = False, during: bool = False, settle: bool = False
    ) -> None:
        """Whether the shared parameters are as the store left them (see the module
        docstring); ``values``: their values too (a checksum: one pass over each, where it
        is).

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
            when: how the error's message says when the change was found.
            values: compare checksums too.
            during: the change may be the op's own.
            settle: never raise (a promotion or demotion re-points the slots): a failing
                change is kept for the next check to raise.

        Raises:
            FrozenTensorModifiedError: one another task also uses was changed.
        """
        for i, ref in list(self._refs.items()):
            pending = self._bad.get(i)
            what = pending or self._change(i, values)
            if what is None:
                continue
            p = self._params[i]
            shared = self._live[i][0]
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
                and p._version == self._live[i][1]
                and torch.equal(p.data, shared)
            ):  # copied by a pointer request (data_ptr(), numpy()), not written
                p.data = alias(shared)
                self._live[i] = (shared, p._version)
                continue
            others = ref.pool.others(ref)
            if not others:
                self._bad.pop(i, None)
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
                self._bad[i] = what
                continue
            self._bad.pop(i, None)
            raise FrozenTensorModifiedError(ref.task, ref.name, what, others)

    def _change(self, i: int, values: bool) -> str | None:
        p = self._params[i]
        live, version = self._live[i]
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
        if values and checksum(t) != self._refs[i].entry.checksum:
            return "written in place through .data"
        return None

    def _unshare(self, i: int) -> None:
        """Parameter ``i`` changed, and no other task uses its entry: it becomes the
        store's own again (as if never shared), the entry leaves the pool."""
        with self._owner.lock:
            ref = self._refs.pop(i)
            shared, _ = self._live.pop(i)
            self._bad.pop(i, None)
            key = self._dev.pop(i, None)
            if key is not None:  # its device copy is the store's own now
                ref.pool.off_device(ref.entry, key)
            p = self._params[i]
            if address(p.data) == address(shared):  # the tensor itself, not an alias of it
                p.data = shared
            if self._owner.at_home:
                # At home (or in place): its tensor is the entry's, now the store's own
                # (released first: one the pool had on disk is read into RAM for it).
                ref.pool.release(ref, p, keep=True)
                host = p.data
            else:
                # On a device: the entry's tensor is its host buffer, filled at demotion
                # (a RAM copy of one on disk: the store writes its buffer).
                host = ref.entry.host.clone() if ref.entry.on_disk else ref.entry.host
                ref.pool.release(ref, p, keep=True)
            self._owner.param_owned(i, host)

    def _take_own(self, i: int) -> None:
        """Parameter ``i`` was written between ops into the task's own copy-on-write
        alias (now a private tensor, see :meth:`check`) while other tasks use its entry:
        that tensor becomes the store's own state, the others keep the entry."""
        with self._owner.lock:
            ref = self._refs.pop(i)
            self._live.pop(i, None)
            self._bad.pop(i, None)
            key = self._dev.pop(i, None)
            if key is not None:  # the shared device copy stays the others'
                ref.pool.off_device(ref.entry, key)
            p = self._params[i]
            ref.pool.release(ref, p)  # p.data is at another address: left as it is
            # (On a device its host buffer is allocated at the demotion, which copies it.)
            self._owner.param_owned(i, p.data if self._owner.at_home else None)

    # -- moving with the store ------------------------------------------------------------

    def moved(self, index: int) -> None:
        """The pool moved shared parameter ``index``'s entry (to a view of its spill file,
        or back into RAM): point the parameter at its tensor now (the store is at home;
        the caller holds its lock)."""
        ref = self._refs[index]
        if not self._owner.at_home:
            return  # its device copy stays; its demotion points it at the entry's tensor
        if self._live[index][0] is not ref.entry.host:
            self._point(index, ref.entry.host)

    def ready(self) -> list[FrozenEntry]:
        """Before a visit: the shared entries pinned (not spilled during it) and in host
        memory (read back once from the pool's spill file if they were on disk), the
        parameters pointed at them. Returns the entries, to :meth:`unpin` after the
        promotion.

        Raises:
            SpillReadError: an entry cannot be read back (unpinned again)."""
        entries = [ref.entry for ref in self._refs.values()]
        if not entries:
            return entries
        pool = next(iter(self._refs.values())).pool
        pool.pin(entries, 1)
        try:
            for i, ref in self._refs.items():
                if ref.entry.on_disk:
                    pool.load(ref.entry, self._owner)
                self.moved(i)
        except BaseException:
            pool.pin(entries, -1)
            raise
        return entries

    def unpin(self, entries: list[FrozenEntry]) -> None:
        """Unpin ``entries`` (see :meth:`ready`)."""
        if entries:
            next(iter(self._refs.values())).pool.pin(entries, -1)

    def to_device(self, device: torch.device, owner: object, stream: Any) -> int:
        """Point every slot at its entry's copy on ``device`` held by ``owner`` (one copy
        per device for every task resident there, never copied back: the pool's host
        tensor keeps the values); returns the bytes copied."""
        moved = 0
        for i, ref in self._refs.items():
            dev, copied, key = ref.pool.to_device(ref.entry, device, owner, stream)
            self._dev[i] = key
            moved += copied
            self._point(i, dev)
        return moved

    def home(self) -> None:
        """The store left its device: every slot's device copy is given back (dropped as
        an unchanged one is), the slot pointed at its entry's host tensor."""
        for i in self._refs:
            self._home(i)

    def _home(self, i: int) -> None:
        ref = self._refs[i]
        key = self._dev.pop(i, None)
        if key is not None:
            ref.pool.off_device(ref.entry, key)
        self._point(i, ref.entry.host)

    def _point(self, i: int, shared: torch.Tensor) -> None:
        """Point shared parameter ``i`` at (an alias of) ``shared``, unless the task wrote
        its alias since the last check (the next check takes that tensor as the task's
        own): the slot now refers to ``shared``, its version as it was."""
        p = self._params[i]
        live, version = self._live[i]
        if i not in self._bad and address(p.data) != address(live):
            self._live[i] = (shared, version)
            return
        p.data = alias(shared)
        self._live[i] = (shared, version if i in self._bad else p._version)


def shared_parts(slots: Iterable[FrozenSlots], state_bytes: int) -> tuple[tuple[object, int], ...]:
    """The pool entries ``slots`` (stores' shared slots) use, each once, as ``(ledger
    key, bytes)``; empty if they add up to more than ``state_bytes``."""
    parts: dict[object, int] = {}
    for one in slots:
        for ref in list(one.values()):
            parts[ref.entry.ledger_key] = ref.entry.nbytes
    if sum(parts.values()) > state_bytes:
        return ()
    return tuple(parts.items())


def _copying(entry: FrozenEntry) -> bool:
    """Whether a CUDA copy from ``entry``'s host tensor may still be reading it."""
    return any(slot[2] is not None and not slot[2].query() for slot in entry.devices.values())


def shared_on_device(store: Any, worker: Any) -> int:
    """Bytes of ``store``'s shared frozen tensors (a ``LinkedStore``'s parts' too) that
    already have a copy on ``worker``'s device, held by it for other tasks: promoting
    the store there would not copy them (the policy prefers such a shard)."""
    total = 0
    for part in [store.own, *store.shared] if hasattr(store, "own") else [store]:
        refs = getattr(part, "frozen", None)
        if not refs:
            continue
        key: DeviceKey = (str(worker.device), id(worker))  # as the worker promotes it
        ref = next(iter(refs.values()))
        with ref.pool._lock:  # the leaf lock: only the entries' device maps are read
            total += sum(r.entry.nbytes for r in refs.values() if key in r.entry.devices)
    return total


__all__ = [
    "FrozenEntry",
    "FrozenPool",
    "FrozenRef",
    "FrozenSlots",
    "Prepared",
    "SlotOwner",
    "address",
    "alias",
    "canonical_name",
    "checksum",
    "cow_ready",
    "digest",
    "lazy_clone",
    "shared_on_device",
    "shared_parts",
]
