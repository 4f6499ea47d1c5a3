"""Host memory per trial: tune_hydra's proxy trials vs bare Ray Tune trials, and the engine.

Every Tune trial is a Ray worker process, even when (as with tune_hydra) it computes
nothing. This measures, in one run on an embedded local Ray:

* ``bare Trainable``: a minimal ``tune.Trainable`` whose step sleeps (no torch imported):
  the floor any Tune trial costs;
* ``bare Trainable + torch``: the same class in a module that imports torch (what a
  plain PyTorch Tune trial costs before it builds anything);
* ``tune_hydra proxy``: ``th.run`` trials of a factory that closes over ``--closure-mb``
  of data (the proxies must carry neither the data nor torch);

each with ``--trials`` trials at once, sampling every trial process's RSS (``/proc``) while
they run (the max per process, then the median over processes), plus the engine actor's
RSS after each of ``--runs`` ``th.run`` calls on one executor (flat: the factory is freed
when its experiment ends).

    python benchmarks/proxy_memory.py                # 8 trials, 40 MB closure, ~1-2 min
    python benchmarks/proxy_memory.py --quick        # 2 trials, 8 MB, 2 runs (tests)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Sampler:
    """Samples the RSS of every process whose title names ``marker`` (Ray titles actor
    processes ``ray::<Class>...``) until stopped; keeps the max per process."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    title = (entry / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if title.startswith("ray::") and self.marker in title:
                    rss = rss_mib(int(entry.name))
                    if rss is not None:
                        pid = int(entry.name)
                        self.peak[pid] = max(self.peak.get(pid, 0.0), rss)
            self._stop.wait(0.3)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--closure-mb", type=int, default=40)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--step-s", type=float, default=4.0, help="how long bare trials run")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.closure_mb, args.runs, args.step_s = 2, 8, 2, 0.5

    import proxy_trials  # benchmarks/proxy_trials.py
    import ray
    from ray import tune

    import tune_hydra as th

    tmp = tempfile.mkdtemp(prefix="thmem", dir="/tmp")  # short: Ray's socket paths
    ray.init(
        num_cpus=2,
        resources={"hydra_slot": args.trials},
        include_dashboard=False,
        _temp_dir=tmp,
        configure_logging=False,
        log_to_driver=False,
    )
    ray.cloudpickle.register_pickle_by_value(proxy_trials)
    rows: list[tuple[str, float, int]] = []
    storage = Path(tmp) / "results"
    try:
        common: dict[str, Any] = {
            "num_samples": args.trials,
            "resources_per_trial": {"cpu": 0, "hydra_slot": 1},
            "max_concurrent_trials": args.trials,
            "storage_path": str(storage),
            "verbose": 0,
        }
        for label, trainable in (
            ("bare Trainable", proxy_trials.BareTrainable),
            ("bare Trainable + torch", proxy_trials.TorchTrainable),
        ):
            with Sampler(trainable.__name__) as sampler:
                tune.run(
                    trainable,
                    config={"sleep": args.step_s},
                    stop={"training_iteration": 1},
                    **common,
                )
            rows.append((label, statistics.median(sampler.peak.values()), len(sampler.peak)))

        engine_rss: list[float] = []
        with th.HydraExecutor(devices="cpu", slots_per_node=args.trials) as ex:
            pid = ray.get(next(iter(ex.engines().values())).start.remote())["pid"]
            for run in range(args.runs):
                with Sampler("Hydra_") as sampler:  # the proxy classes are Hydra_<name>
                    th.run(
                        proxy_trials.closure_factory(args.closure_mb),
                        config={"lr": tune.uniform(0.01, 0.1)},
                        num_samples=args.trials,
                        stop={"training_iteration": 3},
                        storage_path=str(storage),
                        name=f"hydra{run}",
                        trial_executor=ex,
                        verbose=0,
                    )
                if run == 0:
                    rows.append(
                        (
                            f"tune_hydra proxy ({args.closure_mb} MB closure)",
                            statistics.median(sampler.peak.values()),
                            len(sampler.peak),
                        )
                    )
                time.sleep(0.5)
                engine_rss.append(rss_mib(pid) or 0.0)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    floor = rows[0][1]
    print(f"{'trial process':<36} {'median RSS':>11} {'vs bare':>8} {'processes':>10}")
    for label, rss, n in rows:
        print(f"{label:<36} {rss:>7.0f} MiB {rss / floor:>7.2f}x {n:>10}")
    print()
    print(
        "engine RSS after each th.run (MiB): "
        + ", ".join(f"{r:.0f}" for r in engine_rss)
        + f"  (last - second: {engine_rss[-1] - engine_rss[min(1, len(engine_rss) - 1)]:+.0f} MiB)"
    )


if __name__ == "__main__":
    main()
