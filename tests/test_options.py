"""The option dataclasses: checked at construction, with the check functions' errors, and
frozen."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tune_hydra.core.policies import FIFOPolicy
from tune_hydra.exceptions import InvalidOptionError
from tune_hydra.options import EngineOptions, TrainOptions, check_task_options


def test_train_options_normalize() -> None:
    opts = TrainOptions(np.int64(3), 1, 2, "float32")  # type: ignore[arg-type]
    assert opts == TrainOptions(3, 1.0, 2, None, None, False)
    assert type(opts.seed) is int and type(opts.max_grad_norm) is float


@pytest.mark.parametrize(
    "kw",
    [
        {"seed": "3"},
        {"max_grad_norm": 0},
        {"accumulate_steps": 0},
        {"precision": "fp8"},
        {"iteration_batches": 1.5},
    ],
)
def test_train_options_refuse_as_the_checks_do(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidOptionError) as expected:
        check_task_options(**kw, where="task 'a'")
    with pytest.raises(InvalidOptionError) as got:
        TrainOptions(**{"seed": 0, **kw}, where="task 'a'")
    assert str(got.value) == str(expected.value)


def test_train_options_need_a_resolved_seed() -> None:
    with pytest.raises(InvalidOptionError, match="seed=None is not valid"):
        TrainOptions(seed=None)  # type: ignore[arg-type]


def test_options_are_frozen_and_replace_checks_again() -> None:
    opts = TrainOptions(seed=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 2  # type: ignore[misc]
    assert dataclasses.replace(opts, precision="fp32").precision is None
    with pytest.raises(InvalidOptionError):
        dataclasses.replace(opts, accumulate_steps=-1)


def test_engine_options() -> None:
    policy = FIFOPolicy()
    kwargs = EngineOptions(devices="cpu", policy=policy, max_layers_per_shard=2).kwargs()
    assert kwargs["policy"] is policy  # passed as itself, not copied
    assert set(kwargs) == {
        "devices",
        "device_memory",
        "policy",
        "prefetch",
        "recompute",
        "copy_on_cpu",
        "max_layers_per_shard",
    }
    with pytest.raises(InvalidOptionError) as info:
        EngineOptions(max_layers_per_shard=0, where="train_models")
    assert str(info.value).startswith("train_models: max_layers_per_shard=0 is not valid")
