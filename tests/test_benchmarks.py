"""Each benchmark script runs in its quick/tiny mode and prints its table.

These are smoke tests (no timing assertions): the scripts are what the benchmark README
tells people to run, so they must keep working as the engine changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HANG_S

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _run(script: str, *args: str, timeout: float = HANG_S, code: str = "") -> str:
    """The script's stdout (it must exit 0); ``code``: run ``python -c code args``
    instead."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, *(["-c", code] if code else [str(BENCH / script)]), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _run_each(script: str, *argvs: list[str]) -> list[str]:
    """The stdout of ``script``'s ``main(argv)`` for each of ``argvs``, called one after
    another in one process (one import of torch and transformers rather than one each,
    ~5 s apiece); every call must return 0."""
    marker = "=== next run ==="
    code = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import {Path(script).stem} as m\n"
        f"for argv in {[list(a) for a in argvs]!r}:\n"
        f"    assert m.main(argv) == 0, argv\n"
        f"    print({marker!r}, flush=True)\n"
    )
    out = _run(script, code=code)
    return out.split(marker + "\n")[: len(argvs)]


def test_lora_batched_tiny() -> None:
    pytest.importorskip("peft")
    out, engine, loops = _run_each(
        "lora_batched.py", ["--tiny"], ["--engine", "--tiny"], ["--loops", "--tiny"]
    )
    assert "one after another:" in out and "batched:" in out
    assert float(out.split("batched / one after another: ")[1].split("x")[0]) > 0
    passes = int(engine.split("batch_shared=True : ")[1].split("; ")[2].split()[0])
    assert passes > 0 and "engine batched / not: " in engine  # the engine batched ops
    assert "th.shard loops" in loops and "engine batched / not: " in loops


def test_overhead_quick() -> None:
    out = _run("overhead.py", "--quick")
    assert "ratio vs plain" in out
    for mode in ("plain", "shards by hand", "keep activations", "recompute"):
        assert mode in out


def test_multiplex_quick() -> None:
    out = _run("multiplex.py", "--quick", "--breakdown")
    for text in (
        "plain, 2 worker threads",
        "shards by hand, 2 threads",
        "shards by hand, 1 thread",
        "model parallel",
        "multiplexed",
        "plain, all cores",
        "ceiling",
        "of the ceiling",
        "utilization",
    ):
        assert text in out


def test_budget_stress_quick() -> None:
    out = _run("budget_stress.py", "--quick")
    assert "budget_stress: 10 rounds, 0 broke a rule or parity" in out


def test_sched_overhead_quick() -> None:
    out = _run("sched_overhead.py", "--quick")
    assert "overhead" in out and "1 task, 1 device" in out and "us" in out


def test_gpu_check_tiny(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    out = _run("gpu_check.py", "--tiny", "--out", str(path))
    table = out.strip().splitlines()[-40:]  # the figures table closes the output
    assert any(line.startswith("spilled / resident") for line in table)
    assert any(line.startswith("kept graphs peak / budget") for line in table)
    assert "ERROR" not in out
    figures = json.loads(path.read_text())
    assert figures["parity"]["ok"] is True
    assert figures["spilled_trace_memory"] == "ok"
    assert figures["multitask_prefetch_on"]["trace_memory"] == "ok"
    assert figures["multitask_kept"]["trace_memory"] == "ok"
    assert (
        figures["multitask_recompute"]["budget_bytes"] == figures["multitask_kept"]["budget_bytes"]
    )
    assert figures["spilled_shards"] >= 2 and figures["resident_shards"] == 1
    # #32's loop parts: bf16 autocast, fp16 + GradScaler, a compiled loop, a Trainer
    for key in ("shard_bf16", "shard_fp16", "shard_compile"):
        assert figures[key]["ok"] is True, figures[key]
    assert figures["shard_trainer"].get("ok", "skipped" in figures["shard_trainer"])


def test_gpu_session_script_without_a_gpu(tmp_path: Path) -> None:
    """The prepared GPU run works here too: GPU tests skip, gpu_check refuses, status 1."""
    import shlex
    import shutil

    import pytest
    import torch

    if torch.cuda.is_available() or shutil.which("bash") is None:
        pytest.skip("needs bash and no CUDA device")
    # The script calls `python`; make it this interpreter. A wrapper script, not a symlink:
    # a symlink elsewhere to a virtualenv's python starts the base interpreter without the
    # venv's packages (Python finds pyvenv.cfg next to the path it was started by).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    env_of = [str(wrapper), "-c", "import sys; print(sys.prefix)"]
    assert subprocess.run(env_of, capture_output=True, text=True).stdout.strip() == sys.prefix
    env = dict(os.environ, OUT=str(tmp_path), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_session.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "skipped" in (tmp_path / "gpu_tests.txt").read_text()
    assert "no CUDA device" in proc.stdout + proc.stderr


@pytest.mark.integration  # starts a local Ray of its own (proxy_memory.py)
def test_proxy_memory_quick() -> None:
    out = _run("proxy_memory.py", "--quick", timeout=HANG_S)
    for text in ("bare Trainable", "bare Trainable + torch", "tune_hydra proxy", "engine RSS"):
        assert text in out


def test_hf_gpt2_quick() -> None:
    """HF GPT-2 (tied lm_head) in 3 shards vs plain HF training: the script checks
    exactness itself and exits 1 if the losses or weights differ."""
    import pytest

    pytest.importorskip("transformers")
    out = _run("hf_gpt2.py", "--quick", timeout=HANG_S)
    assert "3 shards on one CPU device" in out
    for mode in ("plain", "tune_hydra", "median s/batch"):
        assert mode in out
    assert "exact: yes (1/1 rounds" in out


def test_disk_tier_quick(tmp_path: Path) -> None:
    """Half-size disk tier run: exits 1 unless the weights are exact against unlimited
    host memory and the trace's host memory replays within the budget."""
    out = _run("disk_tier.py", "--quick", "--spill-dir", str(tmp_path), timeout=HANG_S)
    assert "parity: exact" in out and "trace.validate(host_budget=" in out
    assert not list(tmp_path.iterdir())  # the engines' folders are gone


def test_loops_quick() -> None:
    out = _run("loops.py", "--quick", timeout=HANG_S)
    for text in (
        "4 loops vs 4 task factories",
        "loops throughput / factories' (recompute)",
        "loops throughput / factories' (kept graphs)",
        "keeping activations:",
        "us/op",
    ):
        assert text in out
    assert "same weights: NO" not in out  # loops and factories are both exact to plain


def test_compile_quick() -> None:
    out = _run("compile.py", "--quick", timeout=HANG_S)  # exits 1 if a timed round recompiled
    for text in ("compiled sharded / compiled plain:", "eager sharded / eager plain:"):
        assert text in out
    assert "frames compiled during the timed rounds: 0" in out


def test_hf_loops_quick() -> None:
    pytest.importorskip("transformers")
    out = _run("hf_loops.py", "--quick")  # exits 1 if Trainer's losses differ sharded
    assert "Trainer sharded / plain:" in out and "same losses: yes" in out
    assert "bf16 time / fp32 time:" in out


def test_lora_base_tiny() -> None:
    pytest.importorskip("peft")
    out = _run("lora_base.py", "--tiny", timeout=HANG_S)
    for text in ("host ledger, registered", "copied to devices per step", "samples/s"):
        assert text in out
    shared = float(out.split("host ledger / target: shared ")[1].split(",")[0])
    assert shared <= 1.05  # the base once, plus each trial's adapter and optimizer state


def test_search_runs_engine_and_objective(tmp_path: Path) -> None:
    """The two Ray-free runs of search_runs.py, one policy: their table rows and the
    figures in --json (every trial measured, fractions of the span in order)."""
    out_json = tmp_path / "figures.json"
    out = _run(
        "search_runs.py", "engine", "objective", "--policies", "lrtf", "--json",
        str(out_json), timeout=HANG_S,
    )  # fmt: skip
    assert "## engine: K/2-th / last first epoch" in out and "## objective:" in out
    figures = json.loads(out_json.read_text())
    for run, trials in (("engine", 16), ("objective", 8)):
        (f,) = figures[run]["lrtf"]
        assert f["trials"] == trials
        assert 0 < f["half"] <= f["last"] <= 1 and 0 < f["floor"] <= 1, f
        assert 0 <= f["arrived"] <= f["last"] and f["samples_per_s"] > 0 and f["best"] < 1, f
    assert figures["engine"]["lrtf"][0]["stopped"] == 0  # the driver stops nothing


def test_clipping_quick() -> None:
    pytest.importorskip("transformers")
    out = _run("clipping.py", "--quick")
    for text in ("Trainer, max_grad_norm=1.0", "Trainer, max_grad_norm=0", "MiB copied"):
        assert text in out
