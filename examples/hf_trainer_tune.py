"""A Hugging Face ``Trainer`` fine-tuning search as a Ray Tune function trainable, its
trials sharded and multiplexed on one engine by tune_hydra (the plain twin:
``hf_trainer_tune_plain.py``).

Each trial fine-tunes a small GPT-2 (built with ``from_config``: no download) on random
token rows with Trainer's defaults (its AdamW, linear schedule, clipping and output
folder, in the trial's directory) at the learning rate of a ``tune.Tuner`` grid, and a
Trainer callback reports every evaluation's loss to Tune (one result an epoch). Four lines
differ from the plain twin, marked ``# tune_hydra``: the import, ``th.shard`` around the
model (Trainer builds its optimizer afterwards: the engine adopts it at its first step),
the executor, and the trainable it gives the ``Tuner`` (each trial's function then runs in
a thread of the engine's process, with its own Tune session, working directory, torch
generator and Accelerate state).

Run::

    python examples/hf_trainer_tune.py           # 4 trials
    TUNE_HYDRA_SMOKE=1 python examples/hf_trainer_tune.py   # 2 small trials
"""

import os

import torch
import transformers
from ray import tune

import tune_hydra as th  # tune_hydra

SMOKE = os.environ.get("TUNE_HYDRA_SMOKE") == "1"


class Tokens(torch.utils.data.Dataset):
    """Random token rows as a causal LM's examples."""

    def __init__(self, n, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, 32), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class ReportToTune(transformers.TrainerCallback):
    """Reports each evaluation's loss to Tune."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        tune.report({"eval_loss": metrics["eval_loss"], "epoch": state.epoch})


def train_fn(config):
    torch.manual_seed(0)
    model_config = transformers.GPT2Config(
        n_layer=2 if SMOKE else 4, n_embd=64, n_head=4, vocab_size=256, n_positions=32
    )
    model = th.shard(transformers.GPT2LMHeadModel(model_config))  # tune_hydra
    args = transformers.TrainingArguments(
        learning_rate=config["learning_rate"],
        num_train_epochs=2 if SMOKE else 3,
        per_device_train_batch_size=8,
        eval_strategy="epoch",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(32 if SMOKE else 256),
        eval_dataset=Tokens(16, seed=1),
        callbacks=[ReportToTune()],
    )
    trainer.train()


if __name__ == "__main__":
    ex = th.HydraExecutor(devices="auto", device_memory="6MiB")  # tune_hydra
    tuner = tune.Tuner(
        ex.trainable(train_fn),  # tune_hydra
        param_space={
            "learning_rate": tune.grid_search([1e-3, 3e-3] if SMOKE else [3e-4, 1e-3, 3e-3, 1e-2])
        },
        tune_config=tune.TuneConfig(metric="eval_loss", mode="min"),
        run_config=tune.RunConfig(name="hf_trainer_tune", verbose=0),
    )
    results = tuner.fit()
    best = results.get_best_result()
    print("best config:", best.config)
    print("best eval_loss:", best.metrics["eval_loss"])
