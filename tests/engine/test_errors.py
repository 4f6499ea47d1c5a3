"""Bad input gets a clear TuneHydraError subclass that also is the matching built-in."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, assert_same_model, batches, make_task, mlp, plain_copy
from tune_hydra import exceptions as ex
from tune_hydra.engine import parse_bytes, resolve_devices
from tune_hydra.frontends.task_loop import TaskLoop


def _task(**kw: object) -> th.ModelTask:
    base = dict(
        model=mlp(),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=OPTIMIZERS["sgd"],
        train_data=[(torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 4, (6,)))],
    )
    base.update(kw)
    return th.ModelTask(**base)  # type: ignore[arg-type]


def test_not_a_module() -> None:
    with pytest.raises(ex.InvalidModelError) as info:
        _task(model="not a model")
    assert isinstance(info.value, TypeError) and isinstance(info.value, th.TuneHydraError)
    with pytest.raises(ex.InvalidModelError):
        _task(model=[nn.Linear(2, 2), "x"])


def _refused(tasks: dict[str, th.ModelTask], **kw: Any) -> ex.TrainingError:
    """``train_models`` on ``tasks``: the TrainingError it must raise."""
    with pytest.raises(ex.TrainingError) as info:
        th.train_models(tasks, devices=["cpu"], **kw)
    return info.value


def _refusal(task: th.ModelTask, **kw: Any) -> BaseException:
    """The error a single bad task ``"a"`` is reported with (refused or failed)."""
    err = _refused({"a": task}, **kw)
    assert set(err.errors) == {"a"} and err.history == {"a": []}
    return err.errors["a"]


def test_empty_model() -> None:
    err = _refusal(_task(model=nn.Sequential()))
    assert isinstance(err, ex.InvalidModelError) and "no layers" in str(err)
    assert "task 'a'" in str(err)


def test_a_forward_returning_its_input_says_how_to_fix() -> None:
    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    err = _refusal(_task(model=Net()))
    assert isinstance(err, ex.InvalidModelError) and "nn.Sequential" in str(err)


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-5MiB", "", 0, -1, 1.5, True])
def test_budget_that_does_not_parse(bad: object) -> None:
    with pytest.raises(ex.BudgetFormatError) as info:
        parse_bytes(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_budget_units() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096 and parse_bytes(None) is None


@pytest.mark.parametrize("bad", ["tpu", "cuda:7", "gpu0", []])
def test_unknown_device(bad: object) -> None:
    with pytest.raises(ex.UnknownDeviceError) as info:
        resolve_devices(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_auto_without_gpu_warns_and_uses_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.warns(UserWarning, match="no CUDA"):
        assert resolve_devices("auto") == [torch.device("cpu")]


def test_empty_train_data() -> None:
    err = _refusal(_task(train_data=[]))
    assert isinstance(err, ex.EmptyDataError)
    assert isinstance(err, ValueError) and "train_data" in str(err)


def test_one_shot_iterator_rejected() -> None:
    with pytest.raises(ex.InvalidTaskError, match="re-iterable"):
        _task(train_data=iter([(torch.zeros(1), torch.zeros(1))]))


def test_optimizer_instance_rejected() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ex.InvalidTaskError, match="factory"):
        _task(optimizer=opt)


@pytest.mark.parametrize(
    "kw", [{"epochs": 0}, {"accumulate_steps": 0}, {"precision": "fp8"}, {"max_grad_norm": -1.0}]
)
def test_bad_options(kw: dict) -> None:
    with pytest.raises(ex.InvalidTaskError):
        th.train_models({"a": make_task(mlp())}, devices=["cpu"], **kw)
    # the call's own options: refused before anything trains, naming the option
    with pytest.raises(ex.InvalidOptionError, match=f"train_models: {next(iter(kw))}="):
        th.train_models({"a": make_task(mlp())}, devices=["cpu"], **kw)


def test_unknown_policy_lists_valid_ones() -> None:
    with pytest.raises(ex.UnknownPolicyError, match=r"fifo.*lrtf.*round_robin"):
        th.train_models({"a": make_task(mlp())}, devices=["cpu"], policy="fastest")


def test_policy_returning_foreign_op_fails_clearly_without_hanging() -> None:
    from tune_hydra.core.ops import Op, OpKind
    from tune_hydra.core.policies import BasePolicy, Candidate

    class Rogue(BasePolicy):
        def choose(self, device: int, candidates: list[Candidate]) -> Candidate:
            return Candidate(Op("ghost", OpKind.FORWARD, 0), 1.0, False, 0.0, 0)

    with pytest.raises(ex.TrainingError) as info:
        th.train_models({"a": make_task(mlp())}, devices=["cpu"], policy=Rogue())
    assert isinstance(info.value.errors["a"], ex.ScheduleError)
    assert "not one of the ready operations" in str(info.value.errors["a"])


def test_batch_that_is_not_a_pair() -> None:
    err = _refusal(_task(train_data=[torch.zeros(6, 8)]))
    assert isinstance(err, ex.InvalidTaskError) and "inputs, targets" in str(err)


@pytest.mark.parametrize(
    "err",
    [
        ex.ShardTooLargeError("3", 10, 5, " (state 1 B)"),
        ex.ShardTooLargeError("3", 10, 5, " (state 1 B)", min_device_memory=12),
        ex.NonFiniteLossError("a", 1, 2, float("inf")),
        ex.TaskFailedError("a", "KeyError: 'x'"),
        ex.TrainingError({"a": ValueError("x")}, {"a": [], "b": [{"loss": 1.0}]}),
        ex.SharedModelError("b", "a", [("0.weight", "1.weight")]),
        ex.InvalidOptionError("seed", "x", "give an int", "task 'a'"),
        ex.InvalidOptionError("seed", lambda: 0, "give an int"),  # a value that won't pickle
        ex.InvalidOptimizerError("a", "the optimizer factory returned None"),
        ex.DataMismatchError("a", "layer '0' raised"),
        ex.InvalidLossError("a", "loss_fn returned a float"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_survive_pickling(err: Exception) -> None:
    import pickle

    back = pickle.loads(pickle.dumps(err))  # they cross Ray's process boundaries
    assert type(back) is type(err) and str(back) == str(err)
    if isinstance(err, ex.ShardTooLargeError):  # with the budget to give (issue 32)
        assert back.min_device_memory == err.min_device_memory


# -- bad inputs get an error naming the task, the input and the fix (issue 10, item 6) ----


def _regression_data(target_dtype: torch.dtype = torch.float64) -> list[Any]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(6, 8, generator=g, dtype=torch.float64),
            torch.randn(6, 4, generator=g).to(target_dtype),
        )
        for _ in range(2)
    ]


def test_inputs_of_another_dtype_than_the_model() -> None:
    """The first batch is probed when the task is added: the layer is named, and the
    message says which dtype is which (was: mat1 and mat2 must have the same dtype)."""
    err = _refusal(_task(train_data=batches(2, torch.float32)))
    assert isinstance(err, ex.DataMismatchError) and isinstance(err, ValueError)
    text = str(err)
    assert "task 'a'" in text and "layer '0' (Linear(in_features=8" in text
    assert "float32[6, 8]" in text and "first batch of train_data" in text
    assert "The inputs are float32 but the model is float64: convert one of them" in text
    assert isinstance(err.__cause__, RuntimeError)


def test_inputs_of_another_width_than_the_model() -> None:
    data = [(torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 4, (6,)))]
    err = _refusal(_task(train_data=data))
    assert isinstance(err, ex.DataMismatchError)
    assert "layer '0'" in str(err) and "float64[6, 5]" in str(err)
    assert "takes 8 features in the last dimension, the input has 5" in str(err)


def test_a_later_batch_that_does_not_fit() -> None:
    """A batch unlike the probed one fails its task mid-training with the layer, the
    batch and what differs; the good task beside it trains exactly."""
    data = batches(4)
    data[2] = (data[2][0].float(), data[2][1])
    wide = batches(4)
    wide[1] = (torch.randn(6, 5, dtype=torch.float64), wide[1][1])
    good = make_task(mlp(seed=1), "adam")
    ref = plain_copy(good)
    err = _refused(
        {"dtype": _task(train_data=data), "width": _task(train_data=wide), "good": good},
        device_memory=24_000,  # several shards: the first one is named
        epochs=2,
        seed=0,
    )
    assert set(err.errors) == {"dtype", "width"}
    dtype, width = err.errors["dtype"], err.errors["width"]
    assert isinstance(dtype, ex.DataMismatchError) and isinstance(width, ex.DataMismatchError)
    assert "batch 2 of epoch 0 of train_data" in str(dtype) and "layer '0'" in str(dtype)
    assert "it got float32[6, 8]; the batch probed when the task was added: float64[6, 8]" in (
        str(dtype)
    )
    assert "The inputs are float32 but the model is float64" in str(dtype)
    assert "batch 1 of epoch 0" in str(width) and "the input has 5" in str(width)
    want = th.train_plain(ref, 2, seed=0)
    assert [r["loss"] for r in err.history["good"]] == [r["loss"] for r in want]
    assert_same_model(good.model, ref.model, atol=0.0)


def test_eval_data_of_another_dtype() -> None:
    eval_data = [(x.float(), y) for x, y in batches(1, seed=9)]
    err = _refusal(_task(eval_data=eval_data))
    assert isinstance(err, ex.DataMismatchError)
    assert "batch 0 of eval_data" in str(err) and "float32" in str(err)


def test_a_failure_that_is_not_the_data_stays_a_task_failure() -> None:
    """A layer that fails on a batch like the probed one is not blamed on the data."""

    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4, dtype=torch.float64)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls > 2:  # the probe, then one batch: fails on the second batch
                raise KeyError("broken layer")
            return self.lin(x)

    err = _refusal(_task(model=nn.Sequential(Flaky()), train_data=batches(3)))
    assert isinstance(err, ex.TaskFailedError) and isinstance(err.__cause__, KeyError)
    assert "broken layer" in str(err)


def test_a_layer_that_fails_on_the_probe_shows_its_traceback() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("broken layer")

    err = _refusal(_task(model=nn.Sequential(Broken())))
    assert isinstance(err, ex.DataMismatchError)
    assert "layer '0' (Broken(...)) raised KeyError" in str(err)
    assert "fix the layer" in str(err) and "in forward" in str(err)  # the traceback


def test_targets_that_do_not_fit_the_output() -> None:
    data = [(torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 4, (5,)))]
    err = _refusal(_task(train_data=data))
    assert isinstance(err, ex.DataMismatchError)
    assert "loss_fn(output, target) raised ValueError" in str(err)
    assert "float64[6, 4], the target int64[5]: a batch of 5 targets for 6 inputs" in str(err)
    # float32 targets for a float64 output: HuberLoss fails in its backward
    err = _refusal(_task(loss_fn=nn.HuberLoss(), train_data=_regression_data(torch.float32)))
    assert isinstance(err, ex.DataMismatchError)
    assert "the backward of the loss raised RuntimeError" in str(err)
    assert "target.to(torch.float64)" in str(err)


@pytest.mark.parametrize(
    ("loss_fn", "says"),
    [
        (nn.CrossEntropyLoss(reduction="none"), "a tensor of shape [6], not a scalar"),
        (lambda out, y: float(nn.functional.cross_entropy(out, y)), "returned a float"),
        (lambda out, y: nn.functional.cross_entropy(out, y).detach(), "does not require grad"),
    ],
    ids=["per-sample", "float", "detached"],
)
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
def test_a_loss_that_is_not_a_scalar_tensor(loss_fn: Any, says: str) -> None:
    err = _refusal(_task(loss_fn=loss_fn))
    assert isinstance(err, ex.InvalidLossError) and isinstance(err, ValueError)
    assert "task 'a': loss_fn returned" in str(err) and says in str(err)
    assert "batch 0 of epoch 0 of train_data" in str(err)


def test_a_learning_rate_given_as_a_string() -> None:
    err = _refusal(_task(optimizer=lambda p: torch.optim.SGD(p, lr="0.1")))
    assert isinstance(err, ex.InvalidOptimizerError)
    assert isinstance(err, TypeError) and isinstance(err, ValueError)
    assert "the optimizer factory raised TypeError" in str(err)
    assert "lr=float(config['lr'])" in str(err)


@pytest.mark.parametrize(
    ("factory", "says"), [(lambda p: None, "returned None"), (lambda p: object(), "type object")]
)
def test_an_optimizer_factory_that_returns_no_optimizer(factory: Any, says: str) -> None:
    err = _refusal(_task(optimizer=factory))
    assert isinstance(err, ex.InvalidOptimizerError)
    assert says in str(err) and "not a torch.optim.Optimizer" in str(err)


def test_an_optimizer_factory_that_fails_on_the_models_parameters() -> None:
    """The factory is called once, with every trainable parameter of the model, as plain
    PyTorch calls it (the optimizer is sharded afterwards): its error names that call."""

    def picky(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if len(params) > 1:
            raise RuntimeError("only one tensor please")
        return torch.optim.SGD(params, lr=0.1)

    err = _refusal(_task(optimizer=picky))
    assert isinstance(err, ex.InvalidOptimizerError)
    assert "raised RuntimeError: only one tensor please when called with the model's " in str(err)


def test_a_bad_seed() -> None:
    err = _refusal(_task(seed="x"))
    assert isinstance(err, ex.InvalidOptionError) and err.option == "ModelTask.seed"
    assert str(err).startswith("task 'a': ModelTask.seed='x' is not valid: give an int")
    with pytest.raises(ex.InvalidOptionError, match=r"train_models: seed='x'"):
        th.train_models({"a": _task()}, devices=["cpu"], seed="x")
    with pytest.raises(ex.InvalidOptionError, match=r"seed='7'.*seed=int\('7'\)"):
        th.train_models({"a": _task()}, devices=["cpu"], seed="7")
    with th.Engine(devices=["cpu"]) as engine:
        with pytest.raises(ex.InvalidOptionError, match=r"task 'b': seed=1.5"):
            TaskLoop("b", _task(), engine, seed=1.5)  # type: ignore[arg-type]
        assert engine.tasks() == []
        import numpy as np

        loop = TaskLoop("c", _task(), engine, seed=np.int64(3))  # type: ignore[arg-type]
        assert loop.seed == 3


def test_max_grad_norm_given_as_a_string() -> None:
    # (a TaskLoop given one: test_bad_task_options_on_a_task_loop)
    with pytest.raises(ex.InvalidOptionError, match=r"max_grad_norm='1.0'.*float\('1.0'\)"):
        th.train_models({"a": _task()}, devices=["cpu"], max_grad_norm="1.0")


@pytest.mark.parametrize("bad", [-1, 0, "3", 2.0])
def test_max_layers_per_shard(bad: Any) -> None:
    """Was: -1 killed the dispatcher (max() of no candidates in lrtf.py)."""
    with pytest.raises(ex.InvalidOptionError, match="train_models: max_layers_per_shard"):
        th.train_models({"a": _task()}, devices=["cpu"], max_layers_per_shard=bad)
    with pytest.raises(ex.InvalidOptionError, match="Engine: max_layers_per_shard"):
        th.Engine(devices=["cpu"], max_layers_per_shard=bad)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "parameter-free"])
def test_a_model_with_nothing_to_train(frozen: bool) -> None:
    model = mlp().requires_grad_(False) if frozen else nn.Sequential(nn.ReLU(), nn.Tanh())
    err = _refusal(_task(model=model, loss_fn=lambda out, y: out.sum()))
    assert isinstance(err, ex.InvalidModelError) and "task 'a'" in str(err)
    says = "requires_grad=False" if frozen else "it has no parameters"
    assert says in str(err) and "nothing to train" in str(err)


@pytest.mark.parametrize(
    "kw",
    [
        {"precision": "fp8"},
        {"accumulate_steps": 0},
        {"accumulate_steps": 1.5},
        {"iteration_batches": 0},
        {"max_grad_norm": "1.0"},
    ],
)
def test_bad_task_options_on_a_task_loop(kw: dict[str, Any]) -> None:
    option, value = next(iter(kw.items()))
    with th.Engine(devices=["cpu"]) as engine:
        with pytest.raises(ex.InvalidOptionError) as info:
            TaskLoop("a", _task(), engine, **kw)
        assert info.value.option == option and info.value.value == value
        assert str(info.value).startswith(f"task 'a': {option}={value!r} is not valid")
        assert engine.tasks() == []


def test_one_bad_task_does_not_stop_the_good_one() -> None:
    """Every task refused at registration is reported, with an empty history; the good
    one trains, exactly as plain training."""
    good = make_task(mlp(seed=1), "adam")
    ref = plain_copy(good)
    tasks = {
        "bad_dtype": _task(train_data=batches(2, torch.float32)),
        "good": good,
        "bad_optimizer": _task(optimizer=lambda p: None),
        "not_a_task": "a string",
    }
    err = _refused(tasks, epochs=2, seed=0)  # type: ignore[arg-type]
    assert list(err.history) == list(tasks)
    assert set(err.errors) == {"bad_dtype", "bad_optimizer", "not_a_task"}
    assert isinstance(err.errors["bad_dtype"], ex.DataMismatchError)
    assert isinstance(err.errors["bad_optimizer"], ex.InvalidOptimizerError)
    assert isinstance(err.errors["not_a_task"], ex.InvalidTaskError)
    assert all(err.history[name] == [] for name in err.errors)
    want = th.train_plain(ref, 2, seed=0)
    assert len(err.history["good"]) == 2
    assert [r["loss"] for r in err.history["good"]] == [r["loss"] for r in want]
    assert [r["val_loss"] for r in err.history["good"]] == [r["val_loss"] for r in want]
    assert_same_model(good.model, ref.model, atol=0.0)


def test_plan_shards_refuses_a_bad_max_layers_per_shard() -> None:
    from tune_hydra.engine.registration.partition import layer_costs, plan_shards
    from tune_hydra.engine.task import model_layers

    costs = layer_costs(model_layers(mlp()), OPTIMIZERS["sgd"], batches(1)[0][0])
    assert len(plan_shards(costs, None, max_layers_per_shard=4)) == 3
    with pytest.raises(ex.InvalidOptionError, match="max_layers_per_shard=-1"):
        plan_shards(costs, None, max_layers_per_shard=-1)
