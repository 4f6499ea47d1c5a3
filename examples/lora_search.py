"""A LoRA search over one local Llama: rank x alpha x learning rate x target modules.

The usual fine-tuning search: one pretrained base (here a small ``LlamaForCausalLM`` with
random weights, saved once with ``save_pretrained`` as if it had been downloaded), and
every trial loads it with ``from_pretrained``, wraps it with
``peft.get_peft_model(base, LoraConfig(...))`` and trains only the adapters. The task
factory is what a plain training script would write; tune_hydra cuts each ``PeftModel``
at its base's blocks (adapter layers inside their blocks) and interleaves the shards of
all trials on the shared devices. Batches are dicts as Hugging Face collators make them,
the loss is the model's own (``labels=``), and each epoch reports the eval perplexity.
The data are synthetic token sequences with learnable structure: nothing is downloaded.

Two front ends, one search:

- default: Ray Tune, ``th.run`` with ``OptunaSearch`` + ``ASHAScheduler``;
- ``--optuna``: a native Optuna study, ``th.optimize`` with TPE + ``MedianPruner`` (no Ray).

Run::

    python examples/lora_search.py --smoke            # 4 trials x 2 epochs (the tests)
    python examples/lora_search.py                    # 12 trials x 4 epochs, ~1-2 min on a CPU
    python examples/lora_search.py --optuna           # the same search with th.optimize
    python examples/lora_search.py --base ./my-llama --device-memory 20GiB --devices auto

At the end it prints the best configuration and its eval perplexity, where its weights
are, then reloads them as a user would: the base from its folder, the same LoRA config,
the saved state dict (``model.pt`` holds the whole ``PeftModel``'s, peft's keys), the
perplexity again on the eval data; and it saves the adapter alone with peft's
``save_pretrained``, which ``PeftModel.from_pretrained(base, folder)`` loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token for a local run

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

import tune_hydra as th

# Which linear layers of each block get adapters (a searched choice, by name).
TARGETS: dict[str, list[str] | str] = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qv": ["q_proj", "v_proj"],
    "all-linear": "all-linear",  # peft's shorthand: every linear layer but the LM head
}
RANKS = [2, 4, 8]
ALPHAS = [4, 8, 16]
LR_RANGE = (1e-3, 1e-1)


# --------------------------------------------------------------------------- the base
def save_base(folder: Path, vocab: int, layers: int, hidden: int, context: int) -> Path:
    """A small random Llama saved as a pretrained checkpoint (stands in for a download)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def load_base(folder: str | Path) -> Any:
    """The pretrained base, from local files only (as every trial loads it)."""
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)


# --------------------------------------------------------------------------- the data
def token_batches(
    n: int, batch: int, context: int, vocab: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of sequences where each token follows from the previous one except
    for 10% noise; ``labels`` are the ``input_ids`` (the model shifts them itself)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(n * batch, context, dtype=torch.long)
    seq[:, 0] = torch.randint(2, vocab, (len(seq),), generator=g)
    for t in range(1, context):
        nxt = 2 + (seq[:, t - 1] * 5 + 3) % (vocab - 2)
        noise = torch.rand(len(seq), generator=g) < 0.1
        seq[:, t] = torch.where(noise, torch.randint(2, vocab, (len(seq),), generator=g), nxt)
    return [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        for ids in seq.split(batch)
    ]


def perplexity(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """The eval metric: a batch's perplexity, exp of the model's own mean token loss (the
    engine averages it over the eval batches, weighted by batch size)."""
    return output.loss.exp()


def eval_perplexity(model: Any, data: list[dict[str, torch.Tensor]]) -> float:
    """What the engine reports as ``perplexity``, computed on a model in plain PyTorch."""
    model.eval()
    with torch.no_grad():
        values = [perplexity(model(**b), b["labels"]).item() for b in data]
    return sum(values) / len(values)  # equal batches: the plain mean is the weighted one


def eval_data(setup: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """The held-out batches every trial is evaluated on (and the best one reloaded)."""
    return token_batches(2, 8, setup["context"], setup["vocab"], seed=2)


# --------------------------------------------------------------------------- one trial
def lora_model(base: Any, params: dict[str, Any]) -> Any:
    """``base`` with LoRA adapters as ``params`` say (peft freezes the base's weights)."""
    import peft

    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=params["r"],
        lora_alpha=params["lora_alpha"],
        target_modules=TARGETS[params["targets"]],
        lora_dropout=0.0,
    )
    return peft.get_peft_model(base, config)


def build_task(params: dict[str, Any], setup: dict[str, Any]) -> th.ModelTask:
    """One trial, as a plain fine-tuning script writes it: load the base, wrap it, train
    the adapters with AdamW on the model's own loss."""
    torch.manual_seed(0)  # the adapters' initial weights: the same draw for every trial
    model = lora_model(load_base(setup["base"]), params)
    lr = params["lr"]
    return th.ModelTask(
        model=model,
        loss_fn=None,  # the model's own loss (output.loss), from the batch's labels
        # called once per shard; the frozen base gets no gradient, so AdamW leaves it as is
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
        train_data=token_batches(setup["batches"], 8, setup["context"], setup["vocab"], seed=1),
        eval_data=eval_data(setup),
        metrics={"perplexity": perplexity},
    )


# ----------------------------------------------------------------- front end 1: Ray Tune
def make_task(config: dict[str, Any], setup: dict[str, Any]) -> th.ModelTask:
    """The Ray Tune task factory (runs in the engine's process, once per trial); ``setup``
    comes through ``tune.with_parameters``, so it stays out of the searched config."""
    return build_task(config, setup)


def search_with_ray(args: argparse.Namespace, setup: dict[str, Any], out: Path) -> dict[str, Any]:
    """``th.run`` with OptunaSearch + ASHA; returns the best epoch's params, perplexity and
    ``model.pt``."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    ray_tmp = tempfile.mkdtemp(prefix="thlora", dir="/tmp")  # short: Ray's sockets live here
    if os.environ.get("RAY_ADDRESS"):  # a running cluster (`ray job submit` sets it): join it
        ray.init(log_to_driver=False)
    else:
        ray.init(
            num_cpus=os.cpu_count(),
            resources={"hydra_slot": args.concurrent},  # trials at once; they reserve no CPU
            _temp_dir=ray_tmp,
            include_dashboard=False,
            log_to_driver=False,
        )
    try:
        analysis = th.run(
            tune.with_parameters(make_task, setup=setup),
            config={
                "r": tune.choice(RANKS),
                "lora_alpha": tune.choice(ALPHAS),
                "lr": tune.loguniform(*LR_RANGE),
                "targets": tune.choice(list(TARGETS)),
            },
            num_samples=args.trials,
            metric="perplexity",
            mode="min",
            search_alg=OptunaSearch(seed=0),
            scheduler=ASHAScheduler(max_t=args.epochs, grace_period=1, reduction_factor=2),
            stop={"training_iteration": args.epochs},
            storage_path=str(out / "ray_results"),
            name="lora_search",
            trial_executor=th.HydraExecutor(devices=args.devices, device_memory=args.device_memory),
            verbose=1,
        )
        iterations = [t.last_result.get("training_iteration", 0) for t in analysis.trials]
        states = Counter(t.status for t in analysis.trials)
        print(f"\n{len(analysis.trials)} trials: {dict(states)}; epochs run: {iterations}")
        print(f"stopped early by ASHA: {sum(i < args.epochs for i in iterations)}")
        shards = sorted({t.last_result.get("num_shards") for t in analysis.trials})
        print(f"shards per model: {shards}")
        # The best epoch of any trial (ASHA stops trials early and a trial's last epoch need
        # not be its best); every epoch is checkpointed, so its checkpoint is that epoch's.
        best = analysis.get_best_trial("perplexity", "min", scope="all")
        ckpt = analysis.get_best_checkpoint(best, metric="perplexity", mode="min")
        history = analysis.trial_dataframes[best.trial_id]
        row = history.loc[history["perplexity"].idxmin()]
        return {
            "params": dict(best.config),
            "perplexity": float(row["perplexity"]),
            "epoch": int(row["training_iteration"]),
            "model_pt": Path(ckpt.path) / "model.pt",
        }
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)


# ------------------------------------------------------- front end 2: a native Optuna study
def search_with_optuna(
    args: argparse.Namespace, setup: dict[str, Any], out: Path
) -> dict[str, Any]:
    """``th.optimize`` with TPE + MedianPruner (no Ray); same space, same trial."""
    import optuna

    def objective_task(trial: optuna.Trial) -> th.ModelTask:  # define-by-run
        params = {
            "r": trial.suggest_categorical("r", RANKS),
            "lora_alpha": trial.suggest_categorical("lora_alpha", ALPHAS),
            "lr": trial.suggest_float("lr", *LR_RANGE, log=True),
            "targets": trial.suggest_categorical("targets", list(TARGETS)),
        }
        return build_task(params, setup)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
    )
    th.optimize(
        study,
        objective_task,
        n_trials=args.trials,
        epochs=args.epochs,
        devices=args.devices,
        device_memory=args.device_memory,
        max_concurrent=args.concurrent,
        metric="perplexity",
        save_dir=out / "optuna_models",
        seed=0,
    )
    states = Counter(t.state.name for t in study.trials)
    epochs = [len(t.intermediate_values) for t in study.trials]
    print(f"\n{len(study.trials)} trials: {dict(states)}; epochs run: {epochs}")
    cut = [t.user_attrs for t in study.trials if "num_shards" in t.user_attrs]
    shards = sorted({attrs["num_shards"] for attrs in cut})
    print(f"shards per model: {shards}")
    if not study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        errors = {t.user_attrs.get("error", t.state.name) for t in study.trials}
        raise SystemExit(f"no trial completed: {errors}")
    best = study.best_trial  # a complete trial's value is its last epoch's perplexity
    return {
        "params": dict(best.params),
        "perplexity": best.value,
        "epoch": len(best.intermediate_values),
        "model_pt": Path(best.user_attrs["model_path"]),
    }


# ---------------------------------------------------------------------------- the script
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optuna", action="store_true", help="th.optimize (TPE + MedianPruner)")
    p.add_argument(
        "--smoke",
        action="store_true",
        default=os.environ.get("TUNE_HYDRA_SMOKE") == "1",
        help="4 trials x 2 epochs (the tests; also TUNE_HYDRA_SMOKE=1)",
    )
    p.add_argument("--trials", type=int, help="trials to run (default 12; --smoke: 4)")
    p.add_argument("--epochs", type=int, help="epochs per trial at most (default 4; --smoke: 2)")
    p.add_argument("--batches", type=int, help="batches of 8 per epoch (default 8; --smoke: 4)")
    p.add_argument("--concurrent", type=int, default=4, help="trials training at once")
    p.add_argument(
        "--base",
        help="a save_pretrained folder of a causal LM to fine-tune (default: a small random "
        "Llama written to OUTPUT/base)",
    )
    p.add_argument("--context", type=int, default=32, help="tokens per sequence")
    p.add_argument("--devices", default="cpu", help="'cpu', 'auto', or 'cuda:0,cuda:1'")
    p.add_argument(
        "--device-memory",
        default="2560KiB",
        help="per-device shard budget (th.plan: 2560KiB cuts the small Llama in 4 shards; "
        "it needs at least 1.8MiB)",
    )
    p.add_argument("--output", default="lora_output", help="results folder")
    args = p.parse_args(argv)
    args.trials = args.trials or (4 if args.smoke else 12)
    args.epochs = args.epochs or (2 if args.smoke else 4)
    args.batches = args.batches or (4 if args.smoke else 8)
    if "," in args.devices:
        args.devices = args.devices.split(",")
    missing = [m for m in ("peft", "optuna") if importlib.util.find_spec(m) is None]
    if missing:
        needs = " and ".join(missing)
        p.error(f'this example needs {needs}: pip install "tune_hydra[lora,optuna]"')
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()  # no bar per trial's from_pretrained
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.base:
        base_dir = Path(args.base).resolve()
    else:
        base_dir = out / "base"
        if not (base_dir / "config.json").is_file():  # saved once, reused by later runs
            save_base(base_dir, vocab=128, layers=4, hidden=64, context=args.context)
    base_config = load_base(base_dir).config
    setup = {
        "base": str(base_dir),
        "context": min(args.context, base_config.max_position_embeddings),
        "vocab": base_config.vocab_size,
        "batches": args.batches,
    }
    search = search_with_optuna if args.optuna else search_with_ray
    best = search(args, setup, out)

    print(f"\n=== LoRA search over {base_dir} ({'th.optimize' if args.optuna else 'th.run'}) ===")
    print(f"best config: {best['params']}")
    print(f"best perplexity: {best['perplexity']:.4f} at epoch {best['epoch']}")
    print(f"best model.pt: {best['model_pt']}")

    # Reload as a user would: the base, the best trial's LoRA config, the saved state dict.
    model = lora_model(load_base(base_dir), best["params"])
    model.load_state_dict(torch.load(best["model_pt"], weights_only=True))
    data = eval_data(setup)
    print(f"reloaded perplexity: {eval_perplexity(model, data):.4f}")
    # The adapter alone, as peft saves it (a few KB next to the base's weights).
    adapter_dir = out / "best_adapter"
    model.save_pretrained(adapter_dir)
    import peft

    again = peft.PeftModel.from_pretrained(load_base(base_dir), adapter_dir)
    size = sum(f.stat().st_size for f in adapter_dir.iterdir())
    print(f"best adapter: {adapter_dir} ({size / 1024:.0f} KiB)")
    print(f"adapter perplexity: {eval_perplexity(again, data):.4f}")
    untuned = eval_perplexity(load_base(base_dir), data)
    print(f"base perplexity without adapters: {untuned:.4f}")
    return 0 if math.isfinite(best["perplexity"]) else 1


if __name__ == "__main__":
    sys.exit(main())
