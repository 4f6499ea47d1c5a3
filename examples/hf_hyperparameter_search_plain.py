"""Hugging Face ``Trainer.hyperparameter_search`` with Optuna: the plain twin.

A ``model_init`` builds a small GPT-2 (``from_config``: no download) for every trial;
Trainer fine-tunes it on random token rows with its defaults (its AdamW, linear schedule,
clipping and seed) at the learning rate and batch size Optuna suggests, and the search
minimizes the evaluation loss. ``hf_hyperparameter_search.py`` is this file with the
tune_hydra lines added (marked ``# tune_hydra``).

Run::

    python examples/hf_hyperparameter_search_plain.py           # 8 trials
    TUNE_HYDRA_SMOKE=1 python examples/hf_hyperparameter_search_plain.py   # 2 small trials
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


def model_init(trial):
    config = transformers.GPT2Config(
        n_layer=2 if SMOKE else 4, n_embd=64, n_head=4, vocab_size=256, n_positions=32
    )
    return transformers.GPT2LMHeadModel(config)


def hp_space(trial):
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True),
        "per_device_train_batch_size": trial.suggest_categorical(
            "per_device_train_batch_size", [4, 8]
        ),
    }


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "hf_hyperparameter_search"),
        num_train_epochs=1 if SMOKE else 3,
        eval_strategy="epoch",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model_init=model_init,
        args=args,
        train_dataset=Tokens(32 if SMOKE else 256),
        eval_dataset=Tokens(16, seed=1),
    )
    best = trainer.hyperparameter_search(
        hp_space=hp_space,
        n_trials=2 if SMOKE else 8,
        direction="minimize",
        backend="optuna",
        sampler=optuna.samplers.TPESampler(seed=0),
    )
    print("best hyperparameters:", best.hyperparameters)
    print("best eval_loss:", best.objective)
