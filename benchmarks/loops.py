"""``th.shard`` loops: the user's own training loops on the engine vs task factories and plain.

Three measurements, each in one run with its ways interleaved in rounds (after one
warm-up of each), reported as the median over the rounds of the per-round ratio:

- **4 loops vs 4 task factories** on 2 emulated copying CPU devices
  (``devices=["cpu", "cpu"], copy_on_cpu=True``, a ``device_memory`` that cuts each model
  into >= 2 shards): 4 MLPs (Adam, 4 learning rates) trained for one epoch of the same
  batches, either as 4 user loops (``th.shard``, one Python thread each, one engine) or
  as 4 ``ModelTask`` s in one ``th.train_models`` call (which trains each as a
  ``TaskLoop``, a ``th.shard`` loop of the package's own, on a thread of its own). Both
  recompute (the default on copying devices), and both keep their graphs
  (``recompute=False``). Throughput ratio = factory time / loops time (goal >= 0.9x).
  The loops' final weights are compared with the factories' (both are exact to plain
  PyTorch, so they must be equal).
- **one loop vs the plain loop** on one CPU device (the CPU default: it computes in host
  memory), the model cut into >= 3 shards: the same loop with and without the
  ``th.shard`` line, keeping activations (``recompute=False``, goal <= 1.15x) and
  recomputing.
- **the per-op cost of the hooks**: a tiny MLP (compute negligible) cut one or two layers
  a shard; (loop time - plain time) / ops run, in µs: the hand-off from the user's thread
  to the device's and back, the scheduling decision, the autograd function. With dropout
  too (each op then draws on its loop's private generator, through a dispatch mode).

Run::

    python benchmarks/loops.py            # about 2 minutes on 2 cores
    python benchmarks/loops.py --quick    # a few seconds (used by the tests)

torch runs on one intra-op thread (``--threads``), as the other CPU benchmarks do.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import budget_for, make_data, make_mlp  # benchmarks/common.py
from torch import nn

import tune_hydra as th

LRS = (1e-3, 5e-4, 2e-4, 1e-4)


@dataclass
class Config:
    """Benchmark sizes."""

    width: int = 512
    depth: int = 8
    batch: int = 64
    batches: int = 24
    rounds: int = 5
    tiny_batches: int = 60


QUICK = Config(width=64, depth=4, batch=16, batches=4, rounds=1, tiny_batches=6)

Batch = tuple[torch.Tensor, torch.Tensor]


def _adam(lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.Adam(params, lr=lr)


def user_loop(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Batch]) -> None:
    """The user's loop, as written for plain PyTorch (one epoch)."""
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        loss.item()


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- 4 loops vs 4 task factories --------------------------------------------------------


def multiplexed(cfg: Config) -> dict[str, Any]:
    torch.manual_seed(0)
    templates = [make_mlp(cfg.width, cfg.depth) for _ in LRS]
    data = make_data(cfg.width, cfg.batch, cfg.batches)
    budget, shards = budget_for(templates[0], _adam(LRS[0]), data[0][0], 2)
    options: dict[str, Any] = {"devices": ["cpu", "cpu"], "copy_on_cpu": True}
    options["device_memory"] = budget
    last: dict[str, list[nn.Module]] = {}

    def factories(recompute: bool) -> float:
        tasks = {
            f"t{i}": th.ModelTask(copy.deepcopy(m), nn.CrossEntropyLoss(), _adam(lr), data)
            for i, (m, lr) in enumerate(zip(templates, LRS, strict=True))
        }
        t0 = time.perf_counter()
        th.train_models(tasks, epochs=1, seed=0, recompute=recompute, **options)
        elapsed = time.perf_counter() - t0
        last[f"factories {recompute}"] = [t.model for t in tasks.values()]  # type: ignore[misc]
        return elapsed

    def in_threads(recompute: bool, train: Callable[[th.Engine, int], None]) -> float:
        """``train(engine, i)`` for the 4 models, each in a thread, on one engine."""
        errors: list[BaseException] = []
        t0 = time.perf_counter()
        with th.Engine(recompute=recompute, **options) as engine:

            def one(i: int) -> None:
                try:
                    train(engine, i)
                except BaseException as err:  # reported below
                    errors.append(err)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(LRS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return elapsed

    def loops(recompute: bool) -> float:
        models = [copy.deepcopy(m) for m in templates]

        def train(engine: th.Engine, i: int) -> None:
            model, opt = th.shard(models[i], _adam(LRS[i])(models[i].parameters()), engine=engine)
            user_loop(model, opt, data)
            th.unshard(model)

        elapsed = in_threads(recompute, train)
        last[f"loops {recompute}"] = models
        return elapsed

    ways: dict[str, Callable[[], float]] = {
        "factories, recompute": lambda: factories(True),
        "loops, recompute": lambda: loops(True),
        "factories, kept graphs": lambda: factories(False),
        "loops, kept graphs": lambda: loops(False),
    }
    times = _interleave(ways, cfg.rounds)
    equal = {
        r: all(
            same_weights(a, b)
            for a, b in zip(last[f"loops {r}"], last[f"factories {r}"], strict=True)
        )
        for r in (True, False)
    }
    ratio = {
        "recompute": _ratio(times["factories, recompute"], times["loops, recompute"]),
        "kept graphs": _ratio(times["factories, kept graphs"], times["loops, kept graphs"]),
    }
    print(
        f"4 loops vs 4 task factories: MLP width {cfg.width} depth {cfg.depth}, batch "
        f"{cfg.batch} x {cfg.batches} batches, Adam; {shards} shards under "
        f"{budget / 2**20:.2f} MiB on 2 emulated copying CPU devices; {cfg.rounds} "
        f"interleaved rounds after a warm-up"
    )
    print(f"{'way':<24} {'median s':>9} {'min s':>8}")
    for name, ts in times.items():
        print(f"{name:<24} {statistics.median(ts):>9.3f} {min(ts):>8.3f}")
    for mode in ("recompute", "kept graphs"):
        print(
            f"loops throughput / factories' ({mode}): {ratio[mode]:.2f}x (goal >= 0.9x); "
            f"same weights: {'yes' if equal[mode == 'recompute'] else 'NO'}"
        )
    return {"shards": shards, "throughput_ratio": ratio, "same_weights": equal}


# -- one loop vs the plain loop ----------------------------------------------------------


def single(cfg: Config) -> dict[str, Any]:
    torch.manual_seed(1)
    template = make_mlp(cfg.width, cfg.depth)
    data = make_data(cfg.width, cfg.batch, cfg.batches)
    budget, shards = budget_for(template, _adam(1e-3), data[0][0], 3)

    def plain() -> float:
        model = copy.deepcopy(template)
        opt = _adam(1e-3)(model.parameters())
        t0 = time.perf_counter()
        user_loop(model, opt, data)
        return time.perf_counter() - t0

    def sharded(recompute: bool) -> float:
        model = copy.deepcopy(template)
        opt = _adam(1e-3)(model.parameters())
        with th.Engine(devices=["cpu"], device_memory=budget, recompute=recompute) as engine:
            t0 = time.perf_counter()
            model, opt = th.shard(model, opt, engine=engine)
            user_loop(model, opt, data)
            th.unshard(model)
            return time.perf_counter() - t0

    ways: dict[str, Callable[[], float]] = {
        "plain loop": plain,
        "th.shard, keep activations": lambda: sharded(False),
        "th.shard, recompute": lambda: sharded(True),
    }
    times = _interleave(ways, cfg.rounds)
    print(
        f"\none loop vs the plain loop: MLP width {cfg.width} depth {cfg.depth}, batch "
        f"{cfg.batch} x {cfg.batches} batches, Adam; {shards} shards under "
        f"{budget / 2**20:.2f} MiB on one CPU device (in place)"
    )
    print(f"{'way':<28} {'median s':>9} {'min s':>8} {'ratio vs plain':>15}")
    ratios = {}
    for name, ts in times.items():
        ratios[name] = _ratio(ts, times["plain loop"])
        print(f"{name:<28} {statistics.median(ts):>9.3f} {min(ts):>8.3f} {ratios[name]:>14.3f}x")
    print(f"keeping activations: {ratios['th.shard, keep activations']:.3f}x (goal <= 1.15x)")
    return {"shards": shards, "ratio_vs_plain": ratios}


# -- the per-op cost of the hooks ----------------------------------------------------------


def per_op(cfg: Config) -> dict[str, float]:
    width = 16

    def tiny(dropout: bool) -> nn.Sequential:
        torch.manual_seed(2)
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(width, width), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(0.1))
        return nn.Sequential(*layers, nn.Linear(width, 10))

    data = make_data(width, 8, cfg.tiny_batches, seed=3)
    ops: dict[str, int] = {}
    # Process CPU time too: on a loaded machine a thread hand-off waits for a core, which
    # the wall time counts and the CPU time does not.
    cpu: dict[str, list[float]] = {}

    def timed(key: str, fn: Callable[[], None]) -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        cpu.setdefault(key, []).append(used)
        return wall

    def plain(dropout: bool, key: str) -> float:
        model = tiny(dropout)
        opt = _adam(1e-3)(model.parameters())
        return timed(key, lambda: user_loop(model, opt, data[1:]))

    def sharded(dropout: bool, key: str) -> float:
        model = tiny(dropout)
        opt = _adam(1e-3)(model.parameters())
        per_shard = 3 if dropout else 2
        with th.Engine(devices=["cpu"], max_layers_per_shard=per_shard) as engine:
            model, opt = th.shard(model, opt, engine=engine)
            user_loop(model, opt, data[:1])  # the cut, on the first batch: not timed
            runner = engine.runner(engine.tasks()[0])
            before = runner.iteration
            elapsed = timed(key, lambda: user_loop(model, opt, data[1:]))
            ops[key] = runner.iteration - before
            th.unshard(model)
        return elapsed

    ways: dict[str, Callable[[], float]] = {
        "plain": lambda: plain(False, "plain"),
        "th.shard": lambda: sharded(False, "th.shard"),
        "plain, dropout": lambda: plain(True, "plain, dropout"),
        "th.shard, dropout": lambda: sharded(True, "th.shard, dropout"),
    }
    times = _interleave(ways, cfg.rounds)
    for v in cpu.values():
        del v[0]  # the warm-up's
    cost: dict[str, float] = {}
    print(
        f"\nper-op cost of the hooks: 8 x Linear({width}) + ReLU (+ Dropout), Adam, batch 8 x "
        f"{len(data) - 1} batches, one CPU device; {ops['th.shard']} / "
        f"{ops['th.shard, dropout']} ops; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'way':<20} {'wall us/op':>11} {'CPU us/op':>10}")
    for key, base in (("th.shard", "plain"), ("th.shard, dropout", "plain, dropout")):
        wall = [t - p for t, p in zip(times[key], times[base], strict=True)]
        used = [t - p for t, p in zip(cpu[key], cpu[base], strict=True)]
        cost[key] = statistics.median(wall) / ops[key] * 1e6
        cost[key + " (CPU)"] = statistics.median(used) / ops[key] * 1e6
        print(f"{key:<20} {cost[key]:>11.0f} {cost[key + ' (CPU)']:>10.0f}")
    cost["thread round trip"] = ping_pong()
    print(
        f"thread round trip: {cost['thread round trip']:.0f} us (two threads handing an "
        f"Event back and forth: an op's two hand-offs cost at least that)"
    )
    return cost


def ping_pong(n: int = 2000) -> float:
    """One round trip between two threads through ``threading.Event`` (µs): what an op's
    two hand-offs (to the device's thread and back) cost at least on this machine now."""
    a, b = threading.Event(), threading.Event()

    def other() -> None:
        for _ in range(n):
            a.wait()
            a.clear()
            b.set()

    t = threading.Thread(target=other)
    t.start()
    t0 = time.perf_counter()
    for _ in range(n):
        a.set()
        b.wait()
        b.clear()
    t.join()
    return (time.perf_counter() - t0) / n * 1e6


# -- shared --------------------------------------------------------------------------------


def _interleave(ways: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    for fn in ways.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            times[name].append(fn())
    return times


def _ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--only", choices=("multiplexed", "single", "per_op"), default=None, help="one part"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    cfg = copy.copy(QUICK if args.quick else Config())
    if args.rounds is not None:
        cfg.rounds = args.rounds
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = {"multiplexed": multiplexed, "single": single, "per_op": per_op}
    for name, fn in parts.items():
        if args.only in (None, name):
            fn(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
