"""The results every front end reports (``tune_hydra.frontends.common``)."""

from __future__ import annotations

from tune_hydra.frontends.common import (
    LOSS_METRICS,
    REPORTED,
    RESULT_KEYS,
    TASK_METRICS,
    declare_metric,
    ranks_training_loss,
    task_reports,
    training_loss_ranked,
    trial_result,
)
from tune_hydra.options import ENGINE_KEYS, TRAIN_LOSS


def test_a_trial_reports_the_engine_figures_and_its_task_metrics() -> None:
    figures = {k: float(i) for i, k in enumerate(RESULT_KEYS)}
    figures.update(iteration=3, accuracy=0.5, f1=0.25)  # iteration: Tune counts its own
    out = trial_result(figures, ["accuracy"], num_shards=99)
    assert out == {**{k: figures[k] for k in RESULT_KEYS}, "accuracy": 0.5}
    # num_shards from the trial when the engine's result does not say; nothing invented
    assert trial_result({"loss": 1.0}, ["accuracy"], num_shards=2) == {"loss": 1.0, "num_shards": 2}
    assert list(trial_result({"loss": 1.0}, [])) == ["loss"]


def test_the_words_messages_use_name_every_figure() -> None:
    assert all(k in REPORTED for k in RESULT_KEYS) and "eval_data" in REPORTED
    assert set(LOSS_METRICS) <= set(RESULT_KEYS) <= set(ENGINE_KEYS)
    assert "ModelTask(metrics=" in TASK_METRICS
    assert (
        declare_metric("acc")
        == "th.ModelTask(..., eval_data=..., metrics={'acc': fn(output, target)})"
    )


def test_a_metric_of_the_tasks_own_named_loss_takes_the_key() -> None:
    """The engine's result of a task with a metric named ``loss``: ``loss`` is the
    metric's, ``train_loss`` the training loss, and the trial reports both."""
    figures = {"loss": 0.25, "val_loss": 0.75, "train_loss": 0.5, "epoch": 1, "acc": 0.9}
    assert task_reports(["loss", "acc"]) == ("loss", "acc", TRAIN_LOSS)
    assert task_reports(["acc"]) == ("acc",)
    out = trial_result(figures, ["loss", "acc"])
    assert out == {"loss": 0.25, "val_loss": 0.75, "epoch": 1, "train_loss": 0.5, "acc": 0.9}
    # ranking by loss ranks by the task's own metric then: no training-loss warning
    assert not ranks_training_loss("loss", figures)
    assert ranks_training_loss("loss", {"loss": 0.5, "val_loss": 0.75})
    assert not ranks_training_loss("loss", {"loss": 0.5})  # no eval data: loss is all there is
    assert not ranks_training_loss("val_loss", {"loss": 0.5, "val_loss": 0.75})
    # messages: train_loss is declared by declaring loss; the warning says how
    assert "metrics={'loss'" in declare_metric(TRAIN_LOSS) and TRAIN_LOSS in TASK_METRICS
    assert "metrics={'loss'" in training_loss_ranked("metric='loss'")
    assert TRAIN_LOSS in ENGINE_KEYS and TRAIN_LOSS not in RESULT_KEYS
