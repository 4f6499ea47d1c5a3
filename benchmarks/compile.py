"""``torch.compile`` under ``th.shard``: one compiled loop, sharded vs plain, in place on the CPU.

One MLP (8 x Linear(512, 512) + GELU + LayerNorm blocks, a classifier head; batch 64 x 24
batches, Adam) is trained by the user's own loop four ways, each on a ``copy.deepcopy``
of one template, in the same process:

- ``compiled plain``: ``torch.compile(model, backend=...)``, no ``th.shard``;
- ``compiled sharded``: ``th.shard(torch.compile(model, backend=...), optimizer)`` on one
  CPU device (in place: the CPU default, keeping each forward's graph), the budget the
  largest that cuts it into >= 3 shards: each shard's forward compiled with the same
  settings (``tune_hydra.engine.runtime.compiled``);
- ``eager plain`` and ``eager sharded``: the same without ``torch.compile``, for reference.

Each model is built, compiled and cut once, then warmed up (one epoch: every graph
compiled) and timed on further epochs, the four ways interleaved in rounds; a ratio is the
median over the rounds of the per-round ratio. Dynamo's compiled frames are counted before
and after the timed rounds (0 new: nothing recompiles while training). The goal: compiled
sharded <= 1.3x compiled plain.

Run::

    python benchmarks/compile.py                     # inductor, about 3 minutes on 2 cores
    python benchmarks/compile.py --backend aot_eager
    python benchmarks/compile.py --quick             # tiny sizes, aot_eager (the tests)

torch runs on one intra-op thread (``--threads``), as the other CPU benchmarks do.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from common import budget_for, make_data  # benchmarks/common.py
from torch import nn

import tune_hydra as th


@dataclass
class Config:
    """Benchmark sizes."""

    width: int = 512
    depth: int = 8
    batch: int = 64
    batches: int = 24
    rounds: int = 5
    backend: str = "inductor"


QUICK = Config(width=32, depth=3, batch=8, batches=3, rounds=1, backend="aot_eager")

Batch = tuple[torch.Tensor, torch.Tensor]


def make_model(width: int, depth: int) -> nn.Sequential:
    """``depth`` x (Linear, GELU, LayerNorm) and a classifier head: pointwise ops and a
    reduction per block, which the compiler fuses."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def epoch(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Batch]) -> None:
    """The user's loop, as written for plain PyTorch (one epoch)."""
    model.train()
    for x, y in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        loss.item()


def frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def run(cfg: Config) -> dict[str, Any]:
    torch.manual_seed(0)
    template = make_model(cfg.width, cfg.depth)
    data = make_data(cfg.width, cfg.batch, cfg.batches)
    budget, _ = budget_for(template, adam, data[0][0], 3)
    engine = th.Engine(devices=["cpu"], device_memory=budget)
    ways: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for name in ("eager plain", "compiled plain", "eager sharded", "compiled sharded"):
        model = copy.deepcopy(template)
        opt = adam(model.parameters())
        if name.startswith("compiled"):
            model = torch.compile(model, backend=cfg.backend)
        if name.endswith("sharded"):
            model, opt = th.shard(model, opt, engine=engine)
        ways[name] = (model, opt)
    t0 = time.perf_counter()
    for model, opt in ways.values():  # warm-up: the cut, every graph compiled
        epoch(model, opt, data)
    warm = time.perf_counter() - t0
    compiled_before = frames()
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(cfg.rounds):
        for name, (model, opt) in ways.items():
            t0 = time.perf_counter()
            epoch(model, opt, data)
            times[name].append(time.perf_counter() - t0)
    recompiled = frames() - compiled_before
    n = th.shard_count(ways["compiled sharded"][0])
    engine.close()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    print(
        f"torch.compile under th.shard: MLP width {cfg.width} depth {cfg.depth} (Linear, GELU, "
        f"LayerNorm), batch {cfg.batch} x {cfg.batches} batches, Adam; {n} shards under "
        f"{budget / 2**20:.2f} MiB on one CPU device (in place); backend {cfg.backend!r}; "
        f"{cfg.rounds} interleaved rounds after a warm-up epoch ({warm:.1f} s, compiling)"
    )
    print(f"{'way':<18} {'median s':>9} {'min s':>8}")
    for name, ts in times.items():
        print(f"{name:<18} {statistics.median(ts):>9.3f} {min(ts):>8.3f}")
    ratios = {
        "compiled sharded / compiled plain": ratio("compiled sharded", "compiled plain"),
        "eager sharded / eager plain": ratio("eager sharded", "eager plain"),
        "compiled plain / eager plain": ratio("compiled plain", "eager plain"),
        "compiled sharded / eager sharded": ratio("compiled sharded", "eager sharded"),
    }
    for name, r in ratios.items():
        goal = " (goal <= 1.3x)" if name.startswith("compiled sharded / compiled plain") else ""
        print(f"{name}: {r:.3f}x{goal}")
    print(f"frames compiled during the timed rounds: {recompiled}")
    return {"shards": n, "ratios": ratios, "recompiled": recompiled}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--backend", default=None, help="torch.compile backend")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    cfg = copy.copy(QUICK if args.quick else Config())
    if args.rounds is not None:
        cfg.rounds = args.rounds
    if args.backend is not None:
        cfg.backend = args.backend
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(cfg)
    return 0 if result["recompiled"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
