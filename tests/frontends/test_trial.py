"""A trial's model in the shared engine process (``tune_hydra.frontends.trial``): nothing a
trial trains outlives it. Tensors held outside the model (``with_parameters`` data, a
closure, a module global) are trained as copies; modules and parameters another trial
trained are refused, across ``th.optimize`` calls too. None of these tests starts Ray."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import batches, mlp
from tune_hydra.engine import Engine
from tune_hydra.exceptions import ReusedModelError, SharedModelError
from tune_hydra.frontends.trial import TrialClaims, own_storage

optuna = pytest.importorskip("optuna")
F64 = torch.float64
pytestmark = pytest.mark.usefixtures("quiet_optuna")


# ---------------------------------------------------------------- own_storage


def test_a_parameter_around_an_outside_tensor_gets_its_own_storage() -> None:
    weights = torch.randn(10, 4, dtype=F64)
    before = weights.clone()
    emb = nn.Embedding.from_pretrained(weights, freeze=False)
    assert emb.weight.data_ptr() == weights.data_ptr()  # torch shares it
    param = emb.weight
    assert own_storage(emb) == ["weight"]
    assert emb.weight is param  # the same Parameter object, a new storage
    assert emb.weight.data_ptr() != weights.data_ptr()
    assert torch.equal(emb.weight, before)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    assert torch.equal(weights, before)  # the outside tensor is untouched
    assert not torch.equal(emb.weight, before)


def test_a_model_built_afresh_is_not_copied() -> None:
    model = mlp()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert own_storage(model) == []
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_frozen_parameters_stay_shared_and_buffers_are_copied() -> None:
    frozen = torch.randn(4, 4, dtype=F64)
    stats = torch.zeros(4, dtype=F64)  # e.g. running statistics given from outside
    model = nn.Linear(4, 4, dtype=F64)
    model.weight = nn.Parameter(frozen, requires_grad=False)
    # a view of an outside tensor (the outside tensor object itself, registered as is,
    # is one object: the claims refuse it to a second trial, see below)
    model.register_buffer("stats", stats.view(4))
    assert own_storage(model) == ["stats"]
    assert model.weight.data_ptr() == frozen.data_ptr()
    assert model.stats.data_ptr() != stats.data_ptr()


def test_tied_and_aliased_tensors_stay_tied() -> None:
    """One Parameter used by two modules (GPT-2's tied embedding), and two parameters
    viewing one outside storage: after the copy they still share, among themselves."""
    outside = torch.randn(2, 6, dtype=F64)
    a, b = nn.Linear(6, 1, bias=False, dtype=F64), nn.Linear(6, 1, bias=False, dtype=F64)
    a.weight = nn.Parameter(outside[0:1])
    b.weight = nn.Parameter(outside[1:2])
    tied = nn.Linear(6, 6, dtype=F64)
    model = nn.ModuleDict({"a": a, "b": b, "enc": tied, "dec": nn.Linear(6, 6, dtype=F64)})
    model["dec"].weight = tied.weight
    copied = own_storage(model)
    assert sorted(copied) == ["a.weight", "b.weight"]
    assert a.weight.untyped_storage().data_ptr() == b.weight.untyped_storage().data_ptr()
    assert a.weight.untyped_storage().data_ptr() != outside.untyped_storage().data_ptr()
    assert model["dec"].weight is model["enc"].weight
    with torch.no_grad():
        a.weight.add_(1.0)
    assert torch.equal(a.weight, outside[0:1] + 1.0)  # a view of the new storage
    assert torch.equal(b.weight, outside[1:2])


# ---------------------------------------------------------------- claims


class _Run:
    """Stands for a front end's run (an engine actor, a th.optimize call)."""

    def __init__(self) -> None:
        self.live: set[str] = set()

    def trains(self, key: str) -> bool:
        return key in self.live


def test_claims_refuse_an_ended_trials_modules_and_parameters() -> None:
    claims = TrialClaims()
    first, second = _Run(), _Run()
    model = mlp()
    claims.check(model, first, "t1", _Run.trains)
    claims.record(model, first, "t1", _Run.trains)
    first.live.add("t1")
    claims.check(model, first, "t1", _Run.trains)  # the same trial: fine
    with pytest.raises(SharedModelError):  # live: another trial trains it now
        claims.check(model, second, "t1", _Run.trains)
    first.live.clear()
    with pytest.raises(ReusedModelError) as info:
        claims.check(model, second, "t9", _Run.trains)
    assert info.value.owner == "t1" and ("", "") in info.value.tensors
    # one module-level parameter in a fresh module
    fresh = mlp()
    fresh[0].weight = model[0].weight
    with pytest.raises(ReusedModelError) as info:
        claims.check(fresh, second, "t9", _Run.trains)
    assert info.value.tensors == [("0.weight", "")]
    # one module-level buffer tensor (BatchNorm's running mean) in a fresh module
    fresh = mlp()
    fresh[3].running_mean = model[3].running_mean
    with pytest.raises(ReusedModelError) as info:
        claims.check(fresh, second, "t9", _Run.trains)
    assert info.value.tensors == [("3.running_mean", "")]
    del first  # a run that is gone trains nothing
    with pytest.raises(ReusedModelError):
        claims.check(model, second, "t9", _Run.trains)


# ---------------------------------------------------------------- th.optimize


def _values(study: Any) -> list[Any]:
    return [t.value for t in study.trials]


def test_a_module_global_wrapped_in_a_fresh_parameter_is_never_trained() -> None:
    """``nn.Parameter(W)`` around a module-level ``W`` in every trial: each trial starts
    from W's values when the study began, exactly as a fresh process would (before: W was
    trained in place, 8.30 -> 8.89 -> -4.8e7 over three trials)."""
    torch.manual_seed(0)
    W = torch.randn(16, 8, dtype=F64)  # stands for a module global
    start = W.clone()
    data = batches(3)

    def make_task(trial: Any) -> th.ModelTask:
        trial.suggest_float("lr", 0.5, 0.5)
        torch.manual_seed(1)
        first = nn.Linear(8, 16, dtype=F64)
        first.weight = nn.Parameter(W)
        model = nn.Sequential(first, nn.ReLU(), nn.Linear(16, 4, dtype=F64))
        return th.ModelTask(
            model, nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.5), data
        )

    study = optuna.create_study()
    th.optimize(
        study, make_task, n_trials=3, epochs=2, devices=["cpu"], max_concurrent=1, metric="loss"
    )
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert torch.equal(W, start)
    values = _values(study)
    assert values[0] == values[1] == values[2]
    # and each equals plain training of the same model, built from W's first values
    torch.manual_seed(1)
    first = nn.Linear(8, 16, dtype=F64)
    first.weight = nn.Parameter(start.clone())
    ref = th.ModelTask(
        nn.Sequential(first, nn.ReLU(), nn.Linear(16, 4, dtype=F64)),
        nn.CrossEntropyLoss(),
        lambda p: torch.optim.SGD(p, lr=0.5),
        data,
    )
    plain = th.train_plain(ref, 2, seed=0)  # no random op: any seed
    assert plain[-1]["loss"] == values[0]


@pytest.mark.parametrize("shared_engine", [False, True])
def test_a_module_level_model_in_two_optimize_calls_is_refused(shared_engine: bool) -> None:
    """The second ``th.optimize`` call's trials would start from the first call's weights
    (before: COMPLETE, silently); they fail with ReusedModelError instead."""
    shared = mlp()
    trained: dict[str, torch.Tensor] = {}

    def make_task(trial: Any) -> th.ModelTask:
        trial.suggest_float("lr", 1e-2, 1e-2)
        return th.ModelTask(
            shared, nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.01), batches(2)
        )

    engine = Engine(devices=["cpu"]) if shared_engine else None
    try:
        kwargs: dict[str, Any] = {"engine": engine} if shared_engine else {"devices": ["cpu"]}
        first = optuna.create_study()
        th.optimize(first, make_task, n_trials=1, max_concurrent=1, metric="loss", **kwargs)
        assert first.trials[0].state.name == "COMPLETE"
        trained = copy.deepcopy(shared.state_dict())
        second = optuna.create_study()
        th.optimize(second, make_task, n_trials=2, max_concurrent=1, metric="loss", **kwargs)
    finally:
        if engine is not None:
            engine.close()
    assert [t.state.name for t in second.trials] == ["FAIL", "FAIL"]
    error = second.trials[0].user_attrs["error"]
    assert error.startswith("ReusedModelError") and "build the model inside" in error
    assert all(torch.equal(v, trained[k]) for k, v in shared.state_dict().items())
