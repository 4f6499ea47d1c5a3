"""Task factories for the integration tests (pickled by value into the engine actors)."""

from __future__ import annotations

import os
import threading
import time
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


def make_wide_task(config: dict[str, Any]) -> th.ModelTask:
    """A wide MLP whose checkpoint takes long to write (for kill-during-save tests).

    Config keys: ``width`` (4096: each hidden ``Linear(width, width)`` holds 64 MiB of
    float32 weights, and SGD momentum as much again in ``hydra_state.pt``), ``layers`` (2).
    """
    width = int(config.get("width", 4096))
    torch.manual_seed(0)
    hidden = [nn.Linear(width, width) for _ in range(int(config.get("layers", 2)))]
    return th.ModelTask(
        model=nn.Sequential(nn.Linear(N_IN, width), *hidden, nn.Linear(width, 1)),
        loss_fn=nn.MSELoss(),
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-5, momentum=0.9),
        train_data=dataset(n_batches=1),
    )


def wait_for_file(path: str, what: str, timeout_s: float = 120.0) -> None:
    """Wait (bounded) until ``path`` exists: a test's cross-process event."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} did not appear within {timeout_s} s")
        time.sleep(0.01)


class SlowData:
    """Re-iterable batches that each take ``delay`` seconds to load; with ``gate`` (a
    path), those after the first (read at registration) only once that file exists."""

    def __init__(self, batches: list[Any], delay: float, gate: str | None = None) -> None:
        self.batches, self.delay, self.gate = batches, delay, gate

    def __iter__(self) -> Any:
        for i, batch in enumerate(self.batches):
            if self.gate is not None and i:
                wait_for_file(self.gate, "the data's gate")
            time.sleep(self.delay)
            yield batch


def make_slow_task(config: dict[str, Any]) -> th.ModelTask:
    """:func:`make_task` behind a slow factory or slow data.

    Config keys: ``factory_sleep`` (seconds the factory sleeps first), ``hang`` (the
    factory never returns), ``data_delay`` (seconds per training batch), ``started`` (a
    path the factory creates as it starts), ``release`` (a path the factory waits for
    after that: held until the test creates it), ``gate`` (a path the training batches
    after the first wait for), ``overrides`` (a dict merged into the config: lets a grid
    search vary several keys together), plus :func:`make_task`'s keys.
    """
    config = {**config, **config.get("overrides", {})}
    if config.get("started"):
        open(config["started"], "w").close()
    if config.get("hang"):
        threading.Event().wait()
    if config.get("release"):
        wait_for_file(config["release"], "the factory's release")
    time.sleep(float(config.get("factory_sleep", 0.0)))
    task = make_task(config)
    delay = float(config.get("data_delay", 0.0))
    if delay or config.get("gate"):
        task.train_data = SlowData(list(task.train_data), delay, config.get("gate"))
    return task


def closure_factory(megabytes: int) -> Any:
    """A task factory that closes over ``megabytes`` MB of data, as users' factories
    close over a dataset."""
    payload = torch.ones(megabytes * 2**20 // 4)

    def make_big_task(config: dict[str, Any]) -> th.ModelTask:
        task = make_task(config)
        task.extra["payload_sum"] = float(payload[:10].sum())
        return task

    return make_big_task


SHARED_MODEL = build_model(16, torch.float32)
"""A module-level model: the careless pattern :func:`make_shared_task` uses."""


def make_shared_task(config: dict[str, Any]) -> th.ModelTask:
    """:func:`make_task`, but returning the module-level :data:`SHARED_MODEL` (safe in
    plain Tune, where every trial imports the module afresh; refused by the engine)."""
    task = make_task(config)
    task.model = SHARED_MODEL
    return task


# -- drop-in mistakes and Tune's wrappers (tests/frontends/ray/test_dropin_integration.py) ---------


def train_fn(config: dict[str, Any]) -> None:
    """A Ray Tune function trainable, passed where a task factory belongs by mistake."""
    from ray import tune

    task = make_task(config)
    for epoch in range(2):
        tune.report({"loss": float(epoch)})
    del task


def count_call(config: dict[str, Any]) -> None:
    """One file in ``config["calls"]`` (if given) per call: how many times a run called a
    factory, read by the test (a run that ends at its first error calls it once a trial)."""
    folder = config.get("calls")
    if folder:
        import uuid

        open(os.path.join(folder, uuid.uuid4().hex), "w").close()


def hidden_train_fn(config: dict[str, Any]) -> None:
    """A function trainable whose ``report`` call its code does not name (it is looked up
    by string), so only running it tells: it returns None."""
    from ray import tune

    count_call(config)

    report = getattr(tune, "re" + "port")
    for epoch in range(2):
        report({"loss": float(epoch)})


def make_no_task(config: dict[str, Any]) -> th.ModelTask:
    """A factory that forgot its ``return``."""
    make_task(config)
    return None  # type: ignore[return-value]


class Net(nn.Module):
    """A model whose ``forward()`` branches on a tensor's value: torch.fx cannot trace it,
    so the engine cannot cut it (whatever the config)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(N_IN, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.mean() > 0:
            h = torch.tanh(h)
        return self.fc2(h)


def make_net_task(config: dict[str, Any]) -> th.ModelTask:
    """:func:`make_task` with :class:`Net` as the model."""
    task = make_task(config)
    task.model = Net()
    return task


def make_task_with(
    config: dict[str, Any], data: list[Any] | None = None, log: str | None = None
) -> th.ModelTask:
    """:func:`make_task` training on ``data`` (given by ``tune.with_parameters``); appends
    ``"<pid> <id(data)>"`` to the file ``log`` on each call."""
    if data is None:
        raise ValueError("make_task_with needs data=...")
    if log is not None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {id(data)}\n")
    task = make_task(config)
    task.train_data = data
    task.eval_data = data[:2]
    return task


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(1) == target).float().mean()


def make_classifier_task(config: dict[str, Any]) -> th.ModelTask:
    """A 3-class MLP classifier with an ``accuracy`` metric and a StepLR schedule
    (config: ``lr``; ``metrics`` False drops the metric; ``calls``: see count_call)."""
    count_call(config)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(N_BATCHES * BATCH, N_IN, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    data = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(N_IN, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )
    lr = float(config.get("lr", 0.1))
    return th.ModelTask(
        model=model,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
        train_data=data,
        eval_data=data[:2],
        metrics={"accuracy": accuracy} if config.get("metrics", True) else None,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
    )
