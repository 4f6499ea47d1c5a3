"""The examples run end to end in their small modes (``TUNE_HYDRA_SMOKE=1``).

Ours join one local Ray cluster per test worker (the ``ray_address`` fixture), except the
quickstart, the README's main job, which starts its own as a user's first run does; Ray's
own examples, run unchanged, call ``ray.init(num_cpus=...)`` themselves, and Ray refuses
CPU counts from a script that joins a running cluster, so they start their own too."""

from __future__ import annotations

import ast
import csv
import difflib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HANG_S

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


# The examples' one switch to their smoke size; their prints unbuffered (a buffered line is
# lost when a process is ended without flushing, which a test would read as not printed).
SMOKE = {"TUNE_HYDRA_SMOKE": "1", "PYTHONUNBUFFERED": "1"}


def _run(script: str, *args: str, timeout: float = HANG_S, ray_address: str = "") -> str:
    """The example's stdout (it must exit 0), at its smoke size; ``ray_address``: the
    cluster it joins (the ``ray_address`` fixture's) rather than booting a Ray of its own."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT), **SMOKE)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
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
    out = _run("quickstart.py", "--output", str(tmp_path))
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
        f"sys.argv = ['quickstart.py']; "
        f"runpy.run_path({str(ROOT / 'examples' / 'quickstart.py')!r}, run_name='__main__')"
    )
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT), **SMOKE)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, env=env
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'pip install "tune_hydra[optuna]"' in proc.stderr, proc.stderr


def _gpt2_example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gpt2_model_selection", ROOT / "examples" / "gpt2_model_selection.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _gpt2_config(example: Any, argv: list[str], lr: float, batch_size: int) -> dict[str, Any]:
    """The config ``main`` gives ``make_task`` for these flags (one grid point)."""
    args = example.parse_args(argv)
    model = {
        "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
        "context": args.context, "vocab": args.vocab, "dropout": args.dropout,
        "sequences": args.sequences, "epochs": args.epochs, "path": args.model_path,
    }  # fmt: skip
    return {"lr": lr, "batch_size": batch_size, "model": model}


def test_gpt2_model_selection_tiny(tmp_path: Path, ray_address: str) -> None:
    """transformers' GPT2LMHeadModel, dict batches, its own loss: every model is cut into
    >= 3 shards (the tied lm_head / wte in the first and the last), and the best model.pt
    loads strictly into a fresh model, still tied, and gives the printed val_loss."""
    pytest.importorskip("transformers")
    out = _run("gpt2_model_selection.py", "--output", str(tmp_path), ray_address=ray_address)
    assert "4 GPT-2-like models" in out
    assert "best config: lr=" in out
    assert _model_pt(out).is_file()
    assert (tmp_path / "timeline.png").is_file()
    table = out.split("GPT-2-like models", 1)[1].splitlines()[2:6]
    rows = {(float(r.split()[0]), int(r.split()[1])): r.split() for r in table}
    assert len(rows) == 4 and all(int(r[2]) >= 3 for r in rows.values()), table
    import math

    import torch

    best = out.split("best config: ", 1)[1].splitlines()[0]
    lr, batch = float(best.split("lr=")[1].split(",")[0]), int(best.split("batch_size=")[1])
    printed = float(rows[(lr, batch)][4])
    assert abs(math.exp(printed) - float(rows[(lr, batch)][5])) < 0.01
    example = _gpt2_example()
    task = example.make_task(_gpt2_config(example, ["--tiny"], lr, batch))
    model = task.model
    model.load_state_dict(torch.load(_model_pt(out), weights_only=True), strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    model.eval()
    with torch.no_grad():
        losses = [model(**b).loss.item() for b in task.eval_data]
    assert abs(sum(losses) / len(losses) - printed) < 1e-4, (losses, printed)


def test_gpt2_model_path_loads_local_weights(tmp_path: Path) -> None:
    """--model-path starts every grid point from the weights save_pretrained wrote there
    (not a fresh model sized by the flags); the data follow its vocabulary."""
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=48, n_positions=12)
    saved = GPT2LMHeadModel(cfg)
    saved.save_pretrained(tmp_path)
    example = _gpt2_example()
    argv = ["--tiny", "--model-path", str(tmp_path)]
    task = example.make_task(_gpt2_config(example, argv, 1e-3, 4))
    model = task.model
    assert isinstance(model, GPT2LMHeadModel) and model.config.n_layer == 2
    want = saved.state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    assert model.lm_head.weight is model.transformer.wte.weight
    batch = next(iter(task.train_data))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == (4, 12)  # --tiny's context 16, capped by the model
    assert int(batch["input_ids"].max()) < 48 and torch.equal(batch["labels"], batch["input_ids"])


def test_optuna_study_tiny(tmp_path: Path) -> None:
    """th.optimize with a MedianPruner, no Ray, Ray Tune's ConvNet class as written: the
    best trial's model.pt loads strictly into a fresh ConvNet() and gives the printed
    mean_accuracy on the validation data."""
    out = _run("optuna_study.py", "--output", str(tmp_path))
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


def test_tune_mnist_tiny(tmp_path: Path, ray_address: str) -> None:
    """Ray Tune's getting-started search in the literal form: the tutorial's ConvNet class
    as written, mean_accuracy as the metric; its model.pt loads strictly into a fresh
    ConvNet() and gives the printed accuracy on the evaluation data."""
    out = _run("tune_mnist.py", "--storage", str(tmp_path), ray_address=ray_address)
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


def _lora_example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "lora_search", ROOT / "examples" / "lora_search.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _line(stdout: str, prefix: str) -> str:
    return next(x for x in stdout.splitlines() if x.startswith(prefix))[len(prefix) :]


def _check_lora_best(out: str, tmp_path: Path) -> tuple[dict[str, Any], float]:
    """What both modes print about the best trial, checked against the files they wrote:
    the model.pt loads strictly into a fresh PeftModel over the saved base (the base's
    frozen weights in it exactly as loaded) and gives the printed perplexity; the adapter
    folder loads with PeftModel.from_pretrained and gives it too; training lowered the
    base's perplexity."""
    pytest.importorskip("peft")
    import math

    import peft
    import torch

    example = _lora_example()
    params = ast.literal_eval(_line(out, "best config: "))
    assert set(params) == {"r", "lora_alpha", "lr", "targets"}, params
    printed = float(_line(out, "best perplexity: ").split()[0])
    base_ppl = float(_line(out, "base perplexity without adapters: "))
    assert math.isfinite(printed) and 1.0 < printed < base_ppl, (printed, base_ppl)
    base_dir = tmp_path / "base"
    assert (base_dir / "config.json").is_file()
    state = torch.load(_model_pt(out), weights_only=True)
    model = example.lora_model(example.load_base(base_dir), params)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and trained and all("lora_" in n for n in trained)
    fresh = model.state_dict()
    for name in frozen:
        assert torch.equal(state[name], fresh[name]), name
    assert any(not torch.equal(state[n], fresh[n]) for n in trained)  # adapters trained
    model.load_state_dict(state, strict=True)
    setup = {"context": 32, "vocab": model.config.vocab_size}
    data = example.eval_data(setup)
    assert abs(example.eval_perplexity(model, data) - printed) < 1e-3
    again = peft.PeftModel.from_pretrained(example.load_base(base_dir), tmp_path / "best_adapter")
    loaded = dict(again.named_parameters())
    assert all(torch.equal(loaded[n], state[n]) for n in trained)
    assert abs(example.eval_perplexity(again, data) - printed) < 1e-3
    return params, printed


def test_lora_search_ray_smoke(tmp_path: Path, ray_address: str) -> None:
    """th.run with OptunaSearch + ASHA over LoRA trials on a saved tiny Llama: every trial
    terminates after 1..2 epochs (ASHA stops some at its rung; the first to reach it goes
    on), each model is cut in 4 shards, and the printed best epoch is the lowest
    perplexity in any trial's progress.csv, its model.pt and adapter reloading to it."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    out = _run("lora_search.py", "--output", str(tmp_path), ray_address=ray_address)
    assert "4 trials: {'TERMINATED': 4}" in out
    epochs = ast.literal_eval(_line(out, "4 trials: {'TERMINATED': 4}; epochs run: "))
    assert len(epochs) == 4 and all(1 <= e <= 2 for e in epochs) and 2 in epochs, epochs
    assert int(_line(out, "stopped early by ASHA: ")) == epochs.count(1)
    assert _line(out, "shards per model: ") == "[4]"
    _, printed = _check_lora_best(out, tmp_path)
    progress = list((tmp_path / "ray_results" / "lora_search").glob("*/progress.csv"))
    rows = [row for p in progress for row in csv.DictReader(p.open())]
    assert sorted(len(list(csv.DictReader(p.open()))) for p in progress) == sorted(epochs)
    lowest = min(float(row["perplexity"]) for row in rows)
    assert abs(lowest - printed) < 1e-4, (lowest, printed)
    epoch = int(_line(out, "best perplexity: ").split(" at epoch ")[1])
    assert _model_pt(out).parent.name == f"checkpoint_{epoch - 1:06d}"


def test_lora_search_optuna_smoke(tmp_path: Path) -> None:
    """--optuna: th.optimize with TPE + MedianPruner, no Ray; trials end COMPLETE (the
    pruner's 2 startup trials at least, after both epochs) or PRUNED, and the best
    trial's model.pt and adapter reload to its printed perplexity."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    out = _run("lora_search.py", "--optuna", "--output", str(tmp_path), timeout=HANG_S)
    head = _line(out, "4 trials: ")
    states = ast.literal_eval(head.split("; epochs run: ")[0])
    epochs = ast.literal_eval(head.split("; epochs run: ")[1])
    assert set(states) <= {"COMPLETE", "PRUNED"} and sum(states.values()) == 4, states
    assert states["COMPLETE"] >= 2 and all(1 <= e <= 2 for e in epochs), head
    assert _line(out, "shards per model: ") == "[4]"
    path = _model_pt(out)
    assert path.parent.parent == tmp_path / "optuna_models" and path.name == "model.pt"
    assert out.count("best perplexity: ") == 1 and " at epoch 2" in out
    _check_lora_best(out, tmp_path)


def test_hf_bf16_loop_ray_smoke(tmp_path: Path, ray_address: str) -> None:
    """A user's own Hugging Face loop (warmup schedule, accumulation, clipping) under bf16
    autocast, a Tune grid search under HydraExecutor: every trial reports."""
    pytest.importorskip("transformers")
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT), HOME=str(home), **SMOKE)
    env["RAY_ADDRESS"] = ray_address
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_bf16_loop.py")],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "best config: {'lr'" in proc.stdout and "best val_loss:" in proc.stdout
    rows = [
        row
        for progress in (home / "ray_results").glob("train_lm_*/*/progress.csv")
        for row in csv.DictReader(progress.open())
    ]
    assert len(rows) == 4  # 2 trials x 2 epochs


# Prints the tasks left on the embedded engine once those of collected models are gone:
# a collected model's loop leaves on th.shard's remover thread, a moment later.
_LEFT = """
import time
def settled(n=0):
    for _ in range(400):
        if len(shard._ENGINE.tasks()) <= n:
            break
        time.sleep(0.05)
    return shard._ENGINE.tasks()
"""


def _run_on_embedded_engine(script: Path) -> str:
    """Run ``script`` at its smoke size as ``python script`` would, then print its embedded
    engine's device busy time (``busy_s``) and the tasks left on it (``left``)."""
    check = (
        "import gc, runpy, sys\n"
        f"sys.argv = [{script.name!r}]\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "from tune_hydra.frontends import shard\n"
        "gc.collect()\n"
        "s = shard._ENGINE.summary()\n"
        "print('busy_s', sum(d['busy_s'] for d in s['devices'].values()))\n"
        + _LEFT
        + "print('left', settled())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), **SMOKE)
    proc = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_hf_trainer_optuna_smoke() -> None:
    """An Optuna search of Hugging Face Trainer fine-tunings (Trainer's defaults, a tiny
    from_config GPT-2), 2 trials at once: each trial's model was cut into shards on the
    embedded engine (Trainer's optimizer adopted), and every loop left it at the end."""
    pytest.importorskip("transformers")
    script = ROOT / "examples" / "hf_trainer_optuna.py"
    out = _run_on_embedded_engine(script)
    assert "best params: {'learning_rate'" in out and "best eval_loss:" in out
    assert float(out.split("busy_s ", 1)[1].split()[0]) > 0  # trained on the engine
    assert "left []" in out


# Runs an example at its smoke size as ``python script`` would, counting each th.shard
# loop's sharded optimizer steps (a Trainer's first step runs plain, before the engine
# adopts its optimizer) and dynamo's graphs; code after it reads the script's globals, g.
_COUNT_SHARDED_STEPS = (
    _LEFT
    + """
import gc, runpy, sys
import torch._dynamo.utils
from tune_hydra.engine.runtime.loop import LoopRunner
from tune_hydra.frontends import shard
loops = {}
step = LoopRunner.step
def counted(self):
    steps = loops.get(self.name, (0, 0, False))[1]
    loops[self.name] = (len(self.shards), steps + 1, self._compiler is not None)
    return step(self)
LoopRunner.step = counted
script = sys.argv[1]
sys.argv = sys.argv[1:]
g = runpy.run_path(script, run_name="__main__")
gc.collect()
print("loops", loops)  # name: (shards, sharded steps, compiled)
print("dynamo graphs", torch._dynamo.utils.counters["stats"]["unique_graphs"])
if shard._ENGINE is not None:
    summary = shard._ENGINE.summary()
    print("busy_s", sum(d["busy_s"] for d in summary["devices"].values()))
    print("left", settled(1))  # a script's last objects may hold one model
"""
)


def _run_python(
    code: str, *args: str, cwd: Path = ROOT, home: Path | None = None, ray_address: str = ""
) -> str:
    """``python -c code args`` at the smoke size; stdout and stderr together
    (``ray_address`` as :func:`_run`'s)."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT), **SMOKE)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    if home is not None:
        home.mkdir(parents=True, exist_ok=True)
        env["HOME"] = str(home)
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def _optuna_trials(out: str) -> dict[str, float]:
    """Optuna's log of finished trials: their parameters (as printed) -> value."""
    found = {}
    for line in out.splitlines():
        if " finished with value: " in line:
            value, params = line.split(" finished with value: ")[1].split(" and parameters: ")
            found[params.split(". Best is")[0]] = float(value)
    return found


# After _COUNT_SHARDED_STEPS: the script's Trainer lets go of its last model.
_RELEASE_TRAINERS_MODEL = """
g["trainer"].callback_handler.model = None
del g
gc.collect()
print("left then", settled())
"""


def test_hf_hyperparameter_search_smoke() -> None:
    """trainer.hyperparameter_search(backend="optuna") with th.shard in its model_init:
    each trial's GPT-2 cut into shards, every optimizer step after the first (Trainer's
    optimizer adopted there) a sharded one, and every trial's eval_loss equal to the plain
    twin's (float32, ==)."""
    pytest.importorskip("transformers")
    script = ROOT / "examples" / "hf_hyperparameter_search.py"
    out = _run_python(_COUNT_SHARDED_STEPS + _RELEASE_TRAINERS_MODEL, str(script))
    plain = _run_python(_COUNT_SHARDED_STEPS, str(script.with_name(script.stem + "_plain.py")))
    trials = _optuna_trials(out)
    assert len(trials) == 2 and trials == _optuna_trials(plain), (trials, plain[-3000:])
    for line in ("best hyperparameters: ", "best eval_loss: "):
        assert _line(out, line) == _line(plain, line)
    loops = ast.literal_eval(_line(out, "loops "))
    # 32 rows a trial at batch 4 (8 steps) or 8 (4 steps): all but the first sharded
    batches = [ast.literal_eval(p)["per_device_train_batch_size"] for p in trials]
    assert sorted(steps for _, steps, _ in loops.values()) == sorted(32 // b - 1 for b in batches)
    assert all(shards >= 2 for shards, _, _ in loops.values()), loops
    assert _line(plain, "loops ") == "{}"  # the plain twin never touched the engine
    assert float(_line(out, "busy_s ")) > 0
    # The Trainer, alive at the script's end, holds the last trial's model (transformers'
    # callback_handler.model): its loop alone is left, and goes with that reference.
    assert _line(out, "left then ") == "[]", _line(out, "left ")
    assert len(ast.literal_eval(_line(out, "left "))) == 1


def test_compiled_loop_smoke() -> None:
    """A user's loop over model = torch.compile(model), th.shard(model, optimizer), two
    trials at once under th.optimize: every step sharded, each shard's forward compiled
    (dynamo graphs), and every trial's test loss equal to the plain twin's (==)."""
    script = ROOT / "examples" / "compiled_loop.py"
    out = _run_python(_COUNT_SHARDED_STEPS, str(script))
    plain = _run_python(_COUNT_SHARDED_STEPS, str(script.with_name(script.stem + "_plain.py")))
    trial_lines = sorted(line for line in out.splitlines() if line.startswith("trial {"))
    assert len(trial_lines) == 2
    assert trial_lines == sorted(x for x in plain.splitlines() if x.startswith("trial {"))
    assert _line(out, "best test loss: ") == _line(plain, "best test loss: ")
    loops = ast.literal_eval(_line(out, "loops "))
    # 256 images in batches of 64, 2 epochs: 8 steps a trial, each a sharded one
    assert sorted(loops.values()) == [(2, 8, True)] * 2, loops
    assert _line(plain, "loops ") == "{}"
    # one graph a shard at least (per trial; training and no_grad evaluation apart)
    assert int(_line(out, "dynamo graphs ")) >= 4


_TRACE_RAY_EXAMPLE = """
import runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
g = runpy.run_path(script, run_name="__main__")
print("engine tasks", sorted({event.task for event in g["ex"].trace().events}))
"""

# The plain twin's function trainable called here, alone, for each learning rate, with
# tune.report collecting its results (what a plain Tune trial's process runs).
_PLAIN_FUNCTION = """
import importlib.util, sys
from ray import tune
spec = importlib.util.spec_from_file_location("plain_twin", sys.argv[1])
plain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plain)
results = []
tune.report = lambda metrics, checkpoint=None: results.append(metrics["eval_loss"])
for lr in sys.argv[2:]:
    results.clear()
    plain.train_fn({"learning_rate": float(lr)})
    print("plain", float(lr), results)
"""


def test_hf_trainer_tune_ray_smoke(tmp_path: Path, ray_address: str) -> None:
    """A Trainer fine-tuning as a tune.Tuner function trainable over ex.trainable(...):
    both trials' models trained on the engine (each as two loops: its first step's, before
    Trainer's optimizer was adopted, and the rest), and every trial's per-epoch eval_loss
    equal to the plain twin's train_fn run alone (float32, ==)."""
    pytest.importorskip("transformers")
    home = tmp_path / "home"
    script = ROOT / "examples" / "hf_trainer_tune.py"
    out = _run_python(
        _TRACE_RAY_EXAMPLE, str(script), cwd=tmp_path, home=home, ray_address=ray_address
    )
    assert "best config: {'learning_rate'" in out and "best eval_loss:" in out, out[-6000:]
    tasks = ast.literal_eval(_line(out, "engine tasks "))
    assert len(tasks) == 4 and all("GPT2LMHeadModel" in task for task in tasks), tasks
    trials = {}
    for progress in (home / "ray_results" / "hf_trainer_tune").glob("*/progress.csv"):
        config = json.loads((progress.parent / "params.json").read_text())
        losses = [float(row["eval_loss"]) for row in csv.DictReader(progress.open())]
        trials[config["learning_rate"]] = losses
    assert sorted(trials) == [1e-3, 3e-3] and all(len(v) == 2 for v in trials.values())
    plain = _run_python(
        _PLAIN_FUNCTION,
        str(script.with_name(script.stem + "_plain.py")),
        *map(str, trials),
        cwd=tmp_path,
    )
    for lr, losses in trials.items():
        assert ast.literal_eval(_line(plain, f"plain {lr} ")) == losses, (lr, plain[-3000:])


def test_optuna_pytorch_simple_smoke() -> None:
    # optuna-examples' pytorch_simple.py with 4 tune_hydra lines: Optuna's n_jobs threads
    # train on the embedded engine (its devices busy), every loop leaves it at the end.
    script = ROOT / "examples" / "optuna_pytorch_simple.py"
    marked = [line for line in script.read_text().splitlines() if line.endswith("# tune_hydra")]
    assert len(marked) == 4, marked
    for what in ("import tune_hydra as th", "th.configure(", "= th.shard(model, optimizer)"):
        assert sum(what in line for line in marked) == 1, what
    assert sum("n_jobs=" in line for line in marked) == 1
    out = _run_on_embedded_engine(script)
    assert "Number of finished trials:  6" in out and "Best trial:" in out
    busy = float(out.split("busy_s ", 1)[1].split()[0])
    assert busy > 0  # the trials' ops ran on the engine's devices
    assert "left []" in out


def test_optuna_pytorch_lightning_simple_smoke(tmp_path: Path) -> None:
    """optuna-examples' pytorch_lightning_simple.py with 4 tune_hydra lines: the
    LightningModule's network sharded in __init__, HydraStrategy in its pl.Trainer, two
    Optuna threads' Trainers on the embedded engine at once (its devices busy, each trial's
    optimizer stepping shard by shard); every loop leaves it at the end. Lightning writes
    its logs into the working directory (tmp_path), as the original does."""
    pytest.importorskip("lightning")
    pytest.importorskip("optuna_integration")
    script = ROOT / "examples" / "optuna_pytorch_lightning_simple.py"
    check = (
        "import gc, runpy, sys\n"
        "import torch\n"
        "steps = []\n"
        "from tune_hydra.engine.runtime.loop import LoopRunner\n"
        "step = LoopRunner.step\n"
        "LoopRunner.step = lambda self: (steps.append(1), step(self))[1]\n"
        "sys.argv = ['optuna_pytorch_lightning_simple.py']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "from tune_hydra.frontends import shard\n"
        "gc.collect()\n"
        "s = shard._ENGINE.summary()\n"
        "print('busy_s', sum(d['busy_s'] for d in s['devices'].values()))\n"
        "print('sharded steps', len(steps))\n" + _LEFT + "print('left', settled())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), **SMOKE)
    proc = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "Number of finished trials: 4" in out and "Best trial:" in out
    assert float(out.split("busy_s ", 1)[1].split()[0]) > 0
    # 4 trials x 2 epochs x 3 batches, every step a sharded one (none plain).
    assert int(out.split("sharded steps ", 1)[1].split()[0]) == 24
    assert "left []" in out
    assert len(list((tmp_path / "lightning_logs").glob("version_*"))) == 4


# ---------------------------------------------------------------------------------------
# Ray Tune's own PyTorch examples (examples/ray_tune/) and optuna-examples' pytorch_simple:
# each *_plain.py is the original on synthetic data, its twin the tune_hydra version.

RAY_TUNE = ROOT / "examples" / "ray_tune"
PAIRS = {
    "mnist_pytorch": RAY_TUNE / "mnist_pytorch",
    "mnist_pytorch_trainable": RAY_TUNE / "mnist_pytorch_trainable",
    "pbt_convnet_function_example": RAY_TUNE / "pbt_convnet_function_example",
    "cifar10_pytorch": RAY_TUNE / "cifar10_pytorch",
    "tune_getting_started": RAY_TUNE / "tune_getting_started",
    "optuna_pytorch_simple": ROOT / "examples" / "optuna_pytorch_simple",
    "optuna_pytorch_lightning_simple": ROOT / "examples" / "optuna_pytorch_lightning_simple",
    "hf_trainer_optuna": ROOT / "examples" / "hf_trainer_optuna",
    "hf_bf16_loop": ROOT / "examples" / "hf_bf16_loop",
    "hf_trainer_tune": ROOT / "examples" / "hf_trainer_tune",
    "hf_hyperparameter_search": ROOT / "examples" / "hf_hyperparameter_search",
    "compiled_loop": ROOT / "examples" / "compiled_loop",
}
# What the twins outside the rules below add: th.shard returned by a model_init (its
# trials one at a time: no n_jobs), and th.optimize (its own engine: no th.configure).
ADDED = {
    "hf_hyperparameter_search": ["import tune_hydra as th", "return th.shard(", "th.configure("],
    "compiled_loop": ["import tune_hydra as th", "= th.shard(", "th.optimize("],
}


def _code_lines(path: Path) -> list[str]:
    """The file's non-blank lines after its module docstring (blank lines are layout)."""
    text = path.read_text()
    first = ast.parse(text).body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = (first.end_lineno or 0) if is_doc else 0
    return [line for line in text.splitlines()[start:] if line.strip()]


def _changed_lines(old: list[str], new: list[str]) -> tuple[int, list[str]]:
    """How many lines differ (a replaced block counts its longer side) and the new ones."""
    count, added = 0, []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            count += max(i2 - i1, j2 - j1)
            added += new[j1:j2]
    return count, added


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_the_tune_hydra_version_changes_at_most_4_lines(name: str) -> None:
    """Issue #20's acceptance: <= 4 changed lines, each marked, and for Ray the import,
    th.shard and the executor; for Optuna th.configure and n_jobs instead."""
    stem = PAIRS[name]
    plain = stem.with_name(stem.name + "_plain.py")
    count, added = _changed_lines(_code_lines(plain), _code_lines(stem.with_suffix(".py")))
    assert 1 <= count <= 4, (count, added)
    assert all(line.endswith("# tune_hydra") for line in added), added
    wanted = ["import tune_hydra as th", "= th.shard("]
    if name in ADDED:
        wanted = ADDED[name]
    elif "lightning" in name:  # the strategy instead of th.configure (Lightning's own call)
        wanted += ["strategy=th.HydraStrategy()", "n_jobs="]
    elif "optuna" in name:
        wanted += ["th.configure(", "n_jobs="]
    else:
        wanted += ["th.HydraExecutor("]
    for what in wanted:
        assert sum(what in line for line in added) == 1, (what, added)


@pytest.mark.parametrize(
    ("name", "replaced"),
    [
        ("mnist_pytorch", 1),
        ("mnist_pytorch_trainable", 1),
        ("pbt_convnet_function_example", 3),
        ("cifar10_pytorch", 2),
    ],
)
def test_the_plain_version_is_rays_example(name: str, replaced: int) -> None:
    """The *_plain.py files are Ray 2.60's installed examples but for the data imports
    their docstrings name (torchvision -> synthetic.py / mnist_pytorch_plain.py)."""
    ray_examples = Path(importlib.util.find_spec("ray").origin).parent / "tune" / "examples"
    theirs = [
        line
        for line in (ray_examples / f"{name}.py").read_text().splitlines()
        # Formatting pragmas: ours are off for the whole file (Ray's file turns it on again).
        if line.strip()
        and line not in ("#!/usr/bin/env python", "# ruff: noqa", "# fmt: off", "# fmt: on")
    ]
    count, added = _changed_lines(theirs, _code_lines(RAY_TUNE / f"{name}_plain.py"))
    assert count == replaced, added
    assert all("synthetic" in line or "mnist_pytorch_plain" in line for line in added), added


def _run_ray_example(script: str, home: Path, *args: str, code: str = "") -> str:
    """Run examples/ray_tune/<script> (or ``code`` that runs it) as a user would, its
    ~/ray_results and Ray's temp dir under ``home``; stdout and stderr together."""
    home.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="thex", dir="/tmp")  # short: Ray's socket paths
    env = dict(
        os.environ,
        RAY_AUTH_MODE="disabled",
        RAY_TMPDIR=tmp,
        HOME=str(home),
        PYTHONPATH=str(ROOT),
        RAY_DEDUP_LOGS="0",
    )
    path = str(RAY_TUNE / script)
    cmd = [sys.executable, "-c", code, path, *args] if code else [sys.executable, path, *args]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=HANG_S, env=env, cwd=home
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def _progress(home: Path, experiment: str) -> dict[str, list[dict[str, str]]]:
    """Trial folder name -> its progress.csv rows."""
    return {
        p.parent.name: list(csv.DictReader(p.open()))
        for p in (home / "ray_results").glob(f"{experiment}/*/progress.csv")
    }


def test_ray_mnist_pytorch_async_hyperband_smoke(tmp_path: Path) -> None:
    """mnist_pytorch.py --smoke-test: the user's own ray.init(num_cpus=2), AsyncHyperBand,
    tune.with_resources inside the executor's trainable (dropped, one warning)."""
    out = _run_ray_example("mnist_pytorch.py", tmp_path, "--smoke-test")
    assert "Best config is: {'lr': " in out
    assert out.count("tune.with_resources request") == 1
    trials = _progress(tmp_path, "exp")
    assert [len(rows) for rows in trials.values()] == [5]  # stop={"training_iteration": 5}
    assert all(0 <= float(r["mean_accuracy"]) <= 1 for r in next(iter(trials.values())))


def test_ray_mnist_pytorch_trainable_class_smoke(tmp_path: Path) -> None:
    """mnist_pytorch_trainable.py --smoke-test: Ray's class Trainable (th.shard in its
    setup) under ASHA, the user's ray.init(num_cpus=6), tune.with_resources around the
    class (dropped, one warning); its 3 iterations ran in the engine and its
    checkpoint (checkpoint_frequency=3, checkpoint_at_end) holds the class's model.pth."""
    out = _run_ray_example("mnist_pytorch_trainable.py", tmp_path, "--smoke-test")
    assert "Best config is: {" in out
    assert out.count("tune.with_resources request") == 1
    (rows,) = _progress(tmp_path, "TrainMNIST*").values()
    assert [int(r["training_iteration"]) for r in rows] == [1, 2, 3]
    assert all(0 <= float(r["mean_accuracy"]) <= 1 for r in rows)
    (model,) = (tmp_path / "ray_results").glob("TrainMNIST*/*/checkpoint_*/model.pth")
    import torch

    assert set(torch.load(model, weights_only=True)) == {
        "conv1.weight", "conv1.bias", "fc.weight", "fc.bias"
    }  # fmt: skip


def test_ray_tune_getting_started_asha_stops_and_best_checkpoint_reloads(
    tmp_path: Path,
) -> None:
    """OptunaSearch + ASHA over 8 trials of the user's loop: ASHA stops some before their
    10 epochs, and the example's own reload of the best trial's model.pth runs."""
    out = _run_ray_example("tune_getting_started.py", tmp_path, "--smoke-test")
    assert "Best config: {'lr': " in out
    assert "Reloaded best model, test accuracy: " in out
    epochs = sorted(len(rows) for rows in _progress(tmp_path, "train_mnist*").values())
    assert len(epochs) == 8 and epochs[-1] == 10, epochs
    assert epochs[0] < 10, epochs  # stopped early by ASHA


_PBT_SYNCHRONOUS = """
import runpy, sys
import ray.tune.schedulers as schedulers

class Synchronous(schedulers.PopulationBasedTraining):
    def __init__(self, **kwargs):
        # Every trial waits (paused) at iteration 1, when each has reported its step-0
        # checkpoint; then the bottom quantile exploits the top: within the smoke run. (Not
        # later: the example's stopper ends every trial once one reaches 96% accuracy, which
        # its random lr/momentum sometimes give by iteration 3.)
        kwargs["perturbation_interval"] = 1
        kwargs["synch"] = True
        super().__init__(**kwargs)

    def on_trial_result(self, tune_controller, trial, result):
        decision = super().on_trial_result(tune_controller, trial, result)
        if self._next_perturbation_sync > 1:
            # The round at iteration 1 is the point: no later ones, each of which would
            # pause every trial and start its process again (#31: 12 process starts).
            self._perturbation_interval = self._next_perturbation_sync = 10**9
        return decision

schedulers.PopulationBasedTraining = Synchronous
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, script.rsplit("/", 1)[0])
runpy.run_path(script, run_name="__main__")
"""


def test_ray_pbt_function_example_pauses_and_exploits(tmp_path: Path) -> None:
    """The PBT function example, its PBT made synchronous with a perturbation every
    iteration (Ray's example checkpoints at steps 0, 5, ... and perturbs every 5, so its
    own smoke run never has a checkpoint to exploit): every trial is paused at the first
    perturbation (the one the test keeps), the bottom ones are exploited, and they
    restart from the top trial's checkpoint through their own tune.get_checkpoint() +
    load_state_dict; its eval_best_model reloads the best checkpoint."""
    out = _run_ray_example(
        "pbt_convnet_function_example.py", tmp_path, "--smoke-test", code=_PBT_SYNCHRONOUS
    )
    assert "best model accuracy: " in out
    assert "[Synchronous] [Exploit] Cloning trial" in out
    assert "Loading from checkpoint." in out  # the user's restore code, in the engine
    trials = _progress(tmp_path, "pbt_test")
    assert len(trials) == 4
    assert all(int(rows[-1]["training_iteration"]) == 5 for rows in trials.values())


_CIFAR_INTERRUPT_AND_RESTORE = """
import os, signal, sys
script = sys.argv[1]
folder = os.path.dirname(script)
sys.path.insert(0, folder)
# The engine imports this module: Ray hands a script's folder to its workers, not a -c's.
os.environ["PYTHONPATH"] = folder + os.pathsep + os.environ.get("PYTHONPATH", "")
import ray
from ray import tune
import tune_hydra as th
import cifar10_pytorch as example  # the tune_hydra version, as written

ray.init(num_cpus=2)
# The example's own smoke run first (what `cifar10_pytorch.py --smoke-test` does after
# its ray.init), in this Ray session: one Ray start-up for both parts of the test.
example.main(num_samples=1, max_num_epochs=1, gpus_per_trial=0, smoke_test=True)


class InterruptAtIteration2(tune.Callback):  # as Ctrl-C would, once
    def on_trial_result(self, iteration, trials, trial, result, **info):
        # Tune pickles the callback with the experiment: the restored one runs too.
        done = os.path.expanduser("~/interrupted")
        if result["training_iteration"] == 2 and not os.path.exists(done):
            open(done, "w").close()
            os.kill(os.getpid(), signal.SIGINT)


ex = th.HydraExecutor()
space = {"l1": 8, "l2": 8, "lr": tune.grid_search([0.01, 0.02]), "batch_size": 16,
         "smoke_test": True}
first = tune.Tuner(
    ex.trainable(tune.with_parameters(example.train_cifar)),
    tune_config=tune.TuneConfig(metric="loss", mode="min"),
    run_config=tune.RunConfig(name="cifar_restore", stop={"training_iteration": 3},
                              callbacks=[InterruptAtIteration2()]),
    param_space=space,
).fit()
print("FIRST", sorted(r.metrics.get("training_iteration", 0) for r in first))
path = os.path.expanduser("~/ray_results/cifar_restore")
trainable = ex.trainable(tune.with_parameters(example.train_cifar))
restored = tune.Tuner.restore(path, trainable=trainable)
second = restored.fit()
for r in second:
    print("SECOND", r.metrics["training_iteration"], r.metrics["iterations_since_restore"],
          r.error is None)
best = second.get_best_result("loss", "min")
example.test_best_model(best.config, best.checkpoint, smoke_test=True)
"""


def test_ray_cifar10_smoke_and_restore_resumes_unfinished_trials(tmp_path: Path) -> None:
    """cifar10_pytorch.py's smoke run (its main() as --smoke-test calls it; its own
    test_best_model reloads the best checkpoint); then, in the same Ray session, its
    train_cifar in a Tuner interrupted when a trial reports its 2nd iteration (SIGINT,
    as Ctrl-C) resumes both unfinished trials with Tuner.restore to the stop, that one
    from its checkpoint (the example's tune.get_checkpoint())."""
    out = _run_ray_example("cifar10_pytorch.py", tmp_path, code=_CIFAR_INTERRUPT_AND_RESTORE)
    assert "Best trial final validation loss: " in out  # the example's main()
    assert out.count("Best trial test set accuracy: ") == 2, out[-3000:]  # main(), restored
    first = ast.literal_eval(_line(out, "FIRST "))
    assert len(first) == 2 and max(first) < 3, first  # unfinished when interrupted
    second = [line.split()[1:] for line in out.splitlines() if line.startswith("SECOND ")]
    assert len(second) == 2, out[-3000:]
    assert all(ok == "True" and int(iteration) == 3 for iteration, _, ok in second), second
    # The trial at iteration 2 went on from its checkpoint (the example's own
    # tune.get_checkpoint() code), not from scratch.
    assert min(int(since_restore) for _, since_restore, _ in second) < 3, second
