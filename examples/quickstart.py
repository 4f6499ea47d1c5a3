"""tune_hydra quickstart: an Optuna + ASHA search over small GPT-style models.

Eight configurations of a GPT-style language model (learning rate, width, depth) train on
synthetic token sequences. Each model is forced into several shards by a small per-device
memory budget, and all trials share one engine that interleaves their shards on the
devices. Ray runs embedded and local (session files in a temporary folder); on a machine
without a GPU everything runs on the CPU (about 1-2 minutes on 2 cores).

Run::

    python examples/quickstart.py            # the README's main job
    python examples/quickstart.py --smoke    # a smaller run, used by the tests

At the end it prints the best epoch of any trial (its config, val_loss and epoch), where
the ``model.pt`` checkpointed right after that epoch is (load it with
``model.load_state_dict(torch.load(path))``), and writes a timeline PNG of shards on devices.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token for a local run

import ray
import torch
import torch.nn.functional as F
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch
from torch import nn

import tune_hydra as th

VOCAB = 64
CONTEXT = 32


# --------------------------------------------------------------------------- the model
class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, d_model: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Block(nn.Module):
    """A pre-LayerNorm transformer block with causal self-attention."""

    def __init__(self, d_model: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        mask = torch.triu(torch.ones(context, context, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


def gpt(vocab: int, d_model: int, layers: int, heads: int, context: int) -> nn.Sequential:
    """A GPT-style model as an ``nn.Sequential`` the engine can cut between blocks."""
    return nn.Sequential(
        Embedding(vocab, d_model, context),
        *[Block(d_model, heads, context) for _ in range(layers)],
        nn.LayerNorm(d_model),
        nn.Linear(d_model, vocab),
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on the logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_batches(n_batches: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic sequences with learnable structure: each token is a fixed function of the
    previous one, except for 10% random tokens."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(n_batches * batch, CONTEXT + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (len(seq),), generator=g)
    for t in range(1, CONTEXT + 1):
        nxt = (seq[:, t - 1] * 5 + 3) % VOCAB
        noise = torch.rand(len(seq), generator=g) < 0.1
        seq[:, t] = torch.where(noise, torch.randint(0, VOCAB, (len(seq),), generator=g), nxt)
    return [(seq[i : i + batch, :-1], seq[i : i + batch, 1:]) for i in range(0, len(seq), batch)]


def make_task(config: dict[str, Any]) -> th.ModelTask:
    """The task factory: runs inside the engine's process, once per trial."""
    torch.manual_seed(0)
    model = gpt(VOCAB, config["d_model"], config["layers"], heads=4, context=CONTEXT)
    lr = config["lr"]
    return th.ModelTask(
        model=model,
        loss_fn=lm_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        train_data=token_batches(config["batches"], 16, seed=1),
        eval_data=token_batches(2, 16, seed=2),
    )


# ---------------------------------------------------------------------------- the search
def _best_epoch(analysis: Any, trial: Any) -> dict[str, Any]:
    """The result of ``trial``'s epoch with the lowest ``val_loss``."""
    history = analysis.trial_dataframes[trial.trial_id]
    return dict(history.loc[history["val_loss"].idxmin()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8, help="trials Optuna proposes")
    parser.add_argument("--iterations", type=int, default=4, help="epochs per trial at most")
    parser.add_argument("--batches", type=int, default=8, help="batches per epoch")
    parser.add_argument("--device-memory", default="4MiB", help="per-device shard budget")
    parser.add_argument("--devices", default="auto", help="'auto', 'cpu', or 'cpu,cpu'")
    parser.add_argument("--output", default="quickstart_output", help="results folder")
    parser.add_argument(
        "--smoke",
        action="store_true",
        default=os.environ.get("TUNE_HYDRA_SMOKE") == "1",
        help="4 trials x 2 epochs (tests; also TUNE_HYDRA_SMOKE=1)",
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("optuna") is None:
        parser.error('this example searches with OptunaSearch: pip install "tune_hydra[optuna]"')
    if args.smoke:
        args.samples, args.iterations, args.batches = 4, 2, 4

    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ray_tmp = tempfile.mkdtemp(prefix="thqs", dir="/tmp")  # short: Ray's sockets live here
    ray.init(
        num_cpus=os.cpu_count(),
        resources={"hydra_slot": 8},  # 8 concurrent trials; they reserve no CPU
        _temp_dir=ray_tmp,
        include_dashboard=False,
        log_to_driver=False,
    )
    devices: Any = args.devices if args.devices in ("auto", "cpu") else args.devices.split(",")
    executor = th.HydraExecutor(devices=devices, device_memory=args.device_memory)
    try:
        analysis = th.run(
            make_task,
            config={
                "lr": tune.loguniform(1e-4, 3e-2),
                "d_model": tune.choice([48, 64]),
                "layers": tune.choice([3, 4]),
                "batches": args.batches,
            },
            num_samples=args.samples,
            metric="val_loss",
            mode="min",
            search_alg=OptunaSearch(seed=0),
            scheduler=ASHAScheduler(max_t=args.iterations, grace_period=1, reduction_factor=2),
            stop={"training_iteration": args.iterations},
            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1),
            storage_path=str(out / "ray_results"),
            name="quickstart",
            trial_executor=executor,
        )
        # The best model is the best epoch of any trial (ASHA stops trials early, and a
        # trial's last epoch need not be its best): report that epoch's metrics next to
        # its checkpoint's model.pt (every epoch is checkpointed, so the checkpoint with
        # the lowest val_loss is the one taken right after that epoch).
        best = analysis.get_best_trial("val_loss", "min", scope="all")
        ckpt = analysis.get_best_checkpoint(best, metric="val_loss", mode="min")
        epoch = _best_epoch(analysis, best)
        print("\n=== tune_hydra quickstart ===")
        print(f"best config: {best.config}")
        print(
            f"best val_loss: {epoch['val_loss']:.4f} at epoch {epoch['training_iteration']}"
            f" of {best.last_result['training_iteration']} (the lowest of any trial's "
            f"epochs; perplexity {math.exp(epoch['val_loss']):.2f}), "
            f"{epoch['num_shards']} shards; its weights after that epoch:"
        )
        if ckpt is not None:
            print(f"best model.pt: {Path(ckpt.path) / 'model.pt'}")
        shards = sorted({t.last_result.get("num_shards") for t in analysis.trials})
        print(f"trials: {len(analysis.trials)}, shards per model: {shards}")
        trace = executor.trace()
        try:
            png = th.plot_timeline(trace, out / "timeline.png")
            print(f"timeline: {png} ({len(trace)} shard operations)")
        except ImportError as err:
            print(f"timeline skipped: {err}")
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
