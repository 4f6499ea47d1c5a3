"""Discrete-event simulation of shard scheduling with the engine's own policy classes.

Synthetic tasks (mixed shard counts, shard costs, epochs and batches; each task's ops
from its :class:`~tune_hydra.core.program.Program`) run on simulated devices. Each time a
device frees up, the policy is offered one :class:`~tune_hydra.core.policies.Candidate`
per ready task (a task whose previous operation still runs is not ready) and its choice
is validated by the engine's own dispatch code (:mod:`tune_hydra.core.dispatch`:
:func:`~tune_hydra.core.dispatch.offer` builds the candidates,
:func:`~tune_hydra.core.dispatch.decide` asks the policy and checks its answer), with
``remaining_s`` the task's exact remaining work (optionally with multiplicative
estimation noise) and ``resident`` true when the task's previous operation ran on that
device. Simulated devices have no memory limit: every candidate fits and brings nothing
in.

:func:`run` prints each policy's makespan over the lower bound
``max(total work / devices, longest task's work)``; ``benchmarks/simulate.py`` is its
command line.

:func:`simulate_search` runs a *search* the same way: trials of random quality with
noisy learning curves (:func:`make_search`), stopped early by a rule (:class:`ASHARule`,
:class:`MedianRule`, or none: :class:`StopRule`) after each iteration, each candidate
offered with ``milestone_s``, its exact work to the rule's next decision point;
:func:`search_table` compares the policies on what a search's user waits for
(``benchmarks/search_sim.py`` prints it).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from tune_hydra.core.dispatch import decide, offer
from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.policies import BasePolicy, Candidate, get_policy, resolve_policy
from tune_hydra.core.program import Program
from tune_hydra.core.trace import Trace, TraceEvent
from tune_hydra.exceptions import ScheduleError

BACKWARD_FACTOR = 3.0
"""Backward with recompute (forward again + backward + step) costs about 3 forwards."""


@dataclass(frozen=True)
class SimTask:
    """A synthetic task: its operations in order and each one's cost in seconds."""

    name: str
    shards: int
    ops: tuple[Op, ...]
    costs: tuple[float, ...]

    @property
    def work(self) -> float:
        """Total seconds of compute."""
        return sum(self.costs)


@dataclass(frozen=True)
class SimEvent:
    """One operation in a simulated schedule."""

    device: int
    op: Op
    start: float
    end: float


@dataclass
class SimResult:
    """A simulated run: makespan, schedule and a few counters."""

    policy: str
    devices: int
    makespan: float
    schedule: list[SimEvent]
    decisions: int
    moves: int
    """Operations that ran on a different device than the task's previous one."""
    choose_s: float
    """Seconds spent deciding (:func:`~tune_hydra.core.dispatch.decide`: the policy's
    choice and its validation)."""


def make_tasks(
    n_tasks: int = 100,
    seed: int = 0,
    shards: tuple[int, int] = (2, 16),
    epochs: tuple[int, int] = (1, 10),
    batches: tuple[int, int] = (2, 5),
) -> list[SimTask]:
    """Seeded synthetic tasks of mixed sizes.

    Each task draws a shard count, epochs and batches per epoch uniformly from the given
    inclusive ranges, a model scale (log-normal, median 10 ms per shard forward), a
    per-shard forward time (scale x U(0.7, 1.3)) and a small per-operation jitter (±5%).
    A shard's backward costs :data:`BACKWARD_FACTOR` forwards; the last shard's visit
    (forward + loss + backward) costs ``1 + BACKWARD_FACTOR`` forwards. A task's ops are
    its program's batches (:meth:`~tune_hydra.core.program.Program.batch_ops`), without
    the engine's cheap first-shard visit that finds an epoch's data ended.
    """
    rng = random.Random(seed)
    tasks = []
    for k in range(n_tasks):
        n_shards = rng.randint(*shards)
        scale = rng.lognormvariate(math.log(0.01), 0.6)
        fwd = [scale * rng.uniform(0.7, 1.3) for _ in range(n_shards)]
        factor = {OpKind.FORWARD: 1.0, OpKind.LAST: 1.0 + BACKWARD_FACTOR}
        program = Program(f"t{k:03d}", n_shards)
        n_epochs, n_batches = rng.randint(*epochs), rng.randint(*batches)
        ops = [
            op
            for it in range(n_epochs)
            for b in range(n_batches)
            for op in program.batch_ops(it, b)
        ]
        costs = [
            fwd[op.shard] * factor.get(op.kind, BACKWARD_FACTOR) * rng.uniform(0.95, 1.05)
            for op in ops
        ]
        tasks.append(SimTask(f"t{k:03d}", n_shards, tuple(ops), tuple(costs)))
    return tasks


def lower_bound(tasks: Sequence[SimTask], devices: int) -> float:
    """``max(total work / devices, longest task's work)``: no schedule beats it."""
    return max(sum(t.work for t in tasks) / devices, max(t.work for t in tasks))


def simulate(
    policy: str | BasePolicy,
    devices: int,
    tasks: Sequence[SimTask],
    noise: float = 0.0,
    seed: int = 0,
) -> SimResult:
    """Run ``tasks`` on ``devices`` simulated devices under ``policy``.

    Args:
        policy: a policy name or instance (a fresh instance is best: policies keep state).
        devices: number of devices.
        tasks: the workload (see :func:`make_tasks`).
        noise: sigma of the log-normal factor applied to each ``remaining_s`` estimate.
        seed: seed of the noise.

    Returns:
        The makespan and the full schedule.

    Raises:
        ScheduleError: the policy returned something it was not offered (see
            :func:`~tune_hydra.core.dispatch.decide`), or left every device idle while
            operations were ready.
    """
    pol = get_policy(policy)
    rng = random.Random(seed)
    suffix = []  # suffix[i][j]: work of task i from op j on
    for t in tasks:
        acc = [0.0] * (len(t.ops) + 1)
        for j in range(len(t.ops) - 1, -1, -1):
            acc[j] = acc[j + 1] + t.costs[j]
        suffix.append(acc)
    nxt = [0] * len(tasks)
    last_dev = [-1] * len(tasks)
    offers: dict[int, tuple[Candidate, Candidate]] = {}  # ready task -> (elsewhere, resident)

    def make_ready(i: int, now: float) -> None:
        est = suffix[i][nxt[i]] * (math.exp(rng.gauss(0.0, noise)) if noise else 1.0)
        op = tasks[i].ops[nxt[i]]
        offers[i] = (
            offer(op, est, ready_since=now, order=i, resident=False),
            offer(op, est, ready_since=now, order=i, resident=True),
        )

    for i in range(len(tasks)):
        make_ready(i, 0.0)
    idle = list(range(devices))
    running: list[tuple[float, int, int]] = []  # (end, device, task)
    schedule: list[SimEvent] = []
    remaining_tasks = len(tasks)
    decisions = moves = 0
    choose_s = 0.0
    now = 0.0
    while remaining_tasks:
        still_idle = []
        for d in idle:
            if not offers:
                still_idle.append(d)
                continue
            ready = list(offers)
            cands = [offers[i][last_dev[i] == d] for i in ready]
            t0 = time.perf_counter()
            k = decide(pol, d, cands)
            choose_s += time.perf_counter() - t0
            decisions += 1
            if k is None:
                still_idle.append(d)
                continue
            i = ready[k]
            del offers[i]
            moves += last_dev[i] not in (-1, d)
            last_dev[i] = d
            end = now + tasks[i].costs[nxt[i]]
            schedule.append(SimEvent(d, cands[k].op, now, end))
            heapq.heappush(running, (end, d, i))
        idle = still_idle
        if not running:
            raise ScheduleError(f"policy {pol!r} left every device idle with {len(offers)} ready")
        now = running[0][0]
        while running and running[0][0] == now:
            _, d, i = heapq.heappop(running)
            idle.append(d)
            nxt[i] += 1
            if nxt[i] == len(tasks[i].ops):
                remaining_tasks -= 1
                pol.forget(tasks[i].name)
            else:
                make_ready(i, now)
        idle.sort()
    return SimResult(pol.name, devices, now, schedule, decisions, moves, choose_s)


def to_trace(result: SimResult) -> Trace:
    """The schedule as a :class:`~tune_hydra.core.trace.Trace` (devices ``sim#k``)."""
    trace = Trace([f"sim#{d}" for d in range(result.devices)])
    for e in result.schedule:
        op = e.op
        label = f"sim#{e.device}"
        event = TraceEvent(label, op.task, op.shard, op.kind.value, e.start, e.end)
        trace.add(replace(event, iteration=op.iteration, batch=op.batch))
    return trace


def validate_schedule(tasks: Sequence[SimTask], result: SimResult) -> None:
    """Check a simulated schedule: every operation ran once, each task's operations in
    order and one after another, no device ran two operations at once.

    Raises:
        ScheduleError: with the offending operations.
    """
    by_task: dict[str, list[SimEvent]] = {}
    for e in result.schedule:
        by_task.setdefault(e.op.task, []).append(e)
    for t in tasks:
        mine = sorted(by_task.get(t.name, []), key=lambda e: e.start)
        ran = tuple(e.op for e in mine)
        if ran != t.ops:
            bad = next(
                (j for j, (a, b) in enumerate(zip(ran, t.ops, strict=False)) if a != b), len(ran)
            )
            raise ScheduleError(
                f"task {t.name}: ran {len(ran)} of {len(t.ops)} operations; first mismatch at "
                f"position {bad}"
            )
        for a, b in pairwise(mine):
            if b.start < a.end:
                raise ScheduleError(f"task {t.name}: {b.op} started before {a.op} ended")
    to_trace(result).validate()


def run(
    device_counts: Sequence[int],
    n_tasks: int,
    seed: int,
    noise: float,
    epochs: tuple[int, int] = (1, 10),
) -> dict[int, dict[str, float]]:
    """Print one table per device count; return ``{devices: {policy: makespan / bound}}``."""
    tasks = make_tasks(n_tasks, seed, epochs=epochs)
    work = [t.work for t in tasks]
    n_ops = sum(len(t.ops) for t in tasks)
    print(
        f"{n_tasks} tasks, {n_ops} shard operations, total work {sum(work):.1f} s, "
        f"task work {min(work):.2f}..{max(work):.2f} s (seed {seed})"
    )
    configs: list[tuple[str, str, float]] = [
        ("lrtf", "lrtf", 0.0),
        (f"lrtf (noise {noise:g})", "lrtf", noise),
        ("fifo", "fifo", 0.0),
        ("round_robin", "round_robin", 0.0),
    ]
    ratios: dict[int, dict[str, float]] = {}
    for devices in device_counts:
        bound = lower_bound(tasks, devices)
        kind = "work/devices" if bound > max(work) else "longest task"
        print(f"\n{devices} devices: lower bound {bound:.2f} s ({kind})")
        print(
            f"{'policy':<20} {'makespan_s':>10} {'/bound':>7} {'util':>6} {'moved':>6} {'us/op':>6}"
        )
        ratios[devices] = {}
        for label, name, sigma in configs:
            res = simulate(name, devices, tasks, noise=sigma, seed=seed)
            validate_schedule(tasks, res)
            ratio = res.makespan / bound
            ratios[devices][label] = ratio
            util = sum(work) / (devices * res.makespan)
            print(
                f"{label:<20} {res.makespan:>10.2f} {ratio:>6.3f}x {util:>6.1%} "
                f"{res.moves / n_ops:>6.1%} {1e6 * res.choose_s / res.decisions:>6.1f}"
            )
    return ratios


def sweep(device_counts: Sequence[int], n_tasks: int, seeds: int, epochs: tuple[int, int]) -> None:
    """Print mean and worst makespan / bound of each policy over ``seeds`` workloads."""
    policies = ("lrtf", "fifo", "round_robin")
    print(f"\nmakespan / bound over seeds 0..{seeds - 1}, mean (worst):")
    print(f"{'devices':>7} " + " ".join(f"{p:>15}" for p in policies))
    workloads = [make_tasks(n_tasks, seed, epochs=epochs) for seed in range(seeds)]
    for devices in device_counts:
        cells = []
        for name in policies:
            r = [
                simulate(name, devices, ts).makespan / lower_bound(ts, devices) for ts in workloads
            ]
            cells.append(f"{sum(r) / len(r):.3f} ({max(r):.3f})")
        print(f"{devices:>7} " + " ".join(f"{c:>15}" for c in cells))


# --- a search with early stopping ----------------------------------------------------


@dataclass(frozen=True)
class SearchTrial:
    """A synthetic trial of a search: its ops to ``max_t`` iterations, their costs, and
    the loss it reports after each iteration (lower is better).

    Attributes:
        name: the trial's name.
        ops: every op of its ``max_t`` iterations, in order.
        costs: each op's seconds.
        iteration_ends: ``iteration_ends[t]``: how many ops it has run when iteration
            ``t + 1`` ends (when it reports ``losses[t]``).
        losses: the loss reported after iteration 1, 2, ... ``max_t``.
    """

    name: str
    ops: tuple[Op, ...]
    costs: tuple[float, ...]
    iteration_ends: tuple[int, ...]
    losses: tuple[float, ...]

    @property
    def work(self) -> float:
        """Seconds of compute to ``max_t``."""
        return sum(self.costs)

    def costs_to(self, iteration: int) -> float:
        """Seconds of compute of its first ``iteration`` iterations."""
        return sum(self.costs[: self.iteration_ends[iteration - 1]]) if iteration else 0.0


def make_search(
    n_trials: int,
    seed: int = 0,
    max_t: int = 9,
    shards: tuple[int, int] = (2, 4),
    batches: int = 2,
    noise: float = 0.05,
) -> list[SearchTrial]:
    """Seeded trials of random quality with noisy learning curves.

    Trial ``k`` reaches a loss floor ``q ~ U(0, 1)`` at a random speed: after iteration
    ``t`` it reports ``q + a / sqrt(t) + N(0, noise)`` with ``a ~ U(0.2, 1)``, so
    curves cross and an early result only hints at the final one. Its model has a
    random shard count and a log-normal scale (the costs of :func:`make_tasks`), so
    trials differ in cost per iteration by up to ~5x.
    """
    rng = random.Random(seed)
    trials = []
    for k in range(n_trials):
        name = f"s{k:03d}"
        n_shards = rng.randint(*shards)
        scale = rng.lognormvariate(math.log(0.01), 0.5)
        fwd = [scale * rng.uniform(0.7, 1.3) for _ in range(n_shards)]
        factor = {OpKind.FORWARD: 1.0, OpKind.LAST: 1.0 + BACKWARD_FACTOR}
        program = Program(name, n_shards)
        ops: list[Op] = []
        ends = []
        for it in range(max_t):
            for b in range(batches):
                ops.extend(program.batch_ops(it, b))
            ends.append(len(ops))
        costs = [
            fwd[op.shard] * factor.get(op.kind, BACKWARD_FACTOR) * rng.uniform(0.95, 1.05)
            for op in ops
        ]
        floor, amplitude = rng.random(), rng.uniform(0.2, 1.0)
        losses = [
            floor + amplitude / math.sqrt(t) + rng.gauss(0.0, noise) for t in range(1, max_t + 1)
        ]
        trials.append(SearchTrial(name, tuple(ops), tuple(costs), tuple(ends), tuple(losses)))
    return trials


class StopRule:
    """A search's early-stopping rule: where it decides, and what.

    :meth:`next_after` gives the iteration of a trial's next decision point (``None``:
    none left, the trial is committed to ``max_t``); :meth:`report` records a trial's
    result after an iteration and says whether the trial stops there. The base class
    stops nothing (a fixed budget).
    """

    name = "fixed"

    def __init__(self, max_t: int) -> None:
        self.max_t = max_t

    def next_after(self, iteration: int) -> int | None:
        """The next decision point after ``iteration`` completed iterations."""
        return None

    def report(self, trial: str, iteration: int, loss: float) -> bool:
        """Record ``loss`` after ``iteration``; ``True``: stop the trial now."""
        return False

    @property
    def first(self) -> int:
        """The first decision point (the first rung); ``max_t`` without one."""
        return self.next_after(0) or self.max_t

    def hindsight(self, trials: Sequence[SearchTrial]) -> dict[str, int]:
        """For each trial that the rule would stop knowing *every* trial's results (not
        only those reported so far), the iteration it would stop at: the work a trial
        does past it is spent because a decision came on partial evidence."""
        return {}


class ASHARule(StopRule):
    """Ray Tune's asynchronous successive halving (one bracket): rungs at
    ``grace x eta**k`` below ``max_t``; at a rung, a trial stops when its loss is
    above the ``100/eta``-th percentile of the losses recorded there *so far* (nothing
    recorded: it continues), then its loss is recorded."""

    name = "asha"

    def __init__(self, max_t: int, grace: int = 1, eta: int = 3) -> None:
        super().__init__(max_t)
        self.eta = eta
        self.rungs: list[int] = []
        r = grace
        while r < max_t:
            self.rungs.append(r)
            r *= eta
        self._recorded: dict[int, list[float]] = {r: [] for r in self.rungs}

    def next_after(self, iteration: int) -> int | None:
        return next((r for r in self.rungs if r > iteration), None)

    def report(self, trial: str, iteration: int, loss: float) -> bool:
        recorded = self._recorded.get(iteration)
        if recorded is None:
            return False
        stop = bool(recorded) and loss > _percentile(recorded, 100.0 / self.eta)
        recorded.append(loss)
        return stop

    def hindsight(self, trials: Sequence[SearchTrial]) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rungs:  # synchronous halving: the best 1/eta at each rung go on
            alive = [t for t in trials if t.name not in out]
            cut = _percentile([t.losses[r - 1] for t in alive], 100.0 / self.eta)
            out.update((t.name, r) for t in alive if t.losses[r - 1] > cut)
        return out


class MedianRule(StopRule):
    """Ray Tune's median stopping rule on iterations: from ``grace`` on, after each
    iteration ``t`` a trial stops when its best loss is worse than the median of the
    other trials' mean losses up to ``t`` (of those that reported at ``t`` or later,
    at least ``min_samples`` of them)."""

    name = "median"

    def __init__(self, max_t: int, grace: int = 1, min_samples: int = 3) -> None:
        super().__init__(max_t)
        self.grace = grace
        self.min_samples = min_samples
        self._losses: dict[str, list[float]] = {}

    def next_after(self, iteration: int) -> int | None:
        nxt = max(iteration + 1, self.grace)
        return nxt if nxt < self.max_t else None

    def report(self, trial: str, iteration: int, loss: float) -> bool:
        mine = self._losses.setdefault(trial, [])
        mine.append(loss)
        if iteration < self.grace:
            return False
        means = [
            sum(v[:iteration]) / iteration
            for k, v in self._losses.items()
            if k != trial and len(v) >= iteration
        ]
        if len(means) < self.min_samples:
            return False
        return min(mine) > _median(means)

    def hindsight(self, trials: Sequence[SearchTrial]) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in range(self.grace, self.max_t):
            for trial in trials:
                if trial.name in out:
                    continue
                means = [sum(o.losses[:t]) / t for o in trials if o is not trial]
                if min(trial.losses[:t]) > _median(means):
                    out[trial.name] = t
        return out


def _percentile(values: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile."""
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _median(values: Sequence[float]) -> float:
    return _percentile(values, 50.0)


RULES: dict[str, type[StopRule]] = {"fixed": StopRule, "asha": ASHARule, "median": MedianRule}


@dataclass
class SearchResult:
    """What a simulated search gives its user, and when.

    Attributes:
        policy: the policy's name.
        rule: the stopping rule's name.
        first_result_s: when the first trial reached the first decision point (the first
            rung; ``max_t`` without early stopping).
        rung1_s: when ``ceil(K / eta)`` trials had reported at the first rung
            (``eta = 3`` for the median and fixed rules).
        stopped_work_s: device-seconds spent on trials that were stopped.
        best_done_s: when the trial with the best final loss (of those run to
            ``max_t``) finished.
        makespan: when the last trial ended.
        stopped: how many trials were stopped.
        best_loss: the best final loss found.
        total_work_s: device-seconds the whole search took.
        misled_work_s: device-seconds trials spent past the iteration at which the rule
            would have stopped them knowing every trial's results
            (:meth:`StopRule.hindsight`): work done on the strength of decisions taken
            on partial evidence.
        loser_work_s: device-seconds spent on the trials that the rule stops knowing
            every trial's results: the *same* trials under every policy (unlike
            ``stopped_work_s``, whose trials are those this run's order got stopped).
        hindsight_stopped_s: the stopped work of full-evidence decisions: each of those
            trials' work up to the iteration the rule stops it at knowing every result
            (the same for every policy). A policy that lets the rule judge every trial
            on full evidence spends about this on stopped trials; LRTF's
            ``stopped_work_s`` can be far below it only by letting trials run past their
            rungs before anything is recorded there, unjudged.
        schedule: every op run, as in :class:`SimResult`.
    """

    policy: str
    rule: str
    first_result_s: float
    rung1_s: float
    stopped_work_s: float
    best_done_s: float
    makespan: float
    stopped: int
    best_loss: float
    total_work_s: float
    misled_work_s: float
    loser_work_s: float
    hindsight_stopped_s: float
    schedule: list[SimEvent]


def simulate_search(
    policy: str | BasePolicy,
    devices: int,
    trials: Sequence[SearchTrial],
    rule: StopRule,
) -> SearchResult:
    """Run a search: ``trials`` on ``devices`` simulated devices under ``policy``, each
    stopped or continued by ``rule`` after every iteration.

    Each ready trial is offered (:func:`~tune_hydra.core.dispatch.offer`) with
    ``remaining_s`` its exact work to ``max_t`` (a trial's budget, as LRTF sees it) and
    ``milestone_s`` its exact work to ``rule``'s next decision point (``None`` past the
    last one), and :func:`~tune_hydra.core.dispatch.decide` picks, as in the engine.
    A stopped trial leaves (:meth:`~tune_hydra.core.policies.BasePolicy.forget`).

    Raises:
        ScheduleError: as :func:`simulate`.
    """
    pol = get_policy(policy)
    max_t = len(trials[0].iteration_ends)
    suffix = []
    for t in trials:
        acc = [0.0] * (len(t.ops) + 1)
        for j in range(len(t.ops) - 1, -1, -1):
            acc[j] = acc[j + 1] + t.costs[j]
        suffix.append(acc)
    nxt = [0] * len(trials)
    done_iters = [0] * len(trials)
    last_dev = [-1] * len(trials)
    offers: dict[int, tuple[Candidate, Candidate]] = {}
    spent = [0.0] * len(trials)

    def make_ready(i: int, now: float) -> None:
        t = trials[i]
        milestone = rule.next_after(done_iters[i])
        to_milestone = (
            None
            if milestone is None
            else suffix[i][nxt[i]] - suffix[i][t.iteration_ends[milestone - 1]]
        )
        op, rest = t.ops[nxt[i]], suffix[i][nxt[i]]
        offers[i] = (
            offer(op, rest, ready_since=now, order=i, milestone_s=to_milestone),
            offer(op, rest, ready_since=now, order=i, resident=True, milestone_s=to_milestone),
        )

    for i in range(len(trials)):
        make_ready(i, 0.0)
    first_rung = rule.first
    eta = getattr(rule, "eta", 3)
    need = math.ceil(len(trials) / eta)
    at_rung1: list[float] = []
    stopped: set[int] = set()
    finished: dict[int, float] = {}
    idle = list(range(devices))
    running: list[tuple[float, int, int]] = []
    schedule: list[SimEvent] = []
    live = len(trials)
    now = 0.0
    while live:
        still_idle = []
        for d in idle:
            if not offers:
                still_idle.append(d)
                continue
            ready = list(offers)
            cands = [offers[i][last_dev[i] == d] for i in ready]
            k = decide(pol, d, cands)
            if k is None:
                still_idle.append(d)
                continue
            i = ready[k]
            del offers[i]
            last_dev[i] = d
            cost = trials[i].costs[nxt[i]]
            spent[i] += cost
            schedule.append(SimEvent(d, cands[k].op, now, now + cost))
            heapq.heappush(running, (now + cost, d, i))
        idle = still_idle
        if not running:
            raise ScheduleError(f"policy {pol!r} left every device idle with {len(offers)} ready")
        now = running[0][0]
        while running and running[0][0] == now:
            _, d, i = heapq.heappop(running)
            idle.append(d)
            t = trials[i]
            nxt[i] += 1
            if nxt[i] == t.iteration_ends[done_iters[i]]:
                done_iters[i] += 1
                it = done_iters[i]
                if it == first_rung:
                    at_rung1.append(now)
                if it == max_t:
                    finished[i] = now
                elif rule.report(t.name, it, t.losses[it - 1]):
                    stopped.add(i)
                if it == max_t or i in stopped:
                    live -= 1
                    pol.forget(t.name)
                    continue
            make_ready(i, now)
        idle.sort()
    best = min(finished, key=lambda i: trials[i].losses[-1])
    at_rung1.sort()
    hindsight = rule.hindsight(trials)
    return SearchResult(
        policy=pol.name,
        rule=rule.name,
        first_result_s=at_rung1[0],
        rung1_s=at_rung1[min(need, len(at_rung1)) - 1],
        stopped_work_s=sum(spent[i] for i in stopped),
        best_done_s=finished[best],
        makespan=now,
        stopped=len(stopped),
        best_loss=trials[best].losses[-1],
        total_work_s=sum(spent),
        misled_work_s=sum(
            spent[i] - trials[i].costs_to(hindsight[t.name])
            for i, t in enumerate(trials)
            if t.name in hindsight and spent[i] > trials[i].costs_to(hindsight[t.name])
        ),
        loser_work_s=sum(spent[i] for i, t in enumerate(trials) if t.name in hindsight),
        hindsight_stopped_s=sum(
            t.costs_to(hindsight[t.name]) for t in trials if t.name in hindsight
        ),
        schedule=schedule,
    )


SEARCH_POLICIES = ("fifo", "lrtf", "milestone", "auto")
"""The policies :func:`search_table` compares (``auto``: :func:`resolve_policy` with
``search_aware`` = the rule stops trials)."""

SEARCH_METRICS = ("first_result_s", "rung1_s", "stopped_work_s", "misled_work_s",
                  "loser_work_s", "total_work_s", "best_done_s", "makespan")  # fmt: skip


def search_table(
    trial_counts: Sequence[int],
    device_counts: Sequence[int],
    rules: Sequence[str] = ("fixed", "asha", "median"),
    seeds: int = 5,
    max_t: int = 9,
) -> dict[tuple[int, int, str, str], dict[str, float]]:
    """Each policy's search metrics over ``seeds`` workloads, and relative to LRTF's.

    For each trial count K, device count P, rule and policy, and each of
    :data:`SEARCH_METRICS`: its mean over the seeds (key ``<metric>_abs``), that mean over
    LRTF's (key ``<metric>``; ``nan`` where LRTF's is 0) and the largest per-seed ratio
    (key ``<metric>_worst``, over the seeds where LRTF's is not 0). Also
    ``stopped_floor``: the mean ``hindsight_stopped_s`` over LRTF's mean
    ``stopped_work_s`` (the same in every policy's cell; ``nan`` without stops): below
    what full-evidence decisions spend on stopped trials, a policy gets only by leaving
    trials unjudged.

    Returns:
        ``{(K, P, rule, policy): {key: value}}``.
    """
    table: dict[tuple[int, int, str, str], dict[str, float]] = {}
    for k in trial_counts:
        for p in device_counts:
            for rule_name in rules:
                runs: dict[str, list[SearchResult]] = {name: [] for name in SEARCH_POLICIES}
                for seed in range(seeds):
                    trials = make_search(k, seed=seed, max_t=max_t)
                    for name in SEARCH_POLICIES:
                        policy = resolve_policy(name, search_aware=rule_name != "fixed")
                        runs[name].append(
                            simulate_search(policy, p, trials, RULES[rule_name](max_t))
                        )
                for name, results in runs.items():
                    cell: dict[str, float] = {}
                    for m in SEARCH_METRICS:
                        mine = [getattr(r, m) for r in results]
                        base = [getattr(r, m) for r in runs["lrtf"]]
                        cell[f"{m}_abs"] = sum(mine) / seeds
                        cell[m] = sum(mine) / sum(base) if sum(base) > 0 else math.nan
                        ratios = [a / b for a, b in zip(mine, base, strict=True) if b > 0]
                        cell[f"{m}_worst"] = max(ratios, default=math.nan)
                    floor = sum(r.hindsight_stopped_s for r in results)
                    lrtf_stopped = sum(r.stopped_work_s for r in runs["lrtf"])
                    cell["stopped_floor"] = floor / lrtf_stopped if lrtf_stopped > 0 else math.nan
                    table[(k, p, rule_name, name)] = cell
    return table
