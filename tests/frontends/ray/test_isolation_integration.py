"""Trials that share the engine's process keep plain Tune's isolation: data given with
``tune.with_parameters`` is fetched once into the engine, yet no trial trains it in place
(each trial process of plain Tune gets its own copy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ray import tune

import tune_hydra as th
from tune_hydra.frontends.ray import HydraExecutor

pytestmark = pytest.mark.integration


def test_with_parameters_weights_are_not_trained_in_place(
    ray_session: Any, storage: str, tmp_path: Path
) -> None:
    """``nn.Embedding.from_pretrained(weights, freeze=False)`` on ``with_parameters``
    data, trials one after another: every trial starts from the given weights (before:
    trial 2 started from trial 1's trained weights, the embedding sum drifting
    -0.135 -> -0.187 -> -0.216 at successive builds) and so trains to the same result."""
    import torch

    torch.manual_seed(0)
    weights = torch.randn(12, 8)
    log = tmp_path / "sums.log"

    def make_task(config: dict[str, Any], weights: Any, log: str) -> th.ModelTask:
        import torch
        from torch import nn

        with open(log, "a") as f:
            f.write(f"{float(weights.sum())!r}\n")
        torch.manual_seed(1)
        model = nn.Sequential(
            nn.Embedding.from_pretrained(weights, freeze=False),
            nn.Flatten(),
            nn.Linear(4 * 8, 3),
        )
        g = torch.Generator().manual_seed(2)
        data = [
            (torch.randint(0, 12, (16, 4), generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(3)
        ]
        return th.ModelTask(
            model,
            nn.CrossEntropyLoss(),
            lambda p: torch.optim.SGD(p, lr=config["lr"]),
            data,
        )

    with HydraExecutor(devices="cpu", seed=0) as ex:
        analysis = th.run(
            tune.with_parameters(make_task, weights=weights, log=str(log)),
            config={"lr": 0.5, "rep": tune.grid_search([0, 1, 2])},
            metric="loss",
            mode="min",
            stop={"training_iteration": 2},
            max_concurrent_trials=1,
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    assert [t.status for t in analysis.trials] == ["TERMINATED"] * 3
    sums = log.read_text().split()
    assert len(sums) == 3 and len(set(sums)) == 1, sums
    losses = [t.last_result["loss"] for t in analysis.trials]
    assert losses[0] == losses[1] == losses[2], losses


def test_an_architecture_that_cannot_be_cut_fails_its_trials_alone(
    ray_session: Any, storage: str
) -> None:
    """A search space that chooses the architecture, one of which the engine cannot cut:
    its trial fails with UncuttableModelError and the others train (before: the first
    such trial ended the whole search, and the other architectures never ran)."""
    from tests.frontends.ray import tune_tasks

    def make_task(config: dict[str, Any]) -> th.ModelTask:
        if config["arch"] == "net":
            return tune_tasks.make_net_task(config)
        return tune_tasks.make_task(config)

    with HydraExecutor(devices="cpu", seed=0) as ex:
        analysis = th.run(
            make_task,
            config={"lr": 0.01, "arch": tune.grid_search(["net", "mlp", "net", "mlp"])},
            stop={"training_iteration": 1},
            max_concurrent_trials=1,
            storage_path=storage,
            trial_executor=ex,
            raise_on_failed_trial=False,
            verbose=0,
        )
    status = {t.config["arch"]: set() for t in analysis.trials}
    for t in analysis.trials:
        status[t.config["arch"]].add(t.status)
    assert status == {"net": {"ERROR"}, "mlp": {"TERMINATED"}}
    for t in analysis.trials:
        if t.status == "ERROR":
            error = Path(t.error_file).read_text()
            assert "UncuttableModelError" in error and "the other trials go on" in error
