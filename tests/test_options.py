"""The option dataclasses: checked at construction, with the check functions' errors, and
frozen."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tune_hydra.core.policies import FIFOPolicy
from tune_hydra.exceptions import (
    BudgetFormatError,
    InvalidOptionError,
    SpillDirError,
    TuneHydraError,
    UnknownDeviceError,
    UnknownPolicyError,
)
from tune_hydra.options import (
    ENGINE_OPTIONS,
    NOT_OFFERED,
    TASK_OPTIONS,
    EngineOptions,
    TrainOptions,
    check_spill,
    check_task_options,
)


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
        "trace_window",
        "share_frozen",
        "batch_shared",
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


# -- one validator per option, the same judgement in every front end ---------------------

FRONT_ENDS = ("Engine", "train_models", "optimize", "HydraExecutor")
_WHERE = re.compile(r"^(Engine|train_models|optimize|HydraExecutor|task 'a'): ")


def _offers(front_end: str) -> set[str]:
    """The engine, task and other options ``front_end`` takes (the engine options it is
    offered, as its **options take them, and its signature; Engine's per-task options
    are those of the ``TaskLoop`` that trains a task on it; th.optimize's train_opts)."""
    from tune_hydra.options import offered

    if front_end == "optimize":
        from tune_hydra.frontends import optuna as th_optuna

        return {
            "devices",
            "device_memory",
            *th_optuna.ENGINE_OPTIONS,
            *th_optuna.TASK_OPTIONS,
            *th_optuna.OTHER_OPTIONS,
        }
    if front_end == "Engine":
        from tune_hydra.engine import Engine
        from tune_hydra.frontends.task_loop import TaskLoop

        return {
            *offered("Engine"),
            *inspect.signature(Engine).parameters,
            *inspect.signature(TaskLoop.__init__).parameters,
        }
    if front_end == "train_models":
        from tune_hydra.frontends.train import train_models

        return {*offered("train_models"), *inspect.signature(train_models).parameters}
    pytest.importorskip("ray")
    from tune_hydra.frontends.ray.executor import HydraExecutor

    return {*offered("HydraExecutor"), *inspect.signature(HydraExecutor).parameters}


def _call(front_end: str, options: dict[str, Any]) -> None:
    """Give ``front_end`` ``options`` (on one CPU device unless they say otherwise); a
    call that accepts them trains one tiny task (Engine: cuts one, a TaskLoop's; for
    HydraExecutor, starts nothing)."""
    import torch
    from torch import nn

    import tune_hydra as th
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.task_loop import TaskLoop

    task = th.ModelTask(nn.Linear(2, 1), nn.MSELoss(), torch.optim.SGD, [(torch.ones(1, 2),) * 2])
    kw = {"devices": "cpu", **options}
    if front_end == "Engine":
        add = {k: kw.pop(k) for k in TASK_OPTIONS if k in kw}
        with Engine(**kw) as engine:
            # A bad task option is refused when the loop is built: before any cut or training.
            loop = TaskLoop("a", task, engine, **add)
            loop.cut()
            loop.close()
    elif front_end == "train_models":
        th.train_models({"a": task}, **kw)
    elif front_end == "optimize":
        optuna = pytest.importorskip("optuna")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        th.optimize(optuna.create_study(), lambda trial: task, 1, **kw)
    else:
        from tune_hydra.frontends.ray.executor import HydraExecutor

        HydraExecutor(**kw)


# Each bad value of each option, and what refuses it (the one validator's error class).
BAD_OPTIONS: list[tuple[dict[str, Any], type[BaseException]]] = [
    ({"devices": "tpu"}, UnknownDeviceError),
    ({"devices": []}, UnknownDeviceError),
    ({"devices": ["cpu", "gpu0"]}, UnknownDeviceError),
    ({"device_memory": "lots"}, BudgetFormatError),
    ({"device_memory": 0}, BudgetFormatError),
    ({"device_memory": True}, BudgetFormatError),
    ({"policy": "fastest"}, UnknownPolicyError),
    ({"prefetch": "no"}, InvalidOptionError),
    ({"recompute": "yes"}, InvalidOptionError),
    ({"copy_on_cpu": 1}, InvalidOptionError),
    ({"max_layers_per_shard": 0}, InvalidOptionError),
    ({"host_memory": "lots", "spill_dir": "TMP"}, BudgetFormatError),
    ({"host_memory": -1, "spill_dir": "TMP"}, BudgetFormatError),
    ({"host_memory": "1GiB"}, SpillDirError),
    ({"host_memory": "1GiB", "spill_dir": 7}, InvalidOptionError),
    ({"trace_window": 0}, InvalidOptionError),
    ({"seed": "3"}, InvalidOptionError),
    ({"max_grad_norm": 0}, InvalidOptionError),
    ({"accumulate_steps": 0}, InvalidOptionError),
    ({"precision": "fp8"}, InvalidOptionError),
    ({"iteration_batches": 0}, InvalidOptionError),
    ({"factory_timeout_s": 0}, InvalidOptionError),
    ({"factory_timeout_s": -1}, InvalidOptionError),
    ({"factory_timeout_s": "60"}, InvalidOptionError),
    ({"factory_timeout_s": True}, InvalidOptionError),
    ({"factory_timeout_s": float("nan")}, InvalidOptionError),
]


@pytest.mark.parametrize(("options", "error"), BAD_OPTIONS, ids=[repr(o) for o, _ in BAD_OPTIONS])
def test_every_front_end_judges_each_option_the_same(
    options: dict[str, Any], error: type[BaseException], tmp_path: Path
) -> None:
    """The contract of tune_hydra.options: a bad option is refused by every front end
    that takes it, before anything trains or starts, with the same error class and the
    same message (but for the prefix that says who got it)."""
    options = {k: tmp_path if v == "TMP" else v for k, v in options.items()}
    seen: dict[str, tuple[type[BaseException], str]] = {}
    for front_end in FRONT_ENDS:
        if not set(options) <= _offers(front_end):
            continue
        with pytest.raises(error) as info:
            _call(front_end, options)
        err = info.value
        if isinstance(err, InvalidOptionError):
            assert err.where in (front_end, "task 'a'")
            assert str(err).startswith(f"{err.where}: {err.option}=")
        seen[front_end] = (type(err), _WHERE.sub("", str(err)))
    assert seen, f"no front end takes {sorted(options)}"
    assert len(set(seen.values())) == 1, seen


def test_optimize_refuses_factory_timeout_0_as_the_executor_does() -> None:
    """factory_timeout_s=0 was refused by HydraExecutor but accepted by th.optimize."""
    pytest.importorskip("ray")
    optuna = pytest.importorskip("optuna")
    import tune_hydra as th
    from tune_hydra.frontends.ray.executor import HydraExecutor

    with pytest.raises(InvalidOptionError) as executor:
        HydraExecutor(devices="cpu", factory_timeout_s=0)
    study = optuna.create_study()
    with pytest.raises(InvalidOptionError) as optimize:
        th.optimize(study, lambda trial: None, 1, devices="cpu", factory_timeout_s=0)
    assert str(executor.value) == "HydraExecutor: " + str(optimize.value)[len("optimize: ") :]
    assert optimize.value.expected == executor.value.expected
    assert "seconds > 0" in optimize.value.expected
    assert study.trials == []


def test_constructing_a_hydra_executor_imports_no_torch(tmp_path: Path) -> None:
    """HydraExecutor runs in the Ray driver: checking its options (budgets, devices,
    policy ...) loads neither torch nor the engine, nor starts Ray."""
    pytest.importorskip("ray")
    code = textwrap.dedent(
        f"""
        import sys
        from tune_hydra.exceptions import BudgetFormatError, UnknownDeviceError
        from tune_hydra.frontends.ray.executor import HydraExecutor
        ex = HydraExecutor(devices=["cuda:0"], device_memory="40GiB", host_memory="1GiB",
                           spill_dir={str(tmp_path)!r}, policy="fifo", seed=1,
                           factory_timeout_s=5, precision="bf16")
        assert ex.engine_options.device_bytes == 40 * 2**30, ex.engine_options
        for bad in ({{"device_memory": "lots"}}, {{"devices": "tpu"}}):
            try:
                HydraExecutor(**bad)
            except (BudgetFormatError, UnknownDeviceError):
                pass
            else:
                raise AssertionError(bad)
        import ray
        assert not ray.is_initialized()
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(
            ("torch.", "tune_hydra.engine")))
        assert not loaded, loaded
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_front_ends_forward_every_option_or_say_why_not(front_end: str) -> None:
    """Each engine and task option is taken by each front end, with the default of the
    one declaration (EngineOptions, check_task_options), or named in NOT_OFFERED with
    the reason; nothing else is declared twice."""
    offers = _offers(front_end)
    not_offered = NOT_OFFERED.get(front_end, {})
    assert all(reason for reason in not_offered.values())
    for name in (*ENGINE_OPTIONS, *TASK_OPTIONS):
        assert (name in offers) != (name in not_offered), (front_end, name)
    if front_end == "optimize":
        return  # its engine and task options are **train_opts: the defaults are the ones
    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineOptions) if f.init}
    task_defaults = {
        k: p.default for k, p in inspect.signature(check_task_options).parameters.items()
    }
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.train import train_models

    if front_end == "HydraExecutor":
        from tune_hydra.frontends.ray.executor import HydraExecutor

        fn: Any = HydraExecutor
    else:
        fn = Engine if front_end == "Engine" else train_models
    params = dict(inspect.signature(fn).parameters)
    if front_end == "Engine":
        from tune_hydra.frontends.task_loop import TaskLoop

        params.update(inspect.signature(TaskLoop.__init__).parameters)
    for name, default in {**engine_defaults, **task_defaults}.items():
        if name in params:
            assert params[name].default == default, (front_end, name)


@pytest.mark.parametrize("front_end", [*FRONT_ENDS, "configure"])
def test_every_entry_point_names_the_closest_option_for_a_typo(front_end: str) -> None:
    """#30: a misspelt option raises UnknownOptionError naming the closest valid one at
    every entry point (not Python's bare TypeError), before anything trains or starts;
    an engine option the entry point does not take says why (NOT_OFFERED)."""
    from tune_hydra.exceptions import UnknownOptionError

    if front_end == "configure":
        import tune_hydra as th

        with pytest.raises(UnknownOptionError, match=r"'polcy' \(did you mean 'policy'\?\)"):
            th.configure(polcy="fifo")
        return
    with pytest.raises(UnknownOptionError, match=r"'polcy' \(did you mean 'policy'\?\)"):
        _call(front_end, {"polcy": "fifo"})
    for name, reason in NOT_OFFERED.get(front_end, {}).items():
        with pytest.raises(UnknownOptionError, match="does not take") as info:
            _call(front_end, {name: None})
        assert reason in str(info.value)


def test_engine_takes_its_options_whole() -> None:
    """Engine(options=EngineOptions(...)): the front ends hand their checked options down
    as they are; the keywords build the same; both at once are refused."""
    from tune_hydra.engine import Engine

    opts = EngineOptions(devices="cpu", device_memory="1MiB", where="train_models")
    with Engine(options=opts) as engine:
        assert engine.options is opts and engine.budget == 1 << 20
    with Engine(devices="cpu", device_memory="1MiB") as engine:
        assert engine.options == opts and engine.budget == 1 << 20
    with pytest.raises(InvalidOptionError, match="leave out device_memory when passing options="):
        Engine(device_memory="2MiB", options=opts)
    with pytest.raises(InvalidOptionError, match="options="):
        Engine(options={"devices": "cpu"})  # type: ignore[arg-type]


def test_parse_bytes_is_torch_free_and_the_engine_s() -> None:
    from tune_hydra.engine import units
    from tune_hydra.options import parse_bytes

    assert units.parse_bytes is parse_bytes
    assert (
        EngineOptions(device_memory="1.5KiB", host_memory=10, spill_dir="/x").device_bytes == 1536
    )
    assert EngineOptions(host_memory="2KB", spill_dir="/x").host_bytes == 2000
    assert dataclasses.replace(EngineOptions(), device_memory=7).device_bytes == 7


@pytest.mark.parametrize("name", ["auto", "lrtf", "fifo", "round_robin", "milestone"])
def test_every_policy_name_and_auto_are_accepted_as_given(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="tune_hydra"):
        assert EngineOptions(devices="cpu", policy=name).policy == name
    assert not caplog.records, "checking 'auto' does not resolve it (resolving logs the choice)"


@pytest.mark.parametrize("bad", ["AUTO", "auto ", "milestones", 0])
def test_bad_policy_names_list_auto(bad: object) -> None:
    with pytest.raises(UnknownPolicyError) as info:
        EngineOptions(devices="cpu", policy=bad)  # type: ignore[arg-type]
    assert "'auto'" in str(info.value) and "milestone" in str(info.value)
