"""The Hydra paper's model-selection workload: a learning-rate x batch-size grid over
GPT-2-like language models, trained together on shared devices through Ray Tune.

The paper trains 12 GPT-2-XL-sized models (learning rates {3e-4, 1e-4, 5e-5, 6e-5, 1e-5,
2e-5} x batch sizes {16, 8}, context 512) for one epoch of WikiText-2 on one 8-GPU node.
No dataset download works here, so the data are synthetic token sequences with learnable
structure; the model is sized by flags (defaults: GPT-2 XL). ``--tiny`` shrinks everything
to run on a CPU in about a minute.

Run::

    python examples/gpt2_model_selection.py --tiny                      # CPU smoke run
    python examples/gpt2_model_selection.py --layers 24 --d-model 1024 \\
        --heads 16 --device-memory 20GiB                                # GPT-2 medium
    python examples/gpt2_model_selection.py                             # GPT-2 XL, 12 models
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
import torch
import torch.nn.functional as F
from ray import tune
from torch import nn

import tune_hydra as th

PAPER_LRS = [3e-4, 1e-4, 5e-5, 6e-5, 1e-5, 2e-5]
PAPER_BATCH_SIZES = [16, 8]


# --------------------------------------------------------------------------- the model
class Embedding(nn.Module):
    """GPT-2's token and learned position embeddings (plus embedding dropout)."""

    def __init__(self, vocab: int, d_model: int, context: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(positions))


class Block(nn.Module):
    """GPT-2's pre-LayerNorm block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )
        mask = torch.triu(torch.ones(context, context, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        h = self.ln_1(x)
        a, _ = self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)
        x = x + a
        return x + self.mlp(self.ln_2(x))


def gpt2(vocab: int, d_model: int, layers: int, heads: int, context: int, dropout: float):
    """Embedding layer, ``layers`` blocks, final LayerNorm and LM head, in execution order
    (an ``nn.Sequential``, so the engine can cut it into shards between any two layers)."""
    return nn.Sequential(
        Embedding(vocab, d_model, context, dropout),
        *[Block(d_model, heads, context, dropout) for _ in range(layers)],
        nn.LayerNorm(d_model),
        nn.Linear(d_model, vocab, bias=False),
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on the logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_tokens(
    sequences: int, context: int, vocab: int, batch: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token sequences where each token is a fixed function of the previous one except for
    10% noise, cut into ``(inputs, next tokens)`` batches."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(sequences, context + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (sequences,), generator=g)
    for t in range(1, context + 1):
        nxt = (seq[:, t - 1] * 7 + 1) % vocab
        noise = torch.rand(sequences, generator=g) < 0.1
        seq[:, t] = torch.where(noise, torch.randint(0, vocab, (sequences,), generator=g), nxt)
    return [(seq[i : i + batch, :-1], seq[i : i + batch, 1:]) for i in range(0, sequences, batch)]


def make_task(config: dict[str, Any]) -> th.ModelTask:
    """One grid point: the same GPT-2-like model, its own learning rate and batch size."""
    m = config["model"]
    torch.manual_seed(0)  # every grid point starts from the same initial weights
    model = gpt2(m["vocab"], m["d_model"], m["layers"], m["heads"], m["context"], m["dropout"])
    lr = config["lr"]
    batch = config["batch_size"]
    return th.ModelTask(
        model=model,
        loss_fn=lm_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        train_data=synthetic_tokens(m["sequences"], m["context"], m["vocab"], batch, seed=1),
        eval_data=synthetic_tokens(max(batch, m["sequences"] // 8), m["context"], m["vocab"],
                                   batch, seed=2),
    )  # fmt: skip


# ---------------------------------------------------------------------------- the run
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a CPU-sized run (2x2 grid)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--d-model", type=int, default=1600)
    p.add_argument("--heads", type=int, default=25)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--dropout", type=float, default=0.1)
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
        "sequences": args.sequences,
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
        print(f"\n=== {len(analysis.trials)} GPT-2-like models "
              f"({args.layers} layers, d_model {args.d_model}) ===")  # fmt: skip
        print(f"{'lr':>10} {'batch':>6} {'shards':>6} {'loss':>9} {'val_loss':>9} {'device s':>9}")
        for t in sorted(analysis.trials, key=lambda t: (t.config["batch_size"], t.config["lr"])):
            r = t.last_result
            print(
                f"{t.config['lr']:>10.1e} {t.config['batch_size']:>6} {r.get('num_shards', 0):>6}"
                f" {r.get('loss', float('nan')):>9.4f} {r.get('val_loss', float('nan')):>9.4f}"
                f" {r.get('device_time_s', 0.0):>9.2f}"
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
