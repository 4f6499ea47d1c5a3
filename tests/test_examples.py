"""The examples run end to end in their small modes (each starts its own local Ray)."""

from __future__ import annotations

import ast
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
    model = quickstart.make_task(best).model
    model.load_state_dict(torch.load(_model_pt(out)))
    assert (tmp_path / "timeline.png").is_file()
    shards = out.split("shards per model: ")[1].splitlines()[0]
    assert all(int(s) >= 2 for s in shards.strip("[]").split(",")), shards


def test_gpt2_model_selection_tiny(tmp_path: Path) -> None:
    out = _run("gpt2_model_selection.py", "--tiny", "--output", str(tmp_path))
    assert "4 GPT-2-like models" in out
    assert "best config: lr=" in out
    assert _model_pt(out).is_file()
    assert (tmp_path / "timeline.png").is_file()
