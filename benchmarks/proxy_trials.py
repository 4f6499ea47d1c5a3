"""Trainables for ``proxy_memory.py``. This module must not import torch at import time
(the bare trials measure what a Tune trial costs without it)."""

from __future__ import annotations

import time
from typing import Any

from ray import tune


class BareTrainable(tune.Trainable):
    """The smallest Tune trial: one step that sleeps."""

    def step(self) -> dict[str, Any]:
        time.sleep(float(self.config.get("sleep", 1.0)))
        return {"loss": 0.0}


class TorchTrainable(BareTrainable):
    """The same, in a process that imports torch (as a plain PyTorch trial does)."""

    def setup(self, config: dict[str, Any]) -> None:
        import torch

        self._t = torch.zeros(1)


def closure_factory(megabytes: int) -> Any:
    """A task factory closing over ``megabytes`` MB of data (built on the driver)."""
    import torch
    from torch import nn

    import tune_hydra as th

    payload = torch.ones(megabytes * 2**20 // 4)

    def make_task(config: dict[str, Any]) -> th.ModelTask:
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))] * 4
        scale = float(payload[0])
        return th.ModelTask(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
            nn.MSELoss(),
            lambda p: torch.optim.SGD(p, lr=float(config["lr"]) * scale),
            data,
        )

    return make_task
