"""Any nn.Module, as written, cut by tracing its forward: exact float64 parity with
plain training, the user's own parameters and state-dict keys, clear errors."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tune_hydra.engine.registration.partition import layer_costs, plan_shards
from tune_hydra.engine.task import model_layers
from tune_hydra.models import trace_layers

# -- the users' models, as their tutorials write them ---------------------------------------


class ConvNet(nn.Module):  # Ray Tune's getting-started example, verbatim
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3)
        self.fc = nn.Linear(192, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 3))
        x = x.view(-1, 192)
        x = self.fc(x)
        return F.log_softmax(x, dim=1)


class Net(nn.Module):  # the PyTorch CIFAR-10 tutorial's, verbatim (pool called twice)
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)  # flatten all dimensions except batch
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class ResidualMLP(nn.Module):
    """Skip connections that cross cuts, dropout, a buffer read in forward and a
    parameter-free module reused."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.embed(x))
        first = x
        for block in self.blocks:
            x = x + block(x)
            x = self.act(x)
        return self.head(self.norm(x + first) * self.scale)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return x


# -- data, tasks, budgets -------------------------------------------------------------------


def images(shape: tuple[int, ...], classes: int, n: int = 4, seed: int = 1) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(5, *shape, generator=g, dtype=torch.float64),
            torch.randint(0, classes, (5,), generator=g),
        )
        for _ in range(n)
    ]


def nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(out, y)


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], Any, int]] = {
    # name: (model, input shape, loss, shards at least)
    "convnet": (ConvNet, (1, 28, 28), nll, 2),
    "cifar_net": (Net, (3, 32, 32), nn.CrossEntropyLoss(), 3),
    "residual_mlp": (ResidualMLP, (8,), nn.CrossEntropyLoss(), 3),
}
CLASSES = {"convnet": 10, "cifar_net": 10, "residual_mlp": 4}


def make(case: str, seed: int) -> th.ModelTask:
    build, shape, loss, _ = CASES[case]
    torch.manual_seed(seed)
    model = build().double()
    return th.ModelTask(
        model,
        loss,
        lambda p: torch.optim.Adam(p, lr=1e-2),
        images(shape, CLASSES[case], seed=seed),
        eval_data=images(shape, CLASSES[case], n=2, seed=seed + 100),
        # stepped after every optimizer step (of the one optimizer over the whole model)
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    )


def budget(task: th.ModelTask, shards: int, recompute: bool) -> dict[str, Any]:
    """``train_models`` arguments that cut the task's model into at least ``shards``
    shards: with recompute, the largest device_memory (in 64-byte steps down from twice
    the model) that does; without, a device_memory within which one batch's kept graphs
    fit, cut finer by max_layers_per_shard (as tests.conftest.shards_3)."""
    assert isinstance(task.model, nn.Module)
    x = task.train_data[0][0]  # type: ignore[index]
    costs = layer_costs(model_layers(task.model), task.optimizer, x)
    if not recompute:
        per = -(-len(costs) // shards)
        memory = plan_shards(costs, None, max_layers_per_shard=per).kept_peak_bytes() + 64
        plan = plan_shards(costs, memory, max_layers_per_shard=per)
        assert len(plan) >= shards and plan.kept_peak_bytes() <= memory
        return {"device_memory": memory, "max_layers_per_shard": per}
    for b in range(2 * sum(c.total_bytes for c in costs), 0, -64):
        try:
            plan = plan_shards(costs, b)
        except th.exceptions.ShardTooLargeError:
            break
        if len(plan) >= shards:
            return {"device_memory": b}
    raise AssertionError(f"no budget cuts the model into {shards} shards")


def assert_exact(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (pa.grad is None) == (pb.grad is None), name
        assert pa.grad is None or torch.equal(pa.grad, pb.grad), name


def plain_on_emulated_device(
    task: th.ModelTask, epochs: int, *, seed: int, devices: int
) -> list[dict[str, Any]]:
    """``th.train_plain`` with the intra-op threads of one of ``devices`` emulated CPU
    devices (the engine splits the CPU's threads between them), so that matrix products
    reduce in the same order and float64 results are bit for bit comparable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // devices) if devices > 1 else threads)
    try:
        return th.train_plain(task, epochs, seed=seed)
    finally:
        torch.set_num_threads(threads)


# -- parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_float64_parity_exact(case: str, recompute: bool) -> None:
    tasks = {"a": make(case, 1), "b": make(case, 2)}
    models = {k: t.model for k, t in tasks.items()}
    refs = {
        k: th.ModelTask(
            copy.deepcopy(t.model),
            t.loss_fn,
            t.optimizer,
            t.train_data,
            eval_data=t.eval_data,
            lr_scheduler=t.lr_scheduler,
        )
        for k, t in tasks.items()
    }
    shards = CASES[case][3]
    h = th.train_models(
        tasks,
        devices=["cpu", "cpu"],
        **budget(tasks["a"], shards, recompute),
        epochs=2,
        seed=5,
        recompute=recompute,
        copy_on_cpu=True,
    )
    h.validate()
    for name, task in tasks.items():
        assert task.model is models[name]  # the user's own module, trained in place
        want = plain_on_emulated_device(refs[name], 2, seed=5, devices=2)
        got = h[name]
        for g, w in zip(got, want, strict=True):
            assert g["loss"] == w["loss"]
            assert g["val_loss"] == w["val_loss"]
        assert_exact(task.model, refs[name].model)
        used = {e.shard for e in h.trace.events if e.task == name}
        assert len(used) >= shards
    assert len({e.device for e in h.trace.events if e.op in "FLBE"}) == 2


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_loads_strict_into_a_fresh_instance(case: str) -> None:
    task = make(case, 3)
    keys = list(task.model.state_dict())  # type: ignore[union-attr]
    th.train_models(
        {"t": task}, devices=["cpu"], **budget(task, 2, True), epochs=1, seed=0, copy_on_cpu=True
    )
    trained = task.model
    assert isinstance(trained, CASES[case][0])
    assert list(trained.state_dict()) == keys
    fresh = CASES[case][0]().double()
    fresh.load_state_dict(trained.state_dict(), strict=True)
    x = task.train_data[0][0]  # type: ignore[index]
    fresh.eval(), trained.eval()
    assert torch.equal(fresh(x), trained(x))


# -- how a model is cut ----------------------------------------------------------------------


def test_stages_are_named_after_the_modules_and_hold_the_users_parameters() -> None:
    net = Net()
    stages = trace_layers(net)
    assert [n for n, _ in stages] == ["conv1", "pool", "conv2", "pool:2", "fc1", "fc2", "fc3"]
    mine = {id(p) for p in net.parameters()}
    held = [p for _, s in stages for p in s.parameters()]
    assert {id(p) for p in held} == mine and len(held) == len(mine)  # no copies, no repeats
    assert dict(stages)["conv1"].get_submodule("conv1") is net.conv1


def test_skip_connections_travel_with_the_boundary() -> None:
    model = ResidualMLP().eval()
    stages = trace_layers(model)
    x = torch.randn(3, 8)
    carry: Any = x
    widths = []
    for _, stage in stages:
        carry = stage(carry)
        widths.append(len(carry) if isinstance(carry, tuple) else 1)
    assert torch.equal(carry, model(x))
    assert max(widths) >= 3  # x, the block's output and `first`, across a cut


def test_non_float_values_cross_cuts_without_grad() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = x > 0  # a bool tensor, used after the next cut
            n = x.size(1)  # an int, too
            h = self.fc2(self.fc1(x))
            return self.fc3(h.masked_fill(mask, 0.0) / n)

    torch.manual_seed(0)
    model = Masked().double()
    task = th.ModelTask(
        model,
        nn.CrossEntropyLoss(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        [(torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 0])) for _ in range(3)],
    )
    ref = th.ModelTask(copy.deepcopy(model), task.loss_fn, task.optimizer, task.train_data)
    stages = trace_layers(model)
    carry = stages[0][1](task.train_data[0][0])  # type: ignore[index]
    mask, n, _ = carry  # in the order forward made them
    assert mask.dtype == torch.bool and not mask.requires_grad and n == 4
    h = th.train_models(
        {"m": task}, devices=["cpu"], epochs=2, seed=0, copy_on_cpu=True, max_layers_per_shard=1
    )
    want = th.train_plain(ref, 2, seed=0)
    assert [r["loss"] for r in h["m"]] == [r["loss"] for r in want]
    assert_exact(model, ref.model)


class Tied(nn.Module):
    """A module called at two places (fc), so in the first and the last shard."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.mid = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.mid(self.fc(x))))


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("recompute", [True, False])
def test_a_module_called_in_two_shards_trains_exactly(recompute: bool, clip: float | None) -> None:
    torch.manual_seed(0)
    data = [(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))] * 3
    task = th.ModelTask(Tied().double(), nn.MSELoss(), lambda p: torch.optim.Adam(p, lr=0.1), data)
    ref = th.ModelTask(copy.deepcopy(task.model), task.loss_fn, task.optimizer, data)
    h = th.train_models(
        {"t": task},
        devices=["cpu"],
        max_layers_per_shard=1,
        epochs=2,
        seed=0,
        recompute=recompute,
        copy_on_cpu=True,
        max_grad_norm=clip,
        accumulate_steps=2,
    )
    assert len({e.shard for e in h.trace.events}) == 3  # fc, mid, fc:2
    want = th.train_plain(ref, 2, seed=0, max_grad_norm=clip, accumulate_steps=2)
    assert [r["loss"] for r in h["t"]] == [r["loss"] for r in want]
    assert_exact(task.model, ref.model)


def test_a_module_with_buffers_called_in_two_shards_is_refused() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.mid = nn.BatchNorm1d(4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.mid(self.bn(x)))

    task = th.ModelTask(
        Twice(),
        nn.MSELoss(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        [(torch.randn(2, 4), torch.randn(2, 4))],
    )
    with pytest.raises(th.exceptions.TrainingError) as info:
        th.train_models({"t": task}, devices=["cpu"], max_layers_per_shard=1)
    err = info.value.errors["t"]
    assert isinstance(err, th.exceptions.InvalidModelError)
    assert "BatchNorm1d" in str(err) and "shards 0 and 2" in str(err)


# -- what cannot be traced -------------------------------------------------------------------


def test_data_dependent_control_flow_is_refused_with_its_line() -> None:
    th.ModelTask(
        Branchy(),
        nn.MSELoss(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        [(torch.randn(2, 4), torch.randn(2, 4))],
    )  # not refused before it is cut
    with pytest.raises(th.exceptions.InvalidModelError) as info:
        model_layers(Branchy(), "b")
    text = str(info.value)
    assert "task 'b'" in text
    assert "data-dependent control flow" in text
    assert "if x.sum() > 0:" in text and "test_traced.py" in text
    assert "nn.Sequential" in text


def test_untraceable_model_fails_its_task_alone() -> None:
    good = make("residual_mlp", 1)
    bad = th.ModelTask(
        Branchy(),
        nn.MSELoss(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        [(torch.randn(2, 4), torch.randn(2, 4))],
    )
    with pytest.raises(th.exceptions.TuneHydraError) as info:
        th.train_models({"good": good, "bad": bad}, devices=["cpu"], epochs=1)
    assert "data-dependent control flow" in str(info.value)


class FunctionalDropout(nn.Module):
    """Dropout the functional way, as many forwards write it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(F.relu(self.fc1(x)), 0.3, training=self.training)
        x = F.dropout(F.relu(self.fc2(x)), 0.3, training=self.training)
        return self.fc3(x)


@pytest.mark.parametrize("recompute", [True, False])
def test_forward_reading_self_training_runs_each_mode_exactly(recompute: bool) -> None:
    torch.manual_seed(0)
    model = FunctionalDropout().double()
    data = images((8,), 4, seed=3)
    task = th.ModelTask(
        model, nn.CrossEntropyLoss(), lambda p: torch.optim.Adam(p, lr=1e-2), data, data[:2]
    )
    ref = th.ModelTask(copy.deepcopy(model), task.loss_fn, task.optimizer, data, data[:2])
    h = th.train_models(
        {"m": task},
        devices=["cpu"],
        epochs=2,
        seed=0,
        copy_on_cpu=True,
        recompute=recompute,
        max_layers_per_shard=1,
    )
    assert len(h.plans["m"]) == 3
    want = th.train_plain(ref, 2, seed=0)
    assert [(r["loss"], r["val_loss"]) for r in h["m"]] == [
        (r["loss"], r["val_loss"]) for r in want
    ]
    assert_exact(model, ref.model)
    assert model.training  # the mode the user left it in


def test_other_submodules_in_train_and_eval_mode_are_refused() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.noise = nn.Linear(4, 4), nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                x = self.noise(x)
            return self.fc(x)

    with pytest.raises(th.exceptions.InvalidModelError) as info:
        model_layers(Noisy())
    text = str(info.value)
    assert "self.training" in text and "noise, fc vs fc" in text and "nn.Sequential" in text


def test_an_argument_without_default_is_refused() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * mask

    with pytest.raises(th.exceptions.InvalidModelError, match="'mask', which has no default"):
        model_layers(TwoInputs())


def test_arguments_with_defaults_keep_them() -> None:
    class Optional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            if mask is not None:
                x = x * mask
            return self.fc(x)

    model = Optional()
    ((_, stage),) = model_layers(model)
    x = torch.randn(2, 4)
    assert torch.equal(stage(x), model(x))


def test_buffers_read_in_forward_are_the_users_and_follow_the_input_shape() -> None:
    class CausalMix(nn.Module):
        def __init__(self, context: int = 6, width: int = 4) -> None:
            super().__init__()
            self.proj = nn.Linear(width, width)
            self.out = nn.Linear(width, 3)
            self.register_buffer("mask", torch.ones(context, context).tril(), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.size(1)
            h = self.proj(x)
            mixed = self.mask[:t, :t] @ h / t  # each position averages the ones before it
            return self.out(mixed).mean(1)

    torch.manual_seed(0)
    model = CausalMix().double()
    mask = model.mask
    data = [(torch.randn(2, t, 4, dtype=torch.float64), torch.tensor([0, 2])) for t in (6, 4, 5)]
    task = th.ModelTask(model, nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.1), data)
    ref = th.ModelTask(copy.deepcopy(model), task.loss_fn, task.optimizer, data)
    h = th.train_models(
        {"m": task}, devices=["cpu"], epochs=2, seed=0, copy_on_cpu=True, max_layers_per_shard=1
    )
    assert len(h.plans["m"]) == 2
    assert [r["loss"] for r in h["m"]] == [r["loss"] for r in th.train_plain(ref, 2, seed=0)]
    assert_exact(model, ref.model)
    assert model.mask is mask and list(model.state_dict()) == list(ref.model.state_dict())


def test_data_that_does_not_fit_is_told_about_the_users_layer() -> None:
    x = torch.randn(4, 3, 28, 28, dtype=torch.float64)  # ConvNet takes 1 channel
    task = th.ModelTask(
        ConvNet().double(), nll, lambda p: torch.optim.SGD(p, lr=0.1), [(x, torch.zeros(4).long())]
    )
    with pytest.raises(th.exceptions.TrainingError) as info:
        th.train_models({"t": task}, devices=["cpu"])
    err = info.value.errors["t"]
    assert isinstance(err, th.exceptions.DataMismatchError)
    assert "layer 'conv1' (Conv2d(1, 3" in str(err)
    assert "The layer takes 1 channels, the input has 3" in str(err)


def test_tracing_leaves_other_threads_modules_alone() -> None:
    """torch.fx patches nn.Module for the whole process while it traces: a task being
    added (traced) while other tasks train in worker threads must not break their
    modules' calls, nor change what they compute; several traces at once all succeed."""
    import threading

    torch.manual_seed(0)
    busy = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    expected = busy(x).detach()
    stop = threading.Event()
    problems: list[BaseException] = []
    calls = [0]

    def train_other_task() -> None:
        while not stop.is_set():
            try:
                if not torch.equal(busy(x).detach(), expected):
                    problems.append(AssertionError("another thread's output changed"))
                calls[0] += 1
            except BaseException as err:
                problems.append(err)

    def trace_many(out: list[Any]) -> None:
        for _ in range(20):
            out.append(trace_layers(ResidualMLP(), "traced"))

    threads = [threading.Thread(target=train_other_task) for _ in range(2)]
    traces: list[list[Any]] = [[], []]
    tracers = [threading.Thread(target=trace_many, args=(t,)) for t in traces]
    for t in threads + tracers:
        t.start()
    for t in tracers:
        t.join()
    stop.set()
    for t in threads:
        t.join()
    assert calls[0] > 0
    assert not problems, problems[:3]
    names = [[n for n, _ in layers] for t in traces for layers in t]
    assert len(names) == 40 and all(n == names[0] for n in names)
    # and no tracer's patch outlived it
    assert type(busy).__call__ is nn.Module.__call__
    assert nn.Module.__call__.__qualname__ == "Module._wrapped_call_impl"
