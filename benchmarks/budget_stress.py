"""Randomized schedules checked from their traces: device memory within budget, exact parity.

Each round draws a configuration: 1-3 emulated CPU devices that really copy shard state
(``copy_on_cpu=True``, the GPU's way), prefetch on or off, recompute on or off, a policy,
a budget of 3-6 MiB, gradient accumulation and clipping, and 2-5 MLP tasks of mixed shapes
(state-heavy or activation-heavy; some with dropout, BatchNorm or in-place ReLUs). It
trains them with ``train_models``, replays the trace with ``History.validate()`` (each
device's shard state and the running op's activations against the budget; ordering
rules) and compares every task with its plain
training bit for bit. Thread timing differs from run to run, so each round is a new
interleaving of the copy, compute and dispatch threads.

With ``--host`` each round also gets a host-memory budget and a spill folder (the disk
tier): ``host_memory`` is drawn between 1x and (devices + 3)x the largest shard state of
the round's tasks. Mostly it is in the strict range (>= (devices + 2)x, where the engine
keeps host memory within the budget), and the trace's replay of host memory is checked
against ``host_memory``; otherwise it is in the slack range, checked against
``host_memory`` + (devices + 1)x the largest shard state. The engine's own peak account
is held to the same bound, and its scratch folder must be gone once training ends.

Run::

    python benchmarks/budget_stress.py --minutes 4     # about 1200 rounds
    python benchmarks/budget_stress.py --quick         # 10 rounds (tests)
    python benchmarks/budget_stress.py --host --minutes 4   # with the disk tier

Exit status 1 if any round broke a rule or parity; the offending configuration and the
trace rows are printed.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import tune_hydra as th
from tune_hydra.engine import Engine
from tune_hydra.exceptions import (
    InvalidTaskError,
    ScheduleError,
    ShardTooLargeError,
    TrainingError,
)
from tune_hydra.frontends.task_loop import TaskLoop


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


def draw(rng: random.Random, host: bool = False) -> dict[str, Any]:
    """One random configuration; with ``host``, a host budget too (drawn last, so that
    the rounds without it are the ones earlier versions drew)."""
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
    cfg = {
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
    if host:
        # host_memory as a multiple of the largest shard state: strict (>= devices + 2)
        # in 3 rounds of 4, else in the slack range (1x up to devices + 2).
        strict = cfg["devices"] + 2
        cfg["host_strict"] = rng.random() < 0.75
        low, high = (strict, strict + 1) if cfg["host_strict"] else (1, strict)
        cfg["host_factor"] = round(rng.uniform(low, high), 3)
    return cfg


SKIPPED = "skipped"


def largest_state(tasks: dict[str, Any], cfg: dict[str, Any]) -> int:
    """The largest shard state of ``tasks`` as the round's engine will cut them (from the
    plans of deepcopies cut, as ``train_models``' loops cut them, in an engine without a
    host budget)."""
    with Engine(
        ["cpu"],
        cfg["budget_mib"] * 2**20,
        prefetch=cfg["prefetch"],
        recompute=cfg["recompute"],
        copy_on_cpu=True,
        max_layers_per_shard=cfg["max_layers_per_shard"],
    ) as engine:
        loops: list[TaskLoop] = []
        try:
            for name, task in tasks.items():
                loops.append(TaskLoop(name, copy.deepcopy(task), engine, seed=0))
                loops[-1].cut()  # registered with its plan now, as its first batch would
            largest = max(s.state_bytes for name in tasks for s in engine.plan(name).shards)
        finally:
            for loop in loops:
                loop.close()
    return largest


def check(cfg: dict[str, Any], spill_dir: str | None = None) -> str | None:
    """Train one configuration; None if every rule held, else what broke. With a
    ``host_factor`` in ``cfg``, under that host budget with the disk tier in ``spill_dir``
    (which holds nothing of this round's engine once it returns)."""
    tasks = {f"t{spec[0]}": make_task(*spec) for spec in cfg["tasks"]}
    refs = {k: copy.deepcopy(t.model) for k, t in tasks.items()}
    options = {"accumulate_steps": cfg["accumulate_steps"], "max_grad_norm": cfg["max_grad_norm"]}
    host: dict[str, Any] = {}
    host_limit = None
    try:
        if "host_factor" in cfg:
            # The engine's rule: (devices + 2) x the largest shard state holds strictly.
            largest = largest_state(tasks, cfg)
            host = {"host_memory": int(cfg["host_factor"] * largest), "spill_dir": spill_dir}
            # The documented slack: up to (devices + 1) x the largest shard state over.
            slack = 0 if cfg["host_strict"] else (cfg["devices"] + 1) * largest
            host_limit = host["host_memory"] + slack
            cfg["host_memory"] = host["host_memory"]  # shown with a broken round
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
            **host,
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
        if host_limit is not None:
            h.trace.validate(host_budget=host_limit)
    except ScheduleError as err:
        return str(err)
    if host_limit is not None:
        peak = h.summary["host"]["peak_held_bytes"]
        if peak > host_limit:
            return f"the engine's host account peaked at {peak} bytes, over {host_limit}"
        cfg["spilled"] = h.summary["host"]["written_bytes"] > 0
        if spill_dir is not None and os.listdir(spill_dir):
            return f"the engine left {os.listdir(spill_dir)} in {spill_dir}"
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
    parser.add_argument(
        "--host", action="store_true", help="a host-memory budget and the disk tier per round"
    )
    parser.add_argument(
        "--spill-dir",
        default=None,
        help="where the disk tier's folders go (default: a temporary folder)",
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    rounds = bad = skipped = strict = spilled = 0
    with tempfile.TemporaryDirectory(prefix="budget_stress-", dir=args.spill_dir) as spill_dir:
        while (rounds < 10) if args.quick else (time.monotonic() < deadline):
            cfg = draw(rng, host=args.host)
            rounds += 1
            problem = check(cfg, spill_dir if args.host else None)
            if problem is SKIPPED:
                skipped += 1
            elif problem is not None:
                bad += 1
                print(f"round {rounds}: {cfg}\n{problem}\n")
            elif args.host:
                strict += cfg["host_strict"]
                spilled += cfg["spilled"]
    print(f"budget_stress: {rounds} rounds, {bad} broke a rule or parity")
    print(f"({skipped} configurations refused before training: a layer or a batch too large)")
    if args.host:
        passed = rounds - bad - skipped
        print(
            f"(host budgets of the {passed} rounds that held: {strict} strict, "
            f"{passed - strict} slack; {spilled} of them wrote to disk)"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
