"""``th.optimize``: Optuna's own study loop on the embedded engine, without Ray.

Every trial trains exactly as plain PyTorch would; pruned trials stop at once (nothing of
theirs runs after the pruned epoch); failing trials end FAIL and the others go on;
finished trials' models are saved; two processes share one study through Optuna's
storage. None of these tests starts Ray.
"""

from __future__ import annotations

import _thread
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import batches, mlp
from tune_hydra.engine import Engine
from tune_hydra.engine.registration.factory import call_factory
from tune_hydra.exceptions import (
    InvalidOptionError,
    InvalidStudyError,
    MissingDependencyError,
    UnknownMetricError,
    UnknownOptionError,
)

optuna = pytest.importorskip("optuna")
TrialState = optuna.trial.TrialState
ROOT = Path(__file__).resolve().parents[2]  # the repository
EPOCHS = 3
BUDGET = 24_000  # cuts mlp() into 2+ shards
pytestmark = pytest.mark.usefixtures("quiet_optuna")


def _engine() -> Engine:
    """Two emulated CPU devices that really copy shard state, each model in 2+ shards."""
    return Engine(devices=["cpu", "cpu"], device_memory=BUDGET, copy_on_cpu=True)


def factory(
    built: dict[int, th.ModelTask],
    *,
    fail: Collection[int] = (),
    nan: Collection[int] = (),
    hang: Collection[int] = (),
    release: threading.Event | None = None,
    no_eval: Collection[int] = (),
    not_a_task: Collection[int] = (),
    skip: Collection[int] = (),
    sleep_s: float = 0.0,
    penalty: bool = False,
    metrics: dict[str, Callable[[Any, Any], Any]] | None = None,
) -> Callable[[Any], th.ModelTask]:
    """A define-by-run task factory; trials whose number is in a set misbehave that way.
    With ``penalty``, a suggested constant is added to the loss; ``metrics`` are the
    tasks' own."""

    def make_task(trial: Any) -> th.ModelTask:
        lr = trial.suggest_float("lr", 1e-7, 1e-1, log=True)
        momentum = trial.suggest_categorical("momentum", [0.0, 0.9])
        extra = trial.suggest_float("penalty", 0.0, 10.0) if penalty else 0.0
        n = trial.number
        if sleep_s:
            time.sleep(sleep_s)
        if n in fail:
            raise RuntimeError(f"make_task of trial {n} broke")
        if n in skip:
            raise optuna.TrialPruned(f"trial {n}: a configuration not worth training")
        if n in hang:  # until the test releases it (so it ends before Python exits)
            assert release is not None and release.wait(30)
        if n in not_a_task:
            return {"model": mlp()}  # type: ignore[return-value]
        big = n in nan

        def opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            if big:  # diverges: the loss becomes infinite / NaN in the first epoch
                return torch.optim.SGD(params, lr=1e300)
            return torch.optim.SGD(params, lr=lr, momentum=momentum)

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(out, target)
            return loss + extra if extra else loss

        task = th.ModelTask(
            mlp(seed=0),  # seeds torch: on the factory's private generator
            loss_fn,
            opt,
            batches(4),
            eval_data=None if n in no_eval else batches(2, seed=7),
            metrics=metrics,
        )
        built[n] = task
        return task

    return make_task


def _states(study: Any) -> dict[int, str]:
    return {t.number: t.state.name for t in study.trials}


def _ops(engine: Engine, trial: Any) -> list[Any]:
    return [e for e in engine.trace.events if e.task == f"trial_{trial.number}"]


# ------------------------------------------------------------------------------ parity
def test_every_complete_trial_equals_plain_training() -> None:
    """4 trials, 2 at a time on 2 emulated devices, models in 2+ shards with real copies:
    each trial's trained model, reported values and final value are bit for bit those of
    plain PyTorch on the same configuration."""
    built: dict[int, th.ModelTask] = {}
    make_task = factory(built)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    with _engine() as engine:
        out = th.optimize(
            study, make_task, n_trials=4, epochs=EPOCHS, max_concurrent=2, engine=engine, seed=0
        )
        assert engine.tasks() == []  # every trial's task left the engine
        trace = engine.trace
    assert out is study
    assert _states(study) == dict.fromkeys(range(4), "COMPLETE")
    # Each emulated device computes on half the intra-op threads: so does the reference
    # (how a CPU sum is split across threads changes its rounding).
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))
    try:
        _check_plain_parity(study, built, make_task)
    finally:
        torch.set_num_threads(threads)
    # Trials ran at once, sharing both devices.
    assert {e.device for e in trace.events if e.is_compute} == {"cpu#0", "cpu#1"}
    spans = [
        (min(e.start for e in _ops_of(trace, n)), max(e.end for e in _ops_of(trace, n)))
        for n in (0, 1)
    ]
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans


def _check_plain_parity(
    study: Any, built: dict[int, th.ModelTask], make_task: Callable[[Any], th.ModelTask]
) -> None:
    for trial in study.trials:
        assert trial.user_attrs["num_shards"] >= 2
        got = built[trial.number].model.state_dict()
        ref = make_task(optuna.trial.FixedTrial(trial.params, number=trial.number))
        history = th.train_plain(ref, EPOCHS, seed=0)
        want = ref.model.state_dict()
        assert list(got) == list(want)
        for key in want:
            assert torch.equal(got[key], want[key]), (trial.number, key)
        assert trial.intermediate_values == {k: h["val_loss"] for k, h in enumerate(history)}
        assert trial.value == history[-1]["val_loss"]


def _ops_of(trace: Any, number: int) -> list[Any]:
    return [e for e in trace.events if e.task == f"trial_{number}" and e.is_compute]


def test_metric_loss_and_an_own_engine() -> None:
    """metric='loss' reports the training loss; without engine= one is built and closed."""
    built: dict[int, th.ModelTask] = {}
    make_task = factory(built, no_eval={0, 1})
    study = optuna.create_study()
    th.optimize(study, make_task, n_trials=2, epochs=2, devices=["cpu"], metric="loss", seed=3)
    assert _states(study) == {0: "COMPLETE", 1: "COMPLETE"}
    for trial in study.trials:
        ref = make_task(optuna.trial.FixedTrial(trial.params, number=trial.number))
        history = th.train_plain(ref, 2, seed=3)
        assert trial.intermediate_values == {0: history[0]["loss"], 1: history[1]["loss"]}
        assert trial.user_attrs["num_shards"] == 1  # the whole CPU: one shard


def test_a_metric_of_the_tasks_own_named_loss_is_the_objective() -> None:
    """The task's metric named loss is what metric='loss' reports (each epoch and as the
    value); metric='train_loss' then reports the training loss, as plain training has it."""

    def error_rate(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 1.0 - (out.argmax(1) == target).double().mean()

    built: dict[int, th.ModelTask] = {}
    make_task = factory(built, metrics={"loss": error_rate})
    for metric, key in (("loss", "loss"), ("train_loss", "train_loss")):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=2))
        th.optimize(study, make_task, n_trials=1, epochs=2, devices=["cpu"], metric=metric, seed=3)
        (trial,) = study.trials
        assert trial.state.name == "COMPLETE", trial.user_attrs.get("error")
        ref = make_task(optuna.trial.FixedTrial(trial.params, number=trial.number))
        history = th.train_plain(ref, 2, seed=3)
        assert history[0]["loss"] != history[0]["train_loss"]
        assert trial.intermediate_values == {0: history[0][key], 1: history[1][key]}
        assert trial.value == history[1][key]
    # train_loss is a loss (a minimizing study), reported by tasks with their own 'loss'
    with pytest.raises(UnknownMetricError, match="direction='minimize'"):
        th.optimize(optuna.create_study(direction="maximize"), make_task, metric="train_loss")
    study = optuna.create_study()
    th.optimize(study, factory({}), n_trials=1, devices=["cpu"], metric="train_loss")
    (failed,) = study.trials
    assert failed.state.name == "FAIL"
    assert "metrics={'loss'" in failed.user_attrs["error"], failed.user_attrs["error"]


# ------------------------------------------------------------------------------ pruning
class PruneTrialAt(optuna.pruners.BasePruner):  # type: ignore[misc]
    """Prunes one trial once it has reported ``step`` (0: after its first epoch)."""

    def __init__(self, number: int, step: int) -> None:
        self.number, self.step = number, step

    def prune(self, study: Any, trial: Any) -> bool:
        last = trial.last_step
        return trial.number == self.number and last is not None and last >= self.step


def test_pruned_trial_stops_at_once_and_its_slot_is_reused() -> None:
    built: dict[int, th.ModelTask] = {}
    study = optuna.create_study(pruner=PruneTrialAt(1, step=1))
    with _engine() as engine:
        th.optimize(
            study, factory(built), n_trials=4, epochs=EPOCHS, max_concurrent=2, engine=engine
        )
        assert engine.tasks() == []
        pruned = study.trials[1]
        assert pruned.state == TrialState.PRUNED
        assert list(pruned.intermediate_values) == [0, 1]  # steps count from 0
        assert pruned.value == pruned.intermediate_values[1]
        ops = _ops(engine, pruned)
        assert any(e.iteration == 1 for e in ops)  # it trained its second epoch ...
        assert [str(e) for e in ops if e.iteration >= 2] == []  # ... and nothing after
        others = [t for t in study.trials if t.number != 1]
        assert all(t.state == TrialState.COMPLETE for t in others)
        assert all(max(e.iteration for e in _ops(engine, t)) == EPOCHS - 1 for t in others)
    assert len(study.trials) == 4  # the pruned trial's slot went to another trial


def test_median_pruner_prunes_a_bad_trial() -> None:
    """Trials 0 and 1 train the same configuration (so the same losses, exactly); trial 2
    adds 5 to its loss, so at its first report it is above the median of the completed
    trials and MedianPruner prunes it. It starts only once a slot frees, i.e. after trial
    0 or 1 completed."""
    study = optuna.create_study(
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
    )
    for extra in (0.0, 0.0, 5.0):
        study.enqueue_trial({"lr": 0.01, "momentum": 0.9, "penalty": extra})
    with _engine() as engine:
        th.optimize(
            study, factory({}, penalty=True), n_trials=3, epochs=EPOCHS, max_concurrent=2,
            engine=engine, metric="loss", seed=0,
        )  # fmt: skip
        assert _states(study) == {0: "COMPLETE", 1: "COMPLETE", 2: "PRUNED"}
        assert study.trials[0].intermediate_values == study.trials[1].intermediate_values
        bad = study.trials[2]
        assert list(bad.intermediate_values) == [0]
        assert [str(e) for e in _ops(engine, bad) if e.iteration >= 1] == []


# ------------------------------------------------------------------------------ milestones
class _Recording(Engine):
    """An engine that records the milestones announced to it, and the engines built."""

    built: list[_Recording] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.milestones: dict[str, list[int | None]] = {}
        _Recording.built.append(self)

    def set_milestone(self, name: str, iterations: int | None) -> None:
        self.milestones.setdefault(name, []).append(iterations)
        super().set_milestone(name, iterations)


def test_each_epoch_announces_the_pruners_next_step() -> None:
    """A factory's task trains as a th.shard loop: its milestones are in ops (one op is
    one engine iteration of a loop), from the ops an epoch took. MedianPruner
    (n_warmup_steps=1) decides at steps 1, 2, 3 (after epochs 2, 3, 4): after epoch e its
    next decision is one epoch away (half an epoch of slack), and none before its last
    epoch (the end spares nothing), except while fewer trials than n_startup_trials
    finished: then its end is a milestone (the search waits for it). Nothing is ahead
    after its last report. Its work left is announced with each milestone. Trials 0 and 1
    train the same configuration, so 1 is not pruned; trial 0's ops per epoch are read
    from its task at its cut (its batches, its eval batches times its shards), trial 1's
    are trial 0's measure."""
    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1),
    )
    for _ in range(2):
        study.enqueue_trial({"lr": 0.01, "momentum": 0.9})
    with _RecordingOps(devices=["cpu", "cpu"], device_memory=BUDGET, copy_on_cpu=True) as eng:
        th.optimize(study, factory({}), n_trials=2, epochs=4, max_concurrent=1, engine=eng, seed=0)
    assert _states(study) == {0: "COMPLETE", 1: "COMPLETE"}
    epoch = eng.ops["trial_0"][1]  # ops of one epoch
    assert eng.ops["trial_0"] == [0, epoch, 2 * epoch, 3 * epoch, 4 * epoch]
    step = math.ceil(1.5 * epoch)
    assert eng.milestones == {
        "trial_0": [math.ceil(2.5 * epoch), step, step, step, None],
        "trial_1": [math.ceil(2.5 * epoch), step, step, None, None],
    }


class _RecordingOps(_Recording):
    """Also records each loop's ops done (its engine iterations) at each announcement."""

    def set_milestone(self, name: str, iterations: int | None) -> None:
        self.ops = getattr(self, "ops", {})
        self.ops.setdefault(name, []).append(self.runner(name).iteration)
        super().set_milestone(name, iterations)


def test_an_objectives_loop_is_told_its_next_milestone_in_ops() -> None:
    """An objective calling th.shard gets its milestones as a factory's task does, in its
    loop's ops (one op is one engine iteration of a loop): at its cut, then at each
    trial.report, from the ops the steps took. MedianPruner(n_warmup_steps=1) decides
    from step 1 on (after 2 reports), each step; half a step of slack. The first loop's
    ops per step are not known before it reports (far: _UNKNOWN_OPS); the second's are,
    from the first. Each op of a loop carries, as its iteration, the reports before it."""
    from tune_hydra.frontends.optuna import _UNKNOWN_OPS

    def objective(trial: optuna.Trial) -> float:
        trial.suggest_float("lr", 0.01, 0.01)
        torch.manual_seed(0)
        model, optimizer = th.shard(*_model_and_optimizer())
        data = batches(n=2)
        value = 0.0
        for epoch in range(4):
            for x, y in data:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
            with torch.no_grad():
                value = float(nn.functional.cross_entropy(model(data[0][0]), data[0][1]))
            trial.report(value, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1),
    )
    with _RecordingOps(devices=["cpu", "cpu"], device_memory=BUDGET, copy_on_cpu=True) as eng:
        th.optimize(study, objective, n_trials=2, max_concurrent=1, engine=eng)
        assert eng.tasks() == []
    assert _states(study) == {0: "COMPLETE", 1: "COMPLETE"}
    first, second = sorted(eng.milestones, key=lambda n: int(n.rsplit("-", 1)[1]))
    ops = eng.ops[first]
    assert ops[0] == 0 and len(ops) == 5  # the cut, then 4 reports
    per_step = ops[1]
    assert per_step > 0 and ops == [0, per_step, 2 * per_step, 3 * per_step, 4 * per_step]
    next_step = math.ceil(1.5 * per_step)  # one step ahead, half a step of slack
    assert eng.milestones[first] == [_UNKNOWN_OPS] + [next_step] * 4
    assert eng.milestones[second] == [math.ceil(2.5 * per_step)] + [next_step] * 4
    # Its ops' iteration counts the reports before them: the policy sees it progress.
    events = [e for e in eng.trace.events if e.task == first and e.is_compute]
    assert sorted({e.iteration for e in events}) == [0, 1, 2, 3]
    assert sum(e.iteration == 0 for e in events) == per_step


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


@pytest.mark.parametrize(
    ("sampler", "pruner", "policy", "chosen"),
    [
        ("TPESampler", "MedianPruner", "auto", "milestone"),
        ("RandomSampler", "MedianPruner", "auto", "milestone"),
        ("TPESampler", "NopPruner", "auto", "milestone"),  # TPE learns from finished trials
        ("RandomSampler", "NopPruner", "auto", "lrtf"),
        ("RandomSampler", "MedianPruner", "fifo", "fifo"),  # given by hand: kept
    ],
)
def test_auto_is_chosen_from_the_pruner_and_sampler(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    sampler: str,
    pruner: str,
    policy: str,
    chosen: str,
) -> None:
    import tune_hydra.engine

    monkeypatch.setattr(tune_hydra.engine, "Engine", _Recording)
    _Recording.built.clear()
    study = optuna.create_study(
        sampler=getattr(optuna.samplers, sampler)(seed=0), pruner=getattr(optuna.pruners, pruner)()
    )
    with caplog.at_level(logging.INFO, logger="tune_hydra.core.policies"):
        th.optimize(study, factory({}), n_trials=1, devices=["cpu"], policy=policy, seed=0)
    (engine,) = _Recording.built
    assert engine.policy.name == chosen
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("policy=")]
    assert len(said) == (policy == "auto")  # one line says what auto chose, and why
    assert all(m.startswith(f"policy='auto': {chosen} (") for m in said)


# ------------------------------------------------------------------------------ failures
def test_failing_trials_end_fail_and_the_others_complete(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A factory that raises, hangs, returns no ModelTask or one without the eval data
    the metric needs, a loss that becomes infinite: each fails its own trial only, with
    the fix in user_attrs["error"]. A factory raising optuna.TrialPruned prunes it."""
    built: dict[int, th.ModelTask] = {}
    release = threading.Event()
    make_task = factory(
        built, fail={1}, nan={2}, hang={3}, release=release, no_eval={4}, not_a_task={5},
        skip={6},
    )  # fmt: skip
    call_factory(lambda _: mlp(), None, what="a warm-up")  # the first call takes longer
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    optuna_logger = logging.getLogger("optuna")
    optuna_logger.addHandler(caplog.handler)  # trials are logged as Optuna logs them
    try:
        with _engine() as engine:
            th.optimize(
                study, make_task, n_trials=9, epochs=2, max_concurrent=2, engine=engine,
                factory_timeout_s=1.0,
            )  # fmt: skip
            assert engine.tasks() == []
    finally:
        release.set()
        optuna_logger.removeHandler(caplog.handler)
    deadline = time.monotonic() + 30
    while 3 not in built and time.monotonic() < deadline:  # the abandoned call ends
        time.sleep(0.05)
    assert _states(study) == {
        0: "COMPLETE", 1: "FAIL", 2: "FAIL", 3: "FAIL", 4: "FAIL", 5: "FAIL", 6: "PRUNED",
        7: "COMPLETE", 8: "COMPLETE",
    }  # fmt: skip
    errors = {t.number: t.user_attrs.get("error", "") for t in study.trials}
    assert "TaskFactoryError" in errors[1] and "make_task of trial 1 broke" in errors[1]
    assert errors[2].startswith("NonFiniteLossError") and "set max_grad_norm" in errors[2]
    assert errors[3].startswith("TaskFactoryTimeoutError") and "within 1 s" in errors[3]
    assert "metric='val_loss' needs eval_data" in errors[4] and "metric='loss'" in errors[4]
    assert "returned dict" in errors[5] and "th.ModelTask(" in errors[5]
    assert all(not errors[n] for n in (0, 6, 7, 8))
    assert "Trial 1 failed with parameters: {'lr'" in caplog.text  # logged too
    assert study.trials[2].intermediate_values == {}  # it never finished an epoch


def test_a_module_level_model_is_refused_for_the_second_trial() -> None:
    """A factory returning the same model every time: the second trial would start from
    the first one's trained weights (plain Optuna would do that too, silently)."""
    shared = mlp()

    def make_task(trial: Any) -> th.ModelTask:
        trial.suggest_float("lr", 1e-3, 1e-1)
        return th.ModelTask(
            shared, nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.01), batches(2)
        )

    study = optuna.create_study()
    th.optimize(study, make_task, n_trials=2, devices=["cpu"], max_concurrent=1, metric="loss")
    assert _states(study) == {0: "COMPLETE", 1: "FAIL"}
    assert study.trials[1].user_attrs["error"].startswith("ReusedModelError")


def test_ctrl_c_ends_running_trials_fail_and_frees_the_engine() -> None:
    """KeyboardInterrupt while trials are in flight: they end FAIL ("interrupted"), the
    engine keeps none of their tasks, and the interrupt propagates."""
    # Python's own Ctrl-C handler, as in a fresh process: ray.tune.run (run by other tests
    # in this process) leaves its handler installed, which swallows the first Ctrl-C.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_while_trials_run()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_while_trials_run() -> None:
    started: list[int] = []

    def make_task(trial: Any) -> th.ModelTask:
        started.append(trial.number)
        if trial.number == 2:
            _thread.interrupt_main()  # as if Ctrl-C were pressed now
        return factory({})(trial)

    study = optuna.create_study()
    with _engine() as engine, pytest.raises(KeyboardInterrupt):
        th.optimize(study, make_task, n_trials=50, epochs=50, max_concurrent=3, engine=engine)
    assert engine.tasks() == []
    states = _states(study)
    assert "RUNNING" not in states.values()
    interrupted = [
        t for t in study.trials if t.user_attrs.get("error", "").startswith("interrupted")
    ]
    assert {t.number for t in interrupted} >= {2}
    assert all(t.state == TrialState.FAIL for t in interrupted)
    assert len(study.trials) < 50


def test_timeout_stops_starting_trials() -> None:
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    begin = time.monotonic()
    th.optimize(
        study, factory({}, sleep_s=0.3), epochs=1, devices=["cpu"], max_concurrent=2, timeout=0.8
    )
    # Without the timeout the study would run for ever (no n_trials): a bound far above
    # the 0.8 s, so that a loaded machine passes too; the trial count is the behaviour.
    assert time.monotonic() - begin < 60
    assert 2 <= len(study.trials) <= 8
    assert set(_states(study).values()) == {"COMPLETE"}


def test_a_grid_sampler_ends_the_run_when_its_grid_is_done() -> None:
    """GridSampler calls ``study.stop()`` once the grid is done (from ``tell``): as in
    ``study.optimize``, no new trial is asked and the call returns (it raised Optuna's
    "Study.stop is supposed to be invoked inside an objective" before)."""
    grid = {"lr": [1e-3, 1e-2], "momentum": [0.0, 0.9]}
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(grid, seed=0))
    th.optimize(study, factory({}), epochs=1, devices=["cpu"], max_concurrent=2)
    assert set(_states(study).values()) == {"COMPLETE"}
    # No n_trials: only the stop ends the call. Two in flight may draw one point twice
    # (as GridSampler under study.optimize(n_jobs=2)).
    points = {(t.params["lr"], t.params["momentum"]) for t in study.trials}
    assert points == {(1e-3, 0.0), (1e-3, 0.9), (1e-2, 0.0), (1e-2, 0.9)}
    assert len(study.trials) <= 5


# ------------------------------------------------------------------------------ save_dir
def test_save_dir_holds_each_finished_trials_model(tmp_path: Path) -> None:
    built: dict[int, th.ModelTask] = {}
    study = optuna.create_study(pruner=PruneTrialAt(1, step=1))
    th.optimize(
        study, factory(built, fail={2}), n_trials=4, epochs=2, devices=["cpu", "cpu"],
        device_memory=BUDGET, copy_on_cpu=True, max_concurrent=2, save_dir=tmp_path / "models",
    )  # fmt: skip
    assert _states(study) == {0: "COMPLETE", 1: "PRUNED", 2: "FAIL", 3: "COMPLETE"}
    for number in (0, 3):
        trial = study.trials[number]
        path = Path(trial.user_attrs["model_path"])
        assert path == tmp_path / "models" / f"trial_{number}" / "model.pt"
        state = torch.load(path, weights_only=True)
        fresh = mlp(seed=9)
        fresh.load_state_dict(state, strict=True)
        for key, value in built[number].model.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], value), key
        assert sorted(os.listdir(path.parent)) == ["model.pt"]  # no temp file left
    for number in (1, 2):
        assert "model_path" not in study.trials[number].user_attrs
    assert sorted(os.listdir(tmp_path / "models")) == ["trial_0", "trial_3"]


# ------------------------------------------------------------------------------ shared storage
_SHARED = """
import os
import sys
import time

import optuna
import torch
from torch import nn

import tune_hydra as th


def make_task(trial):
    lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
    trial.set_user_attr("pid", os.getpid())
    time.sleep(0.1)  # trials of both processes are in flight at the same time
    torch.manual_seed(0)
    x = torch.randn(3, 8, 4)
    data = [(xb, xb.sum(1, keepdim=True)) for xb in x]
    return th.ModelTask(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), nn.MSELoss(),
        lambda p: torch.optim.SGD(p, lr=lr), data, eval_data=data[:1],
    )


def storage_of(address):
    if address.endswith(".log"):
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(address))
    return address


def run(address):
    study = optuna.load_study(
        study_name="shared", storage=storage_of(address), pruner=optuna.pruners.NopPruner()
    )
    th.optimize(study, make_task, n_trials=3, epochs=2, devices=["cpu"], max_concurrent=2)


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    for address in sys.argv[1:]:
        run(address)
"""


def test_two_processes_share_one_study(tmp_path: Path) -> None:
    """Optuna's distributed mode: this process and another one run th.optimize at the same
    time on one study, through a journal file and through SQLite; the study ends with
    both processes' trials, numbered apart, all complete."""
    script = tmp_path / "shared_worker.py"
    script.write_text(textwrap.dedent(_SHARED))
    addresses = [str(tmp_path / "study.log"), f"sqlite:///{tmp_path / 'study.db'}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(script), *addresses],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        namespace: dict[str, Any] = {}
        exec(compile(script.read_text(), str(script), "exec"), namespace)  # our half
        for address in addresses:  # while the other process starts
            optuna.create_study(study_name="shared", storage=namespace["storage_of"](address))
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()  # type: ignore[union-attr]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        for address in addresses:
            namespace["run"](address)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err[-4000:]
    for address in addresses:
        study = optuna.load_study(study_name="shared", storage=namespace["storage_of"](address))
        trials = study.get_trials()
        assert sorted(t.number for t in trials) == list(range(6)), address
        assert all(t.state == TrialState.COMPLETE for t in trials), address
        assert all(list(t.intermediate_values) == [0, 1] for t in trials), address
        pids = sorted(t.user_attrs["pid"] for t in trials)
        assert pids == sorted([os.getpid()] * 3 + [proc.pid] * 3), address


_KILLED = """
import sys, time
import optuna, torch
from torch import nn
import tune_hydra as th

storage = optuna.storages.RDBStorage(sys.argv[1], heartbeat_interval=1, grace_period=2)
study = optuna.create_study(study_name="beats", storage=storage)

def make_task(trial):
    trial.suggest_float("lr", 1e-7, 1e-1, log=True)  # as factory() below suggests it
    print("building", flush=True)
    time.sleep(600)  # killed before it returns

th.optimize(study, make_task, n_trials=2, devices=["cpu"], max_concurrent=2, metric="loss")
"""


def test_a_killed_process_s_trials_end_fail_through_heartbeats(tmp_path: Path) -> None:
    """A storage with ``heartbeat_interval``: th.optimize beats for its trials, so those of a
    process killed mid-trial end FAIL when the study is next optimized, as with
    ``study.optimize`` (before: RUNNING forever)."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    url = f"sqlite:///{tmp_path / 'beats.db'}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(script), url], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "building"
        time.sleep(1.5)  # a heartbeat is recorded at once, then every second
    finally:
        proc.kill()
        proc.wait(timeout=60)
    storage = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=2)
    study = optuna.load_study(study_name="beats", storage=storage)
    assert [t.state for t in study.trials] == [TrialState.RUNNING] * 2
    time.sleep(2.5)  # past the grace period
    th.optimize(study, factory({}), n_trials=1, devices=["cpu"], metric="loss")
    states = [t.state for t in study.trials]
    assert states == [TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE]


# ------------------------------------------------------------------------------ bad input
def test_bad_input_is_refused_before_any_trial() -> None:
    study = optuna.create_study()
    make_task = factory({})
    with pytest.raises(UnknownMetricError, match=r"metric='epoch'.*'val_loss'"):
        th.optimize(study, make_task, n_trials=1, metric="epoch")
    with pytest.raises(UnknownMetricError, match="metric=''"):
        th.optimize(study, make_task, n_trials=1, metric="")
    with pytest.raises(UnknownMetricError, match="direction='minimize'"):
        th.optimize(
            optuna.create_study(direction="maximize"), make_task, n_trials=1, metric="val_loss"
        )
    with pytest.raises(UnknownOptionError, match=r"'polcy' \(did you mean 'policy'\?\)"):
        th.optimize(study, make_task, n_trials=1, polcy="fifo")
    with pytest.raises(TypeError, match="'num_samples'"):  # also a TypeError, like Python's
        th.optimize(study, make_task, n_trials=1, num_samples=4)
    with pytest.raises(InvalidStudyError, match=r"takes an optuna\.Study first, not function"):
        th.optimize(make_task, study, n_trials=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidStudyError, match="2 objectives"):
        th.optimize(optuna.create_study(directions=["minimize"] * 2), make_task, n_trials=1)
    with pytest.raises(InvalidStudyError, match="make_task must be a function"):
        th.optimize(study, "make_task", n_trials=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="epochs=0"):
        th.optimize(study, make_task, n_trials=1, epochs=0)
    with pytest.raises(InvalidOptionError, match="precision='fp8'"):
        th.optimize(study, make_task, n_trials=1, precision="fp8")
    with pytest.raises(InvalidOptionError, match="factory_timeout_s=-1"):
        th.optimize(study, make_task, n_trials=1, factory_timeout_s=-1)
    with Engine(devices=["cpu"]) as engine, pytest.raises(InvalidOptionError, match="Engine"):
        th.optimize(study, make_task, n_trials=1, engine=engine, device_memory="1MiB")
    assert study.trials == []


def test_maximizing_study_default_metric_stops_at_the_first_factory_trial() -> None:
    # metric left out: an objective may maximize its own value, so the loss-in-a-maximizing-
    # study error comes when the first factory returns its task, and ends the call.
    study = optuna.create_study(direction="maximize")
    with pytest.raises(UnknownMetricError, match="direction='minimize'"):
        th.optimize(study, factory({}), n_trials=3, devices=["cpu"], max_concurrent=1)
    assert [t.state for t in study.trials] == [TrialState.FAIL]


def test_without_optuna_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(MissingDependencyError, match=r'pip install "tune_hydra\[optuna\]"'):
        th.optimize(object(), factory({}), n_trials=1)  # type: ignore[arg-type]


def test_imports_stay_light() -> None:
    """``import tune_hydra`` loads neither optuna, torch nor Ray; the optimize module loads
    no Ray; th.optimize is the function however the module was imported first."""
    code = textwrap.dedent(
        """
        import sys
        import tune_hydra as th
        assert not {"optuna", "torch", "ray"} & set(sys.modules), sys.modules.keys()
        from tune_hydra.frontends.optuna import METRICS
        assert not {"optuna", "torch", "ray"} & set(sys.modules)
        assert callable(th.optimize) and "val_loss" in METRICS
        import optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            th.optimize(optuna.create_study(), lambda t: None, n_trials=1, metric="nope")
        except th.exceptions.UnknownMetricError:
            pass
        assert "ray" not in sys.modules
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
