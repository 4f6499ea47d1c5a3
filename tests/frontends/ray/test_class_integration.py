"""Class trainables (``tune.Trainable`` subclasses with ``th.shard`` in ``setup``) under a
HydraExecutor (issue 32): each trial's instance lives in the engine process, exact against
the plain class under a plain Tuner; PBT (with ``reuse_actors``), ``Tuner.restore`` and
the mistakes behave as with the plain class or say what to do."""

from __future__ import annotations

import hashlib
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import cloudpickle, tune
from ray.tune.schedulers import FIFOScheduler, PopulationBasedTraining
from torch import nn

import tune_hydra as th
from tests.frontends.ray import relay
from tune_hydra.frontends.ray import HydraExecutor
from tune_hydra.frontends.ray.errors import NoShardError, NotATaskFactoryError

pytestmark = pytest.mark.integration

# The engine actors (and the plain Tuner's trial processes) unpickle this module's classes.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ITERS = 3


class ConvNet(nn.Module):
    """Ray Tune's MNIST ConvNet, shrunk to 1x8x8 inputs (dropout: the trial's generator)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(27, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.max_pool2d(self.conv1(x), 2))
        return torch.log_softmax(self.fc(self.drop(x.flatten(1))), dim=1)


def _data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(8, 1, 8, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 4, (8,), generator=gen),
        )
        for _ in range(3)
    ]


def _digest(state: dict[str, torch.Tensor]) -> str:
    """The model's weights, bit for bit, as one hash."""
    return hashlib.sha256(
        b"".join(t.detach().numpy().tobytes() for t in state.values())
    ).hexdigest()


def _wait_for_peers(folder: str, count: int) -> None:
    """A cross-process barrier: the trials start a step together (bounded)."""
    os.makedirs(folder, exist_ok=True)
    Path(folder, uuid.uuid4().hex).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < count and time.monotonic() < deadline:
        time.sleep(0.02)


class TrainConvNet(tune.Trainable):
    """Ray-Tune-style class trainable: SGD momentum, accuracy, a checkpoint file per save.

    Config: ``seed``, ``lr``, ``shard`` (True), ``barrier`` / ``peers`` (wait for the other
    trials before each step: none can finish before another started, whatever the
    load), ``marker`` (raise at the third step while it exists).
    """

    def setup(self, config: dict[str, Any], train_data: Any = None) -> None:
        torch.manual_seed(config["seed"])
        self.train_data = _data(1) if train_data is None else train_data
        self.test_data = _data(2)
        self.model = ConvNet().double()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=config["lr"], momentum=0.9)
        self.instance = uuid.uuid4().hex
        self.loaded_from = self.loaded_digest = ""
        if config.get("shard", True):
            self.model, self.optimizer = th.shard(self.model, self.optimizer)

    def step(self) -> dict[str, Any]:
        if self.config.get("barrier"):
            _wait_for_peers(
                os.path.join(self.config["barrier"], str(self.iteration)), self.config["peers"]
            )
        if (
            self.config.get("marker")
            and self.iteration == 2
            and os.path.exists(self.config["marker"])
        ):
            raise RuntimeError("injected failure at the third step")
        start = _digest(self.model.state_dict())
        self.model.train()
        total = 0.0
        for x, y in self.train_data:
            self.optimizer.zero_grad()
            loss = nn.functional.nll_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
        self.model.eval()
        with torch.no_grad():
            hits = sum(int((self.model(x).argmax(1) == y).sum()) for x, y in self.test_data)
        return {
            "train_loss": total,
            "mean_accuracy": hits / 24,
            "start_digest": start,
            "loaded_from": self.loaded_from,
            "loaded_digest": self.loaded_digest,
            "iter_seen": self.iteration,
            "lr_seen": self.optimizer.param_groups[0]["lr"],
            "instance": self.instance,
            "engine_pid": os.getpid(),
            "cwd": os.getcwd(),
        }

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        torch.save(state, os.path.join(checkpoint_dir, "ckpt.pt"))
        if self.config.get("save_log"):  # what each trial saved when (Tune may reuse folders)
            with open(self.config["save_log"], "a") as f:
                f.write(f"{self.trial_id} {self.iteration} {_digest(state['model'])}\n")

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        state = torch.load(os.path.join(checkpoint_dir, "ckpt.pt"), weights_only=False)
        self.loaded_digest = _digest(state["model"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # this trial's lr, not the donor's
            group["lr"] = self.config["lr"]
        self.loaded_from = checkpoint_dir

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        for group in self.optimizer.param_groups:
            group["lr"] = new_config["lr"]
        return True


def _plain_steps(
    config: dict[str, Any], checkpoint: str | None, iteration: int, steps: int, **params: Any
) -> list[dict[str, Any]]:
    """The plain class driven as Tune drives a restored trial (setup, load_checkpoint,
    steps), in this process."""
    plain = TrainConvNet.__new__(TrainConvNet)
    plain.config = {"seed": config["seed"], "lr": config["lr"], "shard": False}
    plain._iteration, plain._trial_info = iteration, None
    plain.setup(dict(plain.config), **params)
    if checkpoint:
        plain.load_checkpoint(checkpoint)
    out = []
    for _ in range(steps):
        out.append(plain.step())
        plain._iteration += 1
    return out


def _executor() -> HydraExecutor:
    return HydraExecutor(devices="cpu", max_layers_per_shard=1)


make_shared_executor = _executor  # the shared_executor fixture's (conftest)


KEYS = ["train_loss", "mean_accuracy", "start_digest", "iter_seen"]


def _fit(trainable: Any, storage: str, name: str, **space: Any) -> Any:
    return tune.Tuner(
        trainable,
        param_space={"lr": 0.1, **space},
        tune_config=tune.TuneConfig(metric="train_loss", mode="min"),
        run_config=tune.RunConfig(
            name=name, storage_path=storage, stop={"training_iteration": ITERS}, verbose=0
        ),
    ).fit()


def test_class_trainables_equal_the_plain_class_multiplexed_on_one_engine(
    ray_session: Any, storage: str, tmp_path: Path
) -> None:
    """Two trials of the class: every result equals the plain class's under a plain
    Tuner (float64, dropout: bit for bit), both trained at once in one engine process
    (their ops interleave on its trace), each in its own working directory; nothing
    of them stays on the engine."""
    plain = _fit(TrainConvNet, storage, "plain", seed=tune.grid_search([0, 1]), shard=False)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    with _executor() as ex:
        results = _fit(
            ex.trainable(TrainConvNet),
            storage,
            "hydra",
            seed=tune.grid_search([0, 1]),
            barrier=str(barrier),
            peers=2,
        )
        (engine,) = ex.engines().values()
        engine_pid = __import__("ray").get(engine.start.remote())["pid"]
        trace = ex.trace()
        # A stopped one ends at its next forward or report: wait for that first.
        assert relay.live_functions(ex) == []
        registered = ex.registered_trials()
    want = {r.config["seed"]: r.metrics_dataframe for r in plain}
    assert all(r.error is None for r in results), [r.error for r in results]
    cwds = set()
    for r in results:
        frame = r.metrics_dataframe
        assert len(frame) == ITERS
        assert frame[KEYS].to_dict("records") == want[r.config["seed"]][KEYS].to_dict("records")
        assert set(frame["engine_pid"]) == {engine_pid}  # the instance lives in the engine
        assert set(frame["pid"]) != {engine_pid}  # Tune's proxy is a process of its own
        assert frame["cwd"].iloc[-1].endswith(os.path.join("working_dirs", Path(r.path).name))
        cwds.add(frame["cwd"].iloc[-1])
    assert len(cwds) == 2
    spans = {}
    for event in trace.events:
        lo, hi = spans.get(event.task, (event.start, event.end))
        spans[event.task] = (min(lo, event.start), max(hi, event.end))
    assert len(spans) == 2, spans  # each trial's loop on the one engine
    (a0, a1), (b0, b1) = spans.values()
    assert a0 < b1 and b0 < a1, spans  # multiplexed: both trained at once
    assert all(not r["engine_tasks"] for r in registered.values()), registered


def test_pbt_exploits_restore_the_source_checkpoint(
    shared_executor: HydraExecutor, ray_session: Any, storage: str, tmp_path: Path
) -> None:
    """Synchronous PBT perturbing every iteration, with reuse_actors: the exploited trial
    restarts from the source trial's checkpoint (its weights at its next step are that
    checkpoint's, bit for bit) with its own new lr (reset_config / setup); reused
    instances keep their engine loops; nothing is left running. (The class comes in
    tune.with_parameters, whose setup fetches the data in the engine.)"""
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=1,
        quantile_fraction=0.5,
        resample_probability=1.0,
        hyperparam_mutations={"lr": [0.05, 0.2]},
        synch=True,
    )
    ex = shared_executor
    results = tune.Tuner(
        ex.trainable(tune.with_parameters(TrainConvNet, train_data=_data(1))),
        param_space={
            "lr": 0.1,
            "seed": tune.grid_search([0, 1]),
            "save_log": str(tmp_path / "saves.txt"),
        },
        tune_config=tune.TuneConfig(
            metric="train_loss", mode="min", scheduler=pbt, reuse_actors=True
        ),
        run_config=tune.RunConfig(storage_path=storage, stop={"training_iteration": 2}, verbose=0),
    ).fit()
    # A stopped one ends at its next forward or report: wait for that first.
    assert relay.live_functions(ex) == []
    registered = ex.registered_trials()
    assert all(r.error is None for r in results), [r.error for r in results]
    saved = {}  # (trial id, iteration) -> the weights it saved then
    for line in (tmp_path / "saves.txt").read_text().splitlines():
        trial_id, iteration, digest = line.split()
        saved[(trial_id, int(iteration))] = digest
    trial_ids = {Path(r.path).name: r.metrics["trial_id"] for r in results}
    exploits = 0
    seen_instances: set[str] = set()
    reused = 0
    for r in results:
        frame = r.metrics_dataframe
        assert list(frame["lr_seen"]) == list(frame["config/lr"])
        previous = ""
        for row in frame.to_dict("records"):
            if row["loaded_from"] != previous:  # the first step after a restore
                source = trial_ids[Path(row["loaded_from"]).parent.name]
                # The weights it trains from are those the source trial saved at the
                # iteration the restore says (self.iteration as restored), bit for bit.
                assert row["start_digest"] == row["loaded_digest"]
                assert row["loaded_digest"] == saved[(source, row["iter_seen"])]
                exploits += source != r.metrics["trial_id"]
                reused += row["instance"] in seen_instances
            seen_instances.add(row["instance"])
            previous = row["loaded_from"]
    assert exploits >= 1  # a trial restarted from the other trial's checkpoint
    assert reused >= 1  # Tune reset a cached proxy (reset_config) instead of a new setup
    assert all(not r["engine_tasks"] for r in registered.values()), registered


class _PauseOnce(FIFOScheduler):
    """Pauses every trial once, at its first result, and resumes it later (the pause and
    resume Tune does for HyperBand's rungs)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused: set[str] = set()

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        if trial.trial_id not in self.paused:
            self.paused.add(trial.trial_id)
            return self.PAUSE
        return self.CONTINUE


def test_paused_trials_resume_exactly(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """Paused (saved, its proxy stopped) and resumed in a new proxy (a new instance:
    setup, load_checkpoint): each trial goes on from its own checkpoint as the plain
    class restored from it does; nothing is left running."""
    ex = shared_executor
    results = tune.Tuner(
        ex.trainable(TrainConvNet),
        param_space={"lr": 0.1, "seed": tune.grid_search([0, 1])},
        tune_config=tune.TuneConfig(scheduler=_PauseOnce()),
        run_config=tune.RunConfig(
            storage_path=storage, stop={"training_iteration": ITERS}, verbose=0
        ),
    ).fit()
    assert relay.live_functions(ex) == []
    assert all(r.error is None for r in results), [r.error for r in results]
    for r in results:
        frame = r.metrics_dataframe
        assert list(frame["training_iteration"]) == [1, 2, 3]
        after = frame.iloc[1:].to_dict("records")
        checkpoint = after[0]["loaded_from"]
        assert Path(checkpoint).parent.name == Path(r.path).name  # its own checkpoint
        assert after[0]["instance"] != frame["instance"].iloc[0]  # a new instance
        plain = _plain_steps(r.config, checkpoint, iteration=1, steps=ITERS - 1)
        assert [{k: x[k] for k in KEYS} for x in after] == [{k: p[k] for k in KEYS} for p in plain]


def test_tuner_restore_resumes_from_the_checkpoint(
    shared_executor: HydraExecutor, ray_session: Any, storage: str, tmp_path: Path
) -> None:
    """A trial that fails at its third step (checkpoints every iteration) resumes with
    Tuner.restore(resume_errored=True) from its second checkpoint, as the plain class
    restored from it does; its data come from tune.with_parameters around the proxy."""
    marker = tmp_path / "fail"
    marker.touch()
    config = {"lr": 0.1, "seed": 3, "marker": str(marker)}
    data = _data(5)
    ex = shared_executor
    first = tune.Tuner(
        tune.with_parameters(ex.trainable(TrainConvNet), train_data=data),
        param_space=config,
        tune_config=tune.TuneConfig(metric="train_loss", mode="min"),
        run_config=tune.RunConfig(
            name="restore",
            storage_path=storage,
            stop={"training_iteration": ITERS + 1},
            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1),
            verbose=0,
        ),
    ).fit()
    assert first[0].error is not None and "injected failure" in str(first[0].error)
    assert len(first[0].metrics_dataframe) == 2
    marker.unlink()
    restored = tune.Tuner.restore(
        os.path.join(storage, "restore"),
        trainable=tune.with_parameters(ex.trainable(TrainConvNet), train_data=data),
        resume_errored=True,
    )
    (result,) = restored.fit()
    assert relay.live_functions(ex) == []
    assert result.error is None, result.error
    frame = result.metrics_dataframe
    assert list(frame["training_iteration"]) == [1, 2, 3, 4]
    after = frame.iloc[2:].to_dict("records")
    checkpoint = after[0]["loaded_from"]
    assert Path(checkpoint).name == "checkpoint_000001", checkpoint  # the 2nd one
    assert [row["iter_seen"] for row in after] == [2, 3]  # self.iteration as restored
    plain = _plain_steps(config, checkpoint, iteration=2, steps=2, train_data=data)
    assert [{k: row[k] for k in KEYS} for row in after] == [{k: p[k] for k in KEYS} for p in plain]


class TrainPlainly(TrainConvNet):
    """The class without its th.shard line."""

    def setup(self, config: dict[str, Any]) -> None:
        super().setup({**config, "shard": False})


def test_a_class_without_shard_ends_the_run_once(ray_session: Any, storage: str) -> None:
    with _executor() as ex, pytest.raises(NoShardError) as info:
        th.run(
            TrainPlainly,
            config={"lr": 0.1, "seed": 0},
            metric="train_loss",
            mode="min",
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    text = str(info.value)
    assert "self.model, self.optimizer = th.shard(self.model, self.optimizer)" in text
    assert "'TrainPlainly' stepped without calling th.shard" in text
    assert "experiment stops at the first one" in text


class NotATrainable:
    def setup(self, config: dict[str, Any]) -> None:
        pass


def test_a_class_that_is_no_trainable_is_refused() -> None:
    """A class that is no Trainable of the user's (or Tune's base class, Tune's wrapper of
    a function, a trainable the executor made) is refused before anything starts."""
    from ray.tune.trainable import wrap_function

    from tune_hydra.frontends.ray.classes import HydraClassTrainable
    from tune_hydra.frontends.ray.executor import check_task_factory

    ex = _executor()
    with pytest.raises(NotATaskFactoryError, match=r"not a ray\.tune\.Trainable subclass"):
        ex.trainable(NotATrainable)
    assert not ex.started
    assert check_task_factory(TrainConvNet) is True  # it reports its own results
    proxy = HydraClassTrainable.for_class(
        TrainConvNet, factory_id="f", run_id="r", secret="s", slot_resource=""
    )
    for bad, why in [
        (tune.Trainable, "base class itself"),
        (wrap_function(lambda config: None), "pass the function itself"),
        (proxy, "made by HydraExecutor.trainable"),
    ]:
        with pytest.raises(NotATaskFactoryError, match=why):
            check_task_factory(bad)
