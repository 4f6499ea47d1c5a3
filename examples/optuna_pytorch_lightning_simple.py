"""optuna-examples' ``pytorch/pytorch_lightning_simple.py`` on tune_hydra: an Optuna objective
that trains a LightningModule with Lightning's ``Trainer``, its trials multiplexed by one engine.

The script follows the structure of that example (a LightningModule around an MLP over
FashionMNIST-shaped images whose layers, units and dropout come from ``trial.suggest_*``, Adam
from ``configure_optimizers``, a ``LightningDataModule``, validation accuracy logged and watched
by optuna-integration's ``PyTorchLightningPruningCallback``, the same study statistics printed
at the end). What differs:

* tune_hydra, 4 lines, each marked ``# tune_hydra``: the import, ``th.shard(Net(...))`` where
  the LightningModule builds its network, ``strategy=th.HydraStrategy()`` in ``pl.Trainer``
  (it gives the optimizer ``configure_optimizers`` builds to the sharded network) and
  ``n_jobs=`` in ``study.optimize``: Optuna's threads then train their trials at once, every
  network's shards scheduled by the one embedded engine on the shared devices. Each trial is
  the plain Lightning run (float64 bit-equal with and without those lines; see
  tests/frontends/test_lightning.py).
* No progress bar (``enable_progress_bar=False``, in both twins): Lightning's Rich progress
  bar is one live display per process, which two trials' Trainers in threads cannot share.
* The logger (in both twins): ``TensorBoardLogger(os.getcwd(), version=trial.number)``, the
  original's ``logger=True`` with its version named. ``logger=True`` picks the next free
  ``lightning_logs/version_N`` by listing the folder when it first logs, which two threads can
  do at once: both take ``version_0`` and one fails creating it (``FileExistsError``).
* Data (marked ``# synthetic data``): random tensors of FashionMNIST's shapes (1x28x28 images
  in [0, 1], 10 classes, 55000/5000/10000 examples) instead of the download.
* Sizes: ``--trials`` and ``--epochs`` default to the original's 100 trials and 10 epochs;
  ``--smoke`` runs a tiny study. The pruning callback comes from ``optuna_integration`` (the
  original's ``optuna.integration`` path is deprecated in Optuna 5).

Run: ``python examples/optuna_pytorch_lightning_simple.py --smoke`` (Lightning writes its logs
into ./lightning_logs, as the original does).
"""

import argparse
import os

import lightning.pytorch as pl
import optuna
import torch
import torch.nn.functional as F
from optuna_integration.pytorch_lightning import PyTorchLightningPruningCallback
from packaging import version
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset, random_split

import tune_hydra as th  # tune_hydra

if version.parse(pl.__version__) < version.parse("1.6.0"):
    raise RuntimeError("PyTorch Lightning>=1.6.0 is required for this example.")

PERCENT_VALID_EXAMPLES = 0.1
BATCHSIZE = 128
CLASSES = 10
EPOCHS = 10
DIR = os.getcwd()
N_TRAIN, N_VALID, N_TEST = 55000, 5000, 10000  # FashionMNIST's sizes


class Net(nn.Module):
    def __init__(self, dropout: float, output_dims: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []

        input_dim: int = 28 * 28
        for output_dim in output_dims:
            layers.append(nn.Linear(input_dim, output_dim))
            layers.append(nn.ReLU())
            layers.append(nn.Dropout(dropout))
            input_dim = output_dim

        layers.append(nn.Linear(input_dim, CLASSES))

        self.layers = nn.Sequential(*layers)

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        logits = self.layers(data)
        return F.log_softmax(logits, dim=1)


class LightningNet(pl.LightningModule):
    def __init__(self, dropout: float, output_dims: list[int]) -> None:
        super().__init__()
        self.model = th.shard(Net(dropout, output_dims))  # tune_hydra

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        return self.model(data.view(-1, 28 * 28))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        data, target = batch
        output = self(data)
        return F.nll_loss(output, target)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        data, target = batch
        output = self(data)
        pred = output.argmax(dim=1, keepdim=True)
        accuracy = pred.eq(target.view_as(pred)).float().mean()
        self.log("val_acc", accuracy)
        self.log("hp_metric", accuracy, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> optim.Optimizer:
        return optim.Adam(self.model.parameters())


def fashion_mnist_like(n: int, seed: int) -> TensorDataset:
    # synthetic data: FashionMNIST's shapes (1x28x28 in [0, 1], labels 0-9), no download.
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 1, 28, 28, generator=g)
    return TensorDataset(images, torch.randint(0, CLASSES, (n,), generator=g))


class FashionMNISTDataModule(pl.LightningDataModule):
    def __init__(self, data_dir: str, batch_size: int):
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size

    def setup(self, stage: str | None = None) -> None:
        self.mnist_test = fashion_mnist_like(N_TEST, seed=1)  # synthetic data
        mnist_full = fashion_mnist_like(N_TRAIN + N_VALID, seed=0)  # synthetic data
        self.mnist_train, self.mnist_val = random_split(mnist_full, [N_TRAIN, N_VALID])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.mnist_train, batch_size=self.batch_size, shuffle=True, pin_memory=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.mnist_val, batch_size=self.batch_size, shuffle=False, pin_memory=True
        )

    def test_dataloader(self) -> DataLoader:
        return DataLoader(
            self.mnist_test, batch_size=self.batch_size, shuffle=False, pin_memory=True
        )


def objective(trial: optuna.trial.Trial) -> float:
    # We optimize the number of layers, hidden units in each layer and dropouts.
    n_layers = trial.suggest_int("n_layers", 1, 3)
    dropout = trial.suggest_float("dropout", 0.2, 0.5)
    output_dims = [trial.suggest_int(f"n_units_l{i}", 4, 128, log=True) for i in range(n_layers)]

    model = LightningNet(dropout, output_dims)
    datamodule = FashionMNISTDataModule(data_dir=DIR, batch_size=BATCHSIZE)

    trainer = pl.Trainer(
        # one version per trial: two threads' loggers would both take the next free one
        logger=pl.loggers.TensorBoardLogger(os.getcwd(), version=trial.number),
        enable_progress_bar=False,  # Rich's live display is one per process
        limit_val_batches=PERCENT_VALID_EXAMPLES,
        enable_checkpointing=False,
        max_epochs=EPOCHS,
        accelerator="auto",
        devices=1,
        strategy=th.HydraStrategy(),  # tune_hydra
        callbacks=[PyTorchLightningPruningCallback(trial, monitor="val_acc")],
    )
    hyperparameters = dict(n_layers=n_layers, dropout=dropout, output_dims=output_dims)
    trainer.logger.log_hyperparams(hyperparameters)
    trainer.fit(model, datamodule=datamodule)

    return trainer.callback_metrics["val_acc"].item()


def _sizes():
    """The command line: the original's --pruning, and sizes (the original's by default)."""
    global EPOCHS, BATCHSIZE, PERCENT_VALID_EXAMPLES, N_TRAIN, N_VALID, N_TEST
    parser = argparse.ArgumentParser(description="PyTorch Lightning example.")
    parser.add_argument(
        "--pruning",
        "-p",
        action="store_true",
        help="Activate the pruning feature. `MedianPruner` stops unpromising "
        "trials at the early stages of training.",
    )
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument(
        "--smoke",
        action="store_true",
        default=os.environ.get("TUNE_HYDRA_SMOKE") == "1",
        help="a tiny study (tests, CI; also TUNE_HYDRA_SMOKE=1)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.trials, args.epochs, BATCHSIZE, PERCENT_VALID_EXAMPLES = 4, 2, 32, 1.0
        N_TRAIN, N_VALID, N_TEST = 96, 64, 64
    EPOCHS = args.epochs
    return args


if __name__ == "__main__":
    args = _sizes()

    pruner = optuna.pruners.MedianPruner() if args.pruning else optuna.pruners.NopPruner()

    study = optuna.create_study(direction="maximize", pruner=pruner)
    study.optimize(objective, n_trials=args.trials, timeout=600, n_jobs=2)  # tune_hydra

    print(f"Number of finished trials: {len(study.trials)}")

    print("Best trial:")
    trial = study.best_trial

    print(f"  Value: {trial.value}")

    print("  Params: ")
    for key, value in trial.params.items():
        print(f"    {key}: {value}")
