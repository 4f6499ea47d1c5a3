"""Hugging Face ``Trainer`` under Ray Tune with a HydraExecutor (issue 32).

A Tune function trainable that trains a ``Trainer`` over ``th.shard(model)`` (Trainer's
own optimizer, scheduler, accumulation and evaluation) runs in the engine process, one
thread per trial; and ``trainer.hyperparameter_search(backend="ray",
trial_executor=...)`` after ``th.patch_tune()`` (transformers calls ``ray.tune.run``)
with a ``model_init`` that calls ``th.shard``. Each is compared with the same Trainer
without tune_hydra: float32 on the CPU, ``==`` of every logged loss. The tiny GPT-2, its
data and its ``TrainingArguments`` are those of ``tests/frontends/test_shard_trainer.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import cloudpickle, tune

import tune_hydra as th
from tests.frontends.ray import relay
from tune_hydra.frontends.ray import HydraExecutor

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from accelerate.state import GradientState  # noqa: E402

from tests.frontends import test_shard_trainer  # noqa: E402
from tests.frontends.test_shard_trainer import Tokens, gpt2  # noqa: E402
from tests.frontends.test_shard_trainer import args as trainer_args  # noqa: E402

pytestmark = pytest.mark.integration

# The engine actor unpickles these functions (and the shared GPT-2, data and arguments)
# by value: it cannot import the test package.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(test_shard_trainer)

RATES = [1e-2, 3e-2]


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


class ReportLosses(transformers.TrainerCallback):  # type: ignore[misc]
    """Reports every loss the Trainer logs (training and evaluation) to Tune, one result
    each; at the first step waits (bounded) until ``peers`` trials got there, so that
    the trials train at once."""

    def __init__(self, barrier: str | None = None, peers: int = 0) -> None:
        self.barrier, self.peers = barrier, peers

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.barrier is None or state.global_step != 1:
            return
        Path(self.barrier, tune.get_context().get_trial_id()).touch()
        deadline = time.monotonic() + 60
        while len(os.listdir(self.barrier)) < self.peers and time.monotonic() < deadline:
            time.sleep(0.02)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        for key in ("loss", "eval_loss"):
            if key in (logs or {}):
                tune.report({"what": key, "value": logs[key], "step": state.global_step})


def train_trainer(config: dict[str, Any]) -> None:
    """A function trainable: a Trainer with its defaults over the tiny GPT-2 (sharded
    unless ``shard`` is False), its output in the working directory (the trial's)."""
    torch.manual_seed(0)
    model = gpt2()
    if config.get("shard", True):
        model = th.shard(model)
    trainer = transformers.Trainer(
        model=model,
        args=trainer_args(Path("out"), learning_rate=config["lr"], num_train_epochs=1),
        train_dataset=Tokens(),
        eval_dataset=Tokens(8, 1),
        callbacks=[ReportLosses(config.get("barrier"), config.get("peers", 0))],
    )
    trainer.train()


def _plain(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The function without th.shard, here, with a fake session."""
    return relay.plain(train_trainer, {**config, "shard": False}).results


def _executor() -> HydraExecutor:
    """2 emulated copying devices, one block a shard."""
    return relay.emulated_executor(1)


def test_trainer_function_trials_each_equal_alone(
    ray_session: Any, storage: str, tmp_path: Path, monkeypatch: Any, one_torch_thread: None
) -> None:
    """Two Trainer function trials at once in one engine (``tune.run(...,
    trial_executor=...)`` after ``th.patch_tune()``): each trial's logged losses equal the
    same function's without th.shard, alone; both loops ran on the engine, interleaved,
    and left it."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    th.patch_tune()
    try:
        with _executor() as ex:
            analysis = tune.run(
                train_trainer,
                config={"lr": tune.grid_search(RATES), "barrier": str(barrier), "peers": 2},
                storage_path=storage,
                verbose=0,
                trial_executor=ex,
            )
            trace = ex.trace()
            assert relay.live_functions(ex) == []
            registered = ex.registered_trials()
    finally:
        th.unpatch_tune()
    monkeypatch.chdir(tmp_path)  # the plain function's output folder
    trials = sorted(analysis.trials, key=lambda t: t.config["lr"])
    assert [t.status for t in trials] == ["TERMINATED"] * 2, [t.error_file for t in trials]
    for trial in trials:
        want = _plain({"lr": trial.config["lr"]})
        got = analysis.trial_dataframes[trial.trial_id][["what", "value", "step"]]
        assert len(want) == 5  # 4 optimizer steps (accumulating 2) and 1 evaluation
        assert got.to_dict("records") == want
    spans: dict[str, tuple[float, float]] = {}
    for event in trace.events:
        lo, hi = spans.get(event.task, (event.start, event.end))
        spans[event.task] = (min(lo, event.start), max(hi, event.end))
    # Each trial's model on the one engine, as two loops: its first step's (before the
    # Trainer's optimizer, built after th.shard, was adopted) and the rest.
    assert len(spans) == 4 and all("GPT2LMHeadModel" in name for name in spans), spans
    (a0, a1), (b0, b1) = sorted(spans.values())[2:]  # the adopted ones (both past step 1)
    assert a0 < b1 and b0 < a1, spans  # multiplexed: both trained at once
    assert all(not r["engine_tasks"] for r in registered.values()), registered


def test_hyperparameter_search_with_ray_shards_each_trial(
    ray_session: Any, storage: str, tmp_path: Path, one_torch_thread: None
) -> None:
    """``trainer.hyperparameter_search(backend="ray", trial_executor=...)`` after
    ``th.patch_tune()``, with a ``model_init`` that calls ``th.shard``: both trials train
    on the engine and the best run's objective equals the plain Trainer's."""
    logging.getLogger("ray.tune").setLevel(logging.WARNING)
    # Plain transformers/accelerate: once a Trainer trained in this process (the test
    # above's plain runs), Accelerate's process-wide GradientState holds weak references
    # to its dataloaders and no new Trainer pickles for Ray ("cannot pickle
    # 'weakref.ReferenceType'"), with or without tune_hydra.
    GradientState._reset_state()

    def search(shard: bool, **kwargs: Any) -> Any:
        def model_init(trial: Any = None) -> Any:
            torch.manual_seed(0)
            model = gpt2()
            return th.shard(model) if shard else model

        trainer = transformers.Trainer(
            model_init=model_init,
            args=trainer_args(tmp_path / str(shard), num_train_epochs=1),
            train_dataset=Tokens(),
            eval_dataset=Tokens(8, 1),
        )
        from ray.tune.search import BasicVariantGenerator

        return trainer.hyperparameter_search(
            hp_space=lambda _: {"learning_rate": tune.choice(RATES)},
            n_trials=2,
            direction="minimize",
            backend="ray",
            search_alg=BasicVariantGenerator(
                points_to_evaluate=[{"learning_rate": lr} for lr in RATES]
            ),
            storage_path=storage,
            verbose=0,
            **kwargs,
        )

    th.patch_tune()
    try:
        with _executor() as ex:
            best = search(True, trial_executor=ex)
            trace = ex.trace()
            assert relay.live_functions(ex) == []
            registered = ex.registered_trials()
    finally:
        th.unpatch_tune()
    runs = {t.config["learning_rate"]: t for t in best.run_summary.trials}
    assert [t.status for t in runs.values()] == ["TERMINATED"] * 2
    # Both trials' models on the engine, two loops each (see the test above)
    assert len({e.task for e in trace.events}) == 4, {e.task for e in trace.events}
    assert all(not r["engine_tasks"] for r in registered.values()), registered
    # The plain search: Ray's own trials, a process each
    GradientState._reset_state()
    plain = search(False)
    want = {t.config["learning_rate"]: t.last_result["objective"] for t in plain.run_summary.trials}
    got = {lr: t.last_result["objective"] for lr, t in runs.items()}
    assert got == want
    assert (best.objective, best.hyperparameters) == (plain.objective, plain.hyperparameters)
