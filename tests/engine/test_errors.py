"""Bad input gets a clear TuneHydraError subclass that also is the matching built-in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, make_task, mlp
from tune_hydra import exceptions as ex
from tune_hydra.engine import parse_bytes, resolve_devices


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


def test_empty_model() -> None:
    with pytest.raises(ex.InvalidModelError, match="no layers"):
        th.train_models({"a": _task(model=nn.Sequential())}, devices=["cpu"])


def test_non_sequential_module_says_how_to_fix() -> None:
    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ex.InvalidModelError, match=r"nn\.Sequential"):
        th.train_models({"a": _task(model=Net())}, devices=["cpu"])


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
    with pytest.raises(ex.EmptyDataError) as info:
        th.train_models({"a": _task(train_data=[])}, devices=["cpu"])
    assert isinstance(info.value, ValueError) and "train_data" in str(info.value)


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


def test_unknown_policy_lists_valid_ones() -> None:
    with pytest.raises(ex.UnknownPolicyError, match=r"fifo.*lrtf.*round_robin"):
        th.train_models({"a": make_task(mlp())}, devices=["cpu"], policy="fastest")


def test_policy_returning_foreign_op_fails_clearly_without_hanging() -> None:
    from tune_hydra.engine.ops import Op, OpKind
    from tune_hydra.engine.policies import BasePolicy, Candidate

    class Rogue(BasePolicy):
        def choose(self, device: int, candidates: list[Candidate]) -> Candidate:
            return Candidate(Op("ghost", OpKind.FORWARD, 0), 1.0, False, 0.0, 0)

    with pytest.raises(ex.TrainingError) as info:
        th.train_models({"a": make_task(mlp())}, devices=["cpu"], policy=Rogue())
    assert isinstance(info.value.errors["a"], ex.ScheduleError)
    assert "not one of the ready operations" in str(info.value.errors["a"])


def test_batch_that_is_not_a_pair() -> None:
    task = _task(train_data=[torch.zeros(6, 8)])
    with pytest.raises((ex.InvalidTaskError, ex.TrainingError), match="inputs, targets"):
        th.train_models({"a": task}, devices=["cpu"])


@pytest.mark.parametrize(
    "err",
    [
        ex.ShardTooLargeError("3", 10, 5, " (state 1 B)"),
        ex.NonFiniteLossError("a", 1, 2, float("inf")),
        ex.TaskFailedError("a", "KeyError: 'x'"),
        ex.TrainingError({"a": ValueError("x")}, {"a": [], "b": [{"loss": 1.0}]}),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_survive_pickling(err: Exception) -> None:
    import pickle

    back = pickle.loads(pickle.dumps(err))  # they cross Ray's process boundaries
    assert type(back) is type(err) and str(back) == str(err)
