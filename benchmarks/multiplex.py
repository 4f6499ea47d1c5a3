"""Shard parallelism on 2 emulated CPU devices: 4 tasks multiplexed vs the baselines.

Measured in one run, in interleaved rounds (each figure is the median over the rounds):

- **ceiling**: the machine's own scaling of two independent single-threaded torch workers
  (two threads, each ``torch.set_num_threads(1)``, running the model's matmul + ReLU loop)
  over one such worker: ``2 * t(one) / t(two)``. About 1.7x on the shared 2-core machines,
  2x on an idle one.
- **model parallel**: the 4 tasks trained one after another, each cut into >= 2 shards
  over ``devices=["cpu", "cpu"]`` (the two devices take turns, one op at a time).
- **multiplexed**: all 4 tasks in one ``train_models`` call on ``["cpu", "cpu"]``, with the
  same shard plans.
- **plain, all cores**: ``th.train_plain`` of the 4 models one after another with torch's
  default intra-op threads (the obvious baseline); **plain, 1 thread** beside it.

The engine divides torch's intra-op threads among emulated CPU devices (2 cores, 2
devices: one thread each). Models have no dropout (dropout shards serialize on the CPU RNG
lock by design). Speed-ups are ratios of median wall times; "of ceiling" is the
multiplexed speed-up over model parallelism divided by the measured ceiling (goal >= 90%).

With ``--breakdown`` three more ways run in the same rounds: plain training of the 4 tasks
on 2 Python worker threads (2 tasks each, 1 intra-op thread: what multiplexing on 2
single-threaded devices could reach at best), the same with each model cut at the
engine's shard boundaries by hand (what cutting costs without the engine), and that
hand-cut training on 1 thread (so its own 2-thread scaling: the GIL-bound Python between
kernels scales less than the ceiling's plain matmul loop).

Run::

    python benchmarks/multiplex.py               # about 1-2 minutes
    python benchmarks/multiplex.py --breakdown   # plus the two ways above
    python benchmarks/multiplex.py --quick   # a few seconds (used by the tests)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import budget_for, make_data, make_mlp, train_by_hand  # benchmarks/common.py
from torch import nn

import tune_hydra as th
from tune_hydra.engine.registration.partition import layer_costs, plan_shards
from tune_hydra.engine.task import model_layers

LRS = (1e-3, 5e-4, 2e-4, 1e-4)


@dataclass
class Config:
    """Benchmark sizes."""

    width: int = 512
    depth: int = 8
    batch: int = 64
    batches: int = 24
    tasks: int = 4
    rounds: int = 3
    min_shards: int = 2


QUICK = Config(width=64, depth=4, batch=16, batches=4, rounds=1)


def _adam(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.Adam(params, lr=lr)


def ceiling(cfg: Config, seconds: float = 0.6) -> tuple[float, float, float]:
    """Two single-threaded torch workers vs one: returns ``(speed-up, t_one, t_two)``.

    Each worker runs ``n`` iterations of the model's forward matmul + ReLU at batch size
    ``cfg.batch`` (``n`` calibrated so one worker takes about ``seconds``).
    """
    x = torch.randn(cfg.batch, cfg.width)
    w = torch.randn(cfg.width, cfg.width) / cfg.width**0.5

    def work(n: int) -> None:
        torch.set_num_threads(1)
        y = x
        for _ in range(n):
            y = torch.relu(y @ w)

    def timed(workers: int, n: int) -> float:
        threads = [threading.Thread(target=work, args=(n,)) for _ in range(workers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    n = 50
    while (t := timed(1, n)) < seconds / 4:
        n *= 2
    n = max(1, int(n * seconds / t))
    one = statistics.median(timed(1, n) for _ in range(3))
    two = statistics.median(timed(2, n) for _ in range(3))
    return 2 * one / two, one, two


class Bench:
    """Builds fresh copies of the 4 tasks and times each way of training them."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        torch.manual_seed(0)
        self.templates = [make_mlp(cfg.width, cfg.depth) for _ in range(cfg.tasks)]
        self.data = [make_data(cfg.width, cfg.batch, cfg.batches, i) for i in range(cfg.tasks)]
        self.budget, self.shards = budget_for(
            self.templates[0], _adam(1e-3), self.data[0][0][0], cfg.min_shards
        )
        self.threads = torch.get_num_threads()
        self.last: dict[str, th.History] = {}
        costs = layer_costs(model_layers(self.templates[0]), _adam(1e-3), self.data[0][0][0])
        self.ranges = [(s.start, s.stop) for s in plan_shards(costs, self.budget).shards]

    def tasks(self) -> dict[str, th.ModelTask]:
        return {
            f"t{i}": th.ModelTask(
                copy.deepcopy(m), nn.CrossEntropyLoss(), _adam(LRS[i % len(LRS)]), d
            )
            for i, (m, d) in enumerate(zip(self.templates, self.data, strict=True))
        }

    def _engine(self, tasks: dict[str, th.ModelTask]) -> th.History:
        return th.train_models(
            tasks, devices=["cpu", "cpu"], device_memory=self.budget, epochs=1, seed=0
        )

    def model_parallel(self) -> float:
        tasks = self.tasks()
        t0 = time.perf_counter()
        for name, task in tasks.items():
            self.last[f"mp:{name}"] = self._engine({name: task})
        return time.perf_counter() - t0

    def multiplexed(self) -> float:
        tasks = self.tasks()
        t0 = time.perf_counter()
        self.last["mux"] = self._engine(tasks)
        return time.perf_counter() - t0

    def plain(self, threads: int) -> float:
        torch.set_num_threads(threads)
        try:
            tasks = self.tasks()
            t0 = time.perf_counter()
            for task in tasks.values():
                th.train_plain(task, 1, seed=0)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(self.threads)

    def two_workers(self, train: Callable[[th.ModelTask], None]) -> float:
        """The 4 tasks on 2 Python threads (1 intra-op thread each), 2 tasks per thread,
        each thread training its tasks one after another with ``train``."""
        tasks = list(self.tasks().values())

        def worker(mine: list[th.ModelTask]) -> None:
            torch.set_num_threads(1)
            for task in mine:
                train(task)

        threads = [threading.Thread(target=worker, args=(tasks[i::2],)) for i in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.set_num_threads(self.threads)
        return time.perf_counter() - t0

    def one_worker(self, train: Callable[[th.ModelTask], None]) -> float:
        """The 4 tasks one after another in this thread, 1 intra-op thread."""
        tasks = list(self.tasks().values())
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            for task in tasks:
                train(task)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(self.threads)

    def by_hand(self, task: th.ModelTask) -> None:
        """One epoch of the task cut at the engine's shard boundaries, without the engine:
        a shard's input detached, one optimizer per shard, one autograd call per shard."""
        layers = [m for _, m in model_layers(task.model)]  # type: ignore[arg-type]
        shards = [nn.Sequential(*layers[a:b]) for a, b in self.ranges]
        opts = [task.optimizer(list(s.parameters())) for s in shards]
        train_by_hand(shards, opts, task.loss_fn, task.train_data)  # type: ignore[arg-type]


def run(cfg: Config, breakdown: bool = False) -> dict[str, Any]:
    """Run the benchmark; prints a table and returns the figures."""
    bench = Bench(cfg)
    default_threads = bench.threads
    ways: dict[str, Callable[[], float]] = {
        "model parallel": bench.model_parallel,
        "multiplexed": bench.multiplexed,
        f"plain, all cores ({default_threads} thr)": lambda: bench.plain(default_threads),
        "plain, 1 thread": lambda: bench.plain(1),
    }
    if breakdown:  # what multiplexing could reach with 2 worker threads, with and without shards
        ways["plain, 2 worker threads"] = lambda: bench.two_workers(
            lambda t: th.train_plain(t, 1, seed=0)
        )
        ways["shards by hand, 2 threads"] = lambda: bench.two_workers(bench.by_hand)
        ways["shards by hand, 1 thread"] = lambda: bench.one_worker(bench.by_hand)
    for fn in ways.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in ways}
    ceilings: list[float] = []
    for _ in range(cfg.rounds):
        ceilings.append(ceiling(cfg)[0])
        torch.set_num_threads(default_threads)  # the workers changed the global default
        for name, fn in ways.items():
            times[name].append(fn())
    med = {k: statistics.median(v) for k, v in times.items()}
    ceil = statistics.median(ceilings)
    mp, mux = med["model parallel"], med["multiplexed"]
    plain_all = med[f"plain, all cores ({default_threads} thr)"]
    plain_one = med["plain, 1 thread"]
    speedup = mp / mux
    hist = bench.last["mux"]
    util = {d: v["utilization"] for d, v in hist.summary["devices"].items()}
    trace_util = hist.trace.utilization()
    mp_util = bench.last["mp:t0"].summary["devices"]
    result: dict[str, Any] = {
        "shards": bench.shards,
        "budget_bytes": bench.budget,
        "ceiling": ceil,
        "median_s": med,
        "speedup_vs_model_parallel": speedup,
        "fraction_of_ceiling": speedup / ceil,
        "speedup_vs_plain_all_cores": plain_all / mux,
        "speedup_vs_plain_1_thread": plain_one / mux,
        "utilization": util,
    }
    print(
        f"multiplex: {cfg.tasks} tasks, MLP width {cfg.width} depth {cfg.depth} (no dropout), "
        f"batch {cfg.batch} x {cfg.batches} batches, 1 epoch, Adam; {bench.shards} shards each "
        f"under {bench.budget / 2**20:.2f} MiB; devices ['cpu', 'cpu'] (1 intra-op thread "
        f"each); {cfg.rounds} interleaved round(s) after a warm-up"
    )
    print(f"{'way':<28} {'median s':>9} {'min s':>8} {'mux speed-up':>13}")
    for name, ts in times.items():
        print(f"{name:<28} {med[name]:>9.3f} {min(ts):>8.3f} {med[name] / mux:>12.2f}x")
    print(
        f"ceiling (2 single-thread workers vs 1): {ceil:.2f}x  "
        f"(rounds: {', '.join(f'{c:.2f}' for c in ceilings)})"
    )
    print(
        f"multiplexed vs model parallel: {speedup:.2f}x = {100 * speedup / ceil:.0f}% of the "
        f"ceiling (goal >= 90%)"
    )
    print(
        f"multiplexed vs plain, all cores: {plain_all / mux:.2f}x (goal >= 1.0x); "
        f"vs plain, 1 thread: {plain_one / mux:.2f}x"
    )
    if breakdown:
        # The same training code cut by hand, on 2 threads vs 1: how far this workload
        # (autograd, Adam's Python loop: GIL-bound between kernels) scales on the machine.
        hand = med["shards by hand, 1 thread"] / med["shards by hand, 2 threads"]
        result["hand_scaling"] = hand
        print(
            f"shards by hand, 2 threads vs 1: {hand:.2f}x; multiplexed vs model parallel "
            f"{speedup:.2f}x = {100 * speedup / hand:.0f}% of that"
        )
    print(
        "utilization (engine summary / trace), multiplexed: "
        + ", ".join(f"{d} {u:.0%}/{trace_util.get(d, 0.0):.0%}" for d, u in util.items())
    )
    print(
        "utilization, model parallel (task t0): "
        + ", ".join(f"{d} {v['utilization']:.0%}" for d, v in mp_util.items())
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time plain training and hand-cut shards on 2 worker threads",
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = copy.copy(QUICK if args.quick else Config())
    for name in ("rounds", "batches", "width"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    run(cfg, breakdown=args.breakdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
