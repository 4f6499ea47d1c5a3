"""The results every front end reports (``tune_hydra.frontends.common``)."""

from __future__ import annotations

from tune_hydra.frontends.common import (
    LOSS_METRICS,
    REPORTED,
    RESULT_KEYS,
    TASK_METRICS,
    declare_metric,
    trial_result,
)
from tune_hydra.options import ENGINE_KEYS


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
