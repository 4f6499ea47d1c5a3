"""Two Ray nodes on this machine: one engine actor per node, trials spread over both."""

from __future__ import annotations

import os
from typing import Any

import pytest
import ray
from ray import tune

import tune_hydra as th
from tests.frontends.ray import tune_tasks
from tune_hydra.frontends.ray import HydraExecutor

pytestmark = pytest.mark.integration


def test_trials_spread_over_both_nodes(ray_cluster: Any, storage: str) -> None:
    with HydraExecutor(devices="cpu", device_memory="18KiB") as ex:
        assert len(ex.engines()) == 2  # one engine actor per node with slots
        assert ex.max_concurrent_trials == 8  # 4 slots on each node
        analysis = th.run(
            tune_tasks.make_task,
            config={"lr": tune.grid_search([0.005, 0.01, 0.02, 0.03, 0.04, 0.05])},
            metric="val_loss",
            mode="min",
            stop={"training_iteration": 2},
            checkpoint_freq=1,
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
        regs = ex.registered_trials()
        assert all(not r["trials"] and not r["engine_tasks"] for r in regs.values())
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    # each node's engine trained some of the trials (device labels are node-prefixed)
    tasks_per_node: dict[str, set[str]] = {}
    for event in ex.trace().events:
        tasks_per_node.setdefault(event.device.split("/")[0], set()).add(event.task)
    assert len(tasks_per_node) == 2, tasks_per_node
    assert all(tasks for tasks in tasks_per_node.values())
    assert set().union(*tasks_per_node.values()) == {t.trial_id for t in analysis.trials}


def test_an_executor_connects_to_the_cluster_of_ray_address(
    ray_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver on a cluster (RAY_ADDRESS set, as ``ray job submit`` sets it) that leaves
    ray.init to the executor: it connects to that cluster (Ray refuses resources= there)
    and finds its engine nodes, rather than failing on "When connecting to an existing
    cluster, resources must not be provided"."""
    ray.shutdown()
    monkeypatch.setitem(os.environ, "RAY_ADDRESS", ray_cluster.address)
    with HydraExecutor(devices="cpu") as ex:
        assert len(ex.engines()) == 2 and ex.max_concurrent_trials == 8
