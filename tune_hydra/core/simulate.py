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
from tune_hydra.core.policies import BasePolicy, Candidate, get_policy
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
