"""One dispatch decision: offer every ready operation, let the policy choose, validate.

When a device frees up, the dispatcher

1. **offers** the policy one :class:`~tune_hydra.core.policies.Candidate` per ready task,
   built by :func:`offer` (the one place a candidate is made): *every* ready operation,
   with what a policy needs to weigh memory — whether it fits on that device now, the
   bytes of shard state it would bring in, whether that state is in host memory or on
   disk, and how far its trial is from its next milestone;
2. lets the policy **choose** (:meth:`~tune_hydra.core.policies.BasePolicy.select`; by
   default the policy's ``choose`` sees only the candidates that fit, as the engine's
   dispatcher always did);
3. **validates** the choice: it must be one of the candidates offered, and fit now; else
   :class:`~tune_hydra.exceptions.ScheduleError` (a policy bug: it is not silently fixed).

The engine's dispatcher (``Dispatcher._fill``) and the simulator
(:mod:`tune_hydra.core.simulate`) both build their candidates with :func:`offer` and decide
with :func:`decide`, so a policy is simulated with the code the engine runs.
This module imports neither torch nor the engine.

Example:
    >>> from tune_hydra.core.dispatch import decide, offer
    >>> from tune_hydra.core.ops import Op, OpKind
    >>> from tune_hydra.core.policies import LRTFPolicy
    >>> big = offer(Op("a", OpKind.FORWARD, 0), 9.0, ready_since=0.0, order=0, fits=False)
    >>> small = offer(Op("b", OpKind.FORWARD, 0), 1.0, ready_since=0.0, order=1)
    >>> decide(LRTFPolicy(), 0, [big, small])  # the longest does not fit: the other runs
    1
    >>> decide(LRTFPolicy(), 0, [big]) is None  # nothing fits: the device waits
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from tune_hydra.core.ops import Op
from tune_hydra.core.policies import BasePolicy, Candidate
from tune_hydra.exceptions import ScheduleError


def offer(
    op: Op,
    remaining_s: float,
    *,
    ready_since: float,
    order: int,
    resident: bool = False,
    in_host: bool = True,
    fits: bool = True,
    bring_in_bytes: int = 0,
    milestone_s: float | None = None,
    shared_bytes: int = 0,
) -> Candidate:
    """The candidate a task's ready ``op`` is offered as (see
    :class:`~tune_hydra.core.policies.Candidate` for each fact).

    Args:
        op: the task's next operation.
        remaining_s: estimated seconds of work the task has left.
        ready_since: clock seconds at which ``op`` became ready.
        order: the task's registration order (ties).
        resident: running it on the device offered is cheaper than elsewhere (its shard
            is there, or, on a device that copies nothing, the task ran there last);
            ``False`` when offered for no particular device (a ranking).
        in_host: its shard's state is in host memory or on a device (not on disk).
        fits: it may run on the device offered now, within that device's memory.
        bring_in_bytes: bytes of shard state the device must copy in before it runs.
        milestone_s: estimated seconds of its work before its trial's next milestone
            (``None``: not known).
        shared_bytes: bytes of its shard's state already on the device offered, held
            there for other tasks that share them (a frozen base).

    Returns:
        The candidate.
    """
    c = _new(Candidate)
    _set_op(c, op)
    _set_remaining_s(c, remaining_s)
    _set_resident(c, resident)
    _set_ready_since(c, ready_since)
    _set_order(c, order)
    _set_in_host(c, in_host)
    _set_fits(c, fits)
    _set_bring_in_bytes(c, bring_in_bytes)
    _set_milestone_s(c, milestone_s)
    _set_shared_bytes(c, shared_bytes)
    return c


# ``Candidate(...)`` would be the same object, built in twice the time: a frozen
# dataclass's ``__init__`` sets each field through ``object.__setattr__``, and a candidate
# is built per ready task and op. The slots' own descriptors set them directly (a field
# added to ``Candidate`` without a setter here fails at import).
_new = object.__new__
(
    _set_op,
    _set_remaining_s,
    _set_resident,
    _set_ready_since,
    _set_order,
    _set_in_host,
    _set_fits,
    _set_bring_in_bytes,
    _set_milestone_s,
    _set_shared_bytes,
) = (getattr(Candidate, f.name).__set__ for f in fields(Candidate))


def decide(policy: BasePolicy, device: int, candidates: Sequence[Candidate]) -> int | None:
    """Ask ``policy`` which of ``candidates`` device ``device`` runs now, and check it.

    Args:
        policy: the scheduling policy.
        device: index of the free device.
        candidates: every ready operation (at least one), built by :func:`offer`.

    Returns:
        The index in ``candidates`` of the one to run, or ``None``: leave the device idle
        for now (no candidate fits, or the policy waits).

    Raises:
        ScheduleError: the policy chose something it was not offered, or a candidate that
            does not fit on the device now.
    """
    pick = policy.select(device, candidates)
    if pick is None:
        return None
    for i, c in enumerate(candidates):
        if c is pick:
            if not c.fits:
                raise ScheduleError(
                    f"policy {policy!r} chose {c.op} for device {device}, where it does not "
                    f"fit now (fits=False); a policy may only choose a candidate that fits, "
                    f"or None to leave the device idle"
                )
            return i
    raise ScheduleError(
        f"policy {policy!r} returned {pick!r}, which was not offered: it is not one of the "
        f"ready operations offered ({', '.join(str(c.op) for c in candidates)}); choose() "
        f"must return one of its candidates or None"
    )
