"""The option dataclasses: checked at construction, with the check functions' errors, and
frozen."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tune_hydra.core.policies import FIFOPolicy
from tune_hydra.exceptions import InvalidOptionError, SpillDirError, TuneHydraError
from tune_hydra.options import EngineOptions, TrainOptions, check_spill, check_task_options


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
        "host_memory",
        "spill_dir",
    }
    with pytest.raises(InvalidOptionError) as info:
        EngineOptions(max_layers_per_shard=0, where="train_models")
    assert str(info.value).startswith("train_models: max_layers_per_shard=0 is not valid")


def test_engine_options_carry_the_disk_tier(tmp_path: Path) -> None:
    kwargs = EngineOptions(devices="cpu", host_memory="1GiB", spill_dir=tmp_path).kwargs()
    assert kwargs["host_memory"] == "1GiB" and kwargs["spill_dir"] == tmp_path
    plain = EngineOptions(devices="cpu").kwargs()
    assert plain["host_memory"] is None and plain["spill_dir"] is None
    # spill_dir alone is accepted (and unused): no budget, nothing goes to disk.
    assert EngineOptions(spill_dir=str(tmp_path)).kwargs()["spill_dir"] == str(tmp_path)
    with pytest.raises(SpillDirError, match=r"^train_models: host_memory='1GiB' needs spill_dir="):
        EngineOptions(host_memory="1GiB", where="train_models")
    with pytest.raises(SpillDirError):  # replace checks again
        dataclasses.replace(EngineOptions(host_memory=1 << 30, spill_dir=tmp_path), spill_dir=None)


def test_check_spill(tmp_path: Path) -> None:
    check_spill(None, None)
    check_spill(None, tmp_path)
    check_spill("8GiB", str(tmp_path))
    check_spill(4096, tmp_path)
    with pytest.raises(SpillDirError) as info:
        check_spill("8GiB", None, where="HydraExecutor")
    err = info.value
    assert isinstance(err, TuneHydraError) and isinstance(err, OSError)
    assert str(err).startswith("HydraExecutor: host_memory='8GiB' needs spill_dir=")
    assert "NVMe" in str(err) and "tmpfs" in str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # Ray ships it to the driver
    with pytest.raises(SpillDirError, match=r"^host_memory=1 needs"):
        check_spill(1, None)  # no ``where``: no prefix


@pytest.mark.parametrize("bad", [3, b"/tmp", ["/tmp"], True])
def test_check_spill_refuses_a_spill_dir_that_is_not_a_path(bad: object) -> None:
    with pytest.raises(InvalidOptionError) as info:
        check_spill("1GiB", bad, where="optimize")
    err = info.value
    assert err.option == "spill_dir" and err.value is bad and err.where == "optimize"
    assert "give a folder path" in str(err)
    with pytest.raises(InvalidOptionError):
        EngineOptions(spill_dir=bad)  # type: ignore[arg-type]


def _front_end_without_spill_dir(front_end: str) -> None:
    """Call ``front_end`` with ``host_memory`` and no ``spill_dir`` (nothing trains)."""
    import torch
    from torch import nn

    import tune_hydra as th

    task = th.ModelTask(nn.Linear(2, 1), nn.MSELoss(), torch.optim.SGD, [(torch.ones(1, 2),) * 2])
    if front_end == "Engine":
        th.Engine(devices="cpu", host_memory="1MiB")
    elif front_end == "train_models":
        th.train_models({"a": task}, devices="cpu", host_memory="1MiB")
    elif front_end == "optimize":
        optuna = pytest.importorskip("optuna")
        th.optimize(optuna.create_study(), lambda trial: task, 1, devices="cpu", host_memory=1)
    else:
        pytest.importorskip("ray")
        from tune_hydra.frontends.ray.executor import HydraExecutor

        HydraExecutor(devices="cpu", host_memory="1MiB")  # does not start Ray


@pytest.mark.parametrize("front_end", ["Engine", "train_models", "optimize", "HydraExecutor"])
def test_every_front_end_refuses_host_memory_without_spill_dir(front_end: str) -> None:
    """One rule where the user gives the options: before anything trains or starts."""
    with pytest.raises(SpillDirError, match=rf"^{front_end}: host_memory=.* needs spill_dir="):
        _front_end_without_spill_dir(front_end)
