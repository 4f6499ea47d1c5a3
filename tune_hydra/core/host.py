"""Host memory accounting: one ledger per engine, asked by its host memory manager and by
the trace's replay.

A :class:`HostLedger` counts what the engine holds in host memory (RAM) now, each under
its key: shard states whose tensors are in RAM (spilled there by a device, loaded there
from the disk tier, or a model's own tensors since it was registered) and the frozen
pool's entries (``tune_hydra.engine.storage.frozen``).

With a budget, the engine keeps the total within it by moving the coldest shard states
to the disk tier (see ``tune_hydra.engine.storage.host``). The ledger does the arithmetic only:
no lock, no threads (its owner locks it; the trace replay is single-threaded), no torch.

Example:
    >>> ledger = HostLedger(100)
    >>> ledger.take(("a", 0), 60)
    >>> ledger.over(50)  # 60 held + 50 more is 10 over
    10
    >>> ledger.take(("b", 0), 30)
    >>> ledger.held, ledger.peak
    (90, 90)
    >>> ledger.give(("a", 0))
    60
    >>> ledger.held
    30
"""

from __future__ import annotations

from collections.abc import Hashable


class HostLedger:
    """What the engine holds in host memory: shard states and frozen pool entries.

    Args:
        budget: host bytes for all of it (``None``: no limit).
    """

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.states: dict[Hashable, int] = {}  # key -> bytes of that state in RAM
        self.held = 0
        self.peak = 0

    def holds(self, key: Hashable) -> bool:
        """Whether the state under ``key`` is counted in RAM."""
        return key in self.states

    def take(self, key: Hashable, nbytes: int) -> None:
        """Count ``nbytes`` of state under ``key`` (replacing what was counted for it)."""
        self.held += nbytes - self.states.get(key, 0)
        self.states[key] = nbytes
        self.peak = max(self.peak, self.held)

    def give(self, key: Hashable) -> int:
        """Stop counting ``key``'s state; returns the bytes it held (0 if none)."""
        nbytes = self.states.pop(key, 0)
        self.held -= nbytes
        return nbytes

    def over(self, nbytes: int = 0) -> int:
        """Bytes over budget if ``nbytes`` more were held (0 or less: it fits; always 0
        without a budget)."""
        if self.budget is None:
            return 0
        return self.held + nbytes - self.budget


__all__ = ["HostLedger"]
