"""Ray Tune's getting-started search, run on tune_hydra in the literal form.

Ray Tune's "Getting Started" tutorial tunes the learning rate and momentum of a small
`ConvNet` on MNIST with OptunaSearch and ASHA, optimising `mean_accuracy`. This is that
search with the model class exactly as the tutorial writes it (functional `relu`,
`max_pool2d` and `view` in `forward`) — only its training loop became a task factory, and
`tune.run` got `trial_executor=HydraExecutor(...)` after one `th.patch_tune()`.

No downloads: the data are MNIST-shaped synthetic digits (28x28 images whose label a fixed
random teacher network decides), so accuracy has something to learn.

    python examples/tune_mnist.py            # 12 trials, ~1-2 min on 2 CPU cores
    python examples/tune_mnist.py --tiny     # 4 trials, seconds (the tests run this)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from torch import nn

import tune_hydra as th


class ConvNet(nn.Module):  # Ray Tune's getting-started model, unchanged
    def __init__(self):
        super(ConvNet, self).__init__()  # noqa: UP008 - as the tutorial writes it
        # In this example, we don't change the model architecture
        # due to simplicity.
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3)
        self.fc = nn.Linear(192, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 3))
        x = x.view(-1, 192)
        x = self.fc(x)
        return F.log_softmax(x, dim=1)


def mnist_like(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` synthetic 28x28 digits in batches of 64, labelled by a fixed random teacher."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 1, 28, 28, generator=g)
    teacher = torch.randn(28 * 28, 10, generator=torch.Generator().manual_seed(0))
    labels = (images.flatten(1) @ teacher).argmax(1)
    return [(images[i : i + 64], labels[i : i + 64]) for i in range(0, n, 64)]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(1) == target).float().mean()


def make_task(config: dict) -> th.ModelTask:
    """The tutorial's `train_mnist(config)` minus its loop: what to train and how."""
    return th.ModelTask(
        model=ConvNet(),
        loss_fn=F.nll_loss,
        optimizer=lambda params: torch.optim.SGD(
            params, lr=config["lr"], momentum=config["momentum"]
        ),
        train_data=mnist_like(config.get("train_size", 1024), seed=1),
        eval_data=mnist_like(256, seed=2),
        metrics={"mean_accuracy": accuracy},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny",
        action="store_true",
        default=os.environ.get("TUNE_HYDRA_SMOKE") == "1",
        help="4 trials, small data (also TUNE_HYDRA_SMOKE=1)",
    )
    parser.add_argument("--storage", default=None, help="Tune's storage_path")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch()
    except (ImportError, AssertionError):
        raise SystemExit('this example needs optuna: pip install "tune_hydra[optuna]"') from None

    th.patch_tune()  # from now on tune.run accepts trial_executor=
    analysis = tune.run(
        make_task,
        config={
            "lr": tune.loguniform(1e-4, 1e-1),
            "momentum": tune.uniform(0.1, 0.9),
            "train_size": 256 if args.tiny else 1024,
        },
        num_samples=4 if args.tiny else 12,
        metric="mean_accuracy",
        mode="max",
        search_alg=search,
        scheduler=ASHAScheduler(max_t=3 if args.tiny else 10, grace_period=1),
        stop={"training_iteration": 3 if args.tiny else 10},
        storage_path=args.storage,
        # th.plan(make_task, config, device_memory=...) told the budget: 960 KiB cuts the
        # ConvNet in 2 shards (conv1 | fc); it needs at least 918 KiB.
        trial_executor=th.HydraExecutor(devices="cpu", device_memory="960KiB"),
        verbose=1,
    )
    best = analysis.get_best_trial("mean_accuracy", "max", scope="all")
    print(f"best config: {best.config}")
    print(f"best mean_accuracy: {best.metric_analysis['mean_accuracy']['max']:.4f}")
    checkpoint = analysis.get_best_checkpoint(best, "mean_accuracy", "max")
    path = os.path.join(checkpoint.path, "model.pt")
    model = ConvNet()
    model.load_state_dict(torch.load(path, weights_only=True))  # the tutorial's own class
    print(f"best model.pt: {path}")  # loads into the tutorial's own ConvNet()


if __name__ == "__main__":
    main()
