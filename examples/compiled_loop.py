"""A user's own training loop over a ``torch.compile``-d model, searched with Optuna, its
trials sharded and multiplexed on one engine by tune_hydra (the plain twin:
``compiled_loop_plain.py``).

The shape of PyTorch's quickstart tutorial (its ``NeuralNetwork``, ``train_loop`` and
``test_loop``, FashionMNIST-sized random images instead of the download), the model
compiled with ``model = torch.compile(model)``, SGD at the learning rate and momentum that
an Optuna grid gives, the test loss as the objective. Three lines differ from the plain
twin, marked ``# tune_hydra``: the import, ``th.shard`` of the compiled model and its
optimizer (the original module is cut and each shard's forward compiled with the user's
``torch.compile`` settings), and ``th.optimize`` running two trials at once on its engine
(each trial's thread with its own torch generator, so every trial trains as it does
alone in the plain twin).

The full size compiles with inductor, torch.compile's default; the smoke size with
``aot_eager`` (inductor compiles C++ on the CPU, slowly on a small machine).

Run::

    python examples/compiled_loop.py           # 6 trials, inductor
    TUNE_HYDRA_SMOKE=1 python examples/compiled_loop.py   # 2 small trials
"""

import os

import optuna
import torch
from torch import nn

import tune_hydra as th  # tune_hydra

SMOKE = os.environ.get("TUNE_HYDRA_SMOKE") == "1"
BACKEND = "aot_eager" if SMOKE else "inductor"


class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits


def fashion_mnist_like(n, seed):
    """Random 28x28 images, each labelled by a fixed linear rule (the tutorial downloads
    FashionMNIST)."""
    images = torch.rand(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))
    rule = torch.randn(28 * 28, 10, generator=torch.Generator().manual_seed(1234))
    labels = (images.flatten(1) @ rule).argmax(1)
    return torch.utils.data.TensorDataset(images, labels)


def train_loop(dataloader, model, loss_fn, optimizer):
    model.train()
    for X, y in dataloader:
        pred = model(X)
        loss = loss_fn(pred, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_loop(dataloader, model, loss_fn):
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for X, y in dataloader:
            pred = model(X)
            test_loss += loss_fn(pred, y).item()
            correct += (pred.argmax(1) == y).type(torch.float).sum().item()
    return test_loss / len(dataloader), correct / len(dataloader.dataset)


def objective(trial):
    learning_rate = trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
    momentum = trial.suggest_float("momentum", 0.0, 0.9)
    torch.manual_seed(0)
    train_dataloader = torch.utils.data.DataLoader(
        fashion_mnist_like(256 if SMOKE else 4096, 0), batch_size=64, shuffle=True
    )
    test_dataloader = torch.utils.data.DataLoader(fashion_mnist_like(128, 1), batch_size=64)
    model = NeuralNetwork()
    model = torch.compile(model, backend=BACKEND)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=momentum)
    model, optimizer = th.shard(model, optimizer)  # tune_hydra
    epochs = 2 if SMOKE else 5
    for _ in range(epochs):
        train_loop(train_dataloader, model, loss_fn, optimizer)
        test_loss, accuracy = test_loop(test_dataloader, model, loss_fn)
    trial.set_user_attr("accuracy", accuracy)
    return test_loss


if __name__ == "__main__":
    space = {"learning_rate": [1e-2, 1e-1], "momentum": [0.9] if SMOKE else [0.0, 0.5, 0.9]}
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(space, seed=0))
    n_trials = len(space["learning_rate"]) * len(space["momentum"])
    th.optimize(study, objective, n_trials, max_concurrent=2, device_memory="10MiB")  # tune_hydra
    print("best params:", study.best_params)
    print("best test loss:", study.best_value)
    for trial in study.trials:
        print("trial", trial.params, trial.value)
