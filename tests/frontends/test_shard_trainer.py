"""Hugging Face ``Trainer`` over a ``th.shard``-ed model, with Trainer's defaults.

Trainer builds its own optimizer and scheduler after ``th.shard`` (over
``model.parameters()``), accumulates, clips, evaluates and saves; each test compares with
the same Trainer without ``th.shard`` (float32 on the CPU, ``==`` of every logged loss).
Concurrent trials are threads of one process, where Accelerate's state is process-wide
unless made per thread (:mod:`tune_hydra.frontends.threads`): two trials at once under
``th.optimize`` each equal the trial alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import tune_hydra as th

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token rows as a causal LM's batches (no ``datasets``, no download)."""

    def __init__(self, n: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 32, (n, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def gpt2() -> Any:
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=32,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def args(out: Path, **kw: Any) -> Any:
    base: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "num_train_epochs": 2,
        "gradient_accumulation_steps": 2,
        "logging_steps": 1,
        "eval_strategy": "epoch",
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
    }
    return transformers.TrainingArguments(str(out), **{**base, **kw})


def fit(out: Path, *, shard: bool, engine: th.Engine | None = None, **kw: Any) -> Any:
    torch.manual_seed(0)
    model = gpt2()
    if shard:
        model = th.shard(model, engine=engine)
    trainer = transformers.Trainer(
        model=model, args=args(out, **kw), train_dataset=Tokens(), eval_dataset=Tokens(8, 1)
    )
    trainer.train()
    return trainer


def losses(trainer: Any) -> list[float]:
    return [h[k] for h in trainer.state.log_history for k in ("loss", "eval_loss") if k in h]


@pytest.fixture
def engine() -> Any:
    eng = th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2)
    yield eng
    eng.close()


def test_trainer_with_its_defaults_equals_plain(tmp_path: Path, engine: th.Engine) -> None:
    want = fit(tmp_path / "plain", shard=False)
    got = fit(tmp_path / "sharded", shard=True, engine=engine)
    assert len(losses(got)) == 10  # 8 optimizer steps (accumulating 2), 2 evaluations
    assert losses(got) == losses(want)
    # Trainer's own optimizer (built after th.shard) was adopted at its first step: its
    # state is the shards' (the engine's), not a plain optimizer's at home.
    opt = got.optimizer.optimizer  # under Accelerate's wrapper
    assert "_th_shard" in opt.__dict__
    assert opt.state_dict()["state"] and not opt.state
    # save_model writes the model's own state_dict: a plain model loads it.
    got.save_model(str(tmp_path / "saved"))
    plain = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    for k, v in want.model.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k


def test_trainer_s_clipping_leaves_the_states_where_they_are(
    tmp_path: Path, engine: th.Engine, syncs: list[int]
) -> None:
    """Trainer clips every step by default (``max_grad_norm=1.0``, through Accelerate's
    ``clip_grad_norm_``): shard by shard, with the gradients on their devices; and it
    counts the model's parameters every micro-batch (``floating_point_ops``), which reads
    shapes only. So a run, clipping or not, brings the state home once (its first step,
    where Trainer's optimizer is adopted), not at every step, and is bit-equal to plain,
    logged gradient norms included."""
    counts = []
    for norm in (1.0, 0.0):
        want = fit(tmp_path / f"plain{norm}", shard=False, max_grad_norm=norm)
        before = len(syncs)
        got = fit(tmp_path / f"sharded{norm}", shard=True, engine=engine, max_grad_norm=norm)
        counts.append(len(syncs) - before)
        assert losses(got) == losses(want), norm
        assert [h.get("grad_norm") for h in got.state.log_history] == [
            h.get("grad_norm") for h in want.state.log_history
        ], norm
    assert counts[0] == counts[1] == 1, counts  # the first step's: its optimizer adopted


def test_a_datasets_dataset_with_extra_columns_as_plain(tmp_path: Path, engine: th.Engine) -> None:
    """A Hugging Face ``datasets.Dataset`` with a column the model does not take (its
    text) under Trainer's default ``remove_unused_columns=True``: Trainer reads the
    sharded model's ``forward`` signature (the model's own), drops the column, and
    trains as plain."""
    datasets = pytest.importorskip("datasets")

    def table(n: int, seed: int) -> Any:
        rows = [Tokens(n, seed)[i] for i in range(n)]
        columns = {k: [r[k].tolist() for r in rows] for k in rows[0]}
        return datasets.Dataset.from_dict({**columns, "text": [f"row {i}" for i in range(n)]})

    runs = []
    for shard in (False, True):
        torch.manual_seed(0)
        model = th.shard(gpt2(), engine=engine) if shard else gpt2()
        trainer = transformers.Trainer(
            model=model,
            args=args(tmp_path / str(shard)),
            train_dataset=table(32, 0),
            eval_dataset=table(8, 1),
        )
        assert trainer.args.remove_unused_columns  # Trainer's default
        trainer.train()
        runs.append(trainer)
    want, got = runs
    assert len(losses(got)) == 10 and losses(got) == losses(want)
    assert "_th_shard" in got.optimizer.optimizer.__dict__  # trained on the engine
    th.unshard(got.model)


def test_trainer_resumes_from_its_checkpoint_as_plain(tmp_path: Path, engine: th.Engine) -> None:
    def resumed(out: Path, shard: bool) -> list[float]:
        first = fit(out, shard=shard, engine=engine, save_strategy="epoch", num_train_epochs=1)
        del first
        torch.manual_seed(0)
        model = gpt2()
        if shard:
            model = th.shard(model, engine=engine)
        trainer = transformers.Trainer(
            model=model,
            args=args(out, save_strategy="epoch"),
            train_dataset=Tokens(),
            eval_dataset=Tokens(8, 1),
        )
        trainer.train(resume_from_checkpoint=True)
        return losses(trainer)

    assert resumed(tmp_path / "sharded", True) == resumed(tmp_path / "plain", False)


def test_two_concurrent_trainer_trials_each_equal_alone(tmp_path: Path) -> None:
    """Two Trainer objectives at once under th.optimize: Accelerate's gradient state is
    per thread, so neither trial's accumulation window is ended by the other's (before:
    both trials' eval_loss differed from alone)."""
    optuna = pytest.importorskip("optuna")
    rates = [1e-2, 3e-2]
    alone = {lr: losses(fit(tmp_path / f"a{lr}", shard=False, learning_rate=lr)) for lr in rates}
    got: dict[float, list[float]] = {}

    def objective(trial: Any) -> float:
        lr = trial.suggest_float("lr", 1e-3, 1e-1)
        trainer = fit(tmp_path / f"t{trial.number}", shard=True, learning_rate=lr)
        got[lr] = losses(trainer)
        return got[lr][-1]

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    for lr in rates:
        study.enqueue_trial({"lr": lr})
    th.optimize(study, objective, n_trials=2, max_concurrent=2, devices=["cpu", "cpu"])
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert got == alone


def test_hyperparameter_search_with_optuna_shards_each_trial(tmp_path: Path) -> None:
    """``trainer.hyperparameter_search(backend="optuna")`` with a ``model_init`` that
    calls ``th.shard``: every trial trains on the engine and its objective equals the
    plain search's."""
    pytest.importorskip("optuna")
    logging.getLogger("optuna").setLevel(logging.WARNING)
    sharded: list[Any] = []

    def search(shard: bool) -> list[float]:
        def model_init(trial: Any = None) -> Any:
            torch.manual_seed(0)
            model = gpt2()
            if shard:
                model = th.shard(model)
                sharded.append(model)
            return model

        trainer = transformers.Trainer(
            model_init=model_init,
            args=args(tmp_path / str(shard), num_train_epochs=1),
            train_dataset=Tokens(),
            eval_dataset=Tokens(8, 1),
        )
        runs: list[float] = []

        def objective(metrics: dict[str, float]) -> float:
            runs.append(metrics["eval_loss"])
            return metrics["eval_loss"]

        trainer.hyperparameter_search(
            hp_space=lambda t: {"learning_rate": t.suggest_categorical("lr", [1e-2, 3e-2])},
            compute_objective=objective,
            n_trials=2,
            direction="minimize",
            backend="optuna",
            sampler=__import__("optuna").samplers.BruteForceSampler(seed=0),
        )
        return runs

    want = search(False)
    assert search(True) == want
    assert len(sharded) >= 2 and all(th.shard_count(m) >= 1 for m in sharded[-2:])  # each cut
