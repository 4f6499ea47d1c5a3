"""The Hydra paper's model-selection workload: a learning-rate x batch-size grid over
GPT-2 language models, trained together on shared devices through Ray Tune.

The paper trains 12 GPT-2-XL-sized models (learning rates {3e-4, 1e-4, 5e-5, 6e-5, 1e-5,
2e-5} x batch sizes {16, 8}, context 512) for one epoch of WikiText-2 on one 8-GPU node,
with AdamW and a learning-rate schedule. The model is transformers' ``GPT2LMHeadModel``,
sized by flags (defaults: GPT-2 XL) or loaded from a local ``save_pretrained`` folder
(``--model-path``); batches are dicts as Hugging Face collators make them and the loss is
the model's own. No dataset download works here, so the data are synthetic token
sequences with learnable structure. ``--tiny`` shrinks everything to run on a CPU in
about a minute.

Run::

    python examples/gpt2_model_selection.py --tiny                      # CPU smoke run
    python examples/gpt2_model_selection.py --layers 24 --d-model 1024 \\
        --heads 16 --device-memory 20GiB                                # GPT-2 medium
    python examples/gpt2_model_selection.py --model-path ./gpt2-xl      # pretrained weights
    python examples/gpt2_model_selection.py                             # GPT-2 XL, 12 models
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
import torch
from ray import tune
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

import tune_hydra as th

PAPER_LRS = [3e-4, 1e-4, 5e-5, 6e-5, 1e-5, 2e-5]
PAPER_BATCH_SIZES = [16, 8]


# --------------------------------------------------------------------------- the model
def gpt2(m: dict[str, Any]) -> GPT2LMHeadModel:
    """transformers' GPT-2 with its LM head, sized by the flags; or, with a model path,
    the pretrained weights saved there (local files only: nothing is downloaded).

    The engine cuts it at its blocks (``embed``, one stage per block, ``head``); the LM
    head is tied to the token embeddings, one parameter in the first and the last shard.
    """
    if m.get("path"):
        return GPT2LMHeadModel.from_pretrained(m["path"], local_files_only=True)
    config = GPT2Config(
        vocab_size=m["vocab"],
        n_positions=m["context"],
        n_embd=m["d_model"],
        n_layer=m["layers"],
        n_head=m["heads"],
        resid_pdrop=m["dropout"],
        embd_pdrop=m["dropout"],
        attn_pdrop=m["dropout"],
        # GPT-2's end-of-text token is its last one
        bos_token_id=m["vocab"] - 1,
        eos_token_id=m["vocab"] - 1,
    )
    return GPT2LMHeadModel(config)


def synthetic_tokens(
    sequences: int, context: int, vocab: int, batch: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """Token sequences where each token is a fixed function of the previous one except for
    10% noise, cut into batches as Hugging Face's LM collators make them: ``labels`` are
    the ``input_ids`` (the model shifts them to predict the next token)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(sequences, context, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (sequences,), generator=g)
    for t in range(1, context):
        nxt = (seq[:, t - 1] * 7 + 1) % vocab
        noise = torch.rand(sequences, generator=g) < 0.1
        seq[:, t] = torch.where(noise, torch.randint(0, vocab, (sequences,), generator=g), nxt)
    return [
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": ids.clone(),
        }
        for ids in (seq[i : i + batch] for i in range(0, sequences, batch))
    ]


def make_task(config: dict[str, Any]) -> th.ModelTask:
    """One grid point: the same GPT-2 model, its own learning rate and batch size, AdamW
    with a linear warm-up and decay over the whole run (the paper's optimizer)."""
    m = config["model"]
    torch.manual_seed(0)  # every grid point starts from the same initial weights
    model = gpt2(m)
    # A pretrained model's vocabulary and position table bound the data, not the flags.
    context = min(m["context"], model.config.n_positions)
    vocab = model.config.vocab_size
    lr = config["lr"]
    batch = config["batch_size"]
    train = synthetic_tokens(m["sequences"], context, vocab, batch, seed=1)
    steps = len(train) * m["epochs"]
    return th.ModelTask(
        model=model,
        loss_fn=None,  # the model's own loss (output.loss), from the batch's labels
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        train_data=train,
        eval_data=synthetic_tokens(max(batch, m["sequences"] // 8), context, vocab, batch,
                                   seed=2),
        lr_scheduler=lambda opt: get_scheduler(
            "linear", opt, num_warmup_steps=max(1, steps // 10), num_training_steps=steps
        ),
    )  # fmt: skip


# ---------------------------------------------------------------------------- the run
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tiny",
        action="store_true",
        default=os.environ.get("TUNE_HYDRA_SMOKE") == "1",
        help="a CPU-sized run (2x2 grid; also TUNE_HYDRA_SMOKE=1)",
    )
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--d-model", type=int, default=1600)
    p.add_argument("--heads", type=int, default=25)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument(
        "--model-path",
        default=None,
        help="a folder written by save_pretrained: start every model from these weights "
        "(local files only) instead of a fresh one sized by the flags above",
    )
    p.add_argument("--sequences", type=int, default=4608, help="sequences per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lrs", type=float, nargs="+", default=PAPER_LRS)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=PAPER_BATCH_SIZES)
    p.add_argument("--devices", default="auto", help="'auto', 'cpu', or 'cuda:0,cuda:1'")
    p.add_argument("--device-memory", default=None, help="per-device budget, e.g. 40GiB")
    p.add_argument("--precision", default=None, choices=[None, "bf16"], help="bf16 autocast")
    p.add_argument("--slots", type=int, default=16, help="concurrent trials on this node")
    p.add_argument("--output", default="gpt2_output")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.d_model, args.heads, args.context, args.vocab = 3, 32, 4, 16, 64
        args.dropout, args.sequences, args.epochs = 0.0, 32, 2
        args.lrs, args.batch_sizes = [3e-3, 1e-3], [8, 4]
        args.devices, args.device_memory = "cpu", args.device_memory or "1MiB"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ray_tmp = tempfile.mkdtemp(prefix="thg2", dir="/tmp")
    if os.environ.get("RAY_ADDRESS"):  # a running cluster (`ray job submit` sets it): join it
        ray.init(log_to_driver=False)
    else:
        ray.init(
            resources={"hydra_slot": args.slots},
            _temp_dir=ray_tmp,
            include_dashboard=False,
            log_to_driver=False,
        )
    devices: Any = args.devices if args.devices in ("auto", "cpu") else args.devices.split(",")
    executor = th.HydraExecutor(
        devices=devices, device_memory=args.device_memory, precision=args.precision
    )
    model = {
        "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
        "context": args.context, "vocab": args.vocab, "dropout": args.dropout,
        "sequences": args.sequences, "epochs": args.epochs, "path": args.model_path,
    }  # fmt: skip
    try:
        analysis = th.run(
            make_task,
            config={
                "lr": tune.grid_search(args.lrs),
                "batch_size": tune.grid_search(args.batch_sizes),
                "model": model,
            },
            metric="val_loss",
            mode="min",
            stop={"training_iteration": args.epochs},
            checkpoint_at_end=True,
            storage_path=str(out / "ray_results"),
            name="gpt2_model_selection",
            trial_executor=executor,
            verbose=1,
        )
        size = (
            f"from {args.model_path}"
            if args.model_path
            else f"{args.layers} layers, d_model {args.d_model}"
        )
        print(f"\n=== {len(analysis.trials)} GPT-2-like models ({size}) ===")
        print(
            f"{'lr':>10} {'batch':>6} {'shards':>6} {'loss':>9} {'val_loss':>9} {'val_ppl':>9}"
            f" {'device s':>9}"
        )
        for t in sorted(analysis.trials, key=lambda t: (t.config["batch_size"], t.config["lr"])):
            r = t.last_result
            val_loss = r.get("val_loss", float("nan"))
            print(
                f"{t.config['lr']:>10.1e} {t.config['batch_size']:>6} {r.get('num_shards', 0):>6}"
                f" {r.get('loss', float('nan')):>9.4f} {val_loss:>9.4f}"
                f" {math.exp(min(val_loss, 700)):>9.2f} {r.get('device_time_s', 0.0):>9.2f}"
            )
        best = analysis.best_config
        print(f"best config: lr={best['lr']}, batch_size={best['batch_size']}")
        ckpt = analysis.best_checkpoint
        if ckpt is not None:
            print(f"best model.pt: {Path(ckpt.path) / 'model.pt'}")
        for node, summary in executor.summary().items():
            for dev, d in summary.get("devices", {}).items():
                print(f"engine {node[:8]} {dev}: utilization {d.get('utilization', 0):.0%}")
        try:
            png = th.plot_timeline(executor.trace(), out / "timeline.png")
            print(f"timeline: {png}")
        except ImportError as err:
            print(f"timeline skipped: {err}")
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
