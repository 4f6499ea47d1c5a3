"""Issue #21's acceptance runs: how early a search's first results come, per policy.

Three runs on 2 emulated CPU devices that really copy shard state (``copy_on_cpu=True``,
``prefetch=True``: the GPU's way), tiny MLPs cut into 2 shards, the same seeds for every
policy (``lrtf``, ``fifo``, ``auto``):

* ``engine``: 16 equal trials of 4 epochs (each a ``TaskLoop``) cut and registered
  together on one ``Engine``, each trained one epoch at a time by a small driver that
  announces the milestones of ``ASHAScheduler(grace_period=1, reduction_factor=2,
  max_t=4)`` (rungs 1 and 2) as ``HydraScheduler`` does, in the loops' ops (nothing is
  stopped: all 16 trials run their 4 epochs);
* ``tune``: ``th.run`` with that ASHA scheduler, 16 trials (a grid over the trial index,
  each trial's learning rate drawn from the seed), all admitted at once;
* ``optuna``: ``th.optimize`` with ``TPESampler(seed)`` + ``MedianPruner()``, 8 trials, 8
  concurrent, 4 epochs;
* ``objective``: the same study with an objective that trains the same model in its own
  loop through ``th.shard`` (a trial's first epoch ends at its first ``trial.report``);
* ``tpe``: ``th.run`` with ``OptunaSearch(seed)`` and no scheduler, 16 trials, 8 at once
  (the fractions there are of trials *completed*: what the searcher learns from).

Each is measured on the engine's own trace, so Ray's process start-up does not count:
the span runs from the first compute op to the last; a trial's first epoch ends with its
last compute op of iteration 0. Reported: the fraction of the span at which the K/2-th
and the last trial finished their first epoch, throughput (training samples per second of
span), trials stopped or pruned, and the best ``val_loss``.

``--budget`` runs the searches of the issue's last acceptance item instead: a Tune search
with ``OptunaSearch`` + ASHA (``--trials`` trials) and a ``th.optimize`` study with TPE +
MedianPruner, each stopped after ``--budget`` seconds of wall clock (``time_budget_s`` /
``timeout``), and reports the best ``val_loss`` found, per policy and seed.

Usage::

    python benchmarks/search_runs.py engine tune optuna --seeds 0 1 2
    python benchmarks/search_runs.py --budget 60 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import torch
from torch import nn

import tune_hydra as th
from tune_hydra.core.policies import resolve_policy
from tune_hydra.core.trace import Trace, TraceEvent
from tune_hydra.engine import Engine
from tune_hydra.frontends.milestones import optuna_milestones, tune_milestones
from tune_hydra.frontends.task_loop import TaskLoop

POLICIES = ("lrtf", "fifo", "auto")
DEVICES = ["cpu", "cpu"]
EPOCHS = 4
N_IN, WIDTH, BATCH, N_BATCHES = 128, 512, 128, 16
BUDGET = (
    8_000_000  # bytes per device: cuts the MLP into 2 shards (its state and room for a prefetch)
)
LR_LO, LR_HI = 1e-4, 3e-2
ASHA = {"grace_period": 1, "reduction_factor": 2, "max_t": EPOCHS}


# --- the task --------------------------------------------------------------------------------


def make_task(config: dict[str, Any]) -> th.ModelTask:
    """A 3-layer MLP regression task (about 6.4k parameters); ``config``: ``lr``."""
    g = torch.Generator().manual_seed(1234)
    n = (N_BATCHES + 1) * BATCH
    x = torch.randn(n, N_IN, generator=g)
    y = (x[:, :4].sum(1, keepdim=True)).tanh() + 0.05 * torch.randn(n, 1, generator=g)
    data = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, n, BATCH)]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(N_IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
        nn.Linear(WIDTH, 1),
    )  # fmt: skip
    lr = float(config["lr"])
    return th.ModelTask(
        model=model,
        loss_fn=nn.MSELoss(),
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
        train_data=data[:N_BATCHES],
        eval_data=data[N_BATCHES:],
    )


def lr_of(seed: int, index: int) -> float:
    """Trial ``index``'s learning rate under ``seed`` (log-uniform in [1e-4, 3e-2])."""
    g = torch.Generator().manual_seed(seed * 1000 + index)
    u = float(torch.rand(1, generator=g))
    return math.exp(math.log(LR_LO) + u * (math.log(LR_HI) - math.log(LR_LO)))


def make_indexed_task(config: dict[str, Any]) -> th.ModelTask:
    """``make_task`` for a grid over ``config["i"]`` (the learning rate from the seed)."""
    return make_task({"lr": lr_of(int(config["seed"]), int(config["i"]))})


# --- figures from the engine's trace --------------------------------------------------------


@dataclasses.dataclass
class Figures:
    """What one run measured (fractions of the trace's compute span)."""

    half: float  # the K/2-th trial's first epoch
    last: float  # the last trial's first epoch
    span_s: float
    samples_per_s: float
    trials: int
    stopped: int = 0
    best: float = math.nan
    arrived: float = 0.0  # the last trial's first op (its start-up, with Ray)
    # The least ``last`` can be: the trials' first epochs over all epochs trained (with
    # early stopping, most of the run is first epochs).
    floor: float = 0.0


@dataclasses.dataclass
class Span:
    """A trace's compute events and the span they cover (first op's start to last op's
    end): what every figure is a fraction of."""

    events: list[TraceEvent]
    t0: float
    span_s: float

    @classmethod
    def of(cls, trace: Trace) -> Span:
        events = [e for e in trace.events if e.is_compute]
        t0 = min(e.start for e in events)
        return cls(events, t0, max(e.end for e in events) - t0)

    def fraction(self, at: float) -> float:
        """``at`` (on the trace's clock) as a fraction of the span."""
        return (at - self.t0) / self.span_s

    def arrived(self) -> float:
        """When the last trial's first op started (fraction of the span)."""
        began: dict[str, float] = {}
        for e in self.events:
            began[e.task] = min(began.get(e.task, math.inf), e.start)
        return self.fraction(max(began.values()))

    def batches(self) -> int:
        """Training batches computed (each counted once, however many shards)."""
        return len({(e.task, e.iteration, e.batch) for e in self.events if e.op == "L"})

    def figures(self, ends: Iterable[float], batches: int, **rest: Any) -> Figures:
        """The figures of a run whose trials reached the measured point (first epoch,
        or completion) at ``ends``, having trained ``batches`` batches; ``rest``: the
        other :class:`Figures` fields."""
        at = sorted(ends)
        return Figures(
            half=self.fraction(at[len(at) // 2 - 1]),
            last=self.fraction(at[-1]),
            span_s=self.span_s,
            samples_per_s=batches * BATCH / self.span_s,
            trials=len(at),
            **rest,
        )


def figures(trace: Trace, stopped: int = 0, best: float = math.nan) -> Figures:
    """First-epoch fractions and throughput from ``trace``'s compute events."""
    if trace.dropped:
        raise RuntimeError("the trace window dropped events: raise trace_window")
    span = Span.of(trace)
    first_iteration = min(e.iteration for e in span.events)
    first: dict[str, float] = {}
    for e in span.events:
        if e.iteration == first_iteration:
            first[e.task] = max(first.get(e.task, 0.0), e.end)
    return span.figures(
        first.values(),
        span.batches(),
        stopped=stopped,
        best=best,
        arrived=span.arrived(),
        floor=len(first) / len({(e.task, e.iteration) for e in span.events}),
    )


# --- (a) the engine on its own ---------------------------------------------------------------


def engine_run(policy: str, seed: int, trials: int = 16) -> Figures:
    """16 equal trials (each a ``TaskLoop``) cut and registered together, each trained
    one epoch at a time, with the milestones of ASHA (grace 1, rf 2, max_t 4) announced
    as ``HydraScheduler`` does, in the loops' ops (an op per train batch, one per shard
    per eval batch: ``TaskLoop.ops_per_iteration``)."""
    from ray.tune.schedulers import ASHAScheduler

    m = tune_milestones(ASHAScheduler(metric="val_loss", mode="min", **ASHA))
    chosen = resolve_policy(policy, search_aware=m.search_aware)

    def to_milestone(done: int) -> int | None:
        at = m.next_after(done)
        return None if at is None or at >= EPOCHS else at - done

    with _engine(chosen) as eng:
        loops = {
            f"t{i}": TaskLoop(f"t{i}", make_task({"lr": lr_of(seed, i)}), eng, seed=seed)
            for i in range(trials)
        }
        for loop in loops.values():
            loop.cut()  # registered now: the engine takes hints for it
        done = dict.fromkeys(loops, 0)
        running: dict[concurrent.futures.Future[Any], str] = {}

        def grant(name: str) -> None:
            loop = loops[name]
            per = loop.ops_per_iteration()
            assert per is not None  # cut, and its data has a length
            epochs = to_milestone(done[name])
            # Its ops' iteration in the trace is its epoch (as the front ends count
            # reports): the milestone policy reads it as the trial's progress.
            loop.runner.reports = done[name]
            eng.set_remaining(name, math.ceil((EPOCHS - done[name]) * per))
            eng.set_milestone(name, None if epochs is None else math.ceil(epochs * per))
            running[loop.start(1)] = name

        for name in done:
            grant(name)
        best = math.inf
        while running:
            finished, _ = concurrent.futures.wait(
                list(running), return_when=concurrent.futures.FIRST_COMPLETED
            )
            for fut in finished:
                name = running.pop(fut)
                best = min(best, fut.result()[-1]["val_loss"])
                done[name] += 1
                if done[name] < EPOCHS:
                    grant(name)
        result = figures(eng.trace, best=best)
        for loop in loops.values():
            loop.close()
        return result


# --- (b) th.run with ASHA --------------------------------------------------------------------


def _engine(policy: Any) -> Engine:
    """An engine on the emulated devices that copy as a GPU's would, keeping its whole
    trace."""
    return Engine(DEVICES, BUDGET, policy, copy_on_cpu=True, prefetch=True, trace_window=None)


def _ray_init(slots: int) -> str:
    import ray

    tmp = tempfile.mkdtemp(prefix="thsr", dir="/tmp")
    ray.init(
        num_cpus=2,
        resources={"hydra_slot": slots},
        _temp_dir=tmp,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    return tmp


def _executor(policy: str) -> Any:
    ex = th.HydraExecutor(
        devices=DEVICES, device_memory=BUDGET, policy=policy, seed=0, checkpoint=None
    )
    # Benchmark only: HydraExecutor does not offer copy_on_cpu (a node computes on its
    # devices); the engines get it here so they copy as a GPU's would.
    ex._engines.engine_options = dataclasses.replace(
        ex._engines.engine_options, copy_on_cpu=True, trace_window=None
    )
    return ex


def _th_run(policy: str, trainable: Any, **options: Any) -> tuple[Any, Any]:
    """``th.run(trainable, **options)`` for ``val_loss`` (min) and ``EPOCHS`` epochs on a
    fresh executor, its results in a temporary folder; returns the analysis and the
    executor (its trace)."""
    storage = tempfile.mkdtemp(prefix="thsr-results")
    ex = _executor(policy)
    try:
        analysis = th.run(
            trainable,
            trial_executor=ex,
            metric="val_loss",
            mode="min",
            stop={"training_iteration": EPOCHS},
            storage_path=storage,
            verbose=0,
            **options,
        )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return analysis, ex


def _best(analysis: Any) -> float:
    """The best last ``val_loss`` of a Tune run's trials."""
    return min((t.last_result.get("val_loss", math.inf) for t in analysis.trials), default=math.inf)


def tune_run(policy: str, seed: int, trials: int = 16) -> Figures:
    """``th.run`` with ASHA (grace 1, rf 2, max_t 4): ``trials`` trials admitted at once."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    analysis, ex = _th_run(
        policy,
        make_indexed_task,
        config={"i": tune.grid_search(list(range(trials))), "seed": seed},
        scheduler=ASHAScheduler(**ASHA),
        max_concurrent_trials=trials,
    )
    stopped = sum(1 for t in analysis.trials if t.last_result.get("training_iteration", 0) < EPOCHS)
    return figures(ex.trace(), stopped=stopped, best=_best(analysis))


# --- (c) th.optimize with TPE + MedianPruner -------------------------------------------------


def _objective(trial: Any) -> th.ModelTask:
    return make_task({"lr": trial.suggest_float("lr", LR_LO, LR_HI, log=True)})


def _study(seed: int) -> Any:
    """A quiet study with ``TPESampler(seed)`` + ``MedianPruner()``."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=seed), pruner=optuna.pruners.MedianPruner()
    )


def _study_engine(policy: str, study: Any) -> Engine:
    """:func:`_engine` with ``policy`` resolved as ``th.optimize`` resolves it for
    ``study`` (the engine is ours, to read its trace)."""
    aware = optuna_milestones(study.pruner, study.sampler).search_aware
    return _engine(resolve_policy(policy, search_aware=aware))


def _pruned(study: Any) -> int:
    import optuna

    return sum(1 for t in study.trials if t.state == optuna.trial.TrialState.PRUNED)


def optuna_run(policy: str, seed: int, trials: int = 8, concurrent: int = 8) -> Figures:
    """``th.optimize`` with ``TPESampler(seed)`` + ``MedianPruner()``."""
    study = _study(seed)
    with _study_engine(policy, study) as eng:
        th.optimize(
            study, _objective, n_trials=trials, epochs=EPOCHS, max_concurrent=concurrent,
            engine=eng, seed=seed,
        )  # fmt: skip
        return figures(eng.trace, stopped=_pruned(study), best=study.best_value)


# --- (d) th.optimize with an objective that owns its loop (th.shard) ------------------------


def objective_run(policy: str, seed: int, trials: int = 8, concurrent: int = 8) -> Figures:
    """(c) with an objective instead of a factory: the same model, data and optimizer
    trained by the objective's own loop through ``th.shard``, reporting ``val_loss`` each
    epoch. A loop's ops all carry iteration 0 in the trace, so a trial's first epoch
    ends at its first ``trial.report`` (read on the engine's clock)."""
    import optuna

    study = _study(seed)
    with _study_engine(policy, study) as eng:
        first: dict[int, float] = {}
        batches = [0]

        def objective(trial: Any) -> float:
            task = _objective(trial)
            model = task.model
            optimizer = task.optimizer(list(model.parameters()))  # type: ignore[operator]
            model, optimizer = th.shard(model, optimizer)
            value = math.inf
            for epoch in range(EPOCHS):
                for x, y in task.train_data:  # type: ignore[attr-defined]
                    optimizer.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    optimizer.step()
                    batches[0] += 1
                with torch.no_grad():
                    value = statistics.fmean(
                        float(nn.functional.mse_loss(model(x), y))
                        for x, y in task.eval_data  # type: ignore[union-attr]
                    )
                first.setdefault(trial.number, eng.clock())
                trial.report(value, epoch)
                if trial.should_prune():
                    raise optuna.TrialPruned()
            return value

        th.optimize(study, objective, n_trials=trials, max_concurrent=concurrent, engine=eng)
        span = Span.of(eng.trace)
        return span.figures(
            first.values(),
            batches[0],
            stopped=_pruned(study),
            best=study.best_value,
            arrived=span.arrived(),
            floor=len(first) / sum(len(t.intermediate_values) for t in study.trials),
        )


# --- (e) th.run with an adaptive searcher and no early stopping ------------------------------


def tpe_run(policy: str, seed: int, trials: int = 16, concurrent: int = 8) -> Figures:
    """``th.run`` with ``OptunaSearch(seed)`` (TPE), no scheduler, 4 epochs each, 16
    trials, 8 at once: the searcher proposes each next configuration from the trials
    *completed* so far, so here ``half`` / ``last`` are the fractions of the span at
    which the K/2-th and the last trial *completed* (with ``auto`` a trial's end is its
    milestone)."""
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    analysis, ex = _th_run(
        policy,
        make_task,
        config={"lr": tune.loguniform(LR_LO, LR_HI)},
        search_alg=OptunaSearch(seed=seed),
        num_samples=trials,
        max_concurrent_trials=concurrent,
    )
    span = Span.of(ex.trace())
    done: dict[str, float] = {}
    for e in span.events:
        done[e.task] = max(done.get(e.task, 0.0), e.end)
    return span.figures(done.values(), span.batches(), best=_best(analysis))


# --- the fixed-budget searches ---------------------------------------------------------------


def tune_budget(policy: str, seed: int, trials: int, budget_s: float) -> float:
    """Best ``val_loss`` of a Tune search (OptunaSearch + ASHA) after ``budget_s``."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    analysis, _ = _th_run(
        policy,
        make_task,
        config={"lr": tune.loguniform(LR_LO, LR_HI)},
        search_alg=OptunaSearch(seed=seed),
        scheduler=ASHAScheduler(**ASHA),
        num_samples=trials,
        time_budget_s=budget_s,
        max_concurrent_trials=8,
    )
    return _best(analysis)


def optuna_budget(policy: str, seed: int, budget_s: float) -> float:
    """Best ``val_loss`` of a ``th.optimize`` study (TPE + MedianPruner) after ``budget_s``
    (no trial starts after it; the running ones finish)."""
    study = _study(seed)
    th.optimize(
        study, _objective, epochs=EPOCHS, devices=DEVICES, device_memory=BUDGET,
        copy_on_cpu=True, max_concurrent=8, timeout=budget_s, seed=seed, policy=policy,
    )  # fmt: skip
    return study.best_value


# --- main ------------------------------------------------------------------------------------


RUNS = {
    "engine": engine_run,
    "tune": tune_run,
    "optuna": optuna_run,
    "objective": objective_run,
    "tpe": tpe_run,
}


def _mean(values: Sequence[float]) -> str:
    return f"{statistics.fmean(values):.3f}" + (
        f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help=f"of {sorted(RUNS)}")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--budget", type=float, default=None, help="fixed-budget searches")
    parser.add_argument("--trials", type=int, default=16, help="Tune trials with --budget")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args(argv)
    unknown = set(args.runs) - set(RUNS)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}: use {sorted(RUNS)}")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    ray_tmp = None
    if "tune" in args.runs or "tpe" in args.runs or args.budget is not None:
        ray_tmp = _ray_init(max(16, args.trials))
    out: dict[str, Any] = {}
    try:
        for run in args.runs:
            print(f"## {run}: K/2-th / last first epoch (fraction of span), samples/s")
            print(
                "| policy | K/2-th | last | samples/s | vs lrtf | stopped | span s "
                "| last trial's first op | floor of last |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            rows: dict[str, list[Figures]] = {p: [] for p in args.policies}
            # Policies interleaved per seed: the other load on the machine drifts, and
            # each throughput is compared with LRTF's of the same seed, run next to it.
            for seed in args.seeds:
                for policy in args.policies:
                    f = RUNS[run](policy, seed)
                    rows[policy].append(f)
                    print(f"  {run} {policy} seed {seed}: {f}", flush=True)
            for policy, fs in rows.items():
                tput = statistics.fmean(f.samples_per_s for f in fs)
                base = rows.get("lrtf", [])
                ratios = [f.samples_per_s / b.samples_per_s for f, b in zip(fs, base, strict=False)]
                ratio = statistics.fmean(ratios) if ratios else math.nan
                print(
                    f"| {policy} | {_mean([f.half for f in fs])} | {_mean([f.last for f in fs])}"
                    f" | {tput:.0f} | {ratio:.2f}x | "
                    f"{statistics.fmean(f.stopped for f in fs):.1f} | "
                    f"{statistics.fmean(f.span_s for f in fs):.1f} | "
                    f"{statistics.fmean(f.arrived for f in fs):.2f} | "
                    f"{statistics.fmean(f.floor for f in fs):.2f} |",
                    flush=True,
                )
            out[run] = {p: [dataclasses.asdict(f) for f in fs] for p, fs in rows.items()}
        if args.budget is not None:
            print(f"## best val_loss after {args.budget:g} s (mean over seeds {args.seeds})")
            print("| policy | Tune: OptunaSearch + ASHA | th.optimize: TPE + MedianPruner |")
            print("|---|---|---|")
            for policy in args.policies:
                tb = [tune_budget(policy, s, args.trials, args.budget) for s in args.seeds]
                ob = [optuna_budget(policy, s, args.budget) for s in args.seeds]
                print(f"| {policy} | {_mean(tb)} | {_mean(ob)} |", flush=True)
                out.setdefault("budget", {})[policy] = {"tune": tb, "optuna": ob}
    finally:
        if ray_tmp is not None:
            import ray

            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
