"""A native Optuna study on tune_hydra: ``th.optimize`` with a MedianPruner, no Ray.

The search of Ray Tune's getting-started guide (a small ConvNet on MNIST, SGD's learning
rate and momentum), written as a plain Optuna study: ``make_task(trial)`` suggests the
hyperparameters and returns a ``th.ModelTask``; ``th.optimize`` trains several trials at
once on the shared devices, reports ``mean_accuracy`` to Optuna after every epoch, and
drops a trial's work the moment the MedianPruner prunes it. The model is the guide's
``ConvNet`` class as written (``tune_hydra`` cuts it by tracing its ``forward``). The
data is synthetic MNIST-like digits (28x28, 10 classes) made on the spot, so nothing is
downloaded.

Run::

    python examples/optuna_study.py --tiny         # a few seconds on a CPU
    python examples/optuna_study.py                # 20 trials x up to 10 epochs
    python examples/optuna_study.py --devices cuda:0 cuda:1 --device-memory 2GiB

Distributed (Optuna's own mode): start the same command on several machines (or
terminals) with one shared storage; each trains its own trials on its own devices::

    python examples/optuna_study.py --storage sqlite:///mnist.db --study-name mnist

At the end it prints the best trial's parameters, its mean_accuracy, the path of its
``model.pt`` and that model's accuracy on the validation data (loaded from the file into
a fresh ``ConvNet()``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th

IMAGE = 28
CLASSES = 10


# --------------------------------------------------------------------------- the data
def make_digits(n: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` synthetic 28x28 "digits": each class is a smooth random pattern, each image
    its class's pattern plus noise; batched as ``(images, labels)`` pairs."""
    patterns = torch.randn(CLASSES, 1, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))
    patterns = F.avg_pool2d(patterns, 5, stride=1, padding=2)
    patterns = patterns / patterns.std(dim=(1, 2, 3), keepdim=True)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    images = patterns[labels] + 3.0 * torch.randn(n, 1, IMAGE, IMAGE, generator=g)
    return [
        (images[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, n, batch_size)
    ]


# --------------------------------------------------------------------------- the model
class ConvNet(nn.Module):  # Ray Tune's getting-started model, unchanged
    def __init__(self):
        super(ConvNet, self).__init__()  # noqa: UP008 - as the guide writes it
        # In this example, we don't change the model architecture
        # due to simplicity.
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3)
        self.fc = nn.Linear(192, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 3))
        x = x.view(-1, 192)
        x = self.fc(x)
        return F.log_softmax(x, dim=1)


def batch_accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The metric: the share of right answers in a batch (the engine averages it over
    the validation data, weighted by batch size)."""
    return (output.argmax(1) == target).float().mean()


def accuracy(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        right = sum(int((model(x).argmax(1) == y).sum()) for x, y in data)
    return right / sum(len(y) for _, y in data)


# --------------------------------------------------------------------------- the search
def make_objective(train: list[Any], val: list[Any]) -> Any:
    """The define-by-run task factory: Optuna's trial in, a ``th.ModelTask`` out. The data
    is made once, outside it; the model is built inside it, fresh for every trial."""

    def make_task(trial: Any) -> th.ModelTask:
        lr = trial.suggest_float("lr", 1e-10, 0.1, log=True)  # Tune's guide: loguniform
        momentum = trial.suggest_float("momentum", 0.1, 0.9)
        return th.ModelTask(
            model=ConvNet(),
            loss_fn=nn.NLLLoss(),
            optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum),
            train_data=train,
            eval_data=val,
            metrics={"mean_accuracy": batch_accuracy},
        )

    return make_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny",
        action="store_true",
        default=os.environ.get("TUNE_HYDRA_SMOKE") == "1",
        help="a few seconds on a CPU (also TUNE_HYDRA_SMOKE=1)",
    )
    parser.add_argument("--trials", type=int, help="trials to run (default 20; --tiny: 6)")
    parser.add_argument("--epochs", type=int, help="epochs per trial (default 10; --tiny: 3)")
    parser.add_argument("--devices", nargs="+", default=["auto"], help="default: auto")
    parser.add_argument(
        "--device-memory", default="960KiB", help="per-device budget (cuts the net in 2 shards)"
    )
    parser.add_argument("--max-concurrent", type=int, default=4, help="trials at once")
    parser.add_argument("--output", help="folder for the models (default: a temp folder)")
    parser.add_argument("--storage", help="an Optuna storage URL shared by several runs")
    parser.add_argument("--study-name", default="optuna_study", help="with --storage")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("optuna") is None:
        parser.error('this example needs optuna: pip install "tune_hydra[optuna]"')
    import optuna

    trials = args.trials or (6 if args.tiny else 20)
    epochs = args.epochs or (3 if args.tiny else 10)
    n_train, n_val = (512, 256) if args.tiny else (6000, 1000)
    train, val = make_digits(n_train, 64, seed=1), make_digits(n_val, 256, seed=2)
    output = args.output or tempfile.mkdtemp(prefix="optuna_study_")
    devices = args.devices[0] if args.devices == ["auto"] else args.devices

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=args.study_name if args.storage else None,
        storage=args.storage,
        load_if_exists=True,
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
    )
    th.optimize(
        study,
        make_objective(train, val),
        n_trials=trials,
        epochs=epochs,
        devices=devices,
        device_memory=args.device_memory,
        max_concurrent=args.max_concurrent,
        metric="mean_accuracy",
        save_dir=output,
        seed=0,
    )

    states = Counter(t.state.name for t in study.trials)
    shards = sorted(
        {t.user_attrs["num_shards"] for t in study.trials if "num_shards" in t.user_attrs}
    )
    print(f"{len(study.trials)} trials: {dict(states)}; shards per model: {shards}")
    if not study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        errors = {t.user_attrs.get("error", t.state.name) for t in study.trials}
        print(f"no trial completed: {errors}", file=sys.stderr)
        return 1
    best = study.best_trial
    print(f"best trial: {best.number}")
    print(f"best params: {best.params}")
    print(f"best mean_accuracy: {best.value:.4f} after {len(best.intermediate_values)} epochs")
    path = best.user_attrs["model_path"]
    print(f"best model.pt: {path}")
    model = ConvNet()
    model.load_state_dict(torch.load(path, weights_only=True))
    print(f"its validation accuracy: {accuracy(model, val):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
