# ruff: noqa
# fmt: off
# Copyright The Ray Authors, Apache License 2.0: Ray Tune's "Getting Started" tutorial
# (doc/source/tune/getting-started.rst, its code in python/ray/tune/tests/tutorial.py).
"""Ray Tune's getting-started search (MNIST ConvNet, OptunaSearch + ASHA, the best trial's
checkpoint reloaded), plain (``tune_getting_started_plain.py``) and on tune_hydra
(``tune_getting_started.py``, its changed lines marked ``# tune_hydra``).

The tutorial's ``train_mnist(config)`` as issue #20 converts it: Ray's ``ConvNet``,
``train_func``, ``test_func`` and ``get_data_loaders`` (imported from
``ray.tune.examples.mnist_pytorch``), ten epochs, each reporting ``mean_accuracy`` to Tune
with a checkpoint holding ``model.pth``; searched by ``OptunaSearch`` with ``ASHAScheduler``
through ``tune.Tuner``, then the best trial's ``model.pth`` loaded into a fresh ``ConvNet``
as the tutorial's analysis step does. Replaced: ``ray.tune.examples.mnist_pytorch`` (which
needs torchvision) by its copy ``mnist_pytorch_plain.py`` next to this file
(MNIST-shaped synthetic data, see ``synthetic.py``); ``--smoke-test`` runs 8 trials.

    python examples/ray_tune/tune_getting_started.py --smoke-test
"""
import argparse
import os
import tempfile

import torch
import torch.optim as optim

from ray import tune
from ray.tune import Checkpoint
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch
import tune_hydra as th  # tune_hydra

from mnist_pytorch_plain import ConvNet, get_data_loaders, test_func, train_func  # Ray's mnist_pytorch, on synthetic data


def train_mnist(config):
    train_loader, test_loader = get_data_loaders()
    model = ConvNet()
    optimizer = optim.SGD(
        model.parameters(), lr=config["lr"], momentum=config["momentum"])
    model, optimizer = th.shard(model, optimizer)  # tune_hydra
    for i in range(10):
        train_func(model, optimizer, train_loader)
        acc = test_func(model, test_loader)
        with tempfile.TemporaryDirectory() as d:
            # This saves the model to the trial's checkpoint
            torch.save(model.state_dict(), os.path.join(d, "model.pth"))
            # Send the current training result back to Tune
            tune.report({"mean_accuracy": acc}, checkpoint=Checkpoint.from_directory(d))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--smoke-test", action="store_true", help="Finish quickly for testing")
    args, _ = parser.parse_known_args()

    search_space = {
        "lr": tune.loguniform(1e-4, 1e-1),
        "momentum": tune.uniform(0.1, 0.9),
    }
    tuner = tune.Tuner(
        th.HydraExecutor().trainable(train_mnist),  # tune_hydra
        tune_config=tune.TuneConfig(
            metric="mean_accuracy",
            mode="max",
            search_alg=OptunaSearch(),
            scheduler=ASHAScheduler(),
            num_samples=8 if args.smoke_test else 20,
        ),
        param_space=search_space,
    )
    results = tuner.fit()

    best_result = results.get_best_result("mean_accuracy", mode="max")
    with best_result.checkpoint.as_directory() as checkpoint_dir:
        state_dict = torch.load(os.path.join(checkpoint_dir, "model.pth"))

    model = ConvNet()
    model.load_state_dict(state_dict)
    print("Best config:", best_result.config)
    print("Best trial's last mean_accuracy:", best_result.metrics["mean_accuracy"])
    print("Reloaded best model, test accuracy:", test_func(model, get_data_loaders()[1]))
