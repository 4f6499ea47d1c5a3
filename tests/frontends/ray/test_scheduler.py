"""``HydraScheduler`` tells the engines each trial's next milestone, and ``policy="auto"``
is chosen from the run's scheduler, ``stop`` and search algorithm, without starting Ray."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
from ray.tune.schedulers import (
    ASHAScheduler,
    FIFOScheduler,
    MedianStoppingRule,
)
from ray.tune.search.optuna import OptunaSearch

from tune_hydra.frontends.ray import registry
from tune_hydra.frontends.ray.executor import HydraExecutor
from tune_hydra.frontends.ray.scheduler import HydraScheduler

STOP_4 = {"training_iteration": 4}


class _Trial(SimpleNamespace):
    """What the wrapped schedulers read of a Tune trial (hashable, as Tune's are)."""

    __hash__ = object.__hash__


class _Unknown(FIFOScheduler):
    """A scheduler of the user's own: tune_hydra does not know its milestones."""


def _hints(
    monkeypatch: pytest.MonkeyPatch, scheduler: HydraScheduler, reported: list[int]
) -> list[tuple[str, Any]]:
    """What the wrapper broadcasts for one trial added, then reporting ``reported``."""
    sent: list[tuple[str, Any]] = []
    monkeypatch.setattr(
        registry, "broadcast", lambda method, key, *args: sent.append((method, key, *args))
    )
    trial = _Trial(trial_id="t0", last_result={}, config={}, status="RUNNING")
    controller = SimpleNamespace(get_live_trials=lambda: [trial])
    scheduler.on_trial_add(controller, trial)
    for it in reported:
        trial.last_result = {"training_iteration": it, "val_loss": 1.0}
        scheduler.on_trial_result(controller, trial, dict(trial.last_result))
    return [(m, *a) for m, *a in sent if m == "set_milestone"]


@pytest.mark.parametrize(
    ("base", "stop", "expected"),
    [
        # rungs 1 and 2 below max_t 4: after 2 the trial is committed to its end
        (
            ASHAScheduler(
                metric="val_loss", mode="min", grace_period=1, reduction_factor=2, max_t=4
            ),
            STOP_4,
            [1, 1, None, None],
        ),
        # every result from the grace period on, but not the end (it decides nothing)
        (
            MedianStoppingRule(
                metric="val_loss", mode="min", grace_period=2, time_attr="training_iteration"
            ),
            STOP_4,
            [2, 1, 1, None],
        ),
        # rungs 1 and 3 (below max_t 9), whatever the stop
        (
            ASHAScheduler(
                metric="val_loss", mode="min", grace_period=1, reduction_factor=3, max_t=9
            ),
            None,
            [1, 2, 1, None],
        ),
    ],
)
def test_each_trial_is_sent_its_next_milestone(
    monkeypatch: pytest.MonkeyPatch, base: Any, stop: Any, expected: list[int | None]
) -> None:
    sched = HydraScheduler(base, stop=stop)
    sent = _hints(monkeypatch, sched, [1, 2, 3])
    assert sent == [("set_milestone", "t0", n) for n in expected]


def test_a_scheduler_without_milestones_sends_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _hints(monkeypatch, HydraScheduler(None, stop=STOP_4), [1, 2]) == []
    assert HydraScheduler(FIFOScheduler()).has_milestones is False


@pytest.mark.parametrize(
    ("base", "stop", "search_alg", "chosen"),
    [
        (ASHAScheduler(grace_period=1, reduction_factor=2, max_t=4), STOP_4, None, "milestone"),
        (None, STOP_4, None, "lrtf"),  # FIFO, a fixed budget, random search
        ("fifo", None, None, "lrtf"),
        (None, STOP_4, OptunaSearch(metric="val_loss", mode="min"), "milestone"),
        (None, {"training_iteration": 4, "val_loss": 0.1}, None, "milestone"),  # stops early
        (_Unknown(), STOP_4, None, "lrtf"),
    ],
)
def test_auto_is_chosen_from_the_run(
    base: Any, stop: Any, search_alg: Any, chosen: str, caplog: pytest.LogCaptureFixture
) -> None:
    ex = HydraExecutor(devices="cpu")
    assert ex.policy == "auto" and ex.engine_policy == "auto"
    with caplog.at_level(logging.INFO, logger="tune_hydra.core.policies"):
        wrapped = ex.scheduler(base, stop=stop, search_alg=search_alg)
    assert isinstance(wrapped, HydraScheduler)
    assert ex.engine_policy == chosen
    assert ex.policy == "auto"  # the option stays: the next run chooses again
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("policy=")]
    assert len(said) == 1 and said[0].startswith(f"policy='auto': {chosen}")


def test_an_unknown_scheduler_falls_back_to_lrtf_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="tune_hydra.frontends.milestones"):
        ex = HydraExecutor(devices="cpu")
        wrapped = ex.scheduler(_Unknown(), stop=STOP_4)
    lines = [r.getMessage() for r in caplog.records if r.name == "tune_hydra.frontends.milestones"]
    assert len(lines) == 1 and "_Unknown is not known" in lines[0] and "lrtf" in lines[0]
    assert ex.engine_policy == "lrtf" and wrapped.has_milestones is False


def test_a_policy_given_by_hand_is_kept() -> None:
    ex = HydraExecutor(devices="cpu", policy="fifo")
    ex.scheduler(ASHAScheduler(max_t=4))
    assert ex.engine_policy == "fifo"
    ex = HydraExecutor(devices="cpu", policy="lrtf")
    ex.scheduler(ASHAScheduler(max_t=4))
    assert ex.engine_policy == "lrtf"


def test_the_choice_reaches_the_engine_actors_with_the_other_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    ex = HydraExecutor(devices=["cpu", "cpu"], device_memory="1MiB", prefetch=False)
    ex.scheduler(ASHAScheduler(max_t=4))
    created: list[tuple[Any, ...]] = []

    class _Remote:  # stands for ray.remote(...)(EngineActor).options(...)
        def __call__(self, cls: Any) -> _Remote:
            return self

        def options(self, **options: Any) -> _Remote:
            return self

        def remote(self, *args: Any) -> str:
            created.append(args)
            return "handle"

    monkeypatch.setattr(ray, "remote", lambda **kw: _Remote())
    monkeypatch.setattr(ray, "nodes", lambda: [{}])
    ex._engines.create_actor("ab" * 28, {"CPU": 2.0}, 0)
    kwargs = created[0][0].kwargs()  # what Engine(...) gets in the actor
    assert kwargs["policy"] == "milestone"
    assert (kwargs["devices"], kwargs["device_memory"], kwargs["prefetch"]) == (
        ["cpu", "cpu"], "1MiB", False,
    )  # fmt: skip


def _report(scheduler: HydraScheduler, results: list[dict[str, Any]]) -> None:
    trial = _Trial(trial_id="t0", last_result={}, config={}, status="RUNNING")
    controller = SimpleNamespace(get_live_trials=lambda: [trial])
    scheduler.on_trial_add(controller, trial)
    for result in results:
        scheduler.on_trial_result(controller, trial, result)


def test_ranking_a_task_with_eval_data_by_training_loss_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """metric='loss' with a task that has eval data (its results hold val_loss) ranks by
    the training loss: said once per run, not silently; val_loss, a task without eval
    data, or a function trainable's own 'loss' (no engine figures) say nothing."""
    monkeypatch.setattr(registry, "broadcast", lambda *args: None)
    engine = {"loss": 0.5, "val_loss": 0.7, "device_time_s": 0.1, "training_iteration": 1}
    scheduler = HydraScheduler(FIFOScheduler())
    scheduler.set_search_properties("loss", "min")
    with (
        pytest.warns(UserWarning, match=r"metric='loss' ranks the trials by their training"),
        caplog.at_level(logging.WARNING, logger="tune_hydra.frontends.ray.scheduler"),
    ):
        _report(scheduler, [engine, {**engine, "training_iteration": 2}])
    assert sum("training loss" in r.getMessage() for r in caplog.records) == 1
    no_eval = {k: v for k, v in engine.items() if k != "val_loss"}
    quiet = [
        (ASHAScheduler(metric="val_loss", mode="min"), engine),
        (ASHAScheduler(metric="loss", mode="min"), no_eval),
        # a task's own metric named loss: its result holds the training loss as train_loss
        (ASHAScheduler(metric="loss", mode="min"), {**engine, "train_loss": 0.6}),
        (FIFOScheduler(), {"loss": 0.3, "accuracy": 0.9, "training_iteration": 1}),
    ]
    for base, result in quiet:
        wrapped = HydraScheduler(base)
        wrapped.set_search_properties("loss" if type(base) is FIFOScheduler else None, "min")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _report(wrapped, [result])
