"""Sharded, spilled, multiplexed training equals plain PyTorch on a deepcopy (float64: exact)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import (
    assert_same_history,
    assert_same_model,
    make_task,
    mlp,
    plain_copy,
    shards_3,
)
from tune_hydra.frontends.task_loop import TaskLoop


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("recompute", [True, False])
def test_float64_parity_every_optimizer(opt: str, recompute: bool) -> None:
    task = make_task(mlp(), opt)
    ref = plain_copy(task)
    h = th.train_models(
        {"a": task},
        devices=["cpu"],
        **shards_3(recompute),
        epochs=2,
        seed=3,
        recompute=recompute,
        copy_on_cpu=True,
    )
    want = th.train_plain(ref, 2, seed=3)
    assert h["a"][0]["num_shards"] >= 3
    assert_same_history(h["a"], want)
    assert_same_model(task.model, ref.model)


@pytest.mark.parametrize(
    "extra",
    [
        {"max_grad_norm": 0.3},
        {"accumulate_steps": 2},
        {"accumulate_steps": 3, "max_grad_norm": 0.5},
    ],
)
@pytest.mark.parametrize("recompute", [True, False])
def test_clipping_and_accumulation_parity(
    extra: dict, recompute: bool, budget_3_shards: int
) -> None:
    # 5 batches: with accumulate_steps=2 or 3 the last group is partial and still steps.
    task = make_task(mlp(), "adamw")
    ref = plain_copy(task)
    h = th.train_models(
        {"a": task},
        devices=["cpu"],
        device_memory=budget_3_shards,
        epochs=2,
        seed=5,
        recompute=recompute,
        **extra,
    )
    want = th.train_plain(ref, 2, seed=5, **extra)
    assert_same_history(h["a"], want)
    assert_same_model(task.model, ref.model)


def test_clipping_really_clips(budget_3_shards: int) -> None:
    a, b = make_task(mlp(), "sgd"), make_task(mlp(), "sgd")
    th.train_models(
        {"a": a}, devices=["cpu"], device_memory=budget_3_shards, seed=0, max_grad_norm=1e-3
    )
    th.train_models({"b": b}, devices=["cpu"], device_memory=budget_3_shards, seed=0)
    assert not torch.equal(a.model[0].weight, b.model[0].weight)


def test_float32_parity(budget_3_shards: int) -> None:
    task = make_task(mlp(torch.float32), "adam", dtype=torch.float32)
    ref = plain_copy(task)
    h = th.train_models(
        {"a": task},
        devices=["cpu"],
        device_memory=budget_3_shards // 2,
        epochs=2,
        seed=1,
        recompute=True,
    )
    want = th.train_plain(ref, 2, seed=1)
    assert_same_history(h["a"], want, tol=1e-5)
    assert_same_model(task.model, ref.model, atol=1e-6, rtol=1e-5)


def test_bf16_autocast_parity(budget_3_shards: int) -> None:
    task = make_task(mlp(torch.float32), "adam", dtype=torch.float32)
    ref = plain_copy(task)
    h = th.train_models(
        {"a": task},
        devices=["cpu"],
        device_memory=budget_3_shards // 2,
        epochs=1,
        seed=1,
        precision="bf16",
        recompute=True,
    )
    want = th.train_plain(ref, 1, seed=1, precision="bf16")
    assert_same_history(h["a"], want, tol=1e-5)
    assert_same_model(task.model, ref.model, atol=1e-5, rtol=1e-4)


def test_state_dict_keys_and_cpu_after_training(budget_3_shards: int) -> None:
    task = make_task(mlp(), "adam")
    keys = list(task.model.state_dict())
    th.train_models({"a": task}, devices=["cpu"], device_memory=budget_3_shards, copy_on_cpu=True)
    assert list(task.model.state_dict()) == keys
    assert all(t.device.type == "cpu" for t in task.model.state_dict().values())


def test_list_of_modules_model() -> None:
    layers = list(mlp())
    task = make_task(layers, "sgd")  # type: ignore[arg-type]
    ref = plain_copy(task)
    th.train_models({"a": task}, devices=["cpu"], device_memory=24_000, seed=2)
    th.train_plain(ref, 1, seed=2)
    assert_same_model(task.model, ref.model)


def test_shuffled_dataloader_order_is_the_tasks_own(budget_3_shards: int) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(
        torch.randn(30, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (30,), generator=g),
    )
    loader = DataLoader(ds, batch_size=6, shuffle=True)
    task = th.ModelTask(mlp(), torch.nn.CrossEntropyLoss(), lambda p: torch.optim.Adam(p), loader)
    ref = plain_copy(task)
    h = th.train_models(
        {"a": task}, devices=["cpu"], device_memory=budget_3_shards, epochs=2, seed=9
    )
    want = th.train_plain(ref, 2, seed=9)
    assert_same_history(h["a"], want)
    assert_same_model(task.model, ref.model)


def _no_dropout(seed: int = 0) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(m for m in mlp(seed=seed) if not isinstance(m, torch.nn.Dropout)))


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_accumulation_steps_once_per_group_and_equals_plain(
    k: int, recompute: bool, clip: float | None
) -> None:
    # Accumulation over micro-batches, with and without clipping and kept graphs: each
    # batch is one op of the task's loop, visiting each shard once forward and once
    # backward (a shard's step is applied at its next visit after the group's last batch).
    task = make_task(_no_dropout(), "adamw", n=7)
    ref = plain_copy(task)
    h = th.train_models(
        {"a": task},
        devices=["cpu"],
        **shards_3(recompute),
        epochs=2,
        seed=2,
        recompute=recompute,
        accumulate_steps=k,
        max_grad_norm=clip,
        copy_on_cpu=True,
    )
    want = th.train_plain(ref, 2, seed=2, accumulate_steps=k, max_grad_norm=clip)
    assert_same_history(h["a"], want)
    assert_same_model(task.model, ref.model)
    forwards = [e for e in h.trace.events if e.op in ("F", "L") and e.shard == 0]
    assert len(forwards) == 2 * 7  # one per batch (evaluation is its own op, "E")


def test_parameter_free_shards() -> None:
    """Cut one layer per shard, some shards have no parameters (ReLU, Dropout alone):
    they get no optimizer (torch refuses an empty list) and training still equals plain,
    through a checkpoint round trip too."""
    task = make_task(mlp(), "adam")
    ref = plain_copy(task)
    with th.Engine(devices="cpu", max_layers_per_shard=1, copy_on_cpu=True) as engine:
        loop = TaskLoop("a", task, engine, seed=5)
        loop.cut()
        assert any(s.optimizer is None for s in loop.runner.shards)
        first = loop.start(1).result(timeout=120)
        state = loop.state()
        loop.close()
        # restored into a new loop (a new runner) of the same task
        again = TaskLoop("a", task, engine, seed=5)
        again.load_state(state)
        second = again.start(1).result(timeout=120)
        again.close()
    want = th.train_plain(ref, 2, seed=5)
    assert_same_history(first + second, want)
    assert_same_model(task.model, ref.model)


def _inplace_mlp() -> nn.Sequential:
    """In-place activations right after possible cuts, dropout and BatchNorm around them."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(inplace=True),
        nn.BatchNorm1d(16),
        nn.LeakyReLU(0.1, inplace=True),  # not idempotent: a recompute from its output differs
        nn.Dropout(0.2),
        nn.Linear(16, 16),
        nn.ELU(inplace=True),
        nn.Linear(16, 4),
    ).double()


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("cut", [1, 2, None])
def test_layers_that_write_their_input_in_place(recompute: bool, cut: int | None) -> None:
    """``ReLU(inplace=True)`` and kin as the first layer of a shard: torch refuses an
    in-place write to a leaf that requires grad, and a recompute must start from the input
    as it was before the write. Such shards compute on a clone (found by the layer
    probe); the others take their input as is. Training equals plain PyTorch exactly."""
    task = make_task(_inplace_mlp(), "adam")
    ref = plain_copy(task)
    with th.Engine(
        devices="cpu", max_layers_per_shard=cut, recompute=recompute, copy_on_cpu=True
    ) as engine:
        loop = TaskLoop("a", task, engine, seed=2)
        got = loop.start(2).result(timeout=120)
        runner = loop.runner
        loop.close()
    want = th.train_plain(ref, 2, seed=2)
    assert_same_history(got, want)
    assert_same_model(task.model, ref.model)
    inplace = (nn.ReLU, nn.LeakyReLU, nn.ELU)
    for shard in runner.shards:
        first = shard.module[0]
        writes = isinstance(first, inplace) and shard.index > 0  # shard 0 starts with Linear
        assert shard.writes_input is writes, (shard.index, first)


def test_shards_that_do_not_write_their_input_never_clone_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe tells which shards write their input, so the others take it as is from
    their first visit on (no input-sized copy beyond the plan)."""
    from tune_hydra.engine.runtime import loop, loop_chain

    clones: list[int] = []
    real = loop.clone_tensors

    def counting(obj: object) -> object:
        clones.append(1)
        return real(obj)

    # where a loop's forwards, backwards and train-batch chains copy a shard's input
    monkeypatch.setattr(loop, "clone_tensors", counting)
    monkeypatch.setattr(loop_chain, "clone_tensors", counting)
    task = make_task(mlp(), "adam")
    ref = plain_copy(task)
    h = th.train_models(
        {"a": task}, devices=["cpu"], max_layers_per_shard=2, copy_on_cpu=True, seed=4
    )
    assert len(h.plans["a"]) == 5 and not any(s.writes_input for s in h.plans["a"].shards)
    assert clones == []
    assert_same_history(h["a"], th.train_plain(ref, 1, seed=4))
    assert_same_model(task.model, ref.model)


def test_a_layer_that_writes_its_input_only_sometimes_trains_as_plain() -> None:
    """A layer that writes into its input in place on some calls only (here: those without
    grad, from its fourth on): the input a shard keeps for its backward is never the one
    written, so training equals plain, with and without recomputation."""

    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x.mul_(2) if self.calls > 3 and not torch.is_grad_enabled() else x * 2

    for recompute in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), Sometimes(), nn.Linear(16, 4)).double()
        task = make_task(model, "sgd", eval_data=False)
        ref = plain_copy(task)
        h = th.train_models(
            {"a": task},
            devices=["cpu"],
            max_layers_per_shard=1,
            recompute=recompute,
            copy_on_cpu=True,
            epochs=2,
            seed=0,
        )
        assert_same_history(h["a"], th.train_plain(ref, 2, seed=0))
        assert_same_model(task.model, ref.model)


def test_a_model_given_in_eval_mode_trains_in_train_mode(budget_3_shards: int) -> None:
    """Plain training calls ``model.train()`` first: a model registered in eval mode (as
    ``from_pretrained`` returns it) trains with its dropout on, as it would there."""
    task = make_task(mlp().eval(), "adam")
    ref = plain_copy(task)
    h = th.train_models({"a": task}, devices=["cpu"], device_memory=budget_3_shards, seed=3)
    assert_same_history(h["a"], th.train_plain(ref, 1, seed=3))
    assert_same_model(task.model, ref.model)
    assert task.model.training
