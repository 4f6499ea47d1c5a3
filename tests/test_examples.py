"""The examples run end to end in their small modes (each starts its own local Ray)."""

from __future__ import annotations

import ast
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def _run(script: str, *args: str, timeout: int = 420) -> str:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _model_pt(stdout: str) -> Path:
    line = next(x for x in stdout.splitlines() if x.startswith("best model.pt: "))
    return Path(line.split(": ", 1)[1])


def test_quickstart_smoke(tmp_path: Path) -> None:
    out = _run("quickstart.py", "--smoke", "--output", str(tmp_path))
    assert "best config: {" in out
    assert _model_pt(out).is_file()
    # model.pt is the whole model's state_dict: it loads into a freshly built model
    import torch

    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    best = ast.literal_eval(out.split("best config: ", 1)[1].splitlines()[0])
    task = quickstart.make_task(best)
    model = task.model
    model.load_state_dict(torch.load(_model_pt(out)))
    # The printed val_loss, epoch and model.pt agree: the lowest val_loss of any trial's
    # epochs, reported at that epoch, and the model.pt reproduces it on the eval data.
    line = out.split("best val_loss: ", 1)[1].splitlines()[0]
    printed, epoch = float(line.split()[0]), int(line.split(" at epoch ", 1)[1].split()[0])
    model.eval()
    with torch.no_grad():
        losses = [quickstart.lm_loss(model(x), y).item() for x, y in task.eval_data]
    assert abs(sum(losses) / len(losses) - printed) < 1e-4, (losses, line)
    rows = [
        row
        for progress in (tmp_path / "ray_results" / "quickstart").glob("*/progress.csv")
        for row in csv.DictReader(progress.open())
    ]
    lowest = min(rows, key=lambda row: float(row["val_loss"]))
    assert abs(float(lowest["val_loss"]) - printed) < 1e-4, (lowest, line)
    assert int(lowest["training_iteration"]) == epoch, (lowest, line)
    assert (tmp_path / "timeline.png").is_file()
    shards = out.split("shards per model: ")[1].splitlines()[0]
    assert all(int(s) >= 2 for s in shards.strip("[]").split(",")), shards


def test_quickstart_without_optuna_says_what_to_install() -> None:
    """optuna is an extra: the example stops at once with the install command."""
    code = (
        "import runpy, sys; sys.modules['optuna'] = None; "
        f"sys.argv = ['quickstart.py', '--smoke']; "
        f"runpy.run_path({str(ROOT / 'examples' / 'quickstart.py')!r}, run_name='__main__')"
    )
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'pip install "tune_hydra[optuna]"' in proc.stderr, proc.stderr


def test_gpt2_model_selection_tiny(tmp_path: Path) -> None:
    out = _run("gpt2_model_selection.py", "--tiny", "--output", str(tmp_path))
    assert "4 GPT-2-like models" in out
    assert "best config: lr=" in out
    assert _model_pt(out).is_file()
    assert (tmp_path / "timeline.png").is_file()


def test_optuna_study_tiny(tmp_path: Path) -> None:
    """th.optimize with a MedianPruner, no Ray, Ray Tune's ConvNet class as written: the
    best trial's model.pt loads strictly into a fresh ConvNet() and gives the printed
    mean_accuracy on the validation data."""
    out = _run("optuna_study.py", "--tiny", "--output", str(tmp_path))
    assert "best params: {'lr': " in out
    path = _model_pt(out)
    assert path.parent.parent == tmp_path and path.is_file()
    import torch

    spec = importlib.util.spec_from_file_location(
        "optuna_study", ROOT / "examples" / "optuna_study.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.ConvNet()
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    val = example.make_digits(256, 256, seed=2)  # the --tiny validation data
    printed = float(out.split("best mean_accuracy: ", 1)[1].split()[0])
    assert abs(example.accuracy(model, val) - printed) < 1e-4
    shards = out.split("shards per model: ", 1)[1].splitlines()[0]
    assert shards == "[2]", shards


def test_tune_mnist_tiny(tmp_path: Path) -> None:
    """Ray Tune's getting-started search in the literal form: the tutorial's ConvNet class
    as written, mean_accuracy as the metric; its model.pt loads strictly into a fresh
    ConvNet() and gives the printed accuracy on the evaluation data."""
    out = _run("tune_mnist.py", "--tiny", "--storage", str(tmp_path))
    assert "best config: {'lr': " in out
    path = _model_pt(out)
    assert path.is_file() and tmp_path in path.parents
    import torch

    spec = importlib.util.spec_from_file_location("tune_mnist", ROOT / "examples" / "tune_mnist.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.ConvNet()
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in example.mnist_like(256, 2))
    printed = float(out.split("best mean_accuracy: ", 1)[1].split()[0])
    assert abs(hits / 256 - printed) < 1e-4, (hits / 256, printed)
