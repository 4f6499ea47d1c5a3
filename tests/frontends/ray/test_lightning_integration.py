"""Lightning's ``Trainer`` as a Tune function trainable under a HydraExecutor (issue 32).

The function builds a LightningModule whose network is ``th.shard``-ed in ``__init__``
and fits it with ``lightning.Trainer(..., strategy=th.HydraStrategy())``: it runs in the
engine process, one thread per trial, two trials at once. Each trial's reports equal the
same function's with plain Lightning (no ``th.shard``, no strategy), run alone here:
``precision="64-true"``, ``==``. The LightningModule, data and Trainer arguments are
those of ``tests/frontends/test_lightning.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import cloudpickle, tune

import tune_hydra as th
from tests.frontends.ray import relay
from tune_hydra.frontends.ray import HydraExecutor

pl = pytest.importorskip("lightning.pytorch")

from tests.frontends import test_lightning  # noqa: E402
from tests.frontends.test_lightning import LitNet, loaders, net, trainer  # noqa: E402

pytestmark = pytest.mark.integration

# The engine actor unpickles these functions (and the LightningModule) by value: it
# cannot import the test package.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(test_lightning)

RATES = [1e-2, 3e-2]


class Net(LitNet):
    """The test's LightningModule with the trial's learning rate."""

    def __init__(self, lr: float, shard: bool) -> None:
        super().__init__(net(), None, "init" if shard else "")
        self.lr = lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.network.parameters(), lr=self.lr)


class ReportEpochs(pl.Callback):  # type: ignore[misc]
    """One Tune result an epoch: its validation loss and its training losses' sum."""

    def on_validation_epoch_end(self, trainer: Any, module: Any) -> None:
        if trainer.sanity_checking:
            return
        tune.report(
            {
                "val_loss": float(trainer.callback_metrics["val_loss"]),
                "train_losses": repr(module.losses),
            }
        )


def train_lightning(config: dict[str, Any]) -> None:
    """A function trainable: Lightning fits the network (sharded unless ``shard`` is
    False, then under ``th.HydraStrategy()``), reporting each epoch."""
    shard = config.get("shard", True)
    model = Net(config["lr"], shard)
    train, val = loaders()
    strategy = {"strategy": th.HydraStrategy()} if shard else {}
    t = trainer(Path("lightning"), callbacks=[ReportEpochs()], **strategy)
    t.fit(model, train, val)


def _plain(lr: float) -> list[dict[str, Any]]:
    """The function with plain Lightning, in this thread, with a fake session."""
    return relay.plain(train_lightning, {"lr": lr, "shard": False}).results


def make_shared_executor() -> HydraExecutor:
    """2 emulated copying devices, at most 2 layers a shard (3 shards a network)."""
    return relay.emulated_executor(2)


def test_lightning_function_trials_each_equal_alone(
    shared_executor: HydraExecutor,
    ray_session: Any,
    storage: str,
    tmp_path: Path,
    monkeypatch: Any,
    one_torch_thread: None,
) -> None:
    """Two Lightning function trials at once on one engine: each trial's per-epoch
    val_loss and training losses equal plain Lightning's alone; both networks trained on
    the engine (3 shards each) and left it."""
    ex = shared_executor
    analysis = th.run(
        train_lightning,
        config={"lr": tune.grid_search(RATES)},
        storage_path=storage,
        verbose=0,
        trial_executor=ex,
    )
    trace = ex.trace()
    assert relay.live_functions(ex) == []
    assert all(not r["engine_tasks"] for r in ex.registered_trials().values())
    monkeypatch.chdir(tmp_path)  # plain Lightning's default_root_dir
    trials = sorted(analysis.trials, key=lambda t: t.config["lr"])
    assert [t.status for t in trials] == ["TERMINATED"] * 2, [t.error_file for t in trials]
    for trial in trials:
        want = _plain(trial.config["lr"])
        got = analysis.trial_dataframes[trial.trial_id][["val_loss", "train_losses"]]
        assert len(want) == 2  # 2 epochs
        assert got.to_dict("records") == want
    shards: dict[str, set[int]] = {}
    for event in trace.events:
        shards.setdefault(event.task, set()).add(event.shard)
    assert len(shards) == 2 and all(s == {0, 1, 2} for s in shards.values()), shards
