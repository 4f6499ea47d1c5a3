"""The milestones read from the real Tune schedulers and Optuna pruners/samplers
(tune_hydra.frontends.milestones), table-driven; no Ray cluster starts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from tune_hydra.core.policies import LRTFPolicy, MilestonePolicy, resolve_policy
from tune_hydra.frontends.milestones import (
    HORIZON,
    Milestones,
    optuna_milestones,
    tune_milestones,
)

schedulers = pytest.importorskip("ray.tune.schedulers")
pruners = pytest.importorskip("optuna.pruners")
samplers = pytest.importorskip("optuna.samplers")

ITER = "training_iteration"


def _asha(**kw: Any) -> Any:
    return schedulers.ASHAScheduler(metric="loss", mode="min", **kw)


def _walk(m: Milestones, upto: int = 40) -> list[int]:
    """The decision points up to ``upto``, by repeated ``next_after``."""
    out, it = [], 0
    while (nxt := m.next_after(it)) is not None and nxt <= upto:
        assert nxt > it
        out.append(nxt)
        it = nxt
    return out


# (label, scheduler factory, stop, decision points up to 40, early_stopping, adaptive)
TUNE_CASES: list[tuple[str, Callable[[], Any], Any, list[int], bool, bool]] = [
    ("asha rf3 max_t27", lambda: _asha(max_t=27, grace_period=1, reduction_factor=3),
     None, [1, 3, 9], True, False),
    ("asha rf2 max_t4 (#21's run)", lambda: _asha(max_t=4, grace_period=1, reduction_factor=2),
     None, [1, 2], True, False),
    ("asha 2 brackets", lambda: schedulers.AsyncHyperBandScheduler(
        max_t=100, grace_period=5, reduction_factor=4, brackets=2), None, [5, 20], True, False),
    ("asha on time", lambda: _asha(time_attr="time_total_s", max_t=27), None, [], True, False),
    ("hyperband 81/3", lambda: schedulers.HyperBandScheduler(max_t=81, reduction_factor=3),
     None, [1, 3, 9, 27], True, False),
    ("hyperband 9/3", lambda: schedulers.HyperBandScheduler(max_t=9, reduction_factor=3),
     None, [1, 3], True, False),
    ("bohb", lambda: schedulers.HyperBandForBOHB(max_t=9, reduction_factor=3),
     None, [1, 3], True, True),
    ("median grace 3", lambda: schedulers.MedianStoppingRule(time_attr=ITER, grace_period=3),
     None, list(range(3, 41)), True, False),
    ("median on time", lambda: schedulers.MedianStoppingRule(), None, [], True, False),
    ("pbt 4 burn-in 6", lambda: schedulers.PopulationBasedTraining(
        time_attr=ITER, perturbation_interval=4, burn_in_period=6,
        hyperparam_mutations={"lr": [0.1, 0.01]}), None, [6, 10, 14, 18, 22, 26, 30, 34, 38],
     True, False),
    ("pbt on time", lambda: schedulers.PopulationBasedTraining(
        perturbation_interval=60.0, hyperparam_mutations={"lr": [0.1]}), None, [], True, False),
    ("resource changing wraps asha", lambda: schedulers.ResourceChangingScheduler(
        _asha(max_t=27, grace_period=1, reduction_factor=3)), None, [1, 3, 9], True, False),
    ("fifo", lambda: schedulers.FIFOScheduler(), None, [], False, False),
    ("none", lambda: None, None, [], False, False),
    ("fifo + iteration budget", lambda: None, {ITER: 10}, [], False, False),
    ("fifo + metric stop", lambda: None, {"mean_loss": 0.1}, [], True, False),
    ("fifo + callable stop", lambda: None, lambda trial_id, result: False, [], True, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("label", "make", "stop", "points", "early", "adaptive"),
    TUNE_CASES,
    ids=[c[0] for c in TUNE_CASES],
)
def test_tune_milestones(
    label: str,
    make: Callable[[], Any],
    stop: Any,
    points: list[int],
    early: bool,
    adaptive: bool,
) -> None:
    m = tune_milestones(make(), stop)
    assert _walk(m) == points, m
    assert (m.early_stopping, m.adaptive) == (early, adaptive)
    assert m.search_aware == (early or adaptive)


def test_tune_budget_and_max_t() -> None:
    assert tune_milestones(None, {ITER: 10}).until == 10
    assert tune_milestones(_asha(max_t=27), {ITER: 10}).until == 27
    from ray.tune.stopper import MaximumIterationStopper

    m = tune_milestones(None, MaximumIterationStopper(5))
    assert (m.until, m.early_stopping) == (5, False)


def test_tune_milestones_through_hydra_scheduler() -> None:
    from tune_hydra.frontends.ray.scheduler import HydraScheduler

    inner = _asha(max_t=27, grace_period=1, reduction_factor=3)
    assert _walk(tune_milestones(HydraScheduler(inner))) == [1, 3, 9]
    assert not tune_milestones(HydraScheduler()).search_aware


def test_tune_adaptive_search_alg() -> None:
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter
    from ray.tune.search.optuna import OptunaSearch

    assert not tune_milestones(None, search_alg=BasicVariantGenerator()).adaptive
    assert tune_milestones(None, search_alg=OptunaSearch()).adaptive
    limited = ConcurrencyLimiter(OptunaSearch(), max_concurrent=4)
    assert tune_milestones(None, search_alg=limited).search_aware


class Custom(schedulers.FIFOScheduler):  # type: ignore[misc]
    """A user's own scheduler: its rules cannot be read."""


def test_unknown_scheduler_falls_back_to_lrtf_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="tune_hydra"):
        m = tune_milestones(Custom())
        assert m == Milestones(source="unknown scheduler Custom")
        assert m.next_after(0) is None and not m.search_aware
        policy = resolve_policy("auto", search_aware=m.search_aware)
    assert type(policy) is LRTFPolicy
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("milestones")]
    assert len(lines) == 1 and "Custom" in lines[0] and "lrtf" in lines[0]


def test_known_search_resolves_auto_to_milestone() -> None:
    m = tune_milestones(_asha(max_t=27))
    assert isinstance(resolve_policy("auto", search_aware=m.search_aware), MilestonePolicy)


# --- Optuna ----------------------------------------------------------------------------

# (label, pruner factory, decision points up to 40 in epochs, early_stopping, startup trials)
OPTUNA_CASES: list[tuple[str, Callable[[], Any], list[int], bool, int]] = [
    ("median default", lambda: pruners.MedianPruner(), list(range(1, 41)), True, 5),
    ("median warmup 2 every 3", lambda: pruners.MedianPruner(
        n_startup_trials=3, n_warmup_steps=2, interval_steps=3), [3, 6, 9, 12, 15, 18, 21, 24,
        27, 30, 33, 36, 39], True, 3),
    ("percentile warmup 1", lambda: pruners.PercentilePruner(25.0, n_warmup_steps=1),
     list(range(2, 41)), True, 5),
    ("sha 1/3", lambda: pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3),
     [2, 4, 10, 28], True, 0),
    ("sha 2/2 rate 1", lambda: pruners.SuccessiveHalvingPruner(
        min_resource=2, reduction_factor=2, min_early_stopping_rate=1), [5, 9, 17, 33], True, 0),
    ("sha auto", lambda: pruners.SuccessiveHalvingPruner(), [2, 5, 17], True, 0),
    ("hyperband 1..9/3", lambda: pruners.HyperbandPruner(
        min_resource=1, max_resource=9, reduction_factor=3), [2, 4], True, 0),
    ("hyperband auto", lambda: pruners.HyperbandPruner(), [2, 4, 10, 28], True, 0),
    ("threshold warmup 1 every 2", lambda: pruners.ThresholdPruner(
        lower=0.0, n_warmup_steps=1, interval_steps=2), list(range(2, 41, 2)), True, 0),
    ("patient median", lambda: pruners.PatientPruner(
        pruners.MedianPruner(n_warmup_steps=1), patience=1), list(range(2, 41)), True, 5),
    ("wilcoxon", lambda: pruners.WilcoxonPruner(n_startup_steps=2), list(range(3, 41)), True, 0),
    ("nop", lambda: pruners.NopPruner(), [], False, 0),
    ("none", lambda: None, [], False, 0),
]  # fmt: skip


@pytest.mark.parametrize(
    ("label", "make", "points", "early", "startup"),
    OPTUNA_CASES,
    ids=[c[0] for c in OPTUNA_CASES],
)
@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_optuna_milestones(
    label: str, make: Callable[[], Any], points: list[int], early: bool, startup: int
) -> None:
    m = optuna_milestones(make(), samplers.RandomSampler())
    assert _walk(m) == points, m
    assert (m.early_stopping, m.adaptive, m.startup_trials) == (early, False, startup)


def test_optuna_pruner_steps_are_decided_where_optuna_decides() -> None:
    """Optuna's own rule, stepped through: a MedianPruner decides (prunes a trial worse
    than every other) exactly at the epochs listed (th.optimize: step = epoch - 1)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner = pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=2, interval_steps=3)
    study = optuna.create_study(pruner=pruner, sampler=samplers.RandomSampler(seed=0))
    good = study.ask()
    for step in range(12):
        good.report(0.0, step)
    study.tell(good, 0.0)
    decided = []
    for epoch in range(1, 13):
        bad = study.ask()
        for step in range(epoch):
            bad.report(1.0, step)
        # Only the last report is new: prune iff this step is a decision point.
        if bad.should_prune():
            decided.append(epoch)
        study.tell(bad, 1.0)
    m = optuna_milestones(pruner)
    assert decided == [p for p in _walk(m) if p <= 12]


@pytest.mark.parametrize(
    ("make", "adaptive", "startup"),
    [
        (lambda: samplers.TPESampler(), True, 10),
        (lambda: samplers.TPESampler(n_startup_trials=3), True, 5),  # the pruner's 5
        (lambda: samplers.GPSampler(), True, 10),
        (lambda: samplers.CmaEsSampler(), True, 5),
        (lambda: samplers.NSGAIISampler(population_size=20), True, 20),
        (lambda: samplers.RandomSampler(), False, 5),
        (lambda: samplers.GridSampler({"x": [0, 1]}), False, 5),
        (lambda: samplers.QMCSampler(), False, 5),
        (lambda: None, False, 5),
    ],
)
@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_optuna_samplers(make: Callable[[], Any], adaptive: bool, startup: int) -> None:
    m = optuna_milestones(pruners.MedianPruner(), make())
    assert (m.adaptive, m.startup_trials) == (adaptive, startup)
    assert m.search_aware


def test_tpe_without_pruner_is_search_aware() -> None:
    m = optuna_milestones(pruners.NopPruner(), samplers.TPESampler())
    assert m.search_aware and not m.early_stopping and m.next_after(0) is None


class OwnPruner(pruners.BasePruner):  # type: ignore[misc]
    def prune(self, study: Any, trial: Any) -> bool:
        return False


class OwnSampler:
    """Stands for a user's own sampler (any object Optuna would call)."""


def test_unknown_pruner_and_sampler_fall_back_with_one_log_line_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="tune_hydra"):
        m = optuna_milestones(OwnPruner(), OwnSampler())
    assert not m.search_aware and m.next_after(0) is None
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("milestones")]
    assert len(lines) == 2
    assert "OwnPruner" in lines[0] and "OwnSampler" in lines[1]


def test_next_after_combines_points_and_periods() -> None:
    m = Milestones(points=(2, 7), start=5, every=5, until=16)
    assert _walk(m) == [2, 5, 7, 10, 15]
    assert m.next_after(15) is None
    assert Milestones().next_after(0) is None
    assert max(_walk(optuna_milestones(pruners.HyperbandPruner()), HORIZON)) < HORIZON + 2


def test_missing_libraries_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Ray or Optuna importable, nothing of theirs is read: no milestones."""
    import sys

    asha, median = _asha(max_t=27), pruners.MedianPruner()
    for name in ("ray.tune.schedulers", "optuna.pruners", "optuna.samplers"):
        monkeypatch.setitem(sys.modules, name, None)
    assert tune_milestones(asha) == Milestones(source="unknown scheduler AsyncHyperBandScheduler")
    assert not optuna_milestones(median).search_aware
    assert tune_milestones(None) == Milestones(source="FIFOScheduler")
