"""Task factories for the integration tests (pickled by value into the engine actors)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import tune_hydra as th

N_IN = 8
BATCH = 16
N_BATCHES = 4


def dataset(dtype: torch.dtype = torch.float32, n_batches: int = N_BATCHES) -> list[Any]:
    """A fixed synthetic regression dataset: y = sum(x) + noise."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n_batches * BATCH, N_IN, generator=g, dtype=dtype)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(n_batches * BATCH, 1, generator=g, dtype=dtype)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def build_model(width: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(N_IN, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    ).to(dtype)


class FailingLoss:
    """MSE that raises during a training step once more than ``after`` training batches ran
    while ``marker`` exists (and deletes the marker first when ``once``)."""

    def __init__(self, marker: str | None, after: int, once: bool) -> None:
        self.marker, self.after, self.once, self.calls = marker, after, once, 0
        self.mse = nn.MSELoss()

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.marker and self.calls > self.after and os.path.exists(self.marker):
                if self.once:
                    os.remove(self.marker)
                raise RuntimeError(f"injected failure after {self.after} batches")
        return self.mse(out, target)


def make_task(config: dict[str, Any]) -> th.ModelTask:
    """A small MLP regression task.

    Config keys: ``lr``, ``width`` (16), ``float64`` (False), ``fail`` (None, "factory",
    "type", "nan"), ``marker`` (a path: fail after ``fail_after`` batches while it exists),
    ``once`` (delete the marker when failing), ``eval`` (True).
    """
    fail = config.get("fail")
    if fail == "factory":
        raise ValueError("factory exploded on purpose")
    if fail == "type":
        return "not a task"  # type: ignore[return-value]
    dtype = torch.float64 if config.get("float64") else torch.float32
    data = dataset(dtype)
    lr = float(config.get("lr", 0.01))
    if fail == "nan":
        loss_fn: Any = lambda out, y: (out - y).pow(2).mean() * float("nan")  # noqa: E731
    else:
        loss_fn = FailingLoss(
            config.get("marker"), int(config.get("fail_after", 2 * N_BATCHES)),
            bool(config.get("once", False)),
        )  # fmt: skip
    return th.ModelTask(
        model=build_model(int(config.get("width", 16)), dtype),
        loss_fn=loss_fn,
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
        train_data=data,
        eval_data=data[:2] if config.get("eval", True) else None,
    )
