"""The scheduling policy interface: one decision method."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from tune_hydra.core.ops import Op


@dataclass(frozen=True, slots=True)
class Candidate:
    """A task's next operation, offered to a policy for one free device.

    Attributes:
        op: the operation.
        remaining_s: estimated seconds of work the task still has (measured shard times x
            operations left, including iterations announced with ``set_remaining``).
        resident: running the operation on the device being filled is cheaper than
            elsewhere: on a device that copies shard state (a GPU, or ``copy_on_cpu``),
            the shard is already there, so nothing moves; on a CPU device that copies
            nothing, the task is the one that ran there last, so its activations and
            state are still in that core's caches.
        ready_since: engine-clock seconds since the operation became ready.
        order: the task's registration order (0, 1, ...), for stable tie-breaking.
        in_host: the shard's state is in host memory (or on a device), not in the disk
            tier below it (always ``True`` without ``host_memory``): running it needs no
            disk read first.
        fits: the operation may run on the device being filled now, within its memory:
            its shard fits beside the operations already queued there, and its batch's
            kept graphs (``recompute=False``) are there or have room. A policy is offered
            every ready operation, but may only choose one that fits (the default
            :meth:`BasePolicy.select` hands ``choose`` only those).
        bring_in_bytes: bytes of shard state the device must copy in before running it
            (0 when resident, or on a device that computes in host memory).
        milestone_s: estimated seconds of the task's work before its trial's next
            milestone (the next result a search waits for, such as a successive-halving
            rung); ``None`` when not known.
        shared_bytes: bytes of its shard's state already on the device being filled
            because other tasks resident there share them (a fine-tuning search's frozen
            base, held once per device): not copied again, not in ``bring_in_bytes``.

    Candidates are built by :func:`tune_hydra.core.dispatch.offer` (the engine and the
    simulator both); those given to :meth:`BasePolicy.rank` are offered for no device
    (``resident=False``, ``fits=True``, ``bring_in_bytes=0``).
    """

    op: Op
    remaining_s: float
    resident: bool
    ready_since: float
    order: int
    in_host: bool = True
    fits: bool = True
    bring_in_bytes: int = 0
    milestone_s: float | None = None
    shared_bytes: int = 0


class BasePolicy(abc.ABC):
    """Decides which ready operation a free device runs next.

    Subclass it and implement :meth:`choose`; pass an instance as ``policy=`` to
    ``train_models``, ``Engine`` or ``HydraExecutor``. The engine calls ``choose`` from a
    single thread, so a policy may keep state without locks.

    Example:
        >>> from tune_hydra.core.policies import BasePolicy
        >>> class ShortestFirst(BasePolicy):
        ...     name = "srtf"
        ...     def choose(self, device, candidates):
        ...         return min(candidates, key=lambda c: (c.remaining_s, c.order))
    """

    name: str = "custom"

    def select(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        """What the dispatcher calls (:func:`tune_hydra.core.dispatch.decide`): offered
        every ready operation, fitting or not, return one that fits, or ``None``.

        By default the candidates that do not fit are dropped here and :meth:`choose`
        picks among the others (``None`` when none fits). Override it to weigh memory:
        for instance to leave a device idle for a while rather than start a small task
        while a long one waits for room. Choosing a candidate with ``fits=False`` is a
        :class:`~tune_hydra.exceptions.ScheduleError`.
        """
        for c in candidates:
            if not c.fits:
                fitting = [c for c in candidates if c.fits]
                return self.choose(device, fitting) if fitting else None
        return self.choose(device, candidates)

    @abc.abstractmethod
    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        """Pick one of ``candidates`` for device number ``device``.

        Args:
            device: index of the free device in the engine's device list.
            candidates: the ready operations that fit on that device now (never empty),
                one per task at most.

        Returns:
            One element of ``candidates``, or ``None`` to leave the device idle for now.
        """

    def rank(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """``candidates`` in the order this policy would most likely run them, without
        deciding anything (no state may change). With a disk tier, the engine reads the
        tasks' states back from disk in this order. Default: the longest waiting first.
        """
        return sorted(candidates, key=lambda c: (c.ready_since, c.order))

    def forget(self, task: str) -> None:  # noqa: B027 - optional hook, default no-op
        """Called when a task leaves the engine; drop any per-task state."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
