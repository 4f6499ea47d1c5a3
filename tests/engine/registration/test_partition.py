"""The partitioner: plans are data, respect the budget, and name a layer that cannot fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, mlp
from tune_hydra.engine.registration.partition import LayerCost, layer_costs, plan_shards
from tune_hydra.engine.task import model_layers

_X = torch.randn(6, 8, dtype=torch.float64)


def _costs(
    model: nn.Sequential | None = None, opt: str = "adam", x: torch.Tensor = _X
) -> list[LayerCost]:
    return layer_costs(model_layers(model or mlp()), OPTIMIZERS[opt], x)


@pytest.mark.parametrize("budget", [20_000, 24_000, 40_000, 100_000])
@pytest.mark.parametrize("prefetch", [True, False])
def test_plan_respects_budget(budget: int, prefetch: bool) -> None:
    plan = plan_shards(_costs(), budget, prefetch=prefetch)
    assert plan.peak_bytes() <= budget
    assert plan.shards[0].start == 0 and plan.shards[-1].stop == len(plan.layers)
    for a, b in zip(plan.shards, plan.shards[1:], strict=False):
        assert a.stop == b.start  # contiguous, in order
    text = str(plan)
    assert f"{len(plan)} shard(s)" in text and "shard 0: layers" in text


def test_smaller_budget_never_fewer_shards() -> None:
    sizes = [len(plan_shards(_costs(), b)) for b in (20_000, 30_000, 60_000, 200_000)]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] >= 3 and sizes[-1] == 1


def test_costs_count_adam_moments_and_grads() -> None:
    lin = nn.Sequential(nn.Linear(10, 10)).double()
    x = torch.randn(3, 10, dtype=torch.float64)
    (c,) = _costs(lin, x=x)
    assert c.param_bytes == 110 * 8 == c.grad_bytes
    assert c.optimizer_bytes == 2 * 110 * 8
    assert c.activation_bytes >= 3 * 10 * 8  # the saved input and the output
    (s,) = _costs(lin, "sgd", x=x)
    assert s.optimizer_bytes == 110 * 8  # momentum buffer


def test_probe_leaves_batchnorm_and_rng_untouched() -> None:
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    _costs(model)
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_layer_too_large_names_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4000), nn.Linear(4000, 2))
    task = th.ModelTask(
        model, nn.MSELoss(), OPTIMIZERS["sgd"], [(torch.randn(2, 4), torch.randn(2, 2))]
    )
    with pytest.raises(th.exceptions.TrainingError) as info:  # reported, as any bad task
        th.train_models({"a": task}, devices=["cpu"], device_memory="64KiB")
    err = info.value.errors["a"]
    assert isinstance(err, th.exceptions.ShardTooLargeError)
    assert isinstance(err, th.TuneHydraError) and isinstance(err, MemoryError)
    assert err.layer == "1" and err.budget == 65536 and err.nbytes > 65536
    assert "'1'" in str(err) and "65536 bytes" in str(err) and "device_memory" in str(err)


def test_nested_sequential_is_cut_inside_and_keeps_keys() -> None:
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(8, 4))
    names = [n for n, _ in model_layers(model)]
    assert names == ["0", "1.0", "1.1", "1.2", "2"]


def test_a_batch_sliced_from_a_big_tensor_counts_as_its_own_size() -> None:
    """A batch that is a view into the whole dataset tensor costs its own bytes, not the
    dataset's; and a layer writing its input in place can be probed."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    whole = torch.randn(10_000, 8)
    sliced, alone = whole[:16], whole[:16].clone()
    costs = [layer_costs(model_layers(model), OPTIMIZERS["sgd"], x) for x in (sliced, alone)]
    assert [c.activation_bytes for c in costs[0]] == [c.activation_bytes for c in costs[1]]
    assert costs[0][0].activation_bytes < 16 * 8 * 4 * 4  # far from the 320 KB dataset


def test_kept_peak_counts_every_shards_activations() -> None:
    """With recompute=False all shards' graphs wait for their backward at once."""
    model = mlp(width=32)
    x = torch.randn(8, 8, dtype=torch.float64)
    costs = layer_costs(model_layers(model), OPTIMIZERS["adam"], x)
    plan = plan_shards(costs, 90_000)
    assert len(plan) >= 3
    states = max(s.state_bytes for s in plan.shards)
    acts = sum(s.activation_bytes for s in plan.shards)
    assert plan.kept_peak_bytes() == acts + 2 * states > plan.peak_bytes()
    single = plan_shards(costs, None)
    assert single.kept_peak_bytes() == single.peak_bytes()


def test_the_probe_leaves_no_tensor_behind() -> None:
    """Layers that save their own output (ReLU, Tanh) made the probe's saved-tensor hook
    hold the output's Python object inside its own graph: a cycle gc cannot free, so
    every probe (one per added task) leaked a batch of activations."""
    import gc
    import warnings

    def probe() -> None:
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh())
        layer_costs(model_layers(model), OPTIMIZERS["sgd"], torch.randn(64, 32))

    def tensors() -> set[int]:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch's deprecated module proxies
            warnings.simplefilter("ignore")
            return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}

    probe()
    before = tensors()
    for _ in range(3):
        probe()
    assert tensors() - before == set()


def test_the_probe_finds_which_shards_write_their_input_in_place() -> None:
    """A shard writes its input if a layer writes in place what it gets while the layers
    before it in the shard passed their input through (Identity, in-place ReLUs)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.ReLU(inplace=True),  # writes (and returns) its input
        nn.Identity(),  # passes its input through
        nn.ReLU(inplace=True),
        nn.Linear(4, 4),
        nn.ReLU(),  # a new tensor
        nn.ReLU(inplace=True),
    )
    costs = layer_costs(model_layers(model), OPTIMIZERS["sgd"], torch.randn(3, 4))
    assert [(c.writes_input, c.passes_input) for c in costs] == [
        (False, False),
        (True, True),
        (False, True),
        (True, True),
        (False, False),
        (False, False),
        (True, True),
    ]
    # Pairs: [Linear, ReLU(inplace)] writes only what Linear made; [Identity,
    # ReLU(inplace)] writes its input through the pass-through; [Linear, ReLU] not.
    cuts = {1: [False, True, False, True, False, False, True], 2: [False, True, False, True]}
    for size, want in cuts.items():
        plan = plan_shards(costs, None, max_layers_per_shard=size)
        assert [s.writes_input for s in plan.shards] == want, size
    plan = plan_shards(costs, None, max_layers_per_shard=3)  # [ReLU(inplace), Identity, ...]
    assert [s.writes_input for s in plan.shards][1] is True


def test_tuple_inputs_and_outputs_are_probed_too() -> None:
    """The boundaries of traced models are tuples of what lives across a cut: a layer
    that returns its input inside a tuple passes it on; one that writes into a tensor of
    its tuple input writes its input; a layer whose input holds no tensor is unknown."""

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x * 2

    class Sum(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] + pair[1]

    class AddInto(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[1].add_(pair[0])

    costs = layer_costs(
        model_layers(nn.Sequential(Pair(), Sum())), OPTIMIZERS["sgd"], torch.randn(2, 3)
    )
    assert [(c.writes_input, c.passes_input) for c in costs] == [(False, True), (False, False)]
    # the passed-on input is not counted again in the tuple's bytes
    assert costs[0].activation_bytes == 2 * 3 * 4
    plan = plan_shards(costs, None, max_layers_per_shard=1)
    assert [s.writes_input for s in plan.shards] == [False, False]
    costs = layer_costs(
        model_layers(nn.Sequential(Pair(), AddInto())), OPTIMIZERS["sgd"], torch.randn(2, 3)
    )
    assert [c.writes_input for c in costs] == [False, True]
    # Safe side: Pair passes x on, and which element AddInto writes is not told apart
    # (it writes x * 2, not x), so the shard computes on a clone of its input.
    assert plan_shards(costs, None).shards[0].writes_input is True

    class Count(nn.Module):
        def forward(self, n: int) -> torch.Tensor:
            return torch.ones(n)

    costs = layer_costs(model_layers(nn.Sequential(Count())), OPTIMIZERS["sgd"], 3)
    assert (costs[0].writes_input, costs[0].passes_input) == (None, None)


def test_a_preferred_cut_is_taken_only_where_it_fits() -> None:
    costs = _costs()
    n = len(costs)
    budget = 100_000
    own = plan_shards(costs, budget)
    spans = [(s.start, s.stop) for s in own.shards]
    one_each = [(i, i + 1) for i in range(n)]
    assert spans != one_each
    got = plan_shards(costs, budget, prefer=[one_each])
    assert [(s.start, s.stop) for s in got.shards] == one_each
    assert got.peak_bytes() <= budget and [s.index for s in got.shards] == list(range(n))
    # Not a cut of these layers, or a shard of it over the budget or the layer limit:
    # the plan's own cut.
    whole = [(0, n)]
    small = plan_shards(costs, 20_000)
    bad = [[(0, n - 1)], [(0, 2), (1, n)], [(0, 2), (3, n)], [(0, 0), (0, n)], [*one_each, (n, n)]]
    for prefer in bad:
        assert plan_shards(costs, budget, prefer=[prefer]).shards == own.shards, prefer
    assert plan_shards(costs, 20_000, prefer=[whole]).shards == small.shards
    assert len(plan_shards(costs, None, max_layers_per_shard=2, prefer=[whole])) == (n + 1) // 2
    assert len(plan_shards(costs, None, max_layers_per_shard=n, prefer=[one_each])) == n
    # The first cut that fits, of several (the whole model fits this budget too).
    got = plan_shards(costs, budget, prefer=[*bad, one_each, whole])
    assert [(s.start, s.stop) for s in got.shards] == one_each


def test_a_preferred_cut_must_fit_a_kept_batch_where_graphs_are_kept() -> None:
    costs = _costs()
    cut = [(0, 2), (2, len(costs))]
    for budget in range(30_000, 80_000, 500):  # peak fits, a kept batch does not
        own = plan_shards(costs, budget)
        got = plan_shards(costs, budget, prefer=[cut])
        spans = [(s.start, s.stop) for s in got.shards]
        if spans == cut and got.kept_peak_bytes() > budget >= own.kept_peak_bytes():
            break
    else:
        pytest.fail("no budget where the cut fits but not a kept batch")
    assert plan_shards(costs, budget, prefer=[cut], kept=True).shards == own.shards
    roomy = got.kept_peak_bytes()
    kept = plan_shards(costs, roomy, prefer=[cut], kept=True)
    assert [(s.start, s.stop) for s in kept.shards] == cut
