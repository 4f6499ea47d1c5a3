"""Hugging Face GPT-2 cut into >= 3 shards on one CPU device vs plain HF training.

One ``transformers.GPT2LMHeadModel`` (built from a ``GPT2Config``, no download), with
dict batches ``{"input_ids", "attention_mask", "labels"}`` (labels = input_ids: the model
shifts them), its own loss (``loss_fn=None``), AdamW and transformers' linear warm-up and
decay schedule, is trained

- plainly (``th.train_plain`` on a ``copy.deepcopy`` of the template: ``model(**batch)``,
  ``output.loss.backward()``, one optimizer and one scheduler -- the reference),
- by the engine (``th.train_models``, ``devices=["cpu"]``, ``recompute=False``: each
  shard keeps its forward graph, the CPU default), the model cut at its blocks
  (``embed``, one stage per block, ``head``) into >= 3 shards by
  ``max_layers_per_shard``; the LM head is tied to the token embeddings, one parameter
  in the first and the last shard.

Same data, same seed; dropout on (GPT-2's 0.1). Runs alternate (plain, engine, plain,
...) after one warm-up of each; the table reports the median time per batch of each and
the median of the per-round ratios to plain (robust to a shared machine's drift). The
engine's time is the whole ``train_models`` call (cutting, threads, shard execution).
Every round also checks exactness: the engine's per-epoch losses and final weights equal
plain training's bit for bit.

Run::

    python benchmarks/hf_gpt2.py            # about a minute
    python benchmarks/hf_gpt2.py --quick    # a few seconds (used by the tests)

Both sides use one intra-op thread by default (``--threads``), as in ``overhead.py``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

import tune_hydra as th


@dataclass
class Config:
    """Benchmark sizes."""

    layers: int = 6
    d_model: int = 256
    heads: int = 4
    context: int = 128
    vocab: int = 2048
    batch: int = 8
    batches: int = 12
    epochs: int = 1
    repeats: int = 3
    min_shards: int = 3


QUICK = Config(layers=3, d_model=32, heads=2, context=16, vocab=64, batch=4, batches=4, repeats=1)


def make_data(cfg: Config, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Random token batches, as a Hugging Face LM collator makes them."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(cfg.batches):
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.context), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return batches


def run(cfg: Config) -> dict[str, Any]:
    """Run the benchmark; returns the figures (also printed as a table)."""
    torch.manual_seed(0)
    template = GPT2LMHeadModel(
        GPT2Config(
            n_layer=cfg.layers,
            n_embd=cfg.d_model,
            n_head=cfg.heads,
            n_positions=cfg.context,
            vocab_size=cfg.vocab,
            bos_token_id=cfg.vocab - 1,
            eos_token_id=cfg.vocab - 1,
        )
    )
    assert template.lm_head.weight is template.transformer.wte.weight
    data = make_data(cfg)
    steps = cfg.batches * cfg.epochs
    stages = cfg.layers + 2  # embed, the blocks, head
    per_shard = math.ceil(stages / cfg.min_shards)

    def task() -> th.ModelTask:
        return th.ModelTask(
            copy.deepcopy(template),
            None,  # the model's own loss, from the batch's labels
            lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01),
            data,
            lr_scheduler=lambda opt: get_scheduler(
                "linear", opt, num_warmup_steps=max(1, steps // 10), num_training_steps=steps
            ),
        )

    def plain() -> tuple[float, list[float], torch.nn.Module]:
        t = task()
        t0 = time.perf_counter()
        h = th.train_plain(t, cfg.epochs, seed=0)
        return time.perf_counter() - t0, [r["loss"] for r in h], t.model  # type: ignore[return-value]

    shards: list[int] = []

    def engine() -> tuple[float, list[float], torch.nn.Module]:
        t = task()
        t0 = time.perf_counter()
        h = th.train_models(
            {"m": t},
            devices=["cpu"],
            epochs=cfg.epochs,
            seed=0,
            recompute=False,
            max_layers_per_shard=per_shard,
        )
        elapsed = time.perf_counter() - t0
        shards.append(h["m"][-1]["num_shards"])
        return elapsed, [r["loss"] for r in h["m"]], t.model  # type: ignore[return-value]

    def exact(a: Any, b: Any) -> bool:
        """Same losses and the same weights, bit for bit (the tie kept)."""
        (_, loss_a, model_a), (_, loss_b, model_b) = a, b
        same = loss_a == loss_b and model_b.lm_head.weight is model_b.transformer.wte.weight
        params = zip(model_a.state_dict().values(), model_b.state_dict().values(), strict=True)
        return same and all(torch.equal(p, q) for p, q in params)

    plain(), engine()  # warm-up
    times: dict[str, list[float]] = {"plain": [], "tune_hydra": []}
    exact_rounds = 0
    final_losses: tuple[float, float] = (math.nan, math.nan)
    for _ in range(cfg.repeats):
        p = plain()
        e = engine()
        times["plain"].append(p[0] / steps)
        times["tune_hydra"].append(e[0] / steps)
        exact_rounds += exact(p, e)
        final_losses = (p[1][-1], e[1][-1])
    ratios = [e / p for e, p in zip(times["tune_hydra"], times["plain"], strict=True)]
    assert all(n >= cfg.min_shards for n in shards), shards
    result: dict[str, Any] = {
        "shards": shards[-1],
        "median_s_per_batch": {k: statistics.median(v) for k, v in times.items()},
        "ratio_vs_plain": statistics.median(ratios),
        "exact": exact_rounds == cfg.repeats,
    }
    params = sum(p.numel() for p in template.parameters())
    print(
        f"hf_gpt2: GPT2LMHeadModel {cfg.layers} layers, n_embd {cfg.d_model}, {cfg.heads} "
        f"heads, context {cfg.context}, vocab {cfg.vocab} ({params / 1e6:.2f}M parameters, "
        f"lm_head tied); batch {cfg.batch} x {cfg.batches} batches x {cfg.epochs} epoch(s), "
        f"AdamW + linear warm-up/decay; {shards[-1]} shards on one CPU device "
        f"(max_layers_per_shard {per_shard}, recompute=False); {cfg.repeats} alternating "
        f"rounds after a warm-up; torch threads {torch.get_num_threads()}"
    )
    print(f"{'mode':<12} {'shards':>6} {'median s/batch':>15} {'min s/batch':>12} {'ratio':>7}")
    for name, ts in times.items():
        n, ratio = (1, 1.0) if name == "plain" else (shards[-1], result["ratio_vs_plain"])
        print(f"{name:<12} {n:>6} {statistics.median(ts):>15.4f} {min(ts):>12.4f} {ratio:>6.2f}x")
    verdict = "yes" if result["exact"] else "NO"
    print(
        f"exact: {verdict} ({exact_rounds}/{cfg.repeats} rounds: losses and weights bit for "
        f"bit; final loss plain {final_losses[0]!r}, tune_hydra {final_losses[1]!r})"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both sides (default 1, as in overhead.py; 0 = "
        "leave torch's default)",
    )
    args = parser.parse_args(argv)
    cfg = copy.copy(QUICK if args.quick else Config())
    for field in ("repeats", "batches"):
        if getattr(args, field) is not None:
            setattr(cfg, field, getattr(args, field))
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(cfg)
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
