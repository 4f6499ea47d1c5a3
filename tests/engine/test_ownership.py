"""A model belongs to one task of an engine: a model (or part of one) shared by two live
tasks is refused at registration with a SharedModelError, and the first task trains
exactly as plain training would. Weights tied within one model stay allowed."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, assert_same_model, batches, make_task, mlp, plain_copy
from tune_hydra.engine import Engine
from tune_hydra.exceptions import InvalidTaskError, SharedModelError, TrainingError


def _task(model: nn.Module, opt: str = "adam") -> th.ModelTask:
    return th.ModelTask(model, nn.CrossEntropyLoss(), OPTIMIZERS[opt], batches(4))


def test_module_level_model_in_two_tasks() -> None:
    """The mistake that is safe in plain Tune (a process per trial): a factory handing out
    one module-level model. The first task trains it exactly; the second is refused."""
    model = mlp(seed=3)  # stands for `MODEL = Net()` at module level

    def make_task_from_config(config: dict[str, float]) -> th.ModelTask:
        return th.ModelTask(
            model,
            nn.CrossEntropyLoss(),
            lambda p: torch.optim.SGD(p, lr=config["lr"]),
            batches(4),
            eval_data=batches(2, seed=7),
        )

    first, second = make_task_from_config({"lr": 0.05}), make_task_from_config({"lr": 0.1})
    ref = plain_copy(first)
    with pytest.raises(TrainingError) as info:
        th.train_models({"t1": first, "t2": second}, devices=["cpu"], epochs=2, seed=0)
    err = info.value
    assert set(err.errors) == {"t2"} and err.history["t2"] == []
    refused = err.errors["t2"]
    assert isinstance(refused, SharedModelError) and isinstance(refused, InvalidTaskError)
    assert isinstance(refused, ValueError)
    assert refused.task == "t2" and refused.owner == "t1"
    shared = dict(refused.tensors)
    assert set(shared) == set(model.state_dict())  # every parameter and buffer, by name
    assert all(mine == theirs for mine, theirs in refused.tensors)
    text = str(refused)
    assert "task 't2'" in text and "task 't1'" in text and "'0.weight'" in text
    assert "make_task(config)" in text and "module-level" in text
    # the first task is untouched by the refused one: bit for bit its plain training
    want = th.train_plain(ref, 2, seed=0)
    assert [r["loss"] for r in err.history["t1"]] == [r["loss"] for r in want]
    assert_same_model(first.model, ref.model, atol=0.0)


def test_two_tasks_sharing_one_submodule() -> None:
    f64 = {"dtype": torch.float64}
    block = nn.Sequential(nn.Linear(16, 16, **f64), nn.ReLU())
    a = nn.Sequential(nn.Linear(8, 16, **f64), block, nn.Linear(16, 4, **f64))
    b = nn.Sequential(nn.Linear(8, 16, **f64), nn.ReLU(), block, nn.Linear(16, 4, **f64))
    with Engine(devices=["cpu"]) as engine:
        engine.add_task("a", _task(a), seed=0)
        with pytest.raises(SharedModelError) as info:
            engine.add_task("b", _task(b), seed=0)
        assert engine.tasks() == ["a"]
    err = info.value
    # qualified names in each model: the block is child 2 of b and child 1 of a
    assert err.tensors == [("2.0.weight", "1.0.weight"), ("2.0.bias", "1.0.bias")]
    assert "with task 'a'" in str(err) and "'2.0.weight' ('1.0.weight' there)" in str(err)


def test_a_shared_buffer_is_refused() -> None:
    """Buffers count too: a shared BatchNorm without affine parameters (buffers only), and
    one buffer tensor registered in two models' modules."""
    norm = nn.BatchNorm1d(16, affine=False, dtype=torch.float64)

    def net(middle: nn.Module) -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 16), middle, nn.Linear(16, 4)).double()

    with Engine(devices=["cpu"]) as engine:
        engine.add_task("a", _task(net(norm)), seed=0)
        with pytest.raises(SharedModelError) as info:
            engine.add_task("b", _task(net(norm)), seed=0)
        assert ("1.running_mean", "1.running_mean") in info.value.tensors
        assert ("1.num_batches_tracked", "1.num_batches_tracked") in info.value.tensors

    class Shift(nn.Module):
        def __init__(self, offset: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("offset", offset)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.offset

    offset = torch.zeros(16, dtype=torch.float64)
    with Engine(devices=["cpu"]) as engine:
        engine.add_task("a", _task(net(Shift(offset))), seed=0)
        with pytest.raises(SharedModelError) as info:
            engine.add_task("b", _task(net(Shift(offset))), seed=0)
        assert info.value.tensors == [("1.offset", "1.offset")]
        # a view of it is the same memory
        with pytest.raises(SharedModelError):
            engine.add_task("c", _task(net(Shift(offset.view(1, 16)))), seed=0)
        engine.add_task("d", _task(net(Shift(offset.clone()))), seed=0)  # a copy is fine


def test_shared_storage_is_refused_while_the_owner_is_on_a_device() -> None:
    """Two parameter objects over one storage are caught by the storage, also while the
    owner's shards are promoted (copy_on_cpu: the live tensors are copies then, and its
    own memory is the shard's host buffer)."""
    task = make_task(mlp(), "adam")
    originals = {n: p.data for n, p in task.model.named_parameters()}
    with Engine(devices=["cpu"], copy_on_cpu=True, device_memory=24_000) as engine:
        assert engine.add_task("a", task, seed=0) >= 3
        engine.train("a", 1).result(timeout=120)
        runner = engine.runner("a")
        promoted = [s for s in runner.shards if s.store.copied and s.params]
        assert promoted, "no shard stayed on its device after training"
        names = {id(p): n for n, p in task.model.named_parameters()}
        name = names[id(promoted[0].params[0])]
        assert promoted[0].params[0].data_ptr() != originals[name].data_ptr()

        other = mlp(seed=5)
        module, attr = name.rsplit(".", 1)
        setattr(other.get_submodule(module), attr, nn.Parameter(originals[name]))
        with pytest.raises(SharedModelError) as info:
            engine.add_task("b", make_task(other, "adam"), seed=0)
        assert info.value.tensors == [(name, name)]
        # a model of its own next to it trains
        engine.add_task("c", make_task(mlp(seed=6), "adam"), seed=0)
        assert len(engine.train("c", 1).result(timeout=120)) == 1


def test_weights_tied_within_one_model_still_train() -> None:
    torch.manual_seed(0)
    first = nn.Linear(8, 8, dtype=torch.float64)
    second = nn.Linear(8, 8, dtype=torch.float64)
    second.weight = first.weight  # tied: one parameter under two names
    model = nn.Sequential(first, nn.Tanh(), second, nn.Tanh(), nn.Linear(8, 4)).double()
    task = _task(model)
    ref = plain_copy(task)
    assert ref.model[0].weight is ref.model[2].weight  # deepcopy keeps the tie
    history = th.train_models({"tied": task}, devices=["cpu"], epochs=2, seed=0)
    want = th.train_plain(ref, 2, seed=0)
    assert [r["loss"] for r in history["tied"]] == [r["loss"] for r in want]
    assert_same_model(task.model, ref.model, atol=0.0)
    assert task.model[0].weight is task.model[2].weight


def test_ownership_is_released_by_remove_task_and_kept_by_set_state() -> None:
    model = mlp(seed=2)
    with Engine(devices=["cpu"], device_memory=24_000) as engine:
        engine.add_task("a", make_task(model, "sgd"), seed=0)
        engine.train("a", 1).result(timeout=120)
        state = engine.get_state("a")
        engine.set_state("a", state)  # a new runner: still the owner
        with pytest.raises(SharedModelError) as info:
            engine.add_task("b", make_task(model, "sgd"), seed=0)
        assert info.value.owner == "a"
        engine.remove_task("a")
        assert engine.add_task("b", make_task(model, "sgd"), seed=0) >= 3
        assert len(engine.train("b", 1).result(timeout=120)) == 1
        with pytest.raises(SharedModelError) as info:  # now b owns it
            engine.add_task("a", make_task(model, "sgd"), seed=0)
        assert info.value.owner == "b" and info.value.task == "a"


def test_the_same_task_under_two_names() -> None:
    task = make_task(mlp(), "adam")
    ref = plain_copy(task)
    with pytest.raises(TrainingError) as info:
        th.train_models({"a": task, "b": task}, devices=["cpu"], epochs=1, seed=0)
    assert isinstance(info.value.errors["b"], SharedModelError)
    th.train_plain(ref, 1, seed=0)
    assert_same_model(task.model, ref.model, atol=0.0)


def test_models_of_their_own_are_not_confused() -> None:
    """Deep copies and freshly built models share nothing (no false alarm), with many
    tasks registered and removed in turn (ids and addresses are reused by then)."""
    template = mlp(seed=4)
    with Engine(devices=["cpu"]) as engine:
        for round_ in range(3):
            for i in range(4):
                engine.add_task(f"r{round_}t{i}", make_task(copy.deepcopy(template)), seed=i)
            for i in range(4):
                engine.remove_task(f"r{round_}t{i}")
        assert engine.tasks() == []


def test_concurrent_registrations_of_one_model() -> None:
    """Two add_task calls at once with one model (the engine actor registers trials
    concurrently): the model is claimed before the probe, so exactly one wins."""
    model = mlp(seed=8)
    start = threading.Barrier(4)
    outcomes: dict[str, object] = {}

    def add(engine: Engine, name: str) -> None:
        start.wait()
        try:
            outcomes[name] = engine.add_task(name, make_task(model), seed=0)
        except SharedModelError as err:
            outcomes[name] = err

    with Engine(devices=["cpu"], device_memory=24_000) as engine:
        threads = [threading.Thread(target=add, args=(engine, f"t{i}")) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [n for n, o in outcomes.items() if isinstance(o, int)]
        assert len(outcomes) == 4 and len(winners) == 1, outcomes
        assert engine.tasks() == winners
        assert all(o.owner in winners for o in outcomes.values() if isinstance(o, SharedModelError))


def test_shared_model_error_survives_pickling() -> None:
    err = SharedModelError("b", "a", [("0.weight", "0.weight"), ("2.bias", "1.bias")])
    back = pickle.loads(pickle.dumps(err))  # it crosses Ray's process boundaries
    assert type(back) is SharedModelError and str(back) == str(err)
    assert back.tensors == err.tensors and back.owner == "a"
