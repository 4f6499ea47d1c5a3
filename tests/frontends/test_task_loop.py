"""TaskLoop: a ModelTask trained as a th.shard loop equals train_plain on a deepcopy
(float64: exact), and resumes exactly from its state (or from one of the older per-shard
layout).

Sharded runs use 2 emulated copying devices under a budget that cuts mlp() into >= 3
shards; torch runs on one intra-op thread (see tests/frontends/test_shard.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, assert_same, make_task, mlp, plain_copy
from tests.engine.runtime.test_resume import per_shard_state
from tune_hydra.exceptions import EmptyDataError, ResumeStateError
from tune_hydra.frontends.task_loop import TaskLoop


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


def _engine(**options: Any) -> th.Engine:
    options.setdefault("device_memory", 24_000)
    return th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, **options)


def _train(
    task: th.ModelTask,
    iterations: int,
    *,
    state: dict[str, Any] | None = None,
    engine_options: dict[str, Any] | None = None,
    seed: int = 3,
    **options: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """``iterations`` of ``task`` as a TaskLoop (from ``state``); its results, its state
    after them, and its shard count."""
    with _engine(**(engine_options or {})) as engine:
        loop = TaskLoop("a", task, engine, seed=seed, **options)
        if state is not None:
            loop.load_state(state)
        history = [loop.train_iteration() for _ in range(iterations)]
        out = loop.state()
        shards = out["num_shards"]
        loop.close()
    return history, out, shards


def _same_history(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for key, value in w.items():
            assert g[key] == value, (key, g[key], value)


def _step_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


@pytest.mark.parametrize(
    ("opt", "options", "engine_options"),
    [
        ("sgd", {}, {}),
        ("adam", {}, {}),
        ("adamw", {"max_grad_norm": 0.3}, {}),
        ("adamw", {"accumulate_steps": 2}, {}),
        ("adam", {"accumulate_steps": 3, "max_grad_norm": 0.5}, {}),
        (
            "adamw",
            {"accumulate_steps": 2, "max_grad_norm": 0.5},
            {"recompute": False, "device_memory": 40_000, "max_layers_per_shard": 3},
        ),
    ],
)
def test_a_task_equals_plain_training(
    opt: str, options: dict[str, Any], engine_options: dict[str, Any]
) -> None:
    # mlp(): dropout (random numbers in ops) and BatchNorm (buffers); 5 batches, so a
    # group of 2 or 3 is partial at the epoch's end and still steps.
    task = make_task(mlp(), opt)
    ref = plain_copy(task)
    history, _, shards = _train(task, 2, engine_options=engine_options, **options)
    want = th.train_plain(ref, 2, seed=3, **options)
    assert shards >= 3
    _same_history(history, want)
    assert [h["epoch"] for h in history] == [1, 2]
    assert [h["batches"] for h in history] == [5, 5]
    assert_same(task.model, ref.model)


def test_scheduler_metrics_and_a_metric_named_loss_equal_plain() -> None:
    def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out.argmax(-1) == y).double().mean()

    def nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    task = make_task(mlp(), "adam")
    task.lr_scheduler = _step_lr
    task.metrics = {"acc": accuracy, "loss": nll}
    ref = plain_copy(task)
    ref.lr_scheduler, ref.metrics = _step_lr, task.metrics
    history, _, _ = _train(task, 3, accumulate_steps=2)
    want = th.train_plain(ref, 3, seed=3, accumulate_steps=2)
    _same_history(history, want)
    assert set(history[0]) >= {"acc", "loss", "train_loss", "val_loss"}
    assert_same(task.model, ref.model)


def test_a_hugging_face_model_with_its_own_loss_equals_plain() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(torch.float64)
    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(4):
        ids = torch.randint(0, 32, (2, 8), generator=g)
        data.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    task = th.ModelTask(model, None, OPTIMIZERS["adamw"], data, eval_data=data[:2])
    ref = plain_copy(task)
    budget = {"device_memory": 600_000}
    history, _, shards = _train(task, 2, max_grad_norm=1.0, engine_options=budget)
    want = th.train_plain(ref, 2, seed=3, max_grad_norm=1.0)
    assert shards >= 2
    _same_history(history, want)
    assert_same(task.model, ref.model)
    assert task.model.lm_head.weight is task.model.transformer.wte.weight


@pytest.mark.parametrize("recompute", [True, False])
def test_clipping_gpt2_with_prefetch_equals_plain(recompute: bool) -> None:
    """max_grad_norm clips each shard where its gradients are (a step op per shard, the
    scaling with its step): exact as clip_grad_norm_. GPT-2's embedding is tied to its
    head (the first and the last shard), and with prefetch a shard using it is evicted
    while the other computes with it: the shared part stays (it went home mid-op)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0
    )
    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(4):
        ids = torch.randint(0, 64, (4, 12), generator=g)
        data.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    budget = 1_500_000 if recompute else 3_000_000
    for attempt in range(3):  # the eviction's timing varies: more than one interleaving
        torch.manual_seed(attempt)
        model = transformers.GPT2LMHeadModel(cfg).to(torch.float64)
        task = th.ModelTask(model, None, OPTIMIZERS["adamw"], data, eval_data=data[:1])
        ref = plain_copy(task)
        with th.Engine(
            devices=["cpu"],
            device_memory=budget,
            copy_on_cpu=True,
            prefetch=True,
            recompute=recompute,
            max_layers_per_shard=3,
        ) as engine:
            loop = TaskLoop("a", task, engine, seed=0, max_grad_norm=0.05)
            history = [loop.train_iteration() for _ in range(2)]
            assert loop.state()["num_shards"] >= 2  # the embedding and the head apart
            loop.close()
        _same_history(history, th.train_plain(ref, 2, seed=0, max_grad_norm=0.05))
        assert_same(task.model, ref.model)


def test_a_shuffling_dataloader_and_dropout_draw_from_the_tasks_seed() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (24,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True)
    task = th.ModelTask(mlp(), nn.CrossEntropyLoss(), OPTIMIZERS["sgd"], loader)
    ref = plain_copy(task)
    torch.manual_seed(99)  # the global generator is not the task's stream
    history, _, _ = _train(task, 3, seed=11)
    want = th.train_plain(ref, 3, seed=11)
    _same_history(history, want)
    assert_same(task.model, ref.model)


def test_bf16_precision_equals_plain_autocast() -> None:
    task = make_task(mlp(torch.float32), "adam", dtype=torch.float32)
    ref = plain_copy(task)
    history, _, _ = _train(task, 1, precision="bf16", engine_options={"device_memory": 12_000})
    want = th.train_plain(ref, 1, seed=3, precision="bf16")
    _same_history(history, want)
    assert_same(task.model, ref.model)


def test_resumed_between_epochs_equals_training_on() -> None:
    options = {"accumulate_steps": 2, "max_grad_norm": 0.5}
    first = make_task(mlp(), "adamw")
    first.lr_scheduler = _step_lr
    second, ref = plain_copy(first), plain_copy(first)
    second.lr_scheduler = ref.lr_scheduler = _step_lr
    before, state, _ = _train(first, 1, **options)
    # Restored under another cut (another budget): the state does not depend on it.
    after, _, _ = _train(
        second, 1, state=state, engine_options={"device_memory": 60_000}, **options
    )
    want = th.train_plain(ref, 2, seed=3, **options)
    _same_history(before + after, want)
    assert after[0]["iteration"] == 2 and after[0]["epoch"] == 2
    assert_same(second.model, ref.model)


@pytest.mark.parametrize(("per_iteration", "done"), [(2, 3), (3, 2), (5, 1)])
def test_resumed_mid_epoch_and_mid_group_equals_training_on(per_iteration: int, done: int) -> None:
    # 5 batches an epoch, a step every 3: the state falls inside an epoch and inside an
    # accumulation group (its gradients travel with it); the data order is replayed.
    base = make_task(mlp(), "sgd")
    resumed, straight = plain_copy(base), plain_copy(base)
    _, state, _ = _train(base, done, iteration_batches=per_iteration, accumulate_steps=3)
    left = 10 - per_iteration * done
    _train(resumed, 1, state=state, iteration_batches=left, accumulate_steps=3)
    _train(straight, 5, iteration_batches=2, accumulate_steps=3)
    assert_same(resumed.model, straight.model)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_an_older_per_shard_state_resumes_under_any_cut_given_its_own(opt: str) -> None:
    # Saved mid-epoch and mid-group (gradients per shard travel with it), cut into >= 3
    # shards; resumed as a loop cut another way (the saved cut given, as a checkpoint's
    # manifest lists it), and as a loop cut the same way (one shard, no cut given).
    options: dict[str, Any] = {"accumulate_steps": 2, "iteration_batches": 3}
    base = make_task(mlp(), opt)
    straight = plain_copy(base)
    _train(straight, 3, **options)
    for saved_under, loop_under in ((24_000, None), (None, None), (None, 24_000)):
        task, resumed = plain_copy(base), plain_copy(base)
        with _engine(device_memory=saved_under) as engine:
            loop = TaskLoop("a", task, engine, seed=3, **options)
            loop.start(2).result(timeout=120)
            state = per_shard_state(loop)
            cut = loop.cut()
            loop.close()
        assert "optimizer" not in state and len(state["optimizers"]) == len(cut)
        given = cut if saved_under != loop_under else None
        with _engine(device_memory=loop_under) as engine:
            loop = TaskLoop("a", resumed, engine, seed=3, **options)
            loop.load_state(state, cut=given)
            assert (len(loop.cut()) == len(cut)) == (saved_under == loop_under)
            loop.train_iteration()
            loop.close()
        assert_same(resumed.model, straight.model)


def test_a_per_shard_state_without_its_cut_loads_only_under_the_same_one() -> None:
    task = make_task(mlp(), "sgd")
    with _engine(device_memory=24_000) as engine:
        loop = TaskLoop("a", task, engine, seed=3)
        loop.train_iteration()
        state = per_shard_state(loop)
        loop.close()
    assert state["num_shards"] >= 3
    with _engine(device_memory=None) as engine:  # one shard
        loop = TaskLoop("a", make_task(mlp(seed=5), "sgd"), engine, seed=3)
        before = loop.state()
        with pytest.raises(ResumeStateError, match=r"per shard.*give the cut it was saved"):
            loop.load_state(state)
        with pytest.raises(ResumeStateError, match=r"naming layers this model does not"):
            loop.load_state(state, cut=[["0", "1"], ["nope"]])
        assert_same(loop.state()["model"], before["model"])  # nothing was loaded
        loop.close()


def test_empty_data_and_bad_states_say_what_is_wrong() -> None:
    def no_batches() -> Iterator[Any]:
        return iter(())

    class Empty:
        def __iter__(self) -> Iterator[Any]:
            return no_batches()

    task = th.ModelTask(mlp(), nn.CrossEntropyLoss(), OPTIMIZERS["sgd"], Empty())
    with _engine() as engine:
        loop = TaskLoop("a", task, engine, seed=0)
        with pytest.raises(EmptyDataError, match="train_data yielded no batch"):
            loop.train_iteration()
        loop.close()

    good = make_task(mlp(), "sgd")
    _, state, _ = _train(good, 1)
    other = make_task(mlp(width=8), "sgd")
    with _engine() as engine:
        loop = TaskLoop("b", other, engine, seed=0)
        with pytest.raises(ResumeStateError, match="another model"):
            loop.load_state(state)
        damaged = {**copy.copy(state), "iteration": -1}
        with pytest.raises(ResumeStateError, match="'iteration'"):
            loop.load_state(damaged)
        loop.close()
    scheduled = make_task(mlp(), "sgd")
    scheduled.lr_scheduler = _step_lr
    with _engine() as engine:
        loop = TaskLoop("c", scheduled, engine, seed=0)
        with pytest.raises(
            ResumeStateError, match=r"the task has an lr_scheduler and the state none"
        ):
            loop.load_state(state)
        loop.close()


def test_results_report_the_engines_figures() -> None:
    task = make_task(mlp(), "sgd", n=3)
    history, _, shards = _train(task, 2)
    first, second = history
    assert first["num_shards"] == shards >= 3
    assert 0 < first["device_time_s"] < second["device_time_s"]
    assert 0 < first["bytes_spilled"] < second["bytes_spilled"]
    assert [h["iteration"] for h in history] == [1, 2]


@pytest.mark.parametrize("kept", [False, True])
def test_an_error_inside_a_batchs_chain_of_ops_is_raised_and_leaves_nothing_behind(
    kept: bool,
) -> None:
    # The loss runs inside the batch's L op, between the forward and the backward ops of
    # the chain: its error ends the chain and reaches the task's thread as it is; the
    # graphs the batch kept are dropped (their reservation ends with the loop's next op,
    # or as it leaves, as for a user's loop that raises mid-batch).
    calls = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("the loss broke")
        return nn.functional.cross_entropy(out, y)

    task = th.ModelTask(mlp(), loss_fn, OPTIMIZERS["adam"], make_task(mlp()).train_data)
    options = {"recompute": False, "device_memory": 40_000, "max_layers_per_shard": 3}
    with _engine(**(options if kept else {})) as engine:
        loop = TaskLoop("a", task, engine, seed=0)
        with pytest.raises(ValueError, match="the loss broke"):
            loop.train_iteration()
        assert engine.runner("a").keeps_batch is False
        loop.close()
        assert engine.tasks() == []


# -- a task's mistakes, named as the task runtime names them ---------------------------


def _data(n: int = 2, dtype: torch.dtype = torch.float64) -> list[Any]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(6, 8, generator=g, dtype=dtype), torch.randint(0, 4, (6,), generator=g))
        for _ in range(n)
    ]


def _refused(task: th.ModelTask, **engine_options: Any) -> BaseException:
    with _engine(**engine_options) as engine, pytest.raises(Exception) as info:
        loop = TaskLoop("a", task, engine, seed=0)
        loop.train_iteration()
    return info.value


def _plain_task(model: nn.Module, **kw: Any) -> th.ModelTask:
    base: dict[str, Any] = dict(
        model=model,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train_data=_data(),
    )
    base.update(kw)
    return th.ModelTask(**base)


def test_a_model_that_cannot_train_is_refused_before_anything_is_built() -> None:
    err = _refused(_plain_task(nn.Sequential()))
    assert isinstance(err, th.exceptions.InvalidModelError) and "no layers" in str(err)
    assert "task 'a'" in str(err)
    err = _refused(_plain_task(mlp().requires_grad_(False), loss_fn=lambda out, y: out.sum()))
    assert isinstance(err, th.exceptions.InvalidModelError) and "nothing to train" in str(err)


def test_data_at_fault_is_named_with_its_batch_and_layer() -> None:
    data = _data(3)
    data[1] = (data[1][0].float(), data[1][1])  # the second batch: another dtype
    err = _refused(_plain_task(mlp(), train_data=data))
    assert isinstance(err, th.exceptions.DataMismatchError)
    assert "batch 1 of epoch 0 of train_data" in str(err) and "layer '0'" in str(err)
    assert "the batch probed when the task was added: float64[6, 8]" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    evals = [(x.float(), y) for x, y in _data(1)]
    err = _refused(_plain_task(mlp(), eval_data=evals))
    assert isinstance(err, th.exceptions.DataMismatchError) and "batch 0 of eval_data" in str(err)
    # float32 targets for a float64 output: HuberLoss fails in its backward
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 4)) for _ in "ab"]
    err = _refused(_plain_task(mlp(), loss_fn=nn.HuberLoss(), train_data=data))
    assert isinstance(err, th.exceptions.DataMismatchError)
    assert "the backward of the loss raised RuntimeError" in str(err)
    assert "target.to(torch.float64)" in str(err)


def test_dict_batches_and_a_model_another_loop_trains_are_refused() -> None:
    data = [{"x": x, "labels": y} for x, y in _data(1)]
    err = _refused(_plain_task(mlp(), train_data=data))
    assert isinstance(err, th.exceptions.InvalidTaskError) and "keyword inputs" in str(err)
    model = mlp()
    with _engine() as engine:
        TaskLoop("first", _plain_task(model), engine, seed=0).train_iteration()
        with pytest.raises(th.exceptions.SharedModelError) as info:
            TaskLoop("second", _plain_task(model), engine, seed=0)
        assert info.value.owner == "first" and info.value.task == "second"
        assert ("3.running_mean", "3.running_mean") in info.value.tensors


def test_three_loops_racing_for_one_module_level_model_leave_it_to_one() -> None:
    """Three threads build a loop over one model at the same moment (a module-level
    ``MODEL`` every factory call returns): one trains it, the others get a
    ``SharedModelError``, and the winner's model is left its own (before, a loser could
    write its state into the model between the check and the class swap)."""
    import threading

    from tune_hydra.engine import Engine
    from tune_hydra.exceptions import SharedModelError

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    data = [(torch.randn(2, 4), torch.randn(2, 1))]
    got: dict[int, Any] = {}
    with Engine("cpu") as eng:
        start = threading.Barrier(3)

        def build(i: int) -> None:
            start.wait()
            task = th.ModelTask(model, nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1), data)
            try:
                got[i] = TaskLoop(f"t{i}", task, eng, seed=0)
            except SharedModelError as err:
                got[i] = err

        threads = [threading.Thread(target=build, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        loops = [v for v in got.values() if isinstance(v, TaskLoop)]
        assert len(loops) == 1 and len(got) == 3, got
        assert loops[0].train_iteration()["batches"] == 1
        loops[0].close()
    assert type(model) is nn.Sequential  # the user's class back
