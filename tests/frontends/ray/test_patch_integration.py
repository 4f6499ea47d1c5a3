"""th.patch_tune(): the literal ``tune.run(..., trial_executor=HydraExecutor(...))`` form.

The first tests start no Ray (they stop at argument checks or use a spy); the last ones run
small experiments on the shared local Ray session.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray.tune
import ray.tune.tune
import torch
from ray import tune

import tune_hydra as th
from tests.frontends.ray import tune_tasks
from tune_hydra.frontends.ray import HydraExecutor, InvalidExecutorError, patch_tune, unpatch_tune
from tune_hydra.frontends.ray import patch as patch_module

pytestmark = pytest.mark.integration

RAY_RUN = ray.tune.run  # Ray's own function, taken before any test patches it
BUDGET = "18KiB"  # cuts the 16-wide MLP into 2 shards


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    """Every test starts and ends with Ray's own ``tune.run``."""
    assert ray.tune.run is RAY_RUN and ray.tune.tune.run is RAY_RUN
    yield
    unpatch_tune()
    assert ray.tune.run is RAY_RUN and ray.tune.tune.run is RAY_RUN


def _score_trainable(config: dict[str, Any]) -> None:
    for step in range(3):
        tune.report({"score": config["x"] * 10 + step})


# ------------------------------------------------------------------ without a Ray session
def test_exported_lazily_without_importing_ray_or_torch_first() -> None:
    code = (
        "import sys, tune_hydra as th; before = 'ray' in sys.modules; "
        "from tune_hydra.frontends.ray.patch import patch_tune; "
        "print(before, th.patch_tune is patch_tune, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True", "False"], out.stderr
    assert th.patch_tune is patch_tune and th.unpatch_tune is unpatch_tune
    assert {"patch_tune", "unpatch_tune"} <= set(th.__all__)


def test_without_the_patch_ray_refuses_trial_executor() -> None:
    with pytest.raises(TypeError, match="trial_executor"):
        tune.run(tune_tasks.make_task, trial_executor=HydraExecutor(devices="cpu"))


def test_patch_is_idempotent_and_unpatch_restores_rays_object() -> None:
    first = patch_tune()
    wrapper = ray.tune.run
    assert first.applied and wrapper is not RAY_RUN
    assert ray.tune.tune.run is wrapper  # the module that defines it too
    second = patch_tune()
    assert not second.applied
    assert ray.tune.run is wrapper and inspect.unwrap(wrapper) is RAY_RUN  # one wrapper
    assert unpatch_tune() is True
    assert ray.tune.run is RAY_RUN and ray.tune.tune.run is RAY_RUN
    assert unpatch_tune() is False  # nothing left to undo
    assert ray.tune.run is RAY_RUN


def test_patched_signature_is_rays_plus_trial_executor() -> None:
    with patch_tune():
        ours = inspect.signature(tune.run).parameters
    theirs = inspect.signature(RAY_RUN).parameters
    assert list(ours) == [*theirs, "trial_executor"]
    assert all(ours[name] == theirs[name] for name in theirs)
    assert ours["trial_executor"].default is None
    assert ours["trial_executor"].kind is inspect.Parameter.KEYWORD_ONLY


def test_context_manager_undoes_only_its_own_patch() -> None:
    with patch_tune() as patched:
        assert patched.applied and ray.tune.run is not RAY_RUN
    assert ray.tune.run is RAY_RUN
    # an error inside the block still unpatches
    with pytest.raises(RuntimeError, match="inside"), patch_tune():
        raise RuntimeError("inside")
    assert ray.tune.run is RAY_RUN
    # already patched when the block starts: it stays patched after it
    patch_tune()
    wrapper = ray.tune.run
    with patch_tune() as inner:
        assert not inner.applied
    assert ray.tune.run is wrapper
    with patch_tune(), patch_tune():  # nested blocks: the outer one undoes it
        pass
    assert ray.tune.run is wrapper
    unpatch_tune()
    with patch_tune():
        with patch_tune():
            pass
        assert ray.tune.run is not RAY_RUN
    assert ray.tune.run is RAY_RUN


def test_names_imported_before_the_patch_keep_rays_function() -> None:
    from ray.tune import run as imported_before

    with patch_tune():
        from ray.tune import run as imported_after

        assert imported_before is RAY_RUN
        assert imported_after is ray.tune.run and imported_after is not RAY_RUN


def test_with_an_executor_the_call_is_th_run(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def spy(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "analysis"

    monkeypatch.setattr(patch_module, "hydra_run", spy)
    ex = HydraExecutor(devices="cpu", device_memory=BUDGET)
    config = {"lr": tune.grid_search([0.01, 0.03])}
    with patch_tune():
        out = tune.run(tune_tasks.make_task, config=config, metric="val_loss", trial_executor=ex)
    assert out == "analysis"
    assert calls == [
        (
            (tune_tasks.make_task,),
            {"config": config, "metric": "val_loss", "trial_executor": ex},
        )
    ]


def test_without_an_executor_the_arguments_reach_ray_unchanged() -> None:
    with pytest.raises(TypeError) as theirs:
        RAY_RUN(_score_trainable, no_such_option=1)
    with patch_tune():
        with pytest.raises(TypeError) as ours:
            tune.run(_score_trainable, no_such_option=1)
        with pytest.raises(TypeError) as ours_none:
            tune.run(_score_trainable, trial_executor=None, no_such_option=1)
        # a wrong executor gets th.run's message, not Ray's TypeError
        with pytest.raises(InvalidExecutorError, match="HydraExecutor"):
            tune.run(tune_tasks.make_task, trial_executor=object())
    assert str(ours.value) == str(theirs.value) == str(ours_none.value)
    assert "no_such_option" in str(theirs.value)


# --------------------------------------------------------------------- on a Ray session
def _by_lr(analysis: Any) -> dict[float, dict[str, Any]]:
    return {t.config["lr"]: t.last_result for t in analysis.trials}


def test_patched_tune_run_with_executor_trains_like_th_run(
    ray_session: Any, tmp_path: Path
) -> None:
    common: dict[str, Any] = {
        "config": {"lr": tune.grid_search([0.003, 0.03])},
        "metric": "val_loss",
        "mode": "min",
        "stop": {"training_iteration": 2},
        "checkpoint_freq": 1,
        "verbose": 0,
    }
    patched_ex = HydraExecutor(devices="cpu", device_memory=BUDGET, seed=3)
    with patch_tune():
        patched = tune.run(
            tune_tasks.make_task,
            storage_path=str(tmp_path / "patched"),
            trial_executor=patched_ex,
            **common,
        )
    direct = th.run(
        tune_tasks.make_task,
        storage_path=str(tmp_path / "direct"),
        trial_executor=HydraExecutor(devices="cpu", device_memory=BUDGET, seed=3),
        **common,
    )
    assert isinstance(patched, tune.ExperimentAnalysis)
    assert not patched_ex.started  # the call started the engines and shut them down
    assert len({e.task for e in patched_ex.trace().events}) == 2  # both trials on the engine
    ours, reference = _by_lr(patched), _by_lr(direct)
    assert set(ours) == {0.003, 0.03}
    for lr, result in ours.items():
        assert result["training_iteration"] == 2 and result["num_shards"] >= 2
        for key in ("loss", "val_loss"):
            assert result[key] == reference[lr][key], (lr, key)
    assert patched.best_config == direct.best_config
    ckpt = patched.best_checkpoint
    assert ckpt is not None
    model = tune_tasks.build_model(16, torch.float32)
    model.load_state_dict(torch.load(Path(ckpt.path) / "model.pt"))


def test_patched_tune_run_without_executor_is_rays(ray_session: Any, tmp_path: Path) -> None:
    common: dict[str, Any] = {
        "config": {"x": tune.grid_search([1, 2])},
        "metric": "score",
        "mode": "max",
        "verbose": 0,
    }
    plain = tune.run(_score_trainable, storage_path=str(tmp_path / "plain"), **common)
    with patch_tune():
        patched = tune.run(_score_trainable, storage_path=str(tmp_path / "patched"), **common)
    assert type(patched) is type(plain)
    assert patched.best_config == plain.best_config == {"x": 2}
    for analysis in (plain, patched):
        scores = {t.config["x"]: t.last_result["score"] for t in analysis.trials}
        assert scores == {1: 12, 2: 22}
        assert all(t.last_result["training_iteration"] == 3 for t in analysis.trials)
        # ordinary function trainables: not proxies of a tune_hydra engine
        assert all(not t.trainable_name.startswith("Hydra") for t in analysis.trials)


def test_the_tuner_hook_is_idempotent_and_leaves_other_tuners_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """HydraExecutor.trainable installs hook_tuner; it completes only the configs of a
    Tuner over an executor's trainable (none here: no executor is active for a plain
    function), and unhook_tuner gives Ray's constructor back."""
    patch_module.unhook_tuner()
    ray_init = tune.Tuner.__init__
    calls: list[Any] = []
    monkeypatch.setattr(patch_module, "tuner_configs", lambda *a: calls.append(a) or a[1:])
    try:
        assert patch_module.hook_tuner() is True and patch_module.hook_tuner() is False
        assert tune.Tuner.__init__.__wrapped__ is ray_init  # type: ignore[attr-defined]
        assert inspect.signature(tune.Tuner.__init__) == inspect.signature(ray_init)
        tune.Tuner(
            lambda config: None,
            tune_config=tune.TuneConfig(metric="x", mode="min"),
            run_config=tune.RunConfig(storage_path=str(tmp_path)),
        )
        assert calls == []
    finally:
        assert patch_module.unhook_tuner() is True
    assert tune.Tuner.__init__ is ray_init and patch_module.unhook_tuner() is False
