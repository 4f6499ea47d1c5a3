"""A Hugging Face ``Trainer`` fine-tuning search with Optuna: the plain twin.

Each trial fine-tunes a small GPT-2 (built with ``from_config``: no download) on random
token rows with Trainer's defaults (its AdamW, linear schedule and clipping) at a
learning rate Optuna suggests, and returns the evaluation loss. ``hf_trainer_optuna.py``
is this file with the tune_hydra lines added (marked ``# tune_hydra``).

Run::

    python examples/hf_trainer_optuna_plain.py           # 8 trials, about 2 minutes on a CPU
    TUNE_HYDRA_SMOKE=1 python examples/hf_trainer_optuna_plain.py   # 2 small trials
"""

import os
import tempfile

import optuna
import torch
import transformers

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


def objective(trial):
    learning_rate = trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2 if SMOKE else 4, n_embd=64, n_head=4, vocab_size=256, n_positions=32
    )
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), f"hf_trainer_optuna_{trial.number}"),
        learning_rate=learning_rate,
        num_train_epochs=1 if SMOKE else 3,
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
    )
    trainer.train()
    return trainer.evaluate()["eval_loss"]


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    study = optuna.create_study(direction="minimize")
    study.optimize(objective, n_trials=2 if SMOKE else 8)
    print("best params:", study.best_params)
    print("best eval_loss:", study.best_value)
