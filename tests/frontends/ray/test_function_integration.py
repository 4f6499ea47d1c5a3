"""Function trainables (their own loop, ``th.shard`` + ``tune.report``) under a
HydraExecutor (issue 20): run in the engine process, exact against the same function
without ``th.shard``, with Tune's schedulers, checkpoints and context."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import cloudpickle, tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining
from torch import nn

import tune_hydra as th
from tests.frontends.ray import relay
from tune_hydra.frontends.ray import HydraExecutor
from tune_hydra.frontends.ray.errors import NoShardError

pytestmark = pytest.mark.integration

# The engine actors unpickle this module's functions: send them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ITERS = 3


class ConvNet(nn.Module):
    """Ray Tune's PBT/MNIST ConvNet, shrunk to 1x8x8 inputs."""

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


def train_convnet(config: dict[str, Any]) -> None:
    """A Ray-Tune-style function trainable: SGD momentum, accuracy, a checkpoint per
    iteration, resumes from ``tune.get_checkpoint()`` (weights, optimizer, iteration)."""
    torch.manual_seed(config["seed"])
    train_loader, test_loader = _data(1), _data(2)
    model = ConvNet().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    if config.get("shard", True):
        model, optimizer = th.shard(model, optimizer)
    start, restored_from = 0, ""
    checkpoint = tune.get_checkpoint()
    if checkpoint:
        restored_from = checkpoint.path
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "ckpt.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["iteration"]
    for i in range(start, config.get("iters", ITERS)):
        model.train()
        total = 0.0
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = nn.functional.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in test_loader:
                correct += int((model(x).argmax(1) == y).sum())
        acc = correct / 24
        with tempfile.TemporaryDirectory() as d:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iteration": i + 1,
                },
                os.path.join(d, "ckpt.pt"),
            )
            tune.report(
                {
                    "mean_accuracy": acc,
                    "train_loss": total,
                    "lr_seen": config["lr"],
                    "seed_seen": config["seed"],  # PBT copies the donor's config
                    "start": start,
                    "restored_from": restored_from,
                },
                checkpoint=tune.Checkpoint.from_directory(d),
            )


def _plain(config: dict[str, Any], checkpoint: Any = None, fn: Any = None) -> relay.FakeSession:
    """The function (``train_convnet`` by default) without th.shard, in this thread, with
    a fake session."""
    return relay.plain(fn or train_convnet, {**config, "shard": False}, checkpoint)


def _executor(**options: Any) -> HydraExecutor:
    """2 emulated copying devices, layers cut into several shards."""
    return relay.emulated_executor(1, **options)


def _load(trial_checkpoint: Any) -> dict[str, Any]:
    with trial_checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "ckpt.pt"), weights_only=False)


make_shared_executor = _executor  # the shared_executor fixture's (conftest)


SEEDS = [0, 1, 2]
BASE = {"lr": 0.1, "momentum": 0.9}


def test_function_trainables_are_exact_and_tune_works(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """Three function trials multiplexed on one engine: every reported metric and the
    final checkpoint's weights and optimizer state equal the plain function's, bit for
    bit; the engine holds nothing of them afterwards."""
    th.patch_tune()  # the contract's form: tune.run(train_fn, trial_executor=...)
    try:
        ex = shared_executor
        analysis = tune.run(
            train_convnet,
            config={"seed": tune.grid_search(SEEDS), **BASE},
            metric="mean_accuracy",
            mode="max",
            storage_path=storage,
            verbose=0,
            trial_executor=ex,
        )
        # A stopped one ends at its next forward or report: wait for that first.
        assert relay.live_functions(ex) == []
        registered = ex.registered_trials()
    finally:
        th.unpatch_tune()
    trials = sorted(analysis.trials, key=lambda t: t.config["seed"])
    assert [t.status for t in trials] == ["TERMINATED"] * 3
    for trial in trials:
        plain = _plain(dict(trial.config))
        frame = analysis.trial_dataframes[trial.trial_id]
        keys = ["mean_accuracy", "train_loss"]
        got = frame[keys].to_dict("records")
        want = [{k: r[k] for k in keys} for r in plain.results]
        assert got == want
        state = _load(trial.checkpoint)
        for name, value in plain.states[-1]["model"].items():
            assert torch.equal(state["model"][name], value), name
        torch.testing.assert_close(
            state["optimizer"], plain.states[-1]["optimizer"], rtol=0, atol=0
        )
    assert all(not r["engine_tasks"] for r in registered.values()), registered


def train_tiny(config: dict[str, Any]) -> None:
    """A small function trainable: 2 reported steps of an MLP on its seed's data."""
    gen = torch.Generator().manual_seed(int(config["seed"]))
    x = torch.randn(16, 4, generator=gen)
    y = x.sum(1, keepdim=True)
    torch.manual_seed(int(config["seed"]))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if config.get("shard", True):
        model, optimizer = th.shard(model, optimizer)
    for _ in range(2):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tune.report({"loss": loss.item()})


def test_function_trials_reuse_their_proxy_process(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """Three function trials one after another: Tune keeps the first one's proxy process
    for the next (the function runs in the engine actor), also where the run says
    ``reuse_actors=False``; each trial's losses are its own plain run's."""
    ex = shared_executor
    analysis = th.run(
        train_tiny,
        config={"seed": tune.grid_search(SEEDS)},
        stop={"training_iteration": 2},
        max_concurrent_trials=1,
        reuse_actors=False,
        storage_path=storage,
        verbose=0,
        trial_executor=ex,
    )
    assert relay.live_functions(ex) == []
    trials = sorted(analysis.trials, key=lambda t: t.config["seed"])
    assert [t.status for t in trials] == ["TERMINATED"] * 3
    assert len({t.last_result["pid"] for t in trials}) == 1
    for trial in trials:
        plain = _plain({"seed": trial.config["seed"]}, fn=train_tiny)
        got = analysis.trial_dataframes[trial.trial_id]["loss"].tolist()
        assert got == [r["loss"] for r in plain.results]


def train_context(config: dict[str, Any]) -> None:
    """Reports Tune's context, its working directory and a relative file's contents; a
    config may raise mid-run or report from a thread of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = th.shard(model, optimizer)
    x = torch.randn(8, 4, dtype=torch.float64)
    ctx = tune.get_context()
    for i in range(4):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        with open("out.txt", "a") as f:  # relative: the trial's own directory
            f.write(ctx.get_trial_id() + "\n")
        if config.get("fail") and i == 1:  # mid-run, after one report
            raise RuntimeError("injected failure in the user's loop")
        thread_error = ""
        if config.get("thread"):
            caught: list[BaseException] = []

            def report_from_thread(caught: list[BaseException] = caught) -> None:
                try:
                    tune.report({"score": 0.0})
                except BaseException as err:
                    caught.append(err)

            worker = threading.Thread(target=report_from_thread)
            worker.start()
            worker.join()
            thread_error = f"{type(caught[0]).__name__}: {caught[0]}" if caught else "none"
        if i == 0 and not config.get("fail"):
            _after_stronger(config)
        try:
            tune.report(
                {
                    "score": config["q"] * (i + 1),
                    "trial_id": ctx.get_trial_id(),
                    "trial_name": ctx.get_trial_name(),
                    "trial_dir": ctx.get_trial_dir(),
                    "cwd": os.getcwd(),
                    "lines": Path("out.txt").read_text().count("\n"),
                    "thread_error": thread_error,
                }
            )
        finally:  # returned (Tune took it), or raised (Tune stopped the trial after it)
            if i == 0:
                (Path(config["order"]) / str(config["q"])).touch()


def _after_stronger(config: dict[str, Any]) -> None:
    """Wait until each stronger trial's first result was taken by Tune (a report returns,
    or a stopped trial's raises, only after that), so that ASHA's first rung sees the
    results strongest first, whatever the load: each weaker one is then below the rung's
    cutoff. (Sleeps ordered them, but not on a loaded machine: nothing was stopped.)"""
    deadline = time.monotonic() + 120
    for q in config["stronger"]:
        while not (Path(config["order"]) / str(q)).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def test_asha_context_cwd_failures_and_threads(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """Through a Tuner with ASHA: the weaker trials stop early, a trial that raises
    mid-run fails alone (its traceback in its error), each trial sees its own context and works in
    its own directory, and tune.report from a user's thread is a clear error."""
    qs = [0.5, 1.0, 2.0, 3.0, 4.0]
    ex = shared_executor
    order = tempfile.mkdtemp(prefix="order", dir=storage)
    tuner = tune.Tuner(
        ex.trainable(train_context),
        param_space={
            "q": tune.grid_search(qs),
            "fail": tune.sample_from(lambda config: config["q"] == 0.5),
            "thread": tune.sample_from(lambda config: config["q"] == 3.0),
            "order": order,
            "stronger": tune.sample_from(lambda config: [q for q in qs if q > config["q"]]),
        },
        tune_config=tune.TuneConfig(
            metric="score",
            mode="max",
            scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2),
        ),
        run_config=tune.RunConfig(storage_path=storage, verbose=0),
    )
    results = tuner.fit()
    # A stopped one ends at its next forward or report: wait for that first.
    assert relay.live_functions(ex) == []
    registered = ex.registered_trials()
    by_q = {r.config["q"]: r for r in results}
    failed = by_q[0.5]
    assert failed.error is not None
    assert "injected failure in the user's loop" in str(failed.error)
    assert len(failed.metrics_dataframe) == 1  # it failed after its first report
    assert "TrialFunctionError" in str(failed.error) or "raised in the engine" in str(failed.error)
    done = [r for q, r in by_q.items() if q != 0.5]
    assert all(r.error is None for r in done)
    lengths = {q: len(r.metrics_dataframe) for q, r in by_q.items() if q != 0.5}
    assert max(lengths.values()) == 4 and min(lengths.values()) < 4, lengths  # ASHA stopped
    cwds = set()
    for r in done:
        frame = r.metrics_dataframe
        last = frame.iloc[-1]
        assert last["trial_id"] == r.metrics["trial_id"] and last["trial_name"]
        assert Path(last["trial_dir"]).name == Path(r.path).name  # as plain Tune's
        # Tune's trial working directory (RAY_CHDIR_TO_TRIAL_DIR), one per trial
        assert last["cwd"].endswith(os.path.join("working_dirs", Path(r.path).name))
        assert list(frame["lines"]) == list(range(1, len(frame) + 1))  # nobody else's
        lines = (Path(last["cwd"]) / "out.txt").read_text().split()
        assert set(lines) == {last["trial_id"]}
        cwds.add(last["cwd"])
    assert len(cwds) == len(done)
    thread_error = by_q[3.0].metrics_dataframe["thread_error"].iloc[0]
    assert thread_error.startswith("ReportThreadError") and "not a trial's" in thread_error
    assert all(not r["engine_tasks"] for r in registered.values()), registered


def train_plainly(config: dict[str, Any]) -> None:
    model = nn.Linear(2, 1)
    for _ in range(3):
        tune.report({"score": float(model.weight.sum())})


def test_a_function_without_shard_ends_the_run_once(ray_session: Any, storage: str) -> None:
    with _executor() as ex, pytest.raises(NoShardError) as info:
        th.run(
            train_plainly,
            config={"i": tune.grid_search([0, 1])},
            metric="score",
            mode="max",
            storage_path=storage,
            trial_executor=ex,
            verbose=0,
        )
    text = str(info.value)
    assert "model, optimizer = th.shard(model, optimizer)" in text
    assert "'train_plainly' reported without calling th.shard" in text
    assert "experiment stops at the first one" in text


def _check_restarts(analysis: Any, iters: int) -> int:
    """Every run of a trial's function (from scratch, or restarted from a checkpoint:
    ``restored_from``) reports what the plain function started the same way reports, bit
    for bit; returns how many restarts there were."""
    restored = 0
    for trial in analysis.trials:
        frame = analysis.trial_dataframes[trial.trial_id]
        for path, rows in frame.groupby("restored_from"):
            restored += bool(path)  # "": the first run, from scratch
            config = {"seed": int(rows["seed_seen"].iloc[0]), "iters": iters, **BASE}
            config["lr"] = float(rows["lr_seen"].iloc[0])
            checkpoint = tune.Checkpoint(path) if path else None
            plain = _plain(config, checkpoint=checkpoint).results[: len(rows)]
            for key in ("start", "train_loss", "mean_accuracy"):
                assert list(rows[key]) == [r[key] for r in plain], key
    return restored


class _PauseOnce(FIFOScheduler):
    """Pauses every trial once, at its second result, and resumes it later (the pause
    and resume Tune does for HyperBand's rungs)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused: set[str] = set()

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        if result.get("training_iteration") == 2 and trial.trial_id not in self.paused:
            self.paused.add(trial.trial_id)
            return self.PAUSE
        return self.CONTINUE


def test_paused_function_trials_resume_exactly(ray_session: Any, storage: str) -> None:
    """A paused trial (HyperBand's rungs) is saved and its function stopped; resumed, the
    function restarts from its own last checkpoint and goes on exactly as the plain
    function restored from it; no trial errs, nothing is left running."""
    with _executor(recompute=True) as ex:  # shards recompute their forward in backward
        analysis = tune.run(
            ex.trainable(train_convnet),
            config={"seed": tune.grid_search([0, 1]), "iters": 4, **BASE},
            scheduler=_PauseOnce(),
            storage_path=storage,
            verbose=0,
        )
        assert relay.live_functions(ex) == []
    assert all(t.status == "TERMINATED" for t in analysis.trials), [
        (t.status, t.error_file) for t in analysis.trials
    ]
    assert _check_restarts(analysis, iters=4) == 2  # each trial paused and resumed once
    for trial in analysis.trials:
        frame = analysis.trial_dataframes[trial.trial_id]
        assert list(frame["start"])[-2:] == [2, 2]  # resumed after its 2nd iteration


def test_pbt_exploits_restore_weights_and_optimizer(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """PBT pauses the weaker trial and restarts its function from the stronger one's
    checkpoint (``tune.get_checkpoint()`` + ``load_state_dict`` of model and optimizer):
    what it trains from there equals the plain function restored from that checkpoint.
    Synchronous PBT: each perturbation waits for both trials, so that one trial racing
    through its iterations before the other reports (a loaded machine) still exploits."""
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=1,
        synch=True,
        quantile_fraction=0.5,
        resample_probability=1.0,
        hyperparam_mutations={"lr": [0.05, 0.2]},
    )
    ex = shared_executor
    analysis = tune.run(
        ex.trainable(train_convnet),
        config={"seed": tune.grid_search([0, 1]), "iters": 4, **BASE},
        scheduler=pbt,
        metric="train_loss",
        mode="min",
        storage_path=storage,
        verbose=0,
    )
    # A stopped one ends at its next forward or report: wait for that first.
    assert relay.live_functions(ex) == []
    registered = ex.registered_trials()
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    restored = _check_restarts(analysis, iters=4)
    assert restored >= 1  # PBT exploited at least once
    assert all(not r["engine_tasks"] for r in registered.values()), registered


def train_with_data(config: dict[str, Any], data: Any = None) -> None:
    """Data from tune.with_parameters through a shuffling DataLoader with worker
    processes (forked from the engine process's function thread)."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*data), batch_size=4, shuffle=True, num_workers=2
    )
    model = nn.Linear(3, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if config.get("shard", True):
        model, optimizer = th.shard(model, optimizer)
    for _ in range(2):
        total = 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
        tune.report({"loss": total, "batches": len(loader)})


def test_with_parameters_both_ways(
    shared_executor: HydraExecutor, ray_session: Any, storage: str
) -> None:
    """tune.with_parameters inside or around ex.trainable(fn): the data reach the
    function as a keyword argument (fetched by the engine, not the trial processes); its
    DataLoader's worker processes shuffle as the plain function's do (exact)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    data = (x, torch.randn(16, 1, generator=gen, dtype=torch.float64))
    ex = shared_executor
    inside = ex.trainable(tune.with_parameters(train_with_data, data=data))
    around = tune.with_parameters(ex.trainable(train_with_data), data=data)
    frames = []
    for trainable in (inside, around):
        analysis = tune.run(trainable, config={}, storage_path=storage, verbose=0)
        (trial,) = analysis.trials
        assert trial.status == "TERMINATED", trial.error_file
        frames.append(analysis.trial_dataframes[trial.trial_id])
    assert relay.live_functions(ex) == []
    plain = relay.plain(lambda config: train_with_data(config, data=data), {"shard": False})
    want = [r["loss"] for r in plain.results]
    assert list(frames[0]["batches"]) == [4, 4] and list(frames[1]["batches"]) == [4, 4]
    assert list(frames[0]["loss"]) == want and list(frames[1]["loss"]) == want
