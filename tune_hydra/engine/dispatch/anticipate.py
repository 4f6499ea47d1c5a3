"""Holding an idle device for a loop about to come back: :class:`Anticipation`.

A ``th.shard`` loop (a ``TaskLoop``'s batches too) issues its ops from its own thread.
Between two of its ops (two batches: the chain of one ends, the optimizer step is
recorded, the next batch fetched) the device that ran its last op is idle while the
loop's Python runs, well under a millisecond for a ``TaskLoop``. Given at once to another
task's op, a copying device soon evicts this loop's shard, and the loop's next op waits or
goes to another device: its shard travels. A ``ModelTask``'s program has its next op ready
as the last ends, so this never happens there (measured: the same 4 tasks as loops
copied 1.8x the bytes, kept-graph mode).

So the device waits for the loop, as a disk scheduler holds its head for a process
reading on (anticipatory scheduling): at most a few of the loop's own observed gaps,
never over :data:`CAP_S`, and not at all for a loop whose gaps are longer (its Python,
data loading or logging takes its time: waiting would only idle the device). While a
device waits for a loop, that loop's next op goes to no other device.

Only on copying devices (a GPU; a device computing in host memory moves nothing) where
batches keep their graphs on the device (``recompute=False``): there a loop's
next op needs its device (its graphs are there) and a migration costs most. Measured
(``loops.py``, 4 tasks, 2 copying devices): kept-graph task loops went from 0.71-0.73x
of the same tasks as programs to 1.02-1.13x, users' loops from 0.63-0.66x to 0.87-0.88x.
With recomputation they gained nothing (0.93-0.96x either way) and cost LoRA loops on
a shared base some of their batching (``lora_batched.py --loops``: 1.09x, 0.99x; noisy).

Accounting (all under the engine's lock): one hold per device at most; a hold ends when
its loop's op is assigned, at its deadline, or when the loop fails, is cancelled or
leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tune_hydra.engine.dispatch.workers import DeviceWorker
    from tune_hydra.engine.records import TaskRecord

CAP_S = 0.002
"""The longest a device waits for a loop (on a GPU several short ops; on the CPU
emulation a few times a ``TaskLoop``'s gap between batches, 0.4-0.6 ms)."""

_GAPS = 3.0  # a hold lasts this many of the loop's typical gaps
_WEIGHT = 0.3  # of a new gap in the running estimate
_LONGEST = 10 * CAP_S  # a gap counts at most this (a report, an evaluation between)


class Anticipation:
    """The devices waiting for a loop, and each loop's typical gap between its ops.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> holds = Anticipation()
        >>> w, other = NS(index=0), NS(index=1)
        >>> loop = NS(name="a", error=None, cancelled=False, assigned=None)
        >>> holds.begin(loop, w, now=1.0)
        1.002
        >>> holds.holder(w, now=1.001) is loop, holds.elsewhere(loop, other, now=1.001)
        (True, True)
        >>> holds.holder(w, now=1.003) is None  # past its deadline
        True
    """

    def __init__(self) -> None:
        self._holds: dict[int, tuple[TaskRecord, float]] = {}  # device index -> hold
        self._idle_since: dict[str, float] = {}  # loop -> when its last op ended
        self._gap: dict[str, float] = {}  # loop -> its typical gap (running estimate)

    def after_op(self, entry: TaskRecord, w: DeviceWorker, now: float) -> bool:
        """``entry``'s op on ``w`` ended: if ``entry`` is a loop between two of its ops
        (its runner ``comes_back``, no op of it ready) and ``w``, a copying device, has
        nothing queued, hold ``w`` for it (:meth:`begin`). Whether a hold began (the
        dispatch thread must then wake at its deadline)."""
        runner = entry.runner
        if not w.copy or w.assigned or runner.current is not None:
            return False  # a device computing in host memory moves no state: no need
        if not getattr(runner, "comes_back", False):
            return False
        return self.begin(entry, w, now) is not None

    def begin(self, entry: TaskRecord, w: DeviceWorker, now: float) -> float | None:
        """``entry``'s op on ``w`` ended and it has no next op yet: hold ``w`` for it,
        unless its gaps are long. Returns the hold's deadline (None: no hold)."""
        self._idle_since[entry.name] = now
        gap = self._gap.get(entry.name)
        if gap is not None and gap > CAP_S:
            return None
        until = now + (CAP_S if gap is None else min(CAP_S, _GAPS * gap))
        self._holds[w.index] = (entry, until)
        return until

    def came(self, entry: TaskRecord, now: float) -> None:
        """``entry``'s next op is ready: fold the gap into its estimate."""
        since = self._idle_since.pop(entry.name, None)
        if since is None:
            return
        gap = min(now - since, _LONGEST)
        old = self._gap.get(entry.name)
        self._gap[entry.name] = gap if old is None else old + _WEIGHT * (gap - old)

    def holder(self, w: DeviceWorker, now: float) -> TaskRecord | None:
        """The loop ``w`` waits for (None: none, or its hold ended)."""
        hold = self._holds.get(w.index)
        if hold is None:
            return None
        entry, until = hold
        if until <= now or entry.error is not None or entry.cancelled or entry.assigned:
            del self._holds[w.index]
            return None
        return entry

    def may_take(
        self, entry: TaskRecord, w: DeviceWorker, waits_for: TaskRecord | None, now: float
    ) -> bool:
        """Whether ``w`` (waiting for ``waits_for``, see :meth:`holder`) may take
        ``entry``'s ready op: no hold is in the way."""
        if waits_for is not None:
            return entry is waits_for
        return not self.elsewhere(entry, w, now)

    def elsewhere(self, entry: TaskRecord, w: DeviceWorker, now: float) -> bool:
        """Whether another device than ``w`` waits for ``entry`` (its op goes there)."""
        return any(
            e is entry and until > now and index != w.index
            for index, (e, until) in self._holds.items()
        )

    def all_busy(self, workers: Sequence[DeviceWorker], now: float) -> bool:
        """Whether every device has an op or waits for a loop (then an op of a shared
        shard runs along with one queued: ``Engine(batch_shared=True)``)."""
        return all(w.assigned or self.holder(w, now) is not None for w in workers)

    def release(self, w: DeviceWorker) -> None:
        """``w``'s hold is over (its loop's op was assigned to it)."""
        self._holds.pop(w.index, None)

    def timeout(self, poll_s: float, now: float) -> float:
        """How long the dispatch thread may sleep: ``poll_s``, or until the earliest
        deadline of a hold (its device is then offered every ready op)."""
        until = min((until for _, until in self._holds.values()), default=None)
        return poll_s if until is None else min(poll_s, max(until - now, 1e-4))

    def forget(self, name: str) -> None:
        """Task ``name`` left the engine."""
        self._idle_since.pop(name, None)
        self._gap.pop(name, None)
        for index, (e, _) in list(self._holds.items()):
            if e.name == name:
                del self._holds[index]


__all__ = ["CAP_S", "Anticipation"]
