"""Engine overhead on one CPU device: one MLP cut into >= 3 shards vs plain PyTorch training.

The same model (a ``copy.deepcopy`` of one template, same data, same seed) is trained

- plainly (``th.train_plain``, the reference),
- cut at the engine's shard boundaries by hand, without the engine (what cutting costs:
  one optimizer and one autograd call per shard),
- by the engine with ``recompute=False`` (each shard keeps its forward graph: the CPU
  default, as the CPU "device" is host memory),
- by the engine with ``recompute=True`` (backward re-runs each shard's forward, as on a
  GPU under a tight budget),
- as on a GPU: ``recompute=True`` and ``copy_on_cpu=True`` (each visit really copies the
  shard's state -- parameters, gradients, Adam moments -- from its host buffers and
  back), without and with prefetch (the task's next shard copied in by the copy thread
  while the current one computes).

Runs are interleaved (plain, keep, recompute, plain, ...) after one warm-up of each, and
the table reports the median wall time and the median of the per-round ratios to plain,
which is robust to the slow drifts of a shared machine. The engine's time is the whole
``train_models`` call (partitioning, threads, shard execution).

Run::

    python benchmarks/overhead.py            # about a minute
    python benchmarks/overhead.py --quick    # a few seconds (used by the tests)
    python benchmarks/overhead.py --threads 0   # torch's default intra-op threads

Both sides use one intra-op thread by default (``--threads``), so the ratio measures the
engine, not OpenMP's behaviour on a shared machine.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import budget_for, make_data, make_mlp, train_by_hand  # benchmarks/common.py
from torch import nn

import tune_hydra as th
from tune_hydra.engine.registration.partition import layer_costs, plan_shards
from tune_hydra.engine.task import model_layers


@dataclass
class Config:
    """Benchmark sizes."""

    width: int = 512
    depth: int = 8
    batch: int = 64
    batches: int = 40
    epochs: int = 1
    repeats: int = 7
    min_shards: int = 3


QUICK = Config(width=64, depth=4, batch=16, batches=8, repeats=2)


def _optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def run(cfg: Config) -> dict[str, object]:
    """Run the benchmark; returns the figures (also printed as a table)."""
    torch.manual_seed(0)
    template = make_mlp(cfg.width, cfg.depth)
    data = make_data(cfg.width, cfg.batch, cfg.batches)
    budget, shards = budget_for(template, _optimizer, data[0][0], cfg.min_shards)
    assert shards >= cfg.min_shards

    def task() -> th.ModelTask:
        return th.ModelTask(copy.deepcopy(template), nn.CrossEntropyLoss(), _optimizer, data)

    def plain() -> float:
        t = task()
        t0 = time.perf_counter()
        th.train_plain(t, cfg.epochs, seed=0)
        return time.perf_counter() - t0

    costs = layer_costs(model_layers(template), _optimizer, data[0][0])
    ranges = [(sp.start, sp.stop) for sp in plan_shards(costs, budget).shards]

    def by_hand() -> float:
        """The engine's cut, trained without the engine (what cutting itself costs)."""
        t = task()
        layers = [m for _, m in model_layers(t.model)]  # type: ignore[arg-type]
        cut = [nn.Sequential(*layers[a:b]) for a, b in ranges]
        opts = [_optimizer(list(c.parameters())) for c in cut]
        t0 = time.perf_counter()
        for _ in range(cfg.epochs):
            train_by_hand(cut, opts, t.loss_fn, data)  # type: ignore[arg-type]
        return time.perf_counter() - t0

    counts: dict[tuple[bool, bool], int] = {}

    def engine(recompute: bool, spill: bool = False, prefetch: bool = True) -> float:
        t = task()
        t0 = time.perf_counter()
        h = th.train_models(
            {"m": t},
            devices=["cpu"],
            device_memory=budget,
            epochs=cfg.epochs,
            recompute=recompute,
            seed=0,
            copy_on_cpu=spill,
            prefetch=prefetch,
        )
        elapsed = time.perf_counter() - t0
        # Without prefetch the plan needs no room for a second state: it may cut coarser.
        assert prefetch is False or h["m"][0]["num_shards"] == shards
        counts[(spill, prefetch)] = h["m"][0]["num_shards"]
        return elapsed

    runs: dict[str, Callable[[], float]] = {
        "plain": plain,
        "shards by hand": by_hand,
        "keep activations": lambda: engine(False),
        "recompute": lambda: engine(True),
        # Real copies of each shard's state in and out of host buffers, as on a GPU:
        "spill, no prefetch": lambda: engine(True, spill=True, prefetch=False),
        "spill, prefetch": lambda: engine(True, spill=True, prefetch=True),
    }
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(cfg.repeats):
        for name, fn in runs.items():
            times[name].append(fn())
    ratios = {
        name: [t / p for t, p in zip(ts, times["plain"], strict=True)] for name, ts in times.items()
    }
    result: dict[str, object] = {
        "shards": shards,
        "budget_bytes": budget,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "ratio_vs_plain": {k: statistics.median(v) for k, v in ratios.items()},
    }
    print(
        f"overhead: MLP width {cfg.width} depth {cfg.depth}, batch {cfg.batch} x {cfg.batches} "
        f"batches x {cfg.epochs} epoch(s), Adam; {shards} shards under {budget / 2**20:.2f} MiB "
        f"on one CPU device; {cfg.repeats} interleaved repeats after a warm-up; "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'mode':<20} {'shards':>6} {'median s':>9} {'min s':>8} {'ratio vs plain':>15}")
    for name, ts in times.items():
        n = 1 if name == "plain" else shards
        if name == "spill, no prefetch":
            n = counts[(True, False)]
        print(
            f"{name:<20} {n:>6} {statistics.median(ts):>9.3f} {min(ts):>8.3f} "
            f"{statistics.median(ratios[name]):>14.2f}x"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both sides (default 1: on the shared 2-core machines "
        "two OpenMP threads per small matmul are several times slower and very noisy; 0 = "
        "leave torch's default)",
    )
    args = parser.parse_args(argv)
    cfg = copy.copy(QUICK if args.quick else Config())
    for field in ("repeats", "width", "batches"):
        if getattr(args, field) is not None:
            setattr(cfg, field, getattr(args, field))
    if args.threads:
        torch.set_num_threads(args.threads)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
