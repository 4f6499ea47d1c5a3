"""A Hugging Face causal-LM fine-tuning loop in bf16 autocast, searched with Ray Tune, its
trials sharded and multiplexed on one engine by tune_hydra (the plain twin:
``hf_bf16_loop_plain.py``).

The user's own loop: a GPT-2 built with ``from_config`` (no download) on random token
rows, AdamW with a linear warmup schedule (``transformers.get_linear_schedule_with_warmup``),
gradient accumulation and clipping, the forward under
``torch.autocast(..., dtype=torch.bfloat16)``, the evaluation loss reported to Tune each
epoch. Three lines differ from the plain twin, marked ``# tune_hydra``: the import,
``th.shard``, and the executor. Every shard op computes under the autocast the user's
thread entered (bf16 on the engine's devices: the per-step losses are plain bf16's).

Run::

    python examples/hf_bf16_loop.py                  # 4 trials
    TUNE_HYDRA_SMOKE=1 python examples/hf_bf16_loop.py   # 2 small trials
"""

import os

import torch
import transformers
from ray import tune

import tune_hydra as th  # tune_hydra

SMOKE = os.environ.get("TUNE_HYDRA_SMOKE") == "1"
ACCUMULATE = 2


def batches(n, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, 8, 32), generator=generator)
    return [{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b} for b in ids]


def train_lm(config):
    torch.manual_seed(0)
    model_config = transformers.GPT2Config(
        n_layer=2 if SMOKE else 4, n_embd=64, n_head=4, vocab_size=256, n_positions=32
    )
    model = transformers.GPT2LMHeadModel(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    model, optimizer = th.shard(model, optimizer)  # tune_hydra
    train, val = batches(8 if SMOKE else 32, 0), batches(2, 1)
    epochs = 2 if SMOKE else 4
    steps = epochs * len(train) // ACCUMULATE
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, steps // 10, steps)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for epoch in range(epochs):
        model.train()
        for i, batch in enumerate(train):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(**batch).loss / ACCUMULATE
            loss.backward()
            if (i + 1) % ACCUMULATE == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            val_loss = sum(model(**b).loss.item() for b in val) / len(val)
        tune.report({"val_loss": val_loss, "epoch": epoch})


if __name__ == "__main__":
    th.patch_tune()  # tune_hydra
    analysis = tune.run(
        train_lm,
        config={"lr": tune.grid_search([1e-3, 3e-3] if SMOKE else [3e-4, 1e-3, 3e-3, 1e-2])},
        metric="val_loss",
        mode="min",
        verbose=0,
        trial_executor=th.HydraExecutor(devices="auto", device_memory="4MiB"),  # tune_hydra
    )
    print("best config:", analysis.best_config)
    print("best val_loss:", analysis.best_result["val_loss"])
