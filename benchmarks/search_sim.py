"""Simulated searches with early stopping: what each scheduling policy gives the searcher.

The command line of :func:`tune_hydra.core.simulate.search_table`: K trials of random
quality with noisy learning curves (model costs spread ~5x) on P simulated devices, each
trial stopped or continued after every iteration by ASHA (grace 1, eta 3, max_t 9:
rungs 1, 3), Ray's median stopping rule (grace 1, 3 samples), or nothing (a fixed
budget); the policies decide through the engine's own dispatch code. Printed per K, P and
rule: each metric's mean over the seeds for LRTF, and each other policy's mean over
LRTF's (``x``) — time to the first result, to ceil(K/3) rung-1 results, device-seconds
on trials later stopped, device-seconds past where hindsight (every trial's results)
would have stopped a trial, device-seconds on the trials hindsight stops (the same
trials for every policy), the whole search's device-seconds, when the final best
trial finished, and the makespan — then, per K, P and rule, what full-evidence
decisions spend on stopped trials over LRTF's stopped work (the floor of a policy that
lets the rule judge every trial), and #21's targets for ``auto``. Run::

    python benchmarks/search_sim.py            # K in {16, 64}, P in {2, 8}, 5 seeds
    python benchmarks/search_sim.py --quick    # small, for tests
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

try:
    import tune_hydra  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tune_hydra.core.simulate import SEARCH_METRICS, SEARCH_POLICIES, search_table

COLUMNS = {
    "first_result_s": "first",
    "rung1_s": "K/eta@r1",
    "stopped_work_s": "stopped",
    "misled_work_s": "misled",
    "loser_work_s": "losers",
    "total_work_s": "work",
    "best_done_s": "best done",
    "makespan": "makespan",
}

# #21's acceptance for auto, each a (metric, rules, most auto/LRTF).
TARGETS = [
    ("rung1_s", ("asha", "median"), 0.6),
    ("stopped_work_s", ("asha", "median"), 0.6),
    ("makespan", ("fixed",), 1.05),
    ("makespan", ("asha", "median"), 1.10),
]


def _cell(value: float, ratio: bool) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.2f}x" if ratio else f"{value:.3g}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; return 1 if a target of #21's for ``auto`` is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="K=16, P=2, 2 seeds")
    parser.add_argument("--trials", type=int, nargs="+", default=None)
    parser.add_argument("--devices", type=int, nargs="+", default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args(argv)
    logging.getLogger("tune_hydra.core.policies").setLevel(logging.WARNING)
    ks = args.trials or ([16] if args.quick else [16, 64])
    ps = args.devices or ([2] if args.quick else [2, 8])
    seeds = args.seeds or (2 if args.quick else 5)
    t0 = time.perf_counter()
    table = search_table(ks, ps, seeds=seeds)
    sep = " | " if args.markdown else " "
    missed = []
    for k in ks:
        for p in ps:
            for rule in ("fixed", "asha", "median"):
                print(f"\nK={k} trials, P={p} devices, {rule} ({seeds} seeds):")
                head = ["policy", *COLUMNS.values()]
                print(sep.join(f"{h:>10}" for h in head))
                if args.markdown:
                    print(sep.join(["---:"] * len(head)))
                for name in SEARCH_POLICIES:
                    cell = table[(k, p, rule, name)]
                    ratio = name != "lrtf"
                    values = [cell[m] if ratio else cell[f"{m}_abs"] for m in SEARCH_METRICS]
                    print(sep.join([f"{name:>10}", *(f"{_cell(v, ratio):>10}" for v in values)]))
                auto = table[(k, p, rule, "auto")]
                floor = auto["stopped_floor"]
                if not math.isnan(floor):
                    print(f"full-evidence stopped work: {floor:.2f}x lrtf's stopped work")
                for metric, rules, most in TARGETS:
                    if rule in rules and not auto[metric] <= most:
                        why = (
                            f" (full-evidence floor {floor:.2f}x)"
                            if metric == "stopped_work_s"
                            else ""
                        )
                        missed.append(
                            f"K={k} P={p} {rule}: {metric} {auto[metric]:.2f}x > {most}x{why}"
                        )
    print(f"\n{time.perf_counter() - t0:.1f} s")
    print("targets for auto (#21):", "all met" if not missed else "")
    for line in missed:
        print("  missed:", line)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
