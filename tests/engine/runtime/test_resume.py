"""Re-sharding on restore: a task's state (``TaskLoop.state()``, in
:mod:`tune_hydra.engine.runtime.resume`'s layout) captured with the model cut one way
resumes exactly with the model cut another way (float64, ``torch.equal`` everywhere), for
every per-parameter optimizer, mid-way through an accumulation group, with clipping; an
older per-shard state loads; damaged and foreign states are refused before anything
loads."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, batches, make_task, mlp
from tune_hydra.engine import Engine
from tune_hydra.engine.runtime.resume import param_names
from tune_hydra.exceptions import InvalidTaskError, ResumeStateError
from tune_hydra.frontends.task_loop import TaskLoop

# How mlp() (10 layers, float64) is cut: the number of shards each gives.
CUTS: dict[str, dict[str, Any]] = {
    "whole": {},  # no budget: 1 shard
    "budget": {"device_memory": 24_000},  # >= 3 shards
    "fine": {"max_layers_per_shard": 1},  # 10 shards, some without parameters
    "pairs": {"max_layers_per_shard": 2},  # 5 shards
}
# Each iteration is 5 batches, an epoch: with accumulate_steps=2 every checkpoint falls in
# the middle of a group, and the group left at the end of the epoch steps (clipped with
# the norms of its last backward) only when the next iteration starts, after the restore
# (its first batch finds the epoch's data at its end).
MID_GROUP = {"accumulate_steps": 2, "iteration_batches": 5, "max_grad_norm": 0.05}


def assert_equal(got: Any, want: Any, where: str = "state") -> None:
    """Exact equality of nested states: same keys, ``torch.equal`` tensors of one dtype."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), where
        for k in want:
            assert_equal(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def _plan_free(state: dict[str, Any]) -> dict[str, Any]:
    """The state without what records the cut: the shard count. (The optimizer's groups
    are the factory's over the whole model, whatever the cut.)"""
    return {k: v for k, v in state.items() if k != "num_shards"}


def per_shard_state(loop: TaskLoop) -> dict[str, Any]:
    """``loop``'s state in the per-shard layout older tune_hydra versions wrote, under the
    loop's own cut: ``"optimizers"``, one ``state_dict`` per shard (``None`` for a shard
    without parameters) of an optimizer the factory built over that shard's parameters,
    and ``"grads"``, one gradient list per shard, instead of ``"optimizer"`` and
    ``"param_grads"``. Only for a model without tied parameters and a factory that makes
    one group (that runner gave a tied parameter to its first shard, and its factory's
    groups per shard). tests/frontends/test_old_checkpoints.py checks it against a state
    such a version wrote."""
    state = loop.state()
    optimizer, grads = state.pop("optimizer"), state.pop("param_grads")
    (group,) = optimizer["param_groups"]
    hyper = {k: v for k, v in group.items() if k != "params"}
    names = [name for name, _ in loop.model.named_parameters()]
    optimizers: list[dict[str, Any] | None] = []
    grad_lists: list[list[Any]] = []
    for layers in loop.cut():
        held = [n for n in names if any(n.startswith(f"{layer}.") for layer in layers)]
        per_id = {i: optimizer["state"][n] for i, n in enumerate(held) if n in optimizer["state"]}
        optimizers.append(
            copy.deepcopy(
                {"state": per_id, "param_groups": [{**hyper, "params": list(range(len(held)))}]}
            )
            if held
            else None
        )
        grad_lists.append([None if grads.get(n) is None else grads[n].clone() for n in held])
    state["optimizers"], state["grads"] = optimizers, grad_lists
    return state


def _loop(engine: Engine, task: th.ModelTask, **options: Any) -> TaskLoop:
    return TaskLoop("t", task, engine, seed=3, **options)


def _train(
    legs: list[tuple[str, int]],
    opt: str,
    options: dict[str, Any],
    model: nn.Module | None = None,
    batches_per_epoch: int = 5,
) -> tuple[dict[str, Any], list[int], list[dict[str, Any]]]:
    """Train a task in ``legs`` (cut, iterations), each a loop on a fresh engine restored
    from the previous leg's state (a fresh model of other weights: the state brings them).
    Returns the last state, the shard count of each leg, and every iteration's result."""
    state: dict[str, Any] | None = None
    shards, results = [], []
    for i, (cut, iterations) in enumerate(legs):
        net = (model if model is not None else mlp()) if i == 0 else mlp(seed=99)
        with Engine("cpu", **CUTS[cut]) as eng:
            loop = _loop(eng, make_task(net, opt, n=batches_per_epoch), **options)
            if state is not None:
                given = copy.deepcopy(state)
                loop.load_state(state)
                assert_equal(state, given)  # restoring does not touch the state it reads
            results += loop.start(iterations).result(timeout=120)
            state = loop.state()
            shards.append(len(loop.cut()))
            assert state["num_shards"] == shards[-1]
            loop.close()
    assert state is not None
    return state, shards, results


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
def test_restore_under_another_cut_equals_an_uninterrupted_run(opt: str) -> None:
    want, (n_budget,), want_results = _train([("budget", 4)], opt, MID_GROUP)
    whole, (n_whole,), _ = _train([("whole", 4)], opt, MID_GROUP)
    assert n_budget >= 3 and n_whole == 1
    assert_equal(_plan_free(whole), _plan_free(want))  # the cut alone changes nothing
    for legs in ([("budget", 2), ("whole", 2)], [("whole", 2), ("fine", 2)]):
        got, shards, results = _train(legs, opt, MID_GROUP)
        assert len(set(shards)) == 2, shards
        assert_equal(_plan_free(got), _plan_free(want))
        assert [r["loss"] for r in results] == [r["loss"] for r in want_results]
        assert [r["val_loss"] for r in results] == [r["val_loss"] for r in want_results]
    # the checkpoints really were taken in the middle of a group, with moments stored
    half, _, _ = _train([("budget", 2)], opt, MID_GROUP)
    assert half["batch_in_epoch"] % 2 == 1 and half["param_grads"]
    assert set(half["param_grads"]) == set(dict(mlp().named_parameters()))
    moments = {"sgd": "momentum_buffer", "adam": "exp_avg_sq", "adamw": "exp_avg_sq"}[opt]
    assert all(moments in s for s in half["optimizer"]["state"].values())


@pytest.mark.parametrize(("first", "then"), [("fine", "pairs"), ("pairs", "budget")])
def test_restore_mid_group_equals_plain_training(first: str, then: str) -> None:
    """Plain PyTorch on a deepcopy, 3 epochs of 4 batches in groups of 2, clipped: the
    loop stops after 3 batches (in the middle of a group), resumes cut another way and
    runs 9 batches more; its model (BatchNorm statistics included) equals plain training's."""
    ref = make_task(mlp(), "adam", n=4)
    th.train_plain(ref, 3, seed=3, accumulate_steps=2, max_grad_norm=0.05)
    options = {"accumulate_steps": 2, "iteration_batches": 3, "max_grad_norm": 0.05}
    state, shards, _ = _train([(first, 1), (then, 3)], "adam", options, batches_per_epoch=4)
    assert shards[0] != shards[1]
    assert_equal(state["model"], ref.model.state_dict())


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = a.weight  # tied: one tensor, two names
    return nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4)).double()


def test_tied_weights_are_stored_once_and_restore_across_cuts() -> None:
    assert sorted(param_names(_tied()).values()) == [
        "0.bias", "0.weight", "2.bias", "4.bias", "4.weight", "5.bias", "5.weight",
    ]  # fmt: skip

    def run(legs: list[tuple[int | None, int]]) -> dict[str, Any]:
        state = None
        for per_shard, iterations in legs:
            with Engine("cpu", max_layers_per_shard=per_shard) as eng:
                loop = TaskLoop("t", make_task(_tied(), "adamw"), eng, seed=1, max_grad_norm=0.1)
                if state is not None:
                    loop.load_state(state)
                loop.start(iterations).result(timeout=120)
                state = loop.state()
                loop.close()
        assert state is not None
        return state

    want = run([(3, 4)])  # [0, 1, 2] (the tied pair in one shard) and [3, 4, 5]
    assert want["num_shards"] == 2
    assert "2.weight" not in want["optimizer"]["state"]
    # ... also with the tied pair in two shards (max_layers_per_shard=1): one tensor, one
    # optimizer state, its two uses' gradients summed as autograd sums them.
    for legs in ([(3, 2), (None, 2)], [(None, 2), (4, 2)], [(1, 2), (3, 2)], [(3, 2), (1, 2)]):
        assert_equal(_plan_free(run(legs)), _plan_free(want))


def test_a_state_taken_right_after_a_restore_is_the_restored_one() -> None:
    """Saving again before training on (Tune checkpoints a restored trial at once, e.g.
    under PBT) keeps the epoch's data order, not the seed's; before the model is cut and
    after (a checkpoint's save cuts it)."""
    options = {**MID_GROUP, "iteration_batches": 3}  # iterations end mid-epoch
    want, _, _ = _train([("budget", 3)], "adam", options)
    assert want["batch_in_epoch"] != 0 and want["epoch"] > 0
    with Engine("cpu", **CUTS["pairs"]) as eng:
        loop = _loop(eng, make_task(mlp(seed=99), "adam"), **options)
        loop.load_state(copy.deepcopy(want))
        again = loop.state()
        assert len(loop.cut()) == 5
        cut_again = loop.state()
        loop.close()
    assert_equal(_plan_free(again), _plan_free(want))
    assert_equal(_plan_free(cut_again), _plan_free(want))


def test_older_per_shard_states_load_under_their_own_cut_or_given_it() -> None:
    """The per-shard layout of older tune_hydra versions (one optimizer state and one
    gradient list per shard): under the cut it was saved with it goes on exactly; under
    another it needs that cut (a checkpoint's manifest names it), and is refused without
    it before anything loads."""
    options = {"accumulate_steps": 2, "iteration_batches": 3}
    want, _, _ = _train([("budget", 4)], "sgd", options)
    with Engine("cpu", **CUTS["budget"]) as eng:
        loop = _loop(eng, make_task(mlp(), "sgd"), **options)
        loop.start(2).result(timeout=120)
        legacy = per_shard_state(loop)
        cut = loop.cut()
        loop.close()
    assert "optimizer" not in legacy and len(legacy["optimizers"]) == legacy["num_shards"]
    with Engine("cpu", **CUTS["budget"]) as eng:
        loop = _loop(eng, make_task(mlp(seed=99), "sgd"), **options)
        loop.load_state(legacy)
        loop.start(2).result(timeout=120)
        assert_equal(loop.state(), want)
        loop.close()
    with Engine("cpu", **CUTS["whole"]) as eng:
        loop = _loop(eng, make_task(mlp(seed=99), "sgd"), **options)
        assert len(loop.cut()) == 1
        before = loop.state()
        with pytest.raises(
            ResumeStateError, match=r"(?s)older tune_hydra.*give the cut it was saved with"
        ):
            loop.load_state(legacy)
        assert_equal(loop.state(), before)  # nothing was loaded
        loop.load_state(legacy, cut=cut)
        loop.start(2).result(timeout=120)
        assert_equal(_plan_free(loop.state()), _plan_free(want))
        loop.close()


def test_a_state_of_another_model_is_refused_before_loading_anything() -> None:
    state, _, _ = _train([("budget", 1)], "adam", {})
    other = nn.Sequential(*mlp(), nn.Linear(4, 4)).double()  # one layer more
    with Engine("cpu", **CUTS["budget"]) as eng:
        loop = _loop(eng, make_task(other, "adam"))
        loop.cut()
        before = loop.state()
        with pytest.raises(ResumeStateError, match=r"'model' does not fit.*'10\.weight'") as info:
            loop.load_state(state)
        assert isinstance(info.value, InvalidTaskError) and info.value.task == "t"
        assert_equal(loop.state(), before)
        loop.close()
    # The same tensors, an optimizer state of other parameters: one lacking '9.weight',
    # one naming a parameter the model does not have.
    lacking = copy.deepcopy(state)
    for group in lacking["optimizer"]["param_groups"]:
        group["params"] = [n for n in group["params"] if n != "9.weight"]
    lacking["optimizer"]["state"].pop("9.weight", None)
    extra = copy.deepcopy(state)
    extra["optimizer"]["param_groups"][0]["params"].append("99.weight")
    for saved, pattern in (
        (lacking, r"no optimizer entry.*'9\.weight'"),
        (extra, r"optimizer state for 1 parameter.*'99\.weight'"),
    ):
        with Engine("cpu", **CUTS["budget"]) as eng:
            loop = _loop(eng, make_task(mlp(seed=99), "adam"))
            loop.cut()
            before = loop.state()
            with pytest.raises(ResumeStateError, match=pattern) as info:
                loop.load_state(saved)
            assert info.value.task == "t"
            assert_equal(loop.state(), before)
            loop.close()
    with Engine("cpu") as eng:
        loop = _loop(eng, make_task(mlp(), "adam"))
        broken = {k: v for k, v in state.items() if k != "optimizer"}
        with pytest.raises(ResumeStateError, match="no optimizer state"):
            loop.load_state(broken)
        loop.close()


def _by_position(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """A factory whose groups depend on the parameters' position in its list."""
    return torch.optim.SGD(
        [{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": 0.2}], lr=0.3
    )


def _positional_task(seed: int) -> th.ModelTask:
    return th.ModelTask(mlp(seed=seed), nn.CrossEntropyLoss(), _by_position, batches())


def test_groups_that_depend_on_position_restore_under_another_cut() -> None:
    """A loop's optimizer is the factory's over the whole model, whatever the cut: a
    factory whose groups depend on the parameters' position gives the same groups cut
    into 5 shards or 1, and the state restores exactly across them."""
    with Engine("cpu", **CUTS["pairs"]) as eng:
        loop = _loop(eng, _positional_task(0))
        loop.start(1).result(timeout=120)
        state = loop.state()
        assert len(loop.cut()) == 5
        loop.start(1).result(timeout=120)
        want = loop.state()
        loop.close()
    groups = state["optimizer"]["param_groups"]
    assert [(g["lr"], len(g["params"])) for g in groups] == [(0.1, 1), (0.2, 9)]
    with Engine("cpu") as eng:
        loop = _loop(eng, _positional_task(9))
        loop.load_state(state)
        assert_equal(_plan_free(loop.state()), _plan_free(state))
        loop.start(1).result(timeout=120)
        assert_equal(_plan_free(loop.state()), _plan_free(want))
        loop.close()


def test_a_state_whose_groups_mix_hyperparameters_under_the_loops_groups_is_refused() -> None:
    """The older runtime built one optimizer per shard with the factory (its states keep
    one group per shard optimizer): under the pairs cut each shard's first parameter had
    lr 0.1. In the loop's optimizer '3.weight' is in the lr 0.2 group; restoring must not
    change its learning rate silently: the error says how to restore instead."""
    with Engine("cpu", **CUTS["pairs"]) as eng:
        loop = _loop(eng, _positional_task(0))
        loop.start(1).result(timeout=120)
        state = loop.state()
        cut = loop.cut()
        loop.close()
    (_, rest) = state["optimizer"]["param_groups"]
    hyper = {k: v for k, v in rest.items() if k != "params"}
    names = list(param_names(mlp()).values())
    per_shard = [[n for n in names if n.split(".")[0] in layers] for layers in cut]
    state["optimizer"]["param_groups"] = [
        {**hyper, "lr": lr, "params": params}
        for held in per_shard
        if held
        for lr, params in ((0.1, held[:1]), (0.2, held[1:]))
    ]
    assert [g["lr"] for g in state["optimizer"]["param_groups"] if "3.weight" in g["params"]] == [
        0.1
    ]
    with Engine("cpu") as eng:
        loop = _loop(eng, _positional_task(9))
        with pytest.raises(ResumeStateError, match=r"different hyperparameters.*lr: 0\.\d"):
            loop.load_state(state)
        loop.close()


def test_damaged_states_are_refused_before_loading_anything() -> None:
    """Issue 23, item 8: a state whose position is past the task's data (was a
    TaskFailedError: StopIteration in the next epoch), whose RNG state torch refuses (a
    raw RuntimeError inside training), or whose tensors do not fit the model, is refused
    by load_state with a ResumeStateError naming the field; the task is left as it was."""
    state, _, _ = _train([("whole", 1)], "sgd", {"iteration_batches": 3})
    n_batches = len(batches())
    damaged = {
        "batch_in_epoch": ({"batch_in_epoch": n_batches + 1}, r"past the end .*train_data"),
        "rng": (
            {"rng": {"cpu": torch.zeros(7, dtype=torch.uint8), "cuda": None}},
            r"'rng' has a CPU entry that holds 7 bytes",
        ),
        "epoch_rng": ({"epoch_rng": torch.ones(3)}, r"'epoch_rng' is a torch\.float32"),
        "iteration": ({"iteration": -2}, r"'iteration' is -2"),
        "model shape": (
            {"model": {k: v[:1] if v.dim() else v for k, v in state["model"].items()}},
            r"'model' holds '0\.weight' of shape \(1, ",
        ),
        "grad shape": (
            {"param_grads": {"0.weight": torch.zeros(1, dtype=torch.float64)}},
            r"'param_grads' holds a gradient of shape \(1,\)",
        ),
    }
    with Engine("cpu") as eng:
        loop = _loop(eng, make_task(mlp(seed=99), "sgd"), iteration_batches=3)
        loop.cut()
        before = loop.state()
        for field, (change, pattern) in damaged.items():
            with pytest.raises(ResumeStateError, match=pattern) as info:
                loop.load_state({**state, **change})
            assert "damaged" in str(info.value), field
            assert_equal(loop.state(), before, field)  # nothing was loaded
        loop.load_state(state)  # the genuine state still restores
        loop.start(1).result(timeout=120)
        loop.close()


class _Stream:
    """Train data without ``__len__`` (a streaming dataset): a position past its end can
    only be found while skipping to it."""

    def __init__(self, data: list[Any]) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return iter(self.data)


def test_a_position_past_the_end_of_data_without_a_length_names_the_field() -> None:
    """Issue 23, item 8, for data load_state cannot measure: the skip to the saved
    position runs out of batches. Before: TaskFailedError: StopIteration; now the task
    fails with a ResumeStateError naming batch_in_epoch, and the other task of the engine
    goes on."""
    data = batches()
    with Engine("cpu") as eng:
        task = th.ModelTask(mlp(seed=1), nn.CrossEntropyLoss(), OPTIMIZERS["sgd"], _Stream(data))
        stream = TaskLoop("t", task, eng, seed=3, iteration_batches=2)
        ok = TaskLoop("ok", make_task(mlp(seed=2), "sgd"), eng, seed=3)
        stream.start(1).result(timeout=120)
        state = stream.state()
        stream.load_state({**state, "batch_in_epoch": len(data) + 2})
        failing, fine = stream.start(1), ok.start(1)
        with pytest.raises(Exception) as info:
            failing.result(timeout=120)
        assert len(fine.result(timeout=120)) == 1
        stream.close()
        ok.close()
    err = info.value
    assert isinstance(err, ResumeStateError) and err.task == "t"
    chain = [err, err.__cause__, getattr(err, "error", None)]
    text = " ".join(str(e) for e in chain if e is not None)
    assert "StopIteration" not in type(err).__name__
    assert "'batch_in_epoch' is 7" in text and "yielded only 5 batch(es)" in text, text
