"""Hugging Face loops under ``th.shard``: Trainer sharded vs plain, and bf16 vs fp32.

Two measurements on a GPT-2 built with ``from_config`` (no download), in one process,
each way on a ``copy.deepcopy`` of one template, the ways interleaved in rounds; a ratio
is the median over the rounds of the per-round ratio:

- **Trainer**: ``transformers.Trainer`` with its defaults (its AdamW and linear schedule,
  clipping at 1.0), one epoch, with and without ``th.shard(model)`` on one CPU device
  (in place, the CPU default), at the smallest budget that fits it (``th.plan``'s
  figure). Goal: sharded <= 1.2x plain. The logged losses are compared (they must be
  equal).
- **bf16 vs fp32**: the user's own loop (AdamW), sharded, with and without
  ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward: throughput of each,
  and each against its plain twin. On a CPU without bf16 matrix units bf16 is slower;
  the point is that the sharded bf16 loop costs what plain bf16 does.

Run::

    python benchmarks/hf_loops.py            # about 2 minutes on 2 cores
    python benchmarks/hf_loops.py --quick    # a few seconds (used by the tests)

torch runs on one intra-op thread (``--threads``), as the other CPU benchmarks do.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

import tune_hydra as th


@dataclass
class Config:
    """Benchmark sizes."""

    layers: int = 4
    width: int = 128
    seq: int = 64
    batch: int = 8
    batches: int = 12
    rounds: int = 3


QUICK = Config(layers=2, width=32, seq=16, batch=4, batches=4, rounds=1)


def gpt2(cfg: Config) -> Any:
    import transformers

    conf = transformers.GPT2Config(
        n_layer=cfg.layers,
        n_embd=cfg.width,
        n_head=4,
        vocab_size=256,
        n_positions=cfg.seq,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(conf)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, cfg: Config) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 256, (cfg.batch * cfg.batches, cfg.seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def engine_for(model: Any, cfg: Config) -> th.Engine:
    """One CPU device (in place) at the smallest budget the model fits (its blocks then
    go into shards of their own; th.plan's figure, as a user sizing a run would)."""
    sample = Tokens(cfg)[0]
    batch = {k: v.expand(cfg.batch, -1) for k, v in sample.items()}
    probe = copy.deepcopy(model)
    opt = torch.optim.AdamW(probe.parameters(), lr=1e-3)  # Trainer's default, the loop's
    budget = th.plan(probe, batch, optimizer=opt)[0].min_device_memory
    return th.Engine("cpu", device_memory=budget)


def trainer_run(model: Any, cfg: Config, out: str) -> tuple[float, list[float]]:
    import transformers

    args = transformers.TrainingArguments(
        out,
        per_device_train_batch_size=cfg.batch,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(cfg))
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    return seconds, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def loop_run(model: Any, opt: Any, cfg: Config, bf16: bool) -> float:
    data = Tokens(cfg)
    t0 = time.perf_counter()
    for b in range(cfg.batches):
        rows = [data[b * cfg.batch + i] for i in range(cfg.batch)]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the tests)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ns = parser.parse_args(argv)
    cfg = QUICK if ns.quick else Config()
    torch.set_num_threads(ns.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("tune_hydra").setLevel(logging.WARNING)
    template = gpt2(cfg)
    engine = engine_for(template, cfg)
    print(
        f"GPT-2 {cfg.layers} layers x {cfg.width}, seq {cfg.seq}, batch {cfg.batch} x "
        f"{cfg.batches} batches; one CPU device, {ns.threads} thread(s); {cfg.rounds} "
        f"interleaved round(s) after a warm-up"
    )
    ratios: dict[str, list[float]] = {"trainer": [], "bf16": [], "fp32": [], "bf16/fp32": []}
    same = True
    shards = 0
    try:
        with tempfile.TemporaryDirectory() as out:
            for r in range(cfg.rounds + 1):  # round 0: the warm-up
                plain_s, plain_losses = trainer_run(copy.deepcopy(template), cfg, out)
                model = th.shard(copy.deepcopy(template), engine=engine)
                shard_s, shard_losses = trainer_run(model, cfg, out)
                shards = th.shard_count(model)
                same = same and shard_losses == plain_losses
                del model
                times: dict[str, float] = {}
                for bf16 in (False, True):
                    plain = copy.deepcopy(template)
                    times[f"plain {bf16}"] = loop_run(
                        plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), cfg, bf16
                    )
                    model = copy.deepcopy(template)
                    model, opt = th.shard(
                        model, torch.optim.AdamW(model.parameters(), lr=1e-3), engine=engine
                    )
                    times[f"sharded {bf16}"] = loop_run(model, opt, cfg, bf16)
                    with contextlib.suppress(Exception):
                        th.unshard(model)
                if r == 0:
                    continue
                ratios["trainer"].append(shard_s / plain_s)
                ratios["fp32"].append(times["sharded False"] / times["plain False"])
                ratios["bf16"].append(times["sharded True"] / times["plain True"])
                ratios["bf16/fp32"].append(times["sharded True"] / times["sharded False"])
    finally:
        engine.close()
    med = {k: statistics.median(v) for k, v in ratios.items()}
    print(f"shards: {shards}")
    print(
        f"Trainer sharded / plain: {med['trainer']:.3f}x (goal <= 1.2x); same losses: "
        f"{'yes' if same else 'NO'}"
    )
    print(f"own loop, sharded / plain, fp32: {med['fp32']:.3f}x; bf16 autocast: {med['bf16']:.3f}x")
    print(f"own loop, sharded, bf16 time / fp32 time: {med['bf16/fp32']:.3f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
