"""A trial's model in a process that many trials share: plain Tune's isolation, kept.

In plain Ray Tune every trial is a process of its own: its factory's closure, its
``tune.with_parameters`` data and its module's globals are fresh copies, so whatever one
trial trains in place, the next one never sees. Here every trial's factory runs in the
engine's process, so two things a careless (but correct in plain Tune) factory does
would leak one trial's training into another:

* **A tensor that outlives the trial becomes a trained parameter**:
  ``nn.Embedding.from_pretrained(weights, freeze=False)`` on ``with_parameters`` data, or
  ``nn.Parameter(W)`` around a module-level ``W``. The parameter shares ``W``'s storage,
  so training writes into ``W`` and the next trial starts from the trained values.
  :func:`own_storage` gives every tensor the trial trains (parameters that require grad,
  and buffers, which training may update in place: BatchNorm's running statistics) a
  storage of its own whenever anything outside the model holds the old one. Frozen
  parameters stay shared: nothing writes them.
* **A module object, or a parameter object, that outlives the trial** (a module-level
  ``MODEL = Net()``, or one ``nn.Parameter``): the trial would start from an earlier
  trial's weights. :class:`TrialClaims` (one per process, :data:`CLAIMS`) remembers, weakly,
  which trial of which front-end run trained each module and parameter, and refuses them
  to any other trial with :class:`~tune_hydra.exceptions.ReusedModelError` — also across
  two ``th.optimize`` calls, or two experiments, in one process.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from tune_hydra.frontends.trial import own_storage
    >>> W = torch.zeros(4, 2)  # module-level, or tune.with_parameters data
    >>> emb = nn.Embedding.from_pretrained(W, freeze=False)
    >>> own_storage(emb)
    ['weight']
    >>> with torch.no_grad():
    ...     _ = emb.weight.add_(1.0)
    >>> float(W.sum()), float(emb.weight.sum())
    (0.0, 8.0)
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from tune_hydra.exceptions import ReusedModelError, SharedModelError

logger = logging.getLogger(__name__)

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _trained(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors training may change in place, by qualified name (each object once)."""
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            yield name, p
    for name, b in model.named_buffers(remove_duplicate=True):
        if id(b) not in seen:
            seen.add(id(b))
            yield name, b


def own_storage(model: nn.Module) -> list[str]:
    """Give each tensor ``model`` trains a storage nobody outside the model holds.

    Tensors of the model that view one storage keep viewing one (new) storage together;
    a storage only the model holds is left as it is (no copy). Where torch does not tell
    how many tensors hold a storage, every trained tensor is copied. The tensors keep
    their identity (``.data`` is replaced), so a hook or optimizer made on them still
    applies.

    Args:
        model: the trial's model, before anything else (an optimizer, the engine) holds
            its tensors.

    Returns:
        The names of the tensors that got a copy.
    """
    trained = {id(t) for _, t in _trained(model)}
    groups: dict[tuple[torch.device, int], list[tuple[str, torch.Tensor]]] = {}
    seen: set[int] = set()
    # Every tensor of the model (frozen ones too): a frozen view of a trained storage
    # must move with it, or the two would stop aliasing.
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or t.device.type == "meta" or t.numel() == 0:
            continue
        seen.add(id(t))
        key = (t.device, t.untyped_storage().data_ptr())
        groups.setdefault(key, []).append((name, t))
    copied: list[str] = []
    with torch.no_grad():
        for members in groups.values():
            if not any(id(t) in trained for _, t in members):
                continue  # frozen: shared, since nothing writes it
            storage = members[0][1].untyped_storage()
            # One count per tensor object holding the storage, one for `storage` here:
            # more than the model's own tensors means someone else holds it too.
            if _use_count is not None and _use_count(storage._cdata) <= len(members) + 1:
                continue
            if len(members) == 1:
                _, t = members[0]
                t.data = t.data.clone(memory_format=torch.preserve_format)
            else:
                fresh = storage.clone()
                for _, t in members:
                    view = torch.empty(0, dtype=t.dtype, device=t.device)
                    view.set_(fresh, t.storage_offset(), t.size(), t.stride())
                    t.data = view
            copied.extend(name for name, _ in members)
    return copied


@dataclass(eq=False)
class _Owner:
    """The trial that trained a module or parameter: its key in its front end's run,
    and whether that run still trains it (weakly: a run that is gone trains nothing)."""

    key: str
    run: weakref.ReferenceType[Any]
    live: Callable[[Any, str], bool]

    def same(self, run: Any, key: str) -> bool:
        return self.run() is run and self.key == key

    def training(self) -> bool:
        run = self.run()
        return run is not None and self.live(run, self.key)


class TrialClaims:
    """Which trial trained each module and trained tensor of this process (weakly).

    A front-end run (an engine actor, a ``th.optimize`` call) calls :meth:`check` with a
    trial's freshly built model before the engine sees it, and :meth:`record` once the
    engine took it. ``live(run, key)`` tells whether that run still trains trial ``key``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modules: weakref.WeakKeyDictionary[nn.Module, _Owner] = weakref.WeakKeyDictionary()
        self._tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def check(
        self,
        model: nn.Module,
        run: Any,
        key: str,
        live: Callable[[Any, str], bool],
    ) -> None:
        """Refuse ``model`` for trial ``key`` of ``run`` if another trial trained (or
        trains) any of its modules or trained tensors.

        Raises:
            ReusedModelError: an ended trial (of any run in this process) trained them.
            SharedModelError: a live trial of this process trains them (``th.shard``
                would refuse the model with a less helpful error).
        """
        found: dict[int, tuple[_Owner, list[tuple[str, str]]]] = {}
        with self._lock:
            for name, module in model.named_modules():
                owner = self._modules.get(module)
                if owner is not None and not owner.same(run, key):
                    found.setdefault(id(owner), (owner, []))[1].append((name, ""))
            for name, t in _trained(model):
                owner = self._tensors.get(t)
                if owner is not None and not owner.same(run, key):
                    found.setdefault(id(owner), (owner, []))[1].append((name, ""))
        for owner, names in found.values():
            if not owner.training():
                raise ReusedModelError(key, owner.key, names)
            raise SharedModelError(key, owner.key, [(n, n) for n, _ in names])

    def record(
        self,
        model: nn.Module,
        run: Any,
        key: str,
        live: Callable[[Any, str], bool],
    ) -> None:
        """Note that trial ``key`` of ``run`` trains ``model`` (its modules and tensors)."""
        owner = _Owner(key, weakref.ref(run), live)
        with self._lock:
            for module in model.modules():
                self._modules[module] = owner
            for _, t in _trained(model):
                self._tensors[t] = owner


CLAIMS = TrialClaims()
"""The process's one record of which trial trained which module."""


def prepare_model(
    model: nn.Module,
    run: Any,
    key: str,
    live: Callable[[Any, str], bool],
) -> None:
    """Make a freshly built trial model safe to train in this shared process: refuse
    modules and tensors another trial trained (:meth:`TrialClaims.check`), then give the
    trained tensors storage of their own (:func:`own_storage`).

    Raises:
        ReusedModelError: see :meth:`TrialClaims.check`.
        SharedModelError: see :meth:`TrialClaims.check`.
    """
    CLAIMS.check(model, run, key, live)
    copied = own_storage(model)
    if copied:
        shown = ", ".join(map(repr, copied[:6])) + (" ..." if len(copied) > 6 else "")
        logger.info(
            "tune_hydra: trial %s trains %d tensor(s) whose storage outlives the trial "
            "(with_parameters data, a closure or a module global): %s; it trains copies, "
            "as a trial process of its own would",
            key,
            len(copied),
            shown,
        )


__all__ = ["CLAIMS", "TrialClaims", "own_storage", "prepare_model"]
