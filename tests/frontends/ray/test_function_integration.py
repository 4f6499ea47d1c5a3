"""Function trainables (their own loop, ``th.shard`` + ``tune.report``) under a
HydraExecutor (issue 20): run in the engine process, exact against the same function
without ``th.shard``, with Tune's schedulers, checkpoints and context."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from typing import Any

import pytest
import torch
from ray import cloudpickle, tune
from ray.train._internal import session as ray_session
from torch import nn

import tune_hydra as th
from tune_hydra.frontends.ray import HydraExecutor

pytestmark = pytest.mark.integration

# The engine actors unpickle this module's functions: send them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ITERS = 3


class ConvNet(nn.Module):
    """Ray Tune's PBT/MNIST ConvNet, shrunk to 1x8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3)
        self.fc = nn.Linear(27, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.max_pool2d(self.conv1(x), 2))
        return torch.log_softmax(self.fc(x.flatten(1)), dim=1)


def _data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(8, 1, 8, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 4, (8,), generator=gen),
        )
        for _ in range(3)
    ]


def train_convnet(config: dict[str, Any]) -> None:
    """A Ray-Tune-style function trainable: SGD momentum, accuracy, a checkpoint per
    iteration, resumes from ``tune.get_checkpoint()`` (weights, optimizer, iteration)."""
    torch.manual_seed(config["seed"])
    train_loader, test_loader = _data(1), _data(2)
    model = ConvNet().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    if config.get("shard", True):
        model, optimizer = th.shard(model, optimizer)
    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "ckpt.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["iteration"]
    for i in range(start, config.get("iters", ITERS)):
        model.train()
        total = 0.0
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = nn.functional.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in test_loader:
                correct += int((model(x).argmax(1) == y).sum())
        acc = correct / 24
        with tempfile.TemporaryDirectory() as d:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iteration": i + 1,
                },
                os.path.join(d, "ckpt.pt"),
            )
            tune.report(
                {"mean_accuracy": acc, "train_loss": total, "lr_seen": config["lr"]},
                checkpoint=tune.Checkpoint.from_directory(d),
            )


class _FakeSession:
    """Enough of Ray's Tune session to call a function trainable directly."""

    world_rank = None

    def __init__(self, checkpoint: Any = None) -> None:
        self.loaded_checkpoint = checkpoint
        self.results: list[dict[str, Any]] = []
        self.states: list[dict[str, Any]] = []

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        self.results.append(dict(metrics))
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                self.states.append(torch.load(os.path.join(d, "ckpt.pt"), weights_only=False))


def _plain(config: dict[str, Any], checkpoint: Any = None) -> _FakeSession:
    """The function without th.shard, in this thread, with a fake session."""
    fake = _FakeSession(checkpoint)
    old = ray_session._session
    ray_session._session = fake  # type: ignore[assignment]
    try:
        train_convnet({**config, "shard": False})
    finally:
        ray_session._session = old
    return fake


def _executor(**options: Any) -> HydraExecutor:
    """2 emulated copying devices, layers cut into several shards."""
    ex = HydraExecutor(devices=["cpu", "cpu"], **options)
    fleet = ex._engines
    fleet.engine_options = dataclasses.replace(
        fleet.engine_options, copy_on_cpu=True, max_layers_per_shard=1
    )
    return ex


def _load(trial_checkpoint: Any) -> dict[str, Any]:
    with trial_checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "ckpt.pt"), weights_only=False)


SEEDS = [0, 1, 2]
BASE = {"lr": 0.1, "momentum": 0.9}


def test_function_trainables_are_exact_and_tune_works(ray_session: Any, storage: str) -> None:
    """Three function trials multiplexed on one engine: every reported metric and the
    final checkpoint's weights and optimizer state equal the plain function's, bit for
    bit; the engine holds nothing of them afterwards."""
    with _executor() as ex:
        analysis = tune.run(
            ex.trainable(train_convnet),
            config={"seed": tune.grid_search(SEEDS), **BASE},
            storage_path=storage,
            verbose=0,
        )
        registered = ex.registered_trials()
    trials = sorted(analysis.trials, key=lambda t: t.config["seed"])
    assert [t.status for t in trials] == ["TERMINATED"] * 3
    for trial in trials:
        plain = _plain(dict(trial.config))
        frame = analysis.trial_dataframes[trial.trial_id]
        keys = ["mean_accuracy", "train_loss"]
        got = frame[keys].to_dict("records")
        want = [{k: r[k] for k in keys} for r in plain.results]
        assert got == want
        state = _load(trial.checkpoint)
        for name, value in plain.states[-1]["model"].items():
            assert torch.equal(state["model"][name], value), name
        torch.testing.assert_close(
            state["optimizer"], plain.states[-1]["optimizer"], rtol=0, atol=0
        )
    assert all(not r["engine_tasks"] for r in registered.values()), registered
