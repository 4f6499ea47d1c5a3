"""optuna-examples' ``pytorch/pytorch_simple.py`` on tune_hydra: an Optuna objective that owns
its PyTorch loop, its trials multiplexed by one engine.

The script follows the structure of that example (an MLP over FashionMNIST-shaped images whose
layers, units and dropout come from ``trial.suggest_*``, Adam/RMSprop/SGD and a log-uniform
learning rate, validation accuracy reported each epoch with ``trial.report`` and pruned with
``trial.should_prune()``, and the same study statistics printed at the end). What differs:

* tune_hydra, 4 lines, each marked ``# tune_hydra``: the import, ``th.configure(...)``,
  ``model, optimizer = th.shard(model, optimizer)`` and ``n_jobs=`` in ``study.optimize``.
  Optuna's ``n_jobs`` threads then train their trials at once, every loop's shards scheduled
  by the one embedded engine on the shared devices; each loop is the plain PyTorch loop
  (float64 bit-equal with and without the ``th.shard`` line; see
  tests/frontends/test_shard_optuna.py).
* Data (marked ``# synthetic data``): random tensors of FashionMNIST's shapes (1x28x28 images
  in [0, 1], 10 classes) instead of the download, so the script runs offline.
* Sizes: ``--trials``, ``--epochs`` and ``--batches`` (training batches per epoch) default to
  the original's 100 trials, 10 epochs and 30 batches of 128; ``--smoke`` runs a tiny study.

Run: ``python examples/optuna_pytorch_simple.py --smoke``.
"""

import argparse
import os

import optuna
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
from optuna.trial import TrialState

import tune_hydra as th  # tune_hydra

DEVICE = torch.device("cpu")
BATCHSIZE = 128
CLASSES = 10
DIR = os.getcwd()
EPOCHS = 10
LOG_INTERVAL = 10
N_TRAIN_EXAMPLES = BATCHSIZE * 30
N_VALID_EXAMPLES = BATCHSIZE * 10


def define_model(trial):
    # The architecture is searched: how many hidden layers, their widths, their dropout.
    n_layers = trial.suggest_int("n_layers", 1, 3)
    layers = []
    in_features = 28 * 28
    for i in range(n_layers):
        out_features = trial.suggest_int(f"n_units_l{i}", 4, 128)
        layers.append(nn.Linear(in_features, out_features))
        layers.append(nn.ReLU())
        p = trial.suggest_float(f"dropout_l{i}", 0.2, 0.5)
        layers.append(nn.Dropout(p))
        in_features = out_features
    layers.append(nn.Linear(in_features, CLASSES))
    layers.append(nn.LogSoftmax(dim=1))
    return nn.Sequential(*layers)


def get_mnist():
    # synthetic data: FashionMNIST's shapes (1x28x28 in [0, 1], labels 0-9), no download.
    g = torch.Generator().manual_seed(0)
    n_train, n_valid = N_TRAIN_EXAMPLES, N_VALID_EXAMPLES
    train = torch.utils.data.TensorDataset(
        torch.rand(n_train, 1, 28, 28, generator=g),
        torch.randint(0, CLASSES, (n_train,), generator=g),
    )
    valid = torch.utils.data.TensorDataset(
        torch.rand(n_valid, 1, 28, 28, generator=g),
        torch.randint(0, CLASSES, (n_valid,), generator=g),
    )
    train_loader = torch.utils.data.DataLoader(train, batch_size=BATCHSIZE, shuffle=True)
    valid_loader = torch.utils.data.DataLoader(valid, batch_size=BATCHSIZE, shuffle=True)
    return train_loader, valid_loader


def objective(trial):
    model = define_model(trial).to(DEVICE)

    optimizer_name = trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"])
    lr = trial.suggest_float("lr", 1e-5, 1e-1, log=True)
    optimizer = getattr(optim, optimizer_name)(model.parameters(), lr=lr)
    model, optimizer = th.shard(model, optimizer)  # tune_hydra

    train_loader, valid_loader = get_mnist()

    for epoch in range(EPOCHS):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            # A subset of the training data per epoch keeps epochs short.
            if batch_idx * BATCHSIZE >= N_TRAIN_EXAMPLES:
                break
            data, target = data.view(data.size(0), -1).to(DEVICE), target.to(DEVICE)
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()

        # Validation accuracy on a subset of the validation data.
        model.eval()
        correct = 0
        with torch.no_grad():
            for batch_idx, (data, target) in enumerate(valid_loader):
                if batch_idx * BATCHSIZE >= N_VALID_EXAMPLES:
                    break
                data, target = data.view(data.size(0), -1).to(DEVICE), target.to(DEVICE)
                output = model(data)
                pred = output.argmax(dim=1, keepdim=True)
                correct += pred.eq(target.view_as(pred)).sum().item()
        accuracy = correct / min(len(valid_loader.dataset), N_VALID_EXAMPLES)

        trial.report(accuracy, epoch)
        if trial.should_prune():
            raise optuna.exceptions.TrialPruned()

    return accuracy


def _sizes():
    """The command line's sizes (the original's constants by default)."""
    global EPOCHS, N_TRAIN_EXAMPLES, N_VALID_EXAMPLES, BATCHSIZE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--batches", type=int, default=30, help="training batches per epoch")
    parser.add_argument(
        "--smoke",
        action="store_true",
        default=os.environ.get("TUNE_HYDRA_SMOKE") == "1",
        help="a tiny study (tests, CI; also TUNE_HYDRA_SMOKE=1)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.trials, args.epochs, args.batches, BATCHSIZE = 6, 2, 3, 32
    EPOCHS = args.epochs
    N_TRAIN_EXAMPLES = BATCHSIZE * args.batches
    N_VALID_EXAMPLES = BATCHSIZE * max(1, args.batches // 3)
    return args


if __name__ == "__main__":
    args = _sizes()
    th.configure(devices="auto")  # tune_hydra
    study = optuna.create_study(direction="maximize")
    study.optimize(objective, n_trials=args.trials, timeout=600, n_jobs=4)  # tune_hydra

    pruned_trials = study.get_trials(deepcopy=False, states=[TrialState.PRUNED])
    complete_trials = study.get_trials(deepcopy=False, states=[TrialState.COMPLETE])

    print("Study statistics: ")
    print("  Number of finished trials: ", len(study.trials))
    print("  Number of pruned trials: ", len(pruned_trials))
    print("  Number of complete trials: ", len(complete_trials))

    print("Best trial:")
    trial = study.best_trial
    print("  Value: ", trial.value)
    print("  Params: ")
    for key, value in trial.params.items():
        print(f"    {key}: {value}")
