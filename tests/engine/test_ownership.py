"""A model belongs to one task of an engine: a model (or part of one) shared by two live
tasks is refused with a SharedModelError, and the first task trains exactly as plain
training would. Weights tied within one model stay allowed.

A task's loop (TaskLoop) refuses a whole model another loop trains when it is built, and
a model sharing some of its tensors with another task's when it is cut (registered)."""

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
from tune_hydra.frontends.task_loop import TaskLoop


def _task(model: nn.Module, opt: str = "adam") -> th.ModelTask:
    return th.ModelTask(model, nn.CrossEntropyLoss(), OPTIMIZERS[opt], batches(4))


def test_module_level_model_in_two_tasks() -> None:
    """The mistake that is safe in plain Tune (a process per trial): a factory handing out
    one module-level model. The task that claims it first trains it exactly; the other
    is refused."""
    model = mlp(seed=3)  # stands for `MODEL = Net()` at module level

    def make_task_from_config(config: dict[str, float]) -> th.ModelTask:
        return th.ModelTask(
            model,
            nn.CrossEntropyLoss(),
            lambda p: torch.optim.SGD(p, lr=config["lr"]),
            batches(4),
            eval_data=batches(2, seed=7),
        )

    tasks = {"t1": make_task_from_config({"lr": 0.05}), "t2": make_task_from_config({"lr": 0.1})}
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    with pytest.raises(TrainingError) as info:
        th.train_models(tasks, devices=["cpu"], epochs=2, seed=0)
    err = info.value
    # Each task's loop is built on a thread of its own: either may claim the model first.
    (refused_name,) = err.errors
    (owner,) = set(tasks) - {refused_name}
    assert err.history[refused_name] == []
    refused = err.errors[refused_name]
    assert isinstance(refused, SharedModelError) and isinstance(refused, InvalidTaskError)
    assert isinstance(refused, ValueError)
    assert refused.task == refused_name and refused.owner == owner
    shared = dict(refused.tensors)
    assert set(shared) == set(model.state_dict())  # every parameter and buffer, by name
    assert all(mine == theirs for mine, theirs in refused.tensors)
    text = str(refused)
    assert f"task {refused_name!r}" in text and f"task {owner!r}" in text
    assert "'0.weight'" in text
    assert "make_task(config)" in text and "module-level" in text
    # the owner is untouched by the refused one: bit for bit its plain training
    want = th.train_plain(refs[owner], 2, seed=0)
    assert [r["loss"] for r in err.history[owner]] == [r["loss"] for r in want]
    assert_same_model(model, refs[owner].model, atol=0.0)


def test_two_tasks_sharing_one_submodule() -> None:
    f64 = {"dtype": torch.float64}
    block = nn.Sequential(nn.Linear(16, 16, **f64), nn.ReLU())
    a = nn.Sequential(nn.Linear(8, 16, **f64), block, nn.Linear(16, 4, **f64))
    b = nn.Sequential(nn.Linear(8, 16, **f64), nn.ReLU(), block, nn.Linear(16, 4, **f64))
    with Engine(devices=["cpu"]) as engine:
        first = TaskLoop("a", _task(a), engine, seed=0)
        first.cut()
        second = TaskLoop("b", _task(b), engine, seed=0)  # b itself is no other loop's
        with pytest.raises(SharedModelError) as info:
            second.cut()  # registering it claims its tensors
        assert engine.tasks() == ["a"]
    err = info.value
    # qualified names in each model: the block is child 2 of b and child 1 of a
    assert err.tensors == [("2.0.weight", "1.0.weight"), ("2.0.bias", "1.0.bias")]
    assert err.task == "b" and err.owner == "a"
    assert "with 'a'" in str(err) and "'2.0.weight' ('1.0.weight' there)" in str(err)


def test_a_shared_buffer_is_refused() -> None:
    """Buffers count too: a shared BatchNorm without affine parameters (buffers only), and
    one buffer tensor registered in two models' modules."""
    norm = nn.BatchNorm1d(16, affine=False, dtype=torch.float64)

    def net(middle: nn.Module) -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 16), middle, nn.Linear(16, 4)).double()

    # Held until the engine closes: a loop whose model is collected leaves its engine.
    loops: list[TaskLoop] = []

    def cut(engine: Engine, name: str, model: nn.Module) -> None:
        loops.append(TaskLoop(name, _task(model), engine, seed=0))
        loops[-1].cut()

    with Engine(devices=["cpu"]) as engine:
        cut(engine, "a", net(norm))
        with pytest.raises(SharedModelError) as info:
            cut(engine, "b", net(norm))
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
        cut(engine, "a", net(Shift(offset)))
        with pytest.raises(SharedModelError) as info:
            cut(engine, "b", net(Shift(offset)))
        assert info.value.tensors == [("1.offset", "1.offset")]
        # a view of it is the same memory
        with pytest.raises(SharedModelError):
            cut(engine, "c", net(Shift(offset.view(1, 16))))
        cut(engine, "d", net(Shift(offset.clone())))  # a copy is fine
        assert engine.tasks() == ["a", "d"]


def test_shared_storage_is_refused_while_the_owner_is_on_a_device() -> None:
    """Two parameter objects over one storage are caught by the storage, also while the
    owner's shards are promoted (copy_on_cpu: the live tensors are copies then, and its
    own memory is the shard's host buffer)."""
    task = make_task(mlp(), "adam")
    originals = {n: p.data for n, p in task.model.named_parameters()}
    # Before training: a sharded model's named_parameters() brings its states home.
    names = {id(p): n for n, p in task.model.named_parameters()}
    with Engine(devices=["cpu"], copy_on_cpu=True, device_memory=24_000) as engine:
        loop = TaskLoop("a", task, engine, seed=0)
        assert len(loop.cut()) >= 3
        loop.train_iteration()
        promoted = [s.store for s in loop.runner.shards if s.store.copied and s.store.params]
        assert promoted, "no shard stayed on its device after training"
        name = names[id(promoted[0].params[0])]
        assert promoted[0].params[0].data_ptr() != originals[name].data_ptr()

        other = mlp(seed=5)
        module, attr = name.rsplit(".", 1)
        setattr(other.get_submodule(module), attr, nn.Parameter(originals[name]))
        refused = TaskLoop("b", make_task(other, "adam"), engine, seed=0)
        with pytest.raises(SharedModelError) as info:
            refused.cut()
        assert info.value.tensors == [(name, name)]
        # a model of its own next to it trains
        own = TaskLoop("c", make_task(mlp(seed=6), "adam"), engine, seed=0)
        assert len(own.start(1).result(timeout=120)) == 1


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


def test_ownership_is_released_by_close_and_kept_by_load_state() -> None:
    model = mlp(seed=2)
    with Engine(devices=["cpu"], device_memory=24_000) as engine:
        a = TaskLoop("a", make_task(model, "sgd"), engine, seed=0)
        a.train_iteration()
        a.load_state(a.state())  # restored in place: still the owner
        with pytest.raises(SharedModelError) as info:
            TaskLoop("b", make_task(model, "sgd"), engine, seed=0)
        assert info.value.owner == "a"
        a.close()
        b = TaskLoop("b", make_task(model, "sgd"), engine, seed=0)
        assert len(b.cut()) >= 3
        assert len(b.start(1).result(timeout=120)) == 1
        with pytest.raises(SharedModelError) as info:  # now b owns it
            TaskLoop("a", make_task(model, "sgd"), engine, seed=0)
        assert info.value.owner == "b" and info.value.task == "a"


def test_the_same_task_under_two_names() -> None:
    task = make_task(mlp(), "adam")
    ref = plain_copy(task)
    with pytest.raises(TrainingError) as info:
        th.train_models({"a": task, "b": task}, devices=["cpu"], epochs=1, seed=0)
    # Each task's loop is built on a thread of its own: either name may claim it first.
    (refused,) = info.value.errors.values()
    assert isinstance(refused, SharedModelError)
    assert {refused.task, refused.owner} == {"a", "b"}
    th.train_plain(ref, 1, seed=0)
    assert_same_model(task.model, ref.model, atol=0.0)


def test_models_of_their_own_are_not_confused() -> None:
    """Deep copies and freshly built models share nothing (no false alarm), with many
    tasks registered and removed in turn (ids and addresses are reused by then)."""
    template = mlp(seed=4)
    with Engine(devices=["cpu"]) as engine:
        for round_ in range(3):
            loops = [
                TaskLoop(f"r{round_}t{i}", make_task(copy.deepcopy(template)), engine, seed=i)
                for i in range(4)
            ]
            for loop in loops:
                loop.cut()
            assert engine.tasks() == [loop.name for loop in loops]
            for loop in loops:
                loop.close()
        assert engine.tasks() == []


def test_concurrent_registrations_of_one_model() -> None:
    """Two loops built at once with one model (the engine actor builds trials' loops
    concurrently): the model is claimed as a loop is built, before its cut's probe, so
    exactly one wins."""
    model = mlp(seed=8)
    start = threading.Barrier(4)
    outcomes: dict[str, object] = {}
    loops: list[TaskLoop] = []  # the winner's, held until the engine closes

    def add(engine: Engine, name: str) -> None:
        start.wait()
        try:
            loop = TaskLoop(name, make_task(model), engine, seed=0)
            loops.append(loop)
            outcomes[name] = loop.cut()
        except SharedModelError as err:
            outcomes[name] = err

    with Engine(devices=["cpu"], device_memory=24_000) as engine:
        threads = [threading.Thread(target=add, args=(engine, f"t{i}")) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [n for n, o in outcomes.items() if isinstance(o, list)]
        assert len(outcomes) == 4 and len(winners) == 1, outcomes
        assert engine.tasks() == winners
        assert all(o.owner in winners for o in outcomes.values() if isinstance(o, SharedModelError))


def test_shared_model_error_survives_pickling() -> None:
    err = SharedModelError("b", "a", [("0.weight", "0.weight"), ("2.bias", "1.bias")])
    back = pickle.loads(pickle.dumps(err))  # it crosses Ray's process boundaries
    assert type(back) is SharedModelError and str(back) == str(err)
    assert back.tensors == err.tensors and back.owner == "a"
