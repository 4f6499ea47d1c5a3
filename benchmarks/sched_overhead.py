"""Scheduler overhead per shard operation, in microseconds, measured with trivial shards.

A model of ``layers`` x ``nn.Linear(1, 1)`` is cut one layer per shard
(``max_layers_per_shard=1``) and trained on 1x1 batches, so an operation's compute is a few
microseconds and the wall time is almost all engine: dispatch (policy, bookkeeping), the
hand-offs between the dispatcher, copy and compute threads, and the per-op work of the
task runner (RNG stream, detach, saved inputs). Per scenario the table shows, per
operation (``ops`` = compute events in ``history.trace``):

- ``wall/op``: trace wall time / ops (for several devices: x devices, i.e. per device-op);
- ``in op``: mean duration of an operation as traced (runner work + compute);
- ``gap/op``: device idle time between operations / ops (dispatch and thread hand-offs);
- ``scheduler``: ``wall/op`` minus the same shard operations run by hand in a loop
  (:func:`sharded_per_op`: what cutting the model costs in torch calls whoever schedules
  it; for several devices, as many Python threads at once, which contend for the GIL
  just as the engine's workers do): the engine's own cost per operation (goal <= 50 us);
- ``vs plain``: ``wall/op`` minus plain PyTorch (``th.train_plain``) per op equivalent.

Run::

    python benchmarks/sched_overhead.py           # about 20 s
    python benchmarks/sched_overhead.py --quick   # a few seconds (used by the tests)
    python benchmarks/sched_overhead.py --profile # cProfile of the 1-task scenario
    python benchmarks/sched_overhead.py --dispatch # one decision's CPU time, alone

``--dispatch`` times the dispatcher's decision alone (``Dispatcher._fill``: a candidate per
ready task, the policy's choice), in the calling thread's CPU time (``time.thread_time``,
so other processes' load counts little), with 1 and 8 ready tasks, measured or not yet
(an unmeasured task's estimate follows the engine-wide mean op time). The policy is LRTF
whose answer is dropped, so that nothing is assigned and every call decides afresh.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from common import train_by_hand  # benchmarks/common.py
from torch import nn

import tune_hydra as th
from tune_hydra.engine import Engine, LRTFPolicy
from tune_hydra.frontends.task_loop import TaskLoop


@dataclass
class Config:
    """Benchmark sizes."""

    layers: int = 16
    batches: int = 100
    repeats: int = 3


QUICK = Config(layers=6, batches=10, repeats=1)
SCENARIOS = (("1 task, 1 device", 1, 1), ("4 tasks, 2 devices", 4, 2), ("8 tasks, 1 device", 8, 1))


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def make_tasks(cfg: Config, n: int) -> dict[str, th.ModelTask]:
    """``n`` tasks of ``cfg.layers`` x ``Linear(1, 1)`` on ``cfg.batches`` 1x1 batches."""
    torch.manual_seed(0)
    data = [(torch.randn(1, 1), torch.randn(1, 1)) for _ in range(cfg.batches)]
    model = nn.Sequential(*(nn.Linear(1, 1) for _ in range(cfg.layers)))
    return {f"t{i}": th.ModelTask(copy.deepcopy(model), nn.MSELoss(), _sgd, data) for i in range(n)}


def plain_per_op(cfg: Config) -> float:
    """Seconds of plain training per shard-op equivalent (median of ``cfg.repeats``)."""
    ops = cfg.batches * (2 * cfg.layers - 1)
    times = []
    for _ in range(cfg.repeats + 1):
        task = make_tasks(cfg, 1)["t0"]
        t0 = time.perf_counter()
        th.train_plain(task, 1, seed=0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / ops


def sharded_per_op(cfg: Config, threads: int = 1) -> float:
    """Seconds per device-op of the same shard operations run by hand, without the engine.

    The torch calls the engine's runner makes on the CPU (one layer per shard, each shard
    its own optimizer, inputs detached at shard boundaries, one autograd call and one
    ``zero_grad`` + ``step`` per shard backward) in a plain loop: the cost of cutting the
    model into trivial shards, which the scheduler overhead is measured on top of. With
    ``threads`` > 1, that many Python threads each train 2 such tasks at once: the
    baseline of as many emulated devices, whose Python competes for the one GIL.
    """
    ops = cfg.batches * (2 * cfg.layers - 1)

    def train(mine: list[th.ModelTask]) -> None:
        for task in mine:
            shards = list(task.model)  # type: ignore[arg-type]
            opts = [task.optimizer(list(s.parameters())) for s in shards]
            train_by_hand(shards, opts, task.loss_fn, task.train_data)  # type: ignore[arg-type]

    times = []
    for _ in range(cfg.repeats + 1):
        tasks = list(make_tasks(cfg, 2 * threads).values())
        workers = [
            threading.Thread(target=train, args=(tasks[i::threads],)) for i in range(threads)
        ]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * threads / (2 * threads * ops)


def engine_run(cfg: Config, tasks: int, devices: int) -> dict[str, float]:
    """Train ``tasks`` trivial tasks on ``devices`` emulated CPU devices; per-op figures."""
    h = th.train_models(
        make_tasks(cfg, tasks), devices=["cpu"] * devices, epochs=1, seed=0, max_layers_per_shard=1
    )
    events = [e for e in h.trace.events if e.is_compute]
    ops = len(events)
    wall = h.trace.wall_s()
    busy = sum(h.trace.busy_s().values())
    return {
        "ops": ops,
        "wall_per_op": wall * devices / ops,
        "in_op": statistics.fmean(e.duration for e in events),
        "gap_per_op": (wall * devices - busy) / ops,
    }


def dispatch_path(tasks: int, measured: bool, calls: int = 3000, repeats: int = 5) -> float:
    """Seconds of thread CPU time per dispatch decision with ``tasks`` ready tasks (min of
    ``repeats`` x ``calls``); ``measured``: each task has a measured op time."""

    class Decline(LRTFPolicy):  # decides as LRTF, assigns nothing
        def choose(self, device: int, candidates: Any) -> Any:
            super().choose(device, candidates)
            return None

    cfg = Config(layers=4, batches=4)
    with Engine(["cpu"], policy=Decline(), max_layers_per_shard=1) as engine:
        # Each task a TaskLoop on a thread of its own: its first op asked for, never
        # assigned (the policy declines), so it stays ready for every decision; closing
        # the engine cancels it (each future ends with CancelledError).
        loops = [
            TaskLoop(name, task, engine, seed=0) for name, task in make_tasks(cfg, tasks).items()
        ]
        futures = [loop.start(1) for loop in loops]
        w = engine.workers[0]
        # Internals, on purpose: one decision, without the threads around it.
        dispatcher = engine._dispatcher
        deadline = time.monotonic() + 60
        while True:
            with engine._cv:
                ready = sum(e.runner.current is not None for e in engine._tasks.values())
            if ready == tasks:
                break
            if time.monotonic() > deadline or any(f.done() for f in futures):
                raise RuntimeError(f"only {ready} of {tasks} tasks got an op ready")
            time.sleep(0.01)
        with engine._cv:
            if measured:
                for e in engine._tasks.values():
                    e.record("F", 0, 1e-5)
            dispatcher._op_sum, dispatcher._op_n = 1e-5, 1
            times = []
            for _ in range(repeats):
                t0 = time.thread_time()
                for _ in range(calls):
                    dispatcher._fill(w)
                times.append((time.thread_time() - t0) / calls)
    return min(times)


def run_dispatch() -> None:
    """Print one decision's thread CPU time for 1 and 8 ready tasks."""
    torch.set_num_threads(1)
    print("dispatch decision alone (Dispatcher._fill, thread CPU time, min of 5 x 3000 calls):")
    for tasks in (1, 8):
        for measured in (True, False):
            us = dispatch_path(tasks, measured) * 1e6
            state = "measured" if measured else "not measured yet"
            print(f"  {tasks} ready task(s), {state:<16} {us:6.2f} us")


def run(cfg: Config) -> dict[str, Any]:
    """Run every scenario; prints the table and returns the figures."""
    torch.set_num_threads(1)
    plain = plain_per_op(cfg)
    sharded = {n: sharded_per_op(cfg, n) for n in sorted({d for _, _, d in SCENARIOS})}
    rows: dict[str, dict[str, float]] = {}
    for name, tasks, devices in SCENARIOS:
        engine_run(cfg, tasks, devices)  # warm-up
        runs = [engine_run(cfg, tasks, devices) for _ in range(cfg.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        med["scheduler"] = med["wall_per_op"] - sharded[devices]
        med["vs_plain"] = med["wall_per_op"] - plain
        rows[name] = med
    print(
        f"sched_overhead: {cfg.layers} shards of Linear(1, 1) (max_layers_per_shard=1), "
        f"{cfg.batches} 1x1 batches, SGD; medians of {cfg.repeats} run(s); 1 intra-op thread"
    )
    us = 1e6
    by_hand = "; ".join(f"{n} thread(s) {t * us:.1f}us" for n, t in sharded.items())
    print(f"plain/op {plain * us:.1f}us; sharded by hand per device-op: {by_hand}")
    print(
        f"{'scenario':<20} {'ops':>6} {'wall/op':>9} {'in op':>8} {'gap/op':>8} "
        f"{'scheduler':>10} {'vs plain':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:<20} {int(r['ops']):>6} {r['wall_per_op'] * us:>7.1f}us "
            f"{r['in_op'] * us:>6.1f}us {r['gap_per_op'] * us:>6.1f}us "
            f"{r['scheduler'] * us:>8.1f}us {r['vs_plain'] * us:>7.1f}us"
        )
    print(
        "goal: scheduler overhead (wall/op - sharded by hand per device-op, as many threads "
        "as devices) <= 50 us per shard operation"
    )
    return {"plain_per_op_s": plain, "sharded_per_op_s": sharded, "scenarios": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the 1-task scenario (all threads) and print the top",
    )
    parser.add_argument(
        "--dispatch", action="store_true", help="time one dispatch decision alone (CPU time)"
    )
    args = parser.parse_args(argv)
    if args.dispatch:
        run_dispatch()
        return 0
    cfg = QUICK if args.quick else Config()
    if args.profile:
        profiles: list[cProfile.Profile] = []

        def hook(*_: object) -> None:  # profile every thread the engine starts
            p = cProfile.Profile()
            profiles.append(p)
            p.enable()

        engine_run(cfg, 1, 1)  # warm-up (first optimizer step imports torch._dynamo)
        threading.setprofile(hook)
        main_prof = cProfile.Profile()
        main_prof.enable()
        engine_run(cfg, 1, 1)
        main_prof.disable()
        threading.setprofile(None)
        for p in profiles:
            p.disable()
        stats = pstats.Stats(main_prof)
        for p in profiles:
            stats.add(p)
        stats.sort_stats("tottime").print_stats(20)
        stats.sort_stats("cumulative").print_stats("tune_hydra|torch", 40)
        return 0
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
