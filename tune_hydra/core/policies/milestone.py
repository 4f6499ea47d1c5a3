"""Milestone first, with admission: serve a search's next decisions before its long tails.

A search with early stopping (ASHA, HyperBand, median stopping, PBT, Optuna's pruners)
acts on results at *milestones* (rungs, report steps); an adaptive searcher learns from
finished trials. Sharded-LRTF serves the trial with the most work left to its *end*, so
equal trials advance in lockstep and every trial's first result comes late.
:class:`MilestonePolicy` instead serves the work to each trial's *next milestone*
(``Candidate.milestone_s``), and *admits* only a few trials at a time, so the first ones
reach their milestones early and the others wait with their state spilled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tune_hydra.core.policies.base import BasePolicy, Candidate
from tune_hydra.core.policies.lrtf import LRTFPolicy

SLOTS_PER_DEVICE = 2
"""Trials admitted per device by default: the engine's queue depth on a device that
copies state (``prefetch=True``: one op runs while the next op's shard is copied in, and
that next op must be another trial's, since a trial's ops run one after another). On a
device of depth 1 (a CPU that copies nothing) the second slot is simply never asked for
by admission's own rule (a trial is admitted only when no admitted one is ready)."""

TENURE_SLACK = 0.25
"""How far past the work it was admitted for (its ``milestone_s`` then) an admitted trial
may run without reaching its milestone before it leaves admission: its milestone is
overdue (it reports less often than announced, or its front end moved the milestone on
without an iteration ending, as a ``th.shard`` loop's ``trial.report`` does), and the
trials waiting for a slot must not wait on it. The slack covers estimates that drift as
op times are measured."""


@dataclass(slots=True)
class _Admitted:
    """What the policy last saw of an admitted trial."""

    iteration: int
    milestone_s: float
    budget_s: float  # its milestone_s when admitted: the work its slot is for
    done_s: float = 0.0  # work done since, as its milestone_s went down


class MilestonePolicy(BasePolicy):
    """Work to the next milestone first, a few trials at a time; LRTF for committed work.

    The rules, in the order a free device applies them (to the ops that fit on it):

    1. **The critical path.** A committed trial (``milestone_s is None``: no decision
       point ahead — past its last rung, or the search cannot stop it) whose remaining
       work is at least ``critical`` x the ready work per device (every ready trial's
       ``remaining_s``, to its end, over the devices: as if no trial were stopped) runs
       first: each second it waits lengthens the run even then.
    2. **Admitted trials.** A resident one first (its shard is on the device, or it ran
       there last), then one whose state is in host memory, then the one with the most
       bytes on the device already for other trials sharing them (a frozen base), then
       the least work to its milestone.
    3. **Admission.** When no admitted trial's op fits, a trial with a milestone ahead
       is admitted and runs, so a device never idles while such a trial could run: the
       one with the fewest iterations done (breadth-first across rungs: a fresh trial's
       first rung before a promoted trial's next one, and equal trials take turns
       between milestones instead of one running ahead without evidence to be judged by;
       a trial whose next milestone is its end counts as none done, so the one nearest
       its end finishes first), then one that did not leave admission overdue (see
       below: the others waited for a slot), then the least work to its milestone
       (shortest first: the earliest results), then resident, in host memory, first
       registered. Admission is on demand, so the admitted set is what keeps the devices
       busy (with prefetch, the engine asks for a second op per device while the first
       runs: another trial's); at most ``slots_per_device x devices`` stay admitted,
       beyond that an op runs without admitting its trial (a trial waiting for its
       search between iterations lends its slot that way): the least work to its
       milestone first (its result comes soonest, and a trial lent ops before goes on
       instead of waiting half-way), those that left admission overdue last.
    4. **Committed trials**, when no trial with a milestone ahead fits: by
       :class:`LRTFPolicy` among themselves, since for them only the makespan is left
       to win.

    A trial leaves admission when it reaches its milestone (its iteration advanced and
    its ``milestone_s`` did not decrease although it did work: the front end announced
    the next milestone; or fell below half: the front end replaced an estimate, as
    ``th.optimize`` does at a ``th.shard`` loop's first ``trial.report``; or it became
    ``None``), when its milestone is overdue (the work
    it did since admission, summed from its ``milestone_s`` going down, exceeds what it
    had to its milestone when admitted by :data:`TENURE_SLACK`: no admitted trial holds
    a slot for good, so none waiting for one stalls), or when it leaves the engine
    (:meth:`forget`).
    A trial offered without a milestone at the same iteration as its last op run with
    one is *due*, not committed: its front end's count passed the milestone before the
    result came (a ``th.shard`` loop reporting later than announced; a factory's
    milestone passes only as an iteration ends). It is served as a trial with a
    milestone, with no work left to it (and keeps its slot if admitted), until a result
    comes (a new iteration).

    When no ready op has a milestone and none is admitted, every decision is exactly
    :class:`LRTFPolicy`'s (so ``auto`` costs a fixed-budget run nothing).

    :meth:`rank` lists the admitted trials first, then the others in admission order,
    then the committed ones: with a disk tier, the engine reads states back in that
    order, so the trials waiting for admission stay spilled.

    Args:
        slots_per_device: trials admitted per device (:data:`SLOTS_PER_DEVICE`).
        devices: the number of devices; ``None``: learnt from the device indices offered.
        affinity: the LRTF band for committed trials (see :class:`LRTFPolicy`).
        critical: the fraction of the work per device at which a committed trial runs
            ahead of the milestones (``float("inf")``: never).

    Raises:
        ValueError: ``slots_per_device`` or ``devices`` below 1, a bad ``affinity`` or a
            non-positive ``critical``.
    """

    name = "milestone"

    def __init__(
        self,
        slots_per_device: int = SLOTS_PER_DEVICE,
        devices: int | None = None,
        affinity: float = 0.05,
        critical: float = 1.0,
    ) -> None:
        if isinstance(slots_per_device, bool) or not isinstance(slots_per_device, int):
            raise ValueError(f"slots_per_device must be an int >= 1, got {slots_per_device!r}")
        if slots_per_device < 1:
            raise ValueError(f"slots_per_device must be >= 1, got {slots_per_device}")
        if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int)):
            raise ValueError(f"devices must be an int >= 1 or None, got {devices!r}")
        if devices is not None and devices < 1:
            raise ValueError(f"devices must be >= 1 or None, got {devices}")
        if not critical > 0:
            raise ValueError(f"critical must be > 0, got {critical}")
        self.slots_per_device = slots_per_device
        self.devices = devices
        self.critical = critical
        self._lrtf = LRTFPolicy(affinity)
        self._seen_devices = 0
        self._admitted: dict[str, _Admitted] = {}
        # Trials that left admission overdue: admitted again after the waiting ones.
        self._overdue: set[str] = set()
        # task -> the iteration of its last op run with a milestone ahead: offered with
        # none at that same iteration, its front end's count passed the milestone before
        # the result came (a loop reporting later than announced): still due, not
        # committed (a factory's milestone passes only as an iteration ends).
        self._due_at: dict[str, int] = {}

    # --- state -------------------------------------------------------------------------

    @property
    def admitted(self) -> list[str]:
        """The admitted trials, in admission order (a copy)."""
        return list(self._admitted)

    @property
    def capacity(self) -> int:
        """How many trials stay admitted at most: slots per device x devices."""
        return self.slots_per_device * max(1, self.devices or self._seen_devices)

    def forget(self, task: str) -> None:
        self._admitted.pop(task, None)
        self._overdue.discard(task)
        self._due_at.pop(task, None)

    def _due(self, c: Candidate) -> bool:
        """Whether ``c`` has a milestone ahead (or one due: see ``_due_at``)."""
        if c.milestone_s is not None:
            return True
        at = self._due_at.get(c.op.task)
        if at is None:
            return False
        if at != c.op.iteration:  # a result came since: committed (or moved on)
            del self._due_at[c.op.task]
            return False
        return True

    @staticmethod
    def _reached(seen: _Admitted, c: Candidate) -> bool:
        """Whether ``c`` shows its trial past the milestone it was admitted for."""
        m = c.milestone_s
        if m is None:  # at the same iteration: due (its result not in yet), not reached
            return c.op.iteration > seen.iteration
        # An iteration (a result) later with as much to go or more: the front end moved
        # the milestone on; with less than half as much: it replaced an estimate (a
        # loop's first report measures its steps), a milestone of its own too.
        return (
            c.op.iteration > seen.iteration and not 0.5 * seen.milestone_s <= m < seen.milestone_s
        )

    @staticmethod
    def _overran(seen: _Admitted, c: Candidate) -> bool:
        """Whether ``c`` (not past its milestone) shows its trial past the work it was
        admitted for: its milestone is overdue."""
        if c.milestone_s is None:
            return False  # due: its slot is kept until its result
        done = seen.done_s + max(0.0, seen.milestone_s - (c.milestone_s or 0.0))
        return done > (1.0 + TENURE_SLACK) * seen.budget_s

    def _refresh(self, candidates: Sequence[Candidate]) -> None:
        admitted = self._admitted
        for c in candidates:
            seen = admitted.get(c.op.task)
            if seen is None:
                continue
            if self._reached(seen, c):
                del admitted[c.op.task]
            elif self._overran(seen, c):
                del admitted[c.op.task]
                self._overdue.add(c.op.task)
            elif c.milestone_s is not None:
                m = c.milestone_s
                seen.done_s += max(0.0, seen.milestone_s - m)
                seen.iteration = c.op.iteration
                seen.milestone_s = m

    # --- decisions ---------------------------------------------------------------------

    def select(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        if device >= self._seen_devices:
            self._seen_devices = device + 1
        if not self._admitted and all(c.milestone_s is None for c in candidates):
            return self._lrtf.select(device, candidates)  # no search: plain LRTF
        self._refresh(candidates)
        return self.choose(device, [c for c in candidates if c.fits] if candidates else [])

    def choose(self, device: int, candidates: Sequence[Candidate]) -> Candidate | None:
        if not candidates:
            return None
        admitted = self._admitted
        bound = [c for c in candidates if c.milestone_s is not None]
        committed = [c for c in candidates if c.milestone_s is None]
        if committed and self._due_at:
            due = {id(c) for c in committed if self._due(c)}
            if due:
                bound += [c for c in committed if id(c) in due]
                committed = [c for c in committed if id(c) not in due]
        if committed:
            urgent = self._urgent(committed, candidates)
            if urgent is not None:
                return urgent
        mine = [c for c in bound if c.op.task in admitted]
        if mine:
            pick = min(mine, key=_admitted_key)
        elif not bound:
            return self._lrtf.choose(device, committed)
        elif len(admitted) < self.capacity:
            pick = min(bound, key=self._admission_key if self._overdue else _admission_key)
            m = pick.milestone_s or 0.0
            admitted[pick.op.task] = _Admitted(pick.op.iteration, m, m)
            self._overdue.discard(pick.op.task)
        else:  # lent while the admitted trials wait: to the one nearest its milestone
            overdue = self._overdue
            pick = min(bound, key=lambda c: (c.op.task in overdue, *_lent_key(c)))
        self._due_at[pick.op.task] = pick.op.iteration
        return pick

    def _urgent(
        self, committed: Sequence[Candidate], candidates: Sequence[Candidate]
    ) -> Candidate | None:
        """The longest committed trial if it is on the critical path, else ``None``."""
        if self.critical == float("inf") or len(candidates) < 2:
            return None
        longest = max(committed, key=lambda c: (c.remaining_s, -c.order))
        # Every ready trial's work to its end: as if none were stopped, so a committed
        # trial jumps the milestones only when it is the long pole even then.
        work = sum(c.remaining_s for c in candidates)
        devices = max(1, self.devices or self._seen_devices)
        if longest.remaining_s >= self.critical * work / devices:
            return self._lrtf.choose(0, committed)
        return None

    def rank(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        if not self._admitted and all(c.milestone_s is None for c in candidates):
            return self._lrtf.rank(candidates)
        admitted, bound, committed = [], [], []
        for c in candidates:
            seen = self._admitted.get(c.op.task)
            if seen is not None and not self._reached(seen, c) and not self._overran(seen, c):
                admitted.append(c)
            elif c.milestone_s is not None or self._due_at.get(c.op.task) == c.op.iteration:
                bound.append(c)
            else:
                committed.append(c)
        admitted.sort(key=_admitted_key)
        bound.sort(key=self._admission_key)
        return admitted + bound + self._lrtf.rank(committed)

    def _admission_key(self, c: Candidate) -> tuple[int, bool, float, bool, bool, int]:
        # Breadth-first; within a level the trials that left admission overdue after the
        # others (which waited for a slot), then as _admission_key.
        return (
            _level(c),
            c.op.task in self._overdue,
            c.milestone_s or 0.0,
            not c.resident,
            not c.in_host,
            c.order,
        )

    def __repr__(self) -> str:
        return (
            f"MilestonePolicy(slots_per_device={self.slots_per_device}, devices={self.devices}, "
            f"affinity={self._lrtf.affinity}, critical={self.critical})"
        )


def _admitted_key(c: Candidate) -> tuple[bool, bool, int, float, int]:
    return (not c.resident, not c.in_host, -c.shared_bytes, c.milestone_s or 0.0, c.order)


def _lent_key(c: Candidate) -> tuple[float, bool, bool, int]:
    return (c.milestone_s or 0.0, not c.resident, not c.in_host, c.order)


def _level(c: Candidate) -> int:
    """Admission's breadth-first level: the iterations done, but 0 for a trial whose next
    milestone is its end (``milestone_s`` equal to ``remaining_s``, both counted from the
    same estimates: an adaptive searcher learns from finished trials), so that those
    nearest their end finish first rather than wait behind fresh trials. (A th.shard
    loop's remaining work is its one granted op, less than its milestone's.)"""
    m = c.milestone_s
    end = m is not None and abs(m - c.remaining_s) <= 1e-9 * c.remaining_s
    return 0 if end else c.op.iteration


def _admission_key(c: Candidate) -> tuple[int, float, bool, bool, int]:
    return (_level(c), c.milestone_s or 0.0, not c.resident, not c.in_host, c.order)
