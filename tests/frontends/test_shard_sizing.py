"""Sizing help for th.shard loops (issue 32): ``th.shard_count``, the smallest budget in
``ShardTooLargeError`` (``min_device_memory``: at it the model cuts, one byte less it
does not), and ``th.plan(model, sample)`` foretelling the cut of the first forward.

On 2 emulated copying CPU devices; float64 and bit-equal where a run is compared with its
plain PyTorch twin.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tests.conftest import batches, mlp
from tune_hydra.exceptions import (
    AlreadyShardedError,
    InvalidOptionError,
    ModelNotCutError,
    NotShardedError,
    ShardError,
    ShardTooLargeError,
    format_bytes_up,
)
from tune_hydra.frontends.task_loop import TaskLoop
from tune_hydra.planning import PlanReports


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


def engine(budget: int | None, **options: Any) -> th.Engine:
    return th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, device_memory=budget, **options)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def cut_of(model: nn.Module, eng: th.Engine) -> list[tuple[int, int]]:
    loop = model.__dict__["_th_shard"].loop
    return [(s.start, s.stop) for s in eng.plan(loop.name).shards]


class Skip(nn.Module):
    """Not a Sequential (cut by tracing) with a skip connection across the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(h + torch.relu(self.b(h)))


# -- th.shard_count -------------------------------------------------------------------------


def test_shard_count_after_the_first_forward_and_refusals_before_and_after() -> None:
    plain = mlp()
    with pytest.raises(NotShardedError, match=r"call th\.shard\(model, optimizer\) first"):
        th.shard_count(plain)
    data = batches(3)
    model, ref = copy.deepcopy(plain), copy.deepcopy(plain)
    ref_opt = adam(ref)
    with engine(24_000) as eng:
        model, opt = th.shard(model, adam(model), engine=eng)
        with pytest.raises(ModelNotCutError, match="cut on its first forward") as info:
            th.shard_count(model)
        assert isinstance(info.value, ShardError) and isinstance(info.value, th.TuneHydraError)
        torch.manual_seed(7)  # dropout: the loop on the main thread shares the user's stream
        got = [step(model, opt, x, y) for x, y in data]
        n = th.shard_count(model)
        assert n == len(model.__dict__["_th_shard"].loop.shards) == len(cut_of(model, eng))
        assert n >= 3
        # reading the count changes nothing: the loop trains on bit-equal to plain PyTorch
        torch.manual_seed(7)
        assert got == [step(ref, ref_opt, x, y) for x, y in data]
        th.unshard(model)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(NotShardedError, match=r"th\.unshard"):
        th.shard_count(model)
    assert "shard_count" in th.__all__


# -- ShardTooLargeError.min_device_memory ---------------------------------------------------


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_a_loop_at_min_device_memory_cuts_and_one_byte_less_raises(prefetch: bool) -> None:
    x, _ = batches(1)[0]
    # a budget far too small: the error tells the one to give, not the first layer over
    with engine(2_000, prefetch=prefetch) as eng:
        model = mlp()
        model, opt = th.shard(model, adam(model), engine=eng)
        with pytest.raises(ShardTooLargeError) as info:
            model(x)
    smallest = info.value.min_device_memory
    assert isinstance(smallest, int) and smallest > 2_000
    assert f"give device_memory >= {format_bytes_up(smallest)} ({smallest} bytes)" in str(
        info.value
    )
    back = pickle.loads(pickle.dumps(info.value))  # Ray sends it across processes
    assert back.min_device_memory == smallest and str(back) == str(info.value)
    plain = mlp()
    assert th.plan(plain, x, optimizer=adam(plain), prefetch=prefetch).min_device_memory == (
        smallest
    )
    # one byte less: refused again, with the same figure
    with engine(smallest - 1, prefetch=prefetch) as eng:
        model = mlp()
        model, opt = th.shard(model, adam(model), engine=eng)
        with pytest.raises(ShardTooLargeError) as again:
            model(x)
        assert again.value.min_device_memory == smallest and again.value.budget == smallest - 1
    # at it: cut, and trained bit-equal to plain PyTorch
    data = batches(3)
    ref = mlp()
    ref_opt = adam(ref)
    with engine(smallest, prefetch=prefetch) as eng:
        model = mlp()
        model, opt = th.shard(model, adam(model), engine=eng)
        torch.manual_seed(7)
        got = [step(model, opt, x, y) for x, y in data]
        assert eng.plan(model.__dict__["_th_shard"].loop.name).peak_bytes() <= smallest
        assert th.shard_count(model) >= 2
    torch.manual_seed(7)
    assert got == [step(ref, ref_opt, x, y) for x, y in data]


def test_a_task_factory_gets_min_device_memory_too() -> None:
    # A task's TaskLoop, cut on its first batch (what th.run / HydraExecutor's engines do
    # for each trial)
    def make_task(config: Any) -> th.ModelTask:
        return th.ModelTask(mlp(), nn.CrossEntropyLoss(), torch.optim.Adam, batches(2))

    with engine(2_000) as eng, pytest.raises(ShardTooLargeError) as info:
        TaskLoop("t", make_task({}), eng, seed=0).cut()
    smallest = info.value.min_device_memory
    assert smallest is not None and "give device_memory >=" in str(info.value)
    (report,) = th.plan(make_task, {})
    assert report.min_device_memory == smallest
    with engine(smallest) as eng:
        loop = TaskLoop("t", make_task({}), eng, seed=0)
        assert len(loop.cut()) >= 2
        loop.close()
    with engine(smallest - 1) as eng, pytest.raises(ShardTooLargeError) as again:
        TaskLoop("t", make_task({}), eng, seed=0).cut()
    assert again.value.min_device_memory == smallest


# -- th.plan(model, sample) -----------------------------------------------------------------


def _models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    x, _ = batches(1)[0]
    torch.manual_seed(0)
    return {"mlp": (mlp(), x), "traced": (Skip().double(), x)}


@pytest.mark.parametrize("kind", ["mlp", "traced"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_plan_of_a_model_is_the_cut_of_its_first_forward(kind: str, opt: str) -> None:
    model, x = _models()[kind]
    make_opt = adam if opt == "adam" else lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    (report,) = smallest = th.plan(model, x, optimizer=make_opt(model))
    assert isinstance(smallest, PlanReports) and report.model == type(model).__name__
    assert report.config is None and report.probe_device == "cpu"
    # planning left the model as it was (BatchNorm statistics, no grads) and the RNG too
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    total = sum(c.total_bytes for c in report.layers)
    smallest_ = report.min_device_memory
    for budget in (smallest_, smallest_ + total // 3, smallest_ + 4 * total):
        (at,) = th.plan(model, x, optimizer=make_opt(model), device_memory=budget)
        assert at.fits
        with engine(budget) as eng:
            sharded = copy.deepcopy(model)
            sharded, _ = th.shard(sharded, make_opt(sharded), engine=eng)
            sharded(x)
            assert th.shard_count(sharded) == at.num_shards, (kind, budget)
            assert cut_of(sharded, eng) == [(s.start, s.stop) for s in at.shards]
            assert list(eng.plan(sharded.__dict__["_th_shard"].loop.name).layers) == list(at.layers)
    assert report.num_shards is None and len(report.shards) >= 2  # no budget: the smallest's


def test_plan_of_a_model_below_its_smallest_budget_reports_it() -> None:
    model, x = _models()["mlp"]
    (report,) = th.plan(model, x, optimizer=adam(model), device_memory=2_000)
    assert report.fits is False and report.num_shards is None
    assert report.cut_for == report.min_device_memory
    text = str(report)
    assert text.startswith("model Sequential:") and "does NOT fit device_memory" in text


def test_plan_of_a_model_built_on_the_meta_device() -> None:
    x, _ = batches(1)[0]
    real = mlp()
    with torch.device("meta"):
        meta = mlp()
    (want,) = th.plan(real, x, optimizer=adam(real))
    (got,) = th.plan(meta, x, optimizer=adam(meta))
    assert got.probe_device == "meta" and list(got.layers) == list(want.layers)
    assert got.min_device_memory == want.min_device_memory


def test_plan_of_a_hugging_face_model_takes_its_keyword_batch() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double()
    ids = torch.randint(1, 32, (3, 7), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    (report,) = th.plan(model, batch, optimizer=adam(model))
    budget = report.min_device_memory
    (at,) = th.plan(model, batch, optimizer=adam(model), device_memory=budget)
    with engine(budget) as eng:
        sharded = copy.deepcopy(model)
        sharded, _ = th.shard(sharded, adam(sharded), engine=eng)
        sharded(**batch).loss.backward()
        assert th.shard_count(sharded) == at.num_shards == 5  # embed, 3 blocks, head
        assert cut_of(sharded, eng) == [(s.start, s.stop) for s in at.shards]


def test_plan_refuses_a_sharded_model_and_an_optimizer_with_a_factory() -> None:
    x, y = batches(1)[0]
    with engine(None) as eng:
        model = th.shard(mlp(), engine=eng)
        with pytest.raises(AlreadyShardedError, match=r"th\.shard_count"):
            th.plan(model, x)
    factory_task = th.ModelTask(mlp(), nn.CrossEntropyLoss(), torch.optim.Adam, [(x, y)])
    with pytest.raises(InvalidOptionError, match="optimizer with a model only"):
        th.plan(lambda config: factory_task, {}, optimizer=adam(mlp()))


def test_plan_of_a_model_in_bf16_is_the_cut_of_a_first_forward_under_autocast() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 4)
    )
    x = torch.randn(16, 8)
    (full,) = th.plan(model, x, optimizer=adam(model))
    (bf16,) = th.plan(model, x, optimizer=adam(model), precision="bf16")
    assert [c.activation_bytes for c in bf16.layers] != [c.activation_bytes for c in full.layers]
    budget = bf16.min_device_memory
    (at,) = th.plan(model, x, optimizer=adam(model), precision="bf16", device_memory=budget)
    with engine(budget) as eng:
        sharded = copy.deepcopy(model)
        sharded, _ = th.shard(sharded, adam(sharded), engine=eng)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sharded(x)  # the first forward, under the autocast the loop trains in
        assert th.shard_count(sharded) == at.num_shards
        assert list(eng.plan(sharded.__dict__["_th_shard"].loop.name).layers) == list(at.layers)
