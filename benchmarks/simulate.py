"""Discrete-event simulation of shard scheduling with the engine's own policy classes.

The command line of :mod:`tune_hydra.core.simulate`: synthetic tasks (mixed shard
counts, shard costs, epochs and batches) run on simulated devices; each time a device
frees up, the policy is offered one candidate per ready task, exactly as the engine does.

Each policy's makespan is printed over the lower bound
``max(total work / devices, longest task's work)``. Run::

    python benchmarks/simulate.py            # 100 tasks on 8 and 64 devices
    python benchmarks/simulate.py --quick    # small, for tests
    python benchmarks/simulate.py --plot sim.png --trace sim.json   # LRTF timeline
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

try:
    import tune_hydra  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tune_hydra.core.simulate import make_tasks, run, simulate, sweep, to_trace


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 1 if LRTF misses the 1.05x goal."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 tasks, 4 and 16 devices")
    parser.add_argument("--tasks", type=int, default=None)
    parser.add_argument("--devices", type=int, nargs="+", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.2, help="estimate noise sigma")
    parser.add_argument("--seeds", type=int, default=0, help="also sweep this many workloads")
    parser.add_argument("--plot", type=Path, help="write the LRTF timeline PNG here")
    parser.add_argument("--trace", type=Path, help="write the LRTF Chrome trace here")
    args = parser.parse_args(argv)
    n_tasks = args.tasks or (20 if args.quick else 100)
    devices = args.devices or ([4, 16] if args.quick else [8, 64])
    epochs = (1, 3) if args.quick else (1, 10)
    t0 = time.perf_counter()
    ratios = run(devices, n_tasks, args.seed, args.noise, epochs)
    worst = max(r["lrtf"] for r in ratios.values())
    elapsed = time.perf_counter() - t0
    print(f"\nLRTF worst makespan/bound {worst:.3f}x (goal <= 1.05x); {elapsed:.1f} s")
    if args.seeds:
        sweep(devices, n_tasks, args.seeds, epochs)
    if args.plot or args.trace:
        from tune_hydra.core.trace import plot_timeline, save_trace

        tasks = make_tasks(n_tasks, args.seed, epochs=epochs)
        trace = to_trace(simulate("lrtf", devices[0], tasks))
        if args.plot:
            print(f"timeline: {plot_timeline(trace, args.plot, f'LRTF, {devices[0]} devices')}")
        if args.trace:
            print(f"chrome trace: {save_trace(trace, args.trace)}")
    return 0 if worst <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
