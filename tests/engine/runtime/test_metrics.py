"""``ModelTask(metrics=..., lr_scheduler=...)``: eval metrics and learning-rate schedules
equal plain training exactly (float64, ``torch.equal``), on 2 tasks multiplexed over 2
emulated devices with the models cut into >= 3 shards, recompute on and off; a resume
mid-epoch carries the schedule; bad inputs are refused with the fix in the message."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import batches, mlp
from tune_hydra.engine import Engine
from tune_hydra.exceptions import (
    InvalidSchedulerError,
    InvalidTaskError,
    MetricError,
    TrainingError,
)
from tune_hydra.frontends.task_loop import TaskLoop

# 2 emulated devices that really copy shard state; a budget that cuts mlp() in >= 3.
DEVICES: dict[str, Any] = {
    "devices": ["cpu", "cpu"],
    "copy_on_cpu": True,
    "device_memory": 24_000,
}
OPTIONS: dict[str, Any] = {"seed": 3, "accumulate_steps": 2, "max_grad_norm": 0.05}


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    return float((output.argmax(1) == target).double().mean())


def neg_nll(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -nn.functional.cross_entropy(output, target)  # a 0-dim tensor


METRICS = {"accuracy": accuracy, "neg_nll": neg_nll}


def eval_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of different sizes, so that the weighted mean differs from the plain one."""
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(n, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (n,), generator=g),
        )
        for n in (6, 2, 5)
    ]


def step_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9**s)


def one_cycle(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)


def hf_linear(opt: torch.optim.Optimizer) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=12)


def task(
    seed: int = 0,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    metrics: dict[str, Any] | None = None,
    opt: str = "adamw",
) -> th.ModelTask:
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = (
        (lambda p: torch.optim.AdamW(p, lr=0.02))
        if opt == "adamw"
        else (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    )
    return th.ModelTask(
        mlp(seed=seed),
        nn.CrossEntropyLoss(),
        optimizer,
        batches(5),
        eval_data=eval_batches(),
        metrics=metrics,
        lr_scheduler=lr_scheduler,
    )


def plain(t: th.ModelTask, epochs: int) -> tuple[th.ModelTask, list[dict[str, Any]]]:
    ref = th.ModelTask(
        copy.deepcopy(t.model),
        t.loss_fn,
        t.optimizer,
        t.train_data,
        eval_data=t.eval_data,
        metrics=t.metrics,
        lr_scheduler=t.lr_scheduler,
    )
    # The engine gives each of its 2 CPU workers half the intra-op threads, and a gradient
    # norm's float64 sum depends on the thread count: the reference runs with as many.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))
    try:
        return ref, th.train_plain(
            ref, epochs, seed=3, accumulate_steps=2, max_grad_norm=OPTIONS["max_grad_norm"]
        )
    finally:
        torch.set_num_threads(threads)


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == torch.float64 or not sa[k].is_floating_point(), k
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("recompute", [True, False])
def test_metrics_are_batch_weighted_means_equal_to_plain_training(recompute: bool) -> None:
    tasks = {"a": task(0, step_lr, METRICS), "b": task(1, warmup, METRICS, opt="sgd")}
    refs = {name: plain(t, 3) for name, t in tasks.items()}
    # Kept graphs (recompute=False) do not fit the budget: cut by layer count instead.
    cut = DEVICES if recompute else {**DEVICES, "device_memory": None, "max_layers_per_shard": 3}
    history = th.train_models(tasks, epochs=3, recompute=recompute, **cut, **OPTIONS)
    for name, t in tasks.items():
        assert history[name][0]["num_shards"] >= 3
        ref_task, ref_hist = refs[name]
        assert_params_equal(t.model, ref_task.model)
        for got, want in zip(history[name], ref_hist, strict=True):
            for key in ("loss", "val_loss", "accuracy", "neg_nll"):
                assert got[key] == want[key], (name, key)
            assert "train_loss" not in got  # "loss" is the training loss here
    # the mean is weighted by batch size (the eval batches have 6, 2 and 5 rows)
    model = tasks["a"].model
    model.eval()
    with torch.no_grad():
        outs = [(model(x), y) for x, y in eval_batches()]
    acc = sum(accuracy(o, y) * len(y) for o, y in outs) / 13
    assert history["a"][-1]["accuracy"] == pytest.approx(acc, abs=1e-12)


def error_rate(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 1.0 - (output.argmax(1) == target).double().mean()


def test_a_metric_named_loss_is_the_tasks_own_and_the_training_loss_moves_aside() -> None:
    """The user's name wins: each epoch's ``loss`` is the task's metric and ``train_loss``
    the engine's training loss, which is exactly that of the same task without the
    metric; engine and plain training agree exactly (2 tasks, 2 emulated devices)."""
    own = {"loss": error_rate, "accuracy": accuracy}
    setups: dict[str, tuple[int, Any, str]] = {"a": (0, step_lr, "adamw"), "b": (1, None, "sgd")}
    tasks = {name: task(seed, sched, own, opt) for name, (seed, sched, opt) in setups.items()}
    refs = {name: plain(t, 2) for name, t in tasks.items()}
    without = {  # the same tasks, their metric named loss left out
        name: plain(task(seed, sched, {"accuracy": accuracy}, opt), 2)[1]
        for name, (seed, sched, opt) in setups.items()
    }
    history = th.train_models(tasks, epochs=2, **DEVICES, **OPTIONS)
    for name, t in tasks.items():
        assert history[name][0]["num_shards"] >= 3
        ref_task, ref_hist = refs[name]
        assert_params_equal(t.model, ref_task.model)
        for got, want, other in zip(history[name], ref_hist, without[name], strict=True):
            assert set(got) >= {"loss", "train_loss", "val_loss", "accuracy"}
            for key in ("loss", "train_loss", "val_loss", "accuracy"):
                assert got[key] == want[key], (name, key)
            assert got["train_loss"] == other["loss"]  # the training loss, unchanged
            assert got["val_loss"] == other["val_loss"]
            assert got["loss"] == pytest.approx(1.0 - got["accuracy"], abs=1e-12)
            assert got["loss"] != got["train_loss"]
    assert "train_loss" not in without["a"][0]  # only a task's own loss moves it aside


@pytest.mark.parametrize("schedule", [step_lr, warmup, one_cycle, hf_linear])
def test_lr_schedulers_equal_plain_training(schedule: Callable[..., Any]) -> None:
    tasks = {"a": task(0, schedule), "b": task(1, schedule, opt="sgd")}
    refs = {name: plain(t, 2) for name, t in tasks.items()}
    history = th.train_models(tasks, epochs=2, **DEVICES, **OPTIONS)
    for name, t in tasks.items():
        assert history[name][0]["num_shards"] >= 3
        assert_params_equal(t.model, refs[name][0].model)
        assert [r["loss"] for r in history[name]] == [r["loss"] for r in refs[name][1]]


def test_the_schedule_really_changes_the_learning_rate() -> None:
    t = task(0, step_lr)
    with Engine(**DEVICES) as eng:
        loop = TaskLoop("a", t, eng, **OPTIONS)
        loop.start(1).result(timeout=120)
        assert loop.scheduler is not None
        steps = {loop.scheduler.last_epoch}
        lrs = {g["lr"] for g in loop.optimizer.param_groups}
        # each shard's optimizer steps with the user's hyperparameters of its step
        shards = [s for s in loop.runner.shards if s.optimizer is not None]
        assert len(shards) >= 3 and {s.steps for s in shards} == steps
        lrs |= {s.optimizer.param_groups[0]["lr"] for s in shards}
        loop.close()
    # 5 batches in groups of 2: 3 steps, StepLR(step_size=2, gamma=0.5) halves once
    assert steps == {3} and lrs == {0.01}


@pytest.mark.parametrize("schedule", [warmup, one_cycle])
def test_resume_mid_epoch_with_a_scheduler_equals_straight_training(
    schedule: Callable[..., Any],
) -> None:
    options = {**OPTIONS, "iteration_batches": 3}
    straight = task(0, schedule, METRICS)
    with Engine(**DEVICES) as eng:
        loop = TaskLoop("t", straight, eng, **options)
        want = loop.start(3).result(timeout=120)
        loop.close()
    results: list[dict[str, Any]] = []
    state: dict[str, Any] | None = None
    for i, (cut, iterations) in enumerate([({"device_memory": 24_000}, 1), ({}, 2)]):
        t = task(0 if i == 0 else 99, schedule, METRICS)
        with Engine(["cpu", "cpu"], copy_on_cpu=True, **cut) as eng:
            loop = TaskLoop("t", t, eng, **options)
            if state is not None:
                loop.load_state(state)
            results += loop.start(iterations).result(timeout=120)
            state = loop.state()
            shards = len(loop.cut())
            loop.close()
        assert (shards >= 3) if i == 0 else (shards == 1)
    assert state is not None and "lr_scheduler" in state
    assert state["lr_scheduler"]["last_epoch"] > 0
    assert_params_equal(t.model, straight.model)
    for got, exp in zip(results, want, strict=True):
        for key in ("loss", "val_loss", "accuracy", "neg_nll"):
            assert got[key] == exp[key], key


def test_a_state_without_scheduler_is_refused_by_a_task_with_one() -> None:
    with Engine("cpu") as eng:
        loop = TaskLoop("t", task(0), eng, seed=0)
        loop.start(1).result(timeout=120)
        state = loop.state()
        loop.close()
    with Engine("cpu") as eng:
        loop = TaskLoop("t", task(0, step_lr), eng, seed=0)
        with pytest.raises(InvalidTaskError, match="lr_scheduler"):
            loop.load_state(state)
        loop.close()


# -- bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["val_loss", "train_loss", "epoch", "num_shards", "iteration", "config/lr"]
)
def test_a_metric_named_like_an_engine_result_is_refused(name: str) -> None:
    with pytest.raises(InvalidTaskError, match=f"metric name '{name}'.*rename"):
        task(0, metrics={name: accuracy})
    # with a metric named loss of the task's own, train_loss holds the training loss
    with pytest.raises(InvalidTaskError, match=f"metric name '{name}'.*rename"):
        task(0, metrics={"loss": accuracy, name: accuracy})


def test_metrics_need_eval_data_and_callables() -> None:
    with pytest.raises(InvalidTaskError, match="eval_data"):
        th.ModelTask(
            mlp(),
            nn.CrossEntropyLoss(),
            lambda p: torch.optim.SGD(p, lr=0.1),
            batches(2),
            metrics={"accuracy": accuracy},
        )
    with pytest.raises(InvalidTaskError, match="callable"):
        task(0, metrics={"accuracy": 0.5})
    with pytest.raises(InvalidTaskError, match="dict"):
        task(0, metrics=[accuracy])  # type: ignore[arg-type]


def test_a_metric_that_raises_fails_its_task_alone() -> None:
    def broken(output: torch.Tensor, target: torch.Tensor) -> float:
        raise ValueError("no labels here")

    tasks = {"bad": task(0, metrics={"f1": broken}), "good": task(1, metrics=METRICS)}
    with pytest.raises(TrainingError) as info:
        th.train_models(tasks, epochs=2, **DEVICES, **OPTIONS)
    err = info.value.errors["bad"]
    assert isinstance(err, MetricError)
    assert "metric 'f1' raised ValueError: no labels here" in str(err)
    assert "good" not in info.value.errors
    assert len(info.value.history["good"]) == 2


def test_a_metric_that_returns_no_number_fails_with_the_fix() -> None:
    tasks = {"bad": task(0, metrics={"per_row": lambda o, y: o.argmax(1) == y})}
    with pytest.raises(TrainingError) as info:
        th.train_models(tasks, epochs=1, devices="cpu")
    assert isinstance(info.value.errors["bad"], MetricError)
    assert "0-dim tensor" in str(info.value.errors["bad"])


def test_bad_lr_schedulers_are_refused() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(InvalidTaskError, match="factory"):
        task(0, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))  # type: ignore[arg-type]
    with pytest.raises(InvalidTaskError, match="factory"):
        task(0, lr_scheduler="linear")  # type: ignore[arg-type]
    for bad in (lambda o: None, lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o)):
        with pytest.raises(TrainingError) as info:
            th.train_models({"a": task(0, bad)}, devices="cpu")
        err = info.value.errors["a"]
        assert isinstance(err, InvalidSchedulerError) and "LRScheduler" in str(err)
    with pytest.raises(TrainingError) as info:
        th.train_models({"a": task(0, lambda o: 1 / 0)}, devices="cpu")
    assert "lr_scheduler(optimizer) raised ZeroDivisionError" in str(info.value.errors["a"])


# -- th.optimize on a metric of the task's own ----------------------------------------------


def test_optimize_maximizes_a_metric_the_task_declares() -> None:
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def make_task(trial: Any) -> th.ModelTask:
        lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        t = task(trial.number, step_lr, METRICS)
        t.optimizer = lambda p: torch.optim.SGD(p, lr=lr)
        return t

    study = optuna.create_study(direction="maximize")
    th.optimize(study, make_task, n_trials=2, epochs=2, devices=["cpu"], metric="accuracy")
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(done) == 2 and all(0.0 <= t.value <= 1.0 for t in done)
    assert all(list(t.intermediate_values) == [0, 1] for t in done)
    # a loss still needs a minimizing study; a name no task declares fails its trials
    with pytest.raises(th.exceptions.UnknownMetricError, match="direction='minimize'"):
        th.optimize(optuna.create_study(direction="maximize"), make_task, n_trials=1)
    other = optuna.create_study(direction="maximize")
    th.optimize(other, make_task, n_trials=1, devices=["cpu"], metric="f1")
    (failed,) = other.trials
    assert failed.state.name == "FAIL"
    error = failed.user_attrs.get("error", "")
    assert "metric='f1' is not reported" in error and "metrics={'f1'" in error


@pytest.mark.parametrize("schedule", [step_lr, warmup, one_cycle, hf_linear])
def test_scheduler_state_survives_a_checkpoint_file(
    schedule: Callable[..., Any], tmp_path: Any
) -> None:
    """The state goes through write_checkpoint / read_checkpoint (safe loading, tensors
    and plain containers only) and resumes into a model cut another way exactly."""
    from tune_hydra.frontends.checkpoint import read_checkpoint, write_checkpoint

    options = {**OPTIONS, "iteration_batches": 3}
    straight = task(0, schedule)
    with Engine(**DEVICES) as eng:
        loop = TaskLoop("t", straight, eng, **options)
        loop.start(2).result(timeout=120)
        loop.close()
    with Engine(**DEVICES) as eng:
        loop = TaskLoop("t", task(0, schedule), eng, **options)
        loop.start(1).result(timeout=120)
        state = loop.state()
        loop.close()
    write_checkpoint(tmp_path, state["model"], {k: v for k, v in state.items() if k != "model"})
    model_state, rest, _ = read_checkpoint(tmp_path)
    loaded = {**rest, "model": model_state}
    resumed = task(5, schedule)
    with Engine(["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2) as eng:
        loop = TaskLoop("t", resumed, eng, **options)
        loop.load_state(loaded)
        loop.start(1).result(timeout=120)
        loop.close()
    assert_params_equal(resumed.model, straight.model)
