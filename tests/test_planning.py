"""``th.plan``: the cut and the smallest budget of each config, found on the meta device,
equal the cut a task's ``TaskLoop`` makes on its first batch for the same budget, without
allocating weights."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, batches, mlp
from tune_hydra.engine import Engine
from tune_hydra.engine.registration.partition import plan_shards
from tune_hydra.exceptions import (
    DataMismatchError,
    InvalidModelError,
    InvalidTaskError,
    ShardTooLargeError,
    TaskFactoryError,
    format_bytes,
    format_bytes_up,
)
from tune_hydra.frontends.task_loop import TaskLoop
from tune_hydra.planning import PlanReport, PlanReports, expand_configs, min_device_memory


def _conv(width: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(inplace=True),  # writes its input in place, right after a possible cut
        nn.MaxPool2d(2),
        nn.Conv2d(width, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.GroupNorm(2, width),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(width * 4 * 4, 10),
    )


class Tokens(nn.Module):
    """An embedding, as a language model's first layer (integer inputs)."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


def _lm(width: int) -> nn.Sequential:
    blocks = [
        nn.Sequential(
            nn.LayerNorm(width),
            nn.Linear(width, 4 * width),
            nn.GELU(),
            nn.Linear(4 * width, width),
            nn.Dropout(0.1),
        )
        for _ in range(3)
    ]
    return nn.Sequential(Tokens(50, width), *blocks, nn.LayerNorm(width), nn.Linear(width, 50))


class LMLoss(nn.Module):
    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def make_task(config: dict[str, Any]) -> th.ModelTask:
    """Three model families, built from the config (its data made here: on meta under
    ``th.plan``)."""
    kind, width = config.get("kind", "mlp"), int(config.get("width", 16))
    opt = OPTIMIZERS[config.get("opt", "adam")]
    if kind == "mlp":
        model: nn.Module = mlp(width=width)
        data: list[Any] = batches(3)
        return th.ModelTask(model, nn.CrossEntropyLoss(), opt, data)
    if kind == "conv":
        data = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(2)]
        return th.ModelTask(_conv(width), nn.CrossEntropyLoss(), opt, data)
    ids = torch.randint(0, 50, (2, 4, 12))
    model = _lm(width).to(torch.bfloat16 if config.get("bf16") else torch.float32)
    return th.ModelTask(model, LMLoss(), opt, [(ids[0], ids[1])])


CONFIGS = [
    {"kind": "mlp", "width": 16, "opt": "sgd"},
    {"kind": "conv", "width": 8, "opt": "adam"},
    {"kind": "lm", "width": 32, "opt": "adamw"},
    {"kind": "lm", "width": 16, "opt": "sgd", "bf16": True},  # a bfloat16 model
]


def _engine_plan(config: dict[str, Any], budget: int | None, **task_options: Any) -> Any:
    """The engine's plan of the cut that ``config``'s task, trained as a TaskLoop, makes
    on its first batch (cut now, nothing trained)."""
    with Engine("cpu", device_memory=budget) as eng:
        loop = TaskLoop("t", make_task(config), eng, seed=0, **task_options)
        cut = loop.cut()
        plan = eng.plan("t")
        loop.close()
    assert cut == [list(s.layer_names) for s in plan.shards]
    return plan


def _spans(shards: Any) -> list[tuple[int, int, tuple[str, ...], int, int]]:
    return [(s.start, s.stop, s.layer_names, s.state_bytes, s.activation_bytes) for s in shards]


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_plan_on_meta_equals_the_cut_of_a_task_loop(precision: str | None) -> None:
    reports = th.plan(make_task, CONFIGS, precision=precision)
    assert isinstance(reports, PlanReports) and len(reports) == len(CONFIGS)
    for config, report in zip(CONFIGS, reports, strict=True):
        assert report.probe_device == "meta" and report.config == config and not report.notes
        engine = _engine_plan(config, None, precision=precision)
        # every layer's figures, as the engine measured them with real data on the CPU
        assert list(report.layers) == list(engine.layers), config
        assert report.state_bytes == sum(c.state_bytes for c in engine.layers)
        # the same cut as the loop's, at a budget a few shards wide and at the smallest one
        total = sum(c.total_bytes for c in engine.layers)
        for budget in (
            report.min_device_memory,
            (report.min_device_memory + total) // 2,
            2 * total,
        ):
            (at,) = th.plan(make_task, config, device_memory=budget, precision=precision)
            want = _engine_plan(config, budget, precision=precision)
            assert at.num_shards == len(want) and at.fits, (config, budget)
            assert _spans(at.shards) == _spans(want.shards), (config, budget)
            assert [s.writes_input for s in at.shards] == [s.writes_input for s in want.shards]
        assert len(_engine_plan(config, report.min_device_memory, precision=precision).shards) >= 2


def test_min_device_memory_fits_and_one_byte_less_does_not() -> None:
    for prefetch in (True, False):
        for report in th.plan(make_task, CONFIGS, prefetch=prefetch):
            smallest = report.min_device_memory
            costs = list(report.layers)
            assert len(plan_shards(costs, smallest, prefetch=prefetch)) == len(report.shards)
            assert report.cut_for == smallest and report.fits is None
            with pytest.raises(ShardTooLargeError) as info:
                plan_shards(costs, smallest - 1, prefetch=prefetch)
            # the error names the budget to give (issue 32): the plan's smallest one
            assert info.value.min_device_memory == smallest
            with Engine("cpu", device_memory=smallest, prefetch=prefetch) as eng:
                loop = TaskLoop("t", make_task(report.config), eng, seed=0)
                loop.cut()
                assert eng.plan("t").peak_bytes() <= smallest
                loop.close()
            with (
                Engine("cpu", device_memory=smallest - 1, prefetch=prefetch) as eng,
                pytest.raises(ShardTooLargeError) as info,
            ):
                TaskLoop("t", make_task(report.config), eng, seed=0).cut()
            assert info.value.min_device_memory == smallest
            assert f"give device_memory >= {format_bytes_up(smallest)}" in str(info.value)
    # with prefetch, the largest layer state comes twice: a layer's own bytes plus that
    state, act = [(4000, 10), (100, 900)], [c for c in "ab"]
    costs = [th.engine.LayerCost(n, s, 0, 0, 0, a) for n, (s, a) in zip(act, state, strict=True)]
    assert min_device_memory(costs) == 4000 + 10 + 4000
    assert min_device_memory(costs, prefetch=False) == 4010


def test_a_budget_too_small_is_reported_not_raised() -> None:
    (report,) = th.plan(make_task, CONFIGS[0], device_memory=100)
    assert report.fits is False and report.num_shards is None
    assert report.cut_for == report.min_device_memory > 100
    assert _spans(report.shards) == _spans(
        _engine_plan(CONFIGS[0], report.min_device_memory).shards
    )
    text = str(report)
    assert "does NOT fit device_memory 100 B" in text
    assert f"smallest device_memory: {format_bytes(report.min_device_memory)}" in text


class Recorder:
    """A factory that records where the model's parameters and the data were made."""

    def __init__(self, outside: torch.Tensor) -> None:
        self.outside = outside  # data made before (outside) the factory: real
        self.devices: list[torch.device] = []
        self.calls = 0

    def __call__(self, config: dict[str, Any]) -> th.ModelTask:
        self.calls += 1
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
        targets = torch.randint(0, 4, (len(self.outside),))
        self.devices += [p.device for p in model.parameters()] + [targets.device]
        return th.ModelTask(
            model, nn.CrossEntropyLoss(), OPTIMIZERS["adam"], [(self.outside, targets)]
        )


def test_the_factory_builds_on_the_meta_device() -> None:
    outside = torch.randn(6, 8)
    before = outside.clone()
    factory = Recorder(outside)
    (report,) = th.plan(factory, {"width": 64})
    assert factory.calls == 1 and report.probe_device == "meta"
    assert factory.devices and {d.type for d in factory.devices} == {"meta"}  # nothing real
    assert outside.device.type == "cpu" and torch.equal(outside, before)  # left as it was
    real = Recorder(outside)
    (cpu,) = th.plan(real, {"width": 64}, meta=False)
    assert {d.type for d in real.devices} == {"cpu"} and cpu.probe_device == "cpu"
    assert cpu.layers == report.layers


class Gate(nn.Module):
    """A layer whose forward reads a tensor's value (no meta kernel can)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if float(x.detach().abs().sum()) > 0 else x


def test_a_factory_that_reads_values_is_planned_on_the_cpu_without_blame() -> None:
    """A factory that reads a tensor's value fails on the meta device only: the note says
    the cause (not the factory wrapper's "fix make_task") and the cut equals the CPU's."""

    def reads(config: dict[str, Any]) -> th.ModelTask:
        scale = torch.ones(3)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        if float(scale.sum()) != 3.0:  # a value: no meta kernel can answer it
            raise AssertionError
        return th.ModelTask(
            model, nn.CrossEntropyLoss(), OPTIMIZERS["sgd"], batches(2, torch.float32)
        )

    (report,) = th.plan(reads, {}, device_memory=6000)
    (cpu,) = th.plan(reads, {}, device_memory=6000, meta=False)
    assert report.probe_device == "cpu" and report.layers == cpu.layers
    (note,) = report.notes
    assert note.startswith("planned on the CPU with real weights") and "meta" in note
    assert "TaskFactoryError" not in note and "fix make_task" not in note


def test_meta_failures_fall_back_to_the_cpu_with_a_note() -> None:
    def gated(config: dict[str, Any]) -> th.ModelTask:
        model = nn.Sequential(nn.Linear(8, 16), Gate(), nn.Linear(16, 4))
        return th.ModelTask(
            model, nn.CrossEntropyLoss(), OPTIMIZERS["sgd"], batches(2, torch.float32)
        )

    (report,) = th.plan(gated, {}, device_memory=6000)
    assert report.probe_device == "cpu"
    # Informational: names the op that has no meta kernel, asks for no fix.
    assert report.notes[0].startswith("planned on the CPU with real weights")
    assert "Tensor.item() cannot be called on meta tensors" in report.notes[0]
    assert "fix" not in report.notes[0].replace("nothing to fix", "")
    with Engine("cpu", device_memory=6000) as eng:
        loop = TaskLoop("t", gated({}), eng, seed=0)
        loop.cut()
        assert list(report.layers) == list(eng.plan("t").layers)
        loop.close()

    def explicit(config: dict[str, Any]) -> th.ModelTask:  # real weights despite the default
        with torch.device("cpu"):
            return make_task(CONFIGS[0])

    (real,) = th.plan(explicit, {})
    assert real.probe_device == "meta" and "on a real device" in real.notes[0]
    assert real.layers == th.plan(make_task, CONFIGS[0])[0].layers


class Branchy(nn.Module):
    """A forward that branches on a tensor's value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        return self.fc(x)


def test_factory_errors_name_the_config() -> None:
    def broken(config: dict[str, Any]) -> th.ModelTask:
        if config["width"] > 32:
            raise ValueError("no such width")
        return make_task(config)

    with pytest.raises(TaskFactoryError, match=r"(?s)config 1 \(\{'width': 64\}\).*no such width"):
        th.plan(broken, [{"width": 16}, {"width": 64}])
    calls: list[int] = []

    def not_a_task(config: dict[str, Any]) -> Any:
        calls.append(1)
        return None

    with pytest.raises(TaskFactoryError, match=r"returned NoneType for config 0.*ModelTask"):
        th.plan(not_a_task, {"lr": 0.1})
    assert len(calls) == 1  # not retried on the CPU: the meta device is not at fault
    with pytest.raises(InvalidModelError, match=r"(?s)control flow.*nn\.Sequential"):
        th.plan(lambda c: th.ModelTask(Branchy(), nn.MSELoss(), OPTIMIZERS["sgd"], batches()), {})

    def mismatch(config: dict[str, Any]) -> th.ModelTask:
        return th.ModelTask(
            nn.Sequential(nn.Linear(5, 4)), nn.CrossEntropyLoss(), OPTIMIZERS["sgd"], batches()
        )

    with pytest.raises(DataMismatchError, match=r"layer '0'"):
        th.plan(mismatch, {})


def test_search_space_sampling() -> None:
    from ray import tune

    space = {
        "kind": "mlp",
        "width": tune.choice([8, 16, 32]),
        "opt": tune.grid_search(["sgd", "adam"]),
        "extra": {"lr": tune.loguniform(1e-4, 1e-1)},
    }
    configs = expand_configs(space, num_samples=3, seed=1)
    assert len(configs) == 6 and [c["opt"] for c in configs] == ["sgd", "adam"] * 3
    assert all(c["width"] in (8, 16, 32) and 1e-4 <= c["extra"]["lr"] <= 1e-1 for c in configs)
    assert expand_configs(space, num_samples=3, seed=1) == configs  # seeded
    assert expand_configs(space, num_samples=3, seed=2) != configs
    reports = th.plan(make_task, [space, CONFIGS[1]], num_samples=3, seed=1)
    assert [r.config for r in reports] == [*configs, CONFIGS[1]]
    for r in reports[:6]:
        (want,) = th.plan(make_task, r.config)
        assert r.layers == want.layers and r.min_device_memory == want.min_device_memory
    assert reports.min_device_memory == max(r.min_device_memory for r in reports)
    with pytest.raises(InvalidTaskError, match="config dict"):
        th.plan(make_task, ["width=16"])


def test_plan_imports_ray_only_for_a_search_space_and_tune_hydra_stays_light() -> None:
    code = (
        "import sys, tune_hydra as th\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
        "from tests.test_planning import make_task\n"
        "r = th.plan(make_task, [{'width': 8}, {'width': 16}], device_memory=10**6)\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
        "print([x.num_shards for x in r])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[1, 1]", out.stderr


def test_reports_print_as_tables() -> None:
    reports = th.plan(make_task, CONFIGS, device_memory=20_000)
    one = reports[0]
    assert isinstance(one, PlanReport) and dataclasses.is_dataclass(one)
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.num_shards = 3  # type: ignore[misc]
    text = str(one).splitlines()
    assert text[0] == f"config {CONFIGS[0]!r}:"
    assert text[1] == f"  {one.num_shards} shard(s) at device_memory {format_bytes(20_000)}"
    assert text[3].split() == ["shard", "layers", "state", "activations"]
    for line, shard in zip(text[4:], one.shards, strict=True):
        cells = line.split()
        assert cells[0] == str(shard.index) and shard.layer_names[0] in line
        assert line.endswith(format_bytes(shard.activation_bytes))
        assert format_bytes(shard.state_bytes) in line
    table = str(reports).splitlines()
    assert "smallest device_memory" in table[0] and len(table) == 1 + len(CONFIGS) + 1
    assert table[-1].startswith(
        f"every config fits device_memory >= {format_bytes(reports.min_device_memory)}"
    )


def test_a_model_is_planned_and_printed_by_its_class() -> None:
    # th.plan(model, sample): one report, named by the model's class (issue 32; the cut
    # equals th.shard's: tests/frontends/test_shard_sizing.py)
    model, (x, y) = mlp(), batches(1)[0]
    reports = th.plan(model, x, optimizer=OPTIMIZERS["adam"](model.parameters()))
    (report,) = reports
    assert report.model == "Sequential" and report.config is None and report.fits is None
    want = plan_shards(list(report.layers), report.min_device_memory)
    assert _spans(report.shards) == _spans(want.shards)
    assert str(report).startswith("model Sequential:\n")
    assert str(reports).splitlines()[1].startswith("model Sequential ")

    # the same figures as a task factory's ModelTask of that model, data and optimizer
    def factory(config: dict[str, Any]) -> th.ModelTask:
        return th.ModelTask(mlp(), nn.CrossEntropyLoss(), OPTIMIZERS["adam"], [(x, y)])

    (task,) = th.plan(factory, {})
    assert report.layers == task.layers and report.min_device_memory == task.min_device_memory


def test_executor_plan_uses_its_options_without_starting_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ray = pytest.importorskip("ray")

    def no_init(*args: object, **kwargs: object) -> None:
        raise AssertionError("HydraExecutor.plan started Ray")

    # Other tests may have left a Ray session running: what counts is that plan starts none.
    monkeypatch.setattr(ray, "init", no_init)
    ex = th.HydraExecutor(devices="cpu", device_memory=20_000, precision="bf16", prefetch=False)
    reports = ex.plan(make_task, CONFIGS[:2])
    want = th.plan(make_task, CONFIGS[:2], device_memory=20_000, precision="bf16", prefetch=False)
    assert [(r.num_shards, r.layers, r.notes) for r in reports] == [
        (w.num_shards, w.layers, w.notes) for w in want
    ]
    gpu = th.HydraExecutor(devices=["cuda:0"], device_memory=None)
    (report,) = gpu.plan(make_task, CONFIGS[0], max_layers_per_shard=2)
    assert len(report.shards) >= 5 and "on a GPU the engine also measures" in report.notes[-1]
    assert "90%" in report.notes[-1]


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_plan_equals_the_cut_of_a_task_trained_as_a_loop(precision: str | None) -> None:
    # th.optimize trains a factory's task as a th.shard loop (TaskLoop), cut on its first
    # batch: the same cut, layer for layer and byte for byte, as th.plan foretells.
    for config in CONFIGS:
        (report,) = th.plan(make_task, config, precision=precision)
        total = sum(c.total_bytes for c in report.layers)
        budget = (report.min_device_memory + total) // 2
        (at,) = th.plan(make_task, config, device_memory=budget, precision=precision)
        with Engine("cpu", device_memory=budget) as eng:
            loop = TaskLoop("t", make_task(config), eng, seed=0, precision=precision)
            loop.train_iteration()
            plan = eng.plan("t")
            loop.close()
        assert _spans(at.shards) == _spans(plan.shards), (config, precision)
