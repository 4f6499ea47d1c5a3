"""HydraExecutor options that need no Ray: ``max_layers_per_shard`` reaches the engines'
options and the executor's plan."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")

import torch
from torch import nn

import tune_hydra as th
from tune_hydra.exceptions import InvalidOptionError


def _make_task(config: dict[str, Any]) -> th.ModelTask:
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    data = [(torch.randn(8, 64), torch.randn(8, 64))]
    return th.ModelTask(model, nn.MSELoss(), torch.optim.SGD, data)


def test_max_layers_per_shard_cuts_finer_than_the_budget() -> None:
    roomy = th.HydraExecutor(devices="cpu", device_memory="1GiB")
    fine = th.HydraExecutor(devices="cpu", device_memory="1GiB", max_layers_per_shard=1)
    assert roomy.max_layers_per_shard is None and fine.max_layers_per_shard == 1
    # What every engine actor is built with (Engine(**engine_options.kwargs())).
    assert fine.engine_options.kwargs()["max_layers_per_shard"] == 1
    assert [r.num_shards for r in roomy.plan(_make_task, {})] == [1]
    assert [r.num_shards for r in fine.plan(_make_task, {})] == [4]
    # plan()'s own keyword still overrides the executor's.
    assert [r.num_shards for r in fine.plan(_make_task, {}, max_layers_per_shard=2)] == [2]


@pytest.mark.parametrize("value", [0, -1, "3", 1.5])
def test_max_layers_per_shard_is_checked_at_construction(value: Any) -> None:
    with pytest.raises(InvalidOptionError, match="max_layers_per_shard"):
        th.HydraExecutor(devices="cpu", max_layers_per_shard=value)
