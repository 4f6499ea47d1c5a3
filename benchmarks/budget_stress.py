"""Randomized schedules checked from their traces: device memory within budget, exact parity.

Each round draws a configuration: 1-3 emulated CPU devices that really copy shard state
(``copy_on_cpu=True``, the GPU's way), prefetch on or off, recompute on or off, a policy,
a budget of 3-6 MiB, gradient accumulation and clipping, and 2-5 MLP tasks of mixed shapes
(state-heavy or activation-heavy; some with dropout, BatchNorm or in-place ReLUs). It
trains them with ``train_models``, replays the trace with ``History.validate()`` (each
device's shard state, the running op's activations and other tasks' waiting boundary
tensors against the budget; ordering rules) and compares every task with its plain
training bit for bit. Thread timing differs from run to run, so each round is a new
interleaving of the copy, compute and dispatch threads.

Run::

    python benchmarks/budget_stress.py --minutes 4     # about 1200 rounds
    python benchmarks/budget_stress.py --quick         # 10 rounds (tests)

Exit status 1 if any round broke a rule or parity; the offending configuration and the
trace rows are printed.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from typing import Any

import torch
from torch import nn

import tune_hydra as th
from tune_hydra.exceptions import (
    InvalidTaskError,
    ScheduleError,
    ShardTooLargeError,
    TrainingError,
)


def make_task(seed: int, width: int, depth: int, batch: int, dropout: bool, bn: bool) -> Any:
    """An MLP task; even seeds use in-place ReLUs."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers.append(nn.Linear(width, width))
        if bn:
            layers.append(nn.BatchNorm1d(width))
        layers.append(nn.ReLU(inplace=seed % 2 == 0))
        if dropout:
            layers.append(nn.Dropout(0.1))
    data = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(3)]
    return th.ModelTask(
        nn.Sequential(*layers),
        nn.MSELoss(),
        lambda p: torch.optim.Adam(p, lr=1e-3),
        data,
        eval_data=data[:1],
    )


def draw(rng: random.Random) -> dict[str, Any]:
    """One random configuration."""
    tasks = [
        (
            s,
            rng.choice([64, 128, 256]),
            rng.choice([2, 3, 4]),
            rng.choice([64, 256, 1024]),
            rng.random() < 0.3,
            rng.random() < 0.3,
        )
        for s in range(rng.choice([2, 3, 4, 5]))
    ]
    recompute = rng.random() < 0.5
    return {
        "devices": rng.choice([1, 2, 3]),
        "prefetch": rng.random() < 0.6,
        "recompute": recompute,
        "policy": rng.choice(["lrtf", "round_robin", "fifo"]),
        # Kept graphs (no recompute) hold a whole batch's activations: larger budgets,
        # and cuts finer than they need so that batches span several shards.
        "budget_mib": rng.choice([3, 4, 6] if recompute else [12, 16, 24, 32]),
        "max_layers_per_shard": None if recompute else rng.choice([None, 2, 3]),
        "accumulate_steps": rng.choice([1, 1, 2]),
        "max_grad_norm": rng.choice([None, 0.5]),
        "tasks": tasks,
    }


SKIPPED = "skipped"


def check(cfg: dict[str, Any]) -> str | None:
    """Train one configuration; None if every rule held, else what broke."""
    tasks = {f"t{spec[0]}": make_task(*spec) for spec in cfg["tasks"]}
    refs = {k: copy.deepcopy(t.model) for k, t in tasks.items()}
    options = {"accumulate_steps": cfg["accumulate_steps"], "max_grad_norm": cfg["max_grad_norm"]}
    try:
        h = th.train_models(
            tasks,
            devices=["cpu"] * cfg["devices"],
            device_memory=cfg["budget_mib"] * 2**20,
            epochs=2,
            seed=0,
            copy_on_cpu=True,
            prefetch=cfg["prefetch"],
            recompute=cfg["recompute"],
            policy=cfg["policy"],
            max_layers_per_shard=cfg["max_layers_per_shard"],
            **options,
        )
    except (ShardTooLargeError, InvalidTaskError):
        # A layer alone, or a batch's kept graphs, do not fit this budget (refused before
        # training): not a schedule to check.
        return SKIPPED
    except TrainingError as err:
        # train_models reports a task refused at registration and trains the others.
        if all(isinstance(e, (ShardTooLargeError, InvalidTaskError)) for e in err.errors.values()):
            return SKIPPED
        raise
    try:
        h.validate()
    except ScheduleError as err:
        return str(err)
    # Emulated devices run torch with a share of the intra-op threads; so does the reference.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // cfg["devices"]))
    try:
        for name, task in tasks.items():
            ref = th.ModelTask(
                refs[name], task.loss_fn, task.optimizer, task.train_data, eval_data=task.eval_data
            )
            want = th.train_plain(ref, 2, seed=0, **options)
            same = all(
                torch.equal(p, q)
                for p, q in zip(
                    task.model.state_dict().values(), ref.model.state_dict().values(), strict=True
                )
            )
            if not same or [r["loss"] for r in want] != [r["loss"] for r in h[name]]:
                return f"task {name} differs from its plain training"
    finally:
        torch.set_num_threads(threads)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="10 rounds (for the tests)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    rounds = bad = skipped = 0
    while (rounds < 10) if args.quick else (time.monotonic() < deadline):
        cfg = draw(rng)
        rounds += 1
        problem = check(cfg)
        if problem is SKIPPED:
            skipped += 1
        elif problem is not None:
            bad += 1
            print(f"round {rounds}: {cfg}\n{problem}\n")
    print(f"budget_stress: {rounds} rounds, {bad} broke a rule or parity")
    print(f"({skipped} configurations refused before training: a layer or a batch too large)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
