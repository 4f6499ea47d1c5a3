"""Shared test helpers: small models, data and the plain-training reference."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th

# Ray starts its worker processes (trials, engine actors) at nice 15: beside any other
# load (the other xdist worker, a CI neighbour, a CPU hog) they got 1-2% of a core and the
# Ray tier crawled. Set before any test boots Ray, here or in an example's subprocess.
os.environ.setdefault("RAY_worker_niceness", "0")

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def mlp(dtype: torch.dtype = torch.float64, seed: int = 0, width: int = 16) -> nn.Sequential:
    """Linear, ReLU, Dropout, BatchNorm1d stack: every tricky layer kind."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.BatchNorm1d(width),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 4),
    ).to(dtype)


def batches(n: int = 5, dtype: torch.dtype = torch.float64, seed: int = 1) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(6, 8, generator=g, dtype=dtype), torch.randint(0, 4, (6,), generator=g))
        for _ in range(n)
    ]


def make_task(
    model: nn.Module,
    opt: str = "adam",
    n: int = 5,
    eval_data: bool = True,
    dtype: torch.dtype = torch.float64,
) -> th.ModelTask:
    data = batches(n, dtype)
    return th.ModelTask(
        model,
        nn.CrossEntropyLoss(),
        OPTIMIZERS[opt],
        data,
        eval_data=batches(2, dtype, seed=7) if eval_data else None,
    )


def plain_copy(task: th.ModelTask) -> th.ModelTask:
    """The same task around a deepcopy of its (untrained) model."""
    return th.ModelTask(
        copy.deepcopy(task.model),
        task.loss_fn,
        task.optimizer,
        task.train_data,
        eval_data=task.eval_data,
    )


def assert_same(a: nn.Module | Mapping[str, Any], b: nn.Module | Mapping[str, Any]) -> None:
    """Bit-equal weights: the same state_dict keys, in order, and ``torch.equal`` values
    (modules or state dicts)."""
    sa = a.state_dict() if isinstance(a, nn.Module) else a
    sb = b.state_dict() if isinstance(b, nn.Module) else b
    assert list(sa) == list(sb)
    for k in sb:
        assert torch.equal(sa[k], sb[k]), k


def assert_same_optimizer(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Bit-equal optimizer state dicts: the same param_groups and per-parameter state."""
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for i, st in b["state"].items():
        assert sorted(a["state"][i]) == sorted(st)
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(v)), (i, k)


def assert_same_model(a: nn.Module, b: nn.Module, atol: float = 1e-12, rtol: float = 0.0) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        torch.testing.assert_close(
            sa[k], sb[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}"
        )
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if pb.grad is None:
            assert pa.grad is None, name
        else:
            torch.testing.assert_close(pa.grad, pb.grad, atol=atol, rtol=rtol)


def assert_same_history(
    h: list[dict[str, Any]], ref: list[dict[str, Any]], tol: float = 1e-12
) -> None:
    assert len(h) == len(ref)
    for got, want in zip(h, ref, strict=True):
        for key in ("loss", "val_loss"):
            if key not in want:
                continue
            value = want[key]
            assert abs(got[key] - value) <= tol * max(1.0, abs(value)), (key, got[key], value)


@pytest.fixture
def budget_3_shards() -> int:
    """A budget that cuts mlp() into at least 3 shards."""
    return 24_000


def shards_3(recompute: bool, budget: int = 24_000) -> dict[str, int]:
    """``train_models`` arguments that cut mlp() into at least 3 shards under a budget:
    without recompute, one within which a batch's kept graphs fit (4 shards)."""
    if recompute:
        return {"device_memory": budget}
    return {"device_memory": 40_000, "max_layers_per_shard": 3}


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """The address of a local Ray cluster for the example and benchmark scripts that the
    tests run as subprocesses (their ``RAY_ADDRESS``: each joins it, as a script joins a
    cluster under ``ray job submit``, instead of booting a Ray of its own, ~4 s a boot).
    One per xdist worker, started on first use as ``ray start --head --block`` (2 CPUs,
    8 ``hydra_slot`` slots) in a process of its own, and stopped by SIGTERM (it drains and
    stops every process it started) at the end of the session."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="thhead", dir="/tmp")  # short: Ray's socket paths
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    log = open(Path(tmp) / "head.log", "w")  # noqa: SIM115 (closed at teardown)
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
         f"--port={port}", "--num-cpus=2", '--resources={"hydra_slot": 8}',
         f"--temp-dir={tmp}", "--include-dashboard=false", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        raylet = Path(tmp) / "session_latest" / "sockets" / "raylet"
        for _ in range(600):  # the raylet's socket is made once the node is up
            if raylet.exists() or head.poll() is not None:
                break
            time.sleep(0.1)
        if not raylet.exists():
            said = (Path(tmp) / "head.log").read_text()
            raise RuntimeError(f"ray start --head did not start:\n{said}")
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


# The longest single tests (each example or benchmark script in its own subprocess) go
# first, so that none of them is left for the end of the run.
FIRST = ("test_examples.py", "test_benchmarks.py")


#: How long a test's subprocess (an example, a benchmark) may run before it is taken for
#: hung: a guard far above the slowest figure beside a CPU hog (the smoke runs took up
#: to 420 s there, 20-50 s on a quiet machine), never a speed check.
HANG_S = 1500


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its hook adds "@ray" to node ids)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under pytest-xdist (pyproject's addopts: ``-n 2 --dist loadgroup``) the tests that
    # use the shared local Ray session run on one worker, one after another: one Ray
    # cluster for all of them (xdist sends that group, the largest, first), while the
    # other worker takes the example scripts (first) and the torch-only tests. (Measured:
    # -n 3 with the Ray tests in two groups, 671 s, vs 701 s: the 2 cores are the limit.)
    ray_group = pytest.mark.xdist_group("ray")
    for item in items:
        if item.path.name.endswith("_integration.py"):
            item.add_marker(ray_group)
    items.sort(key=lambda item: item.path.name not in FIRST)
    hang = pytest.mark.timeout(HANG_S + 300)  # their subprocesses time out first
    for item in items:
        if item.path.name in FIRST:
            item.add_marker(hang)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
