"""The disk tier below host memory (``host_memory=``, ``spill_dir=``): training stays
exact (float64, bit for bit against plain PyTorch on a deepcopy) while shard states go to
files and come back, the trace's replay keeps host memory within the budget, checkpoints
taken while shards are on disk resume exactly, bad folders and full disks give clear
errors, and the engine's scratch folder is its own and is cleaned up."""

from __future__ import annotations

import copy
import errno
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import make_task, plain_copy
from tests.engine.test_resume import assert_equal
from tune_hydra.engine import Engine
from tune_hydra.exceptions import HostBudgetError, SpillDirError, SpillDiskFullError

# Every model is a stack of (Linear, ReLU) pairs and a last Linear: cut two layers per
# shard, every shard holds state, and the widest Linear(width, width) sets the largest.
CUT = 2
SEED = 3
CLIP_ACCUM = {"accumulate_steps": 2, "max_grad_norm": 0.5}


def stack(depth: int, width: int = 16, seed: int = 0) -> nn.Sequential:
    """``depth`` Linear layers (8 -> width ... -> 4) with ReLUs between, float64."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers).to(torch.float64)


def build(specs: dict[str, tuple[str, int, int]], n: int = 3) -> dict[str, th.ModelTask]:
    """Tasks ``{name: (optimizer, depth, width)}``, each with ``n`` batches per epoch."""
    return {
        name: make_task(stack(depth, width, seed=i), opt, n=n)
        for i, (name, (opt, depth, width)) in enumerate(specs.items())
    }


def state_sizes(tasks: dict[str, th.ModelTask]) -> tuple[int, int]:
    """(the largest shard state, all shards' states) of ``tasks`` as the engine cuts them,
    from the plans of deepcopies registered in an engine without a host budget."""
    with Engine("cpu", max_layers_per_shard=CUT, copy_on_cpu=True) as eng:
        for name, task in tasks.items():
            eng.add_task(name, copy.deepcopy(task), seed=SEED)
        states = [s.state_bytes for name in tasks for s in eng.plan(name).shards]
    return max(states), sum(states)


def parked(tasks: dict[str, th.ModelTask], options: dict[str, Any] | None = None) -> int:
    """The most boundary tensors ``tasks`` may park in host memory at once: one batch
    boundary each (rows x the widest layer, float64, per micro-batch of a group). The
    budget holds strictly at (devices + 2) x the largest shard state plus this."""
    group = (options or {}).get("accumulate_steps", 1)
    total = 0
    for task in tasks.values():
        rows = next(iter(task.train_data))[0].shape[0]
        width = max(m.out_features for m in task.model.modules() if isinstance(m, nn.Linear))
        total += group * rows * width * 8
    return total


def run_engine(
    tasks: dict[str, th.ModelTask],
    epochs: int,
    devices: list[str],
    host_memory: int | None,
    spill_dir: Path | None,
    options: dict[str, Any],
    **engine: Any,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any], Any]:
    """Train every task ``epochs`` iterations in one engine; returns the results, the
    host summary and the trace (after close: bringing the models back reads from disk)."""
    engine.setdefault("copy_on_cpu", True)
    with Engine(
        devices,
        max_layers_per_shard=CUT,
        host_memory=host_memory,
        spill_dir=spill_dir,
        **engine,
    ) as eng:
        for name, task in tasks.items():
            eng.add_task(name, task, seed=SEED, **options)
        futures = {name: eng.train(name, epochs) for name in tasks}
        results = {name: f.result(timeout=120) for name, f in futures.items()}
    return results, eng.summary()["host"], eng.trace


def assert_plain(
    results: list[dict[str, Any]],
    model: nn.Module,
    ref: th.ModelTask,
    epochs: int,
    devices: int,
    options: dict[str, Any],
) -> None:
    """``model`` (trained by the engine, with ``results``) equals plain training of ``ref``
    bit for bit: every loss and every parameter and buffer."""
    # Emulated devices run torch with a share of the intra-op threads; so does the reference.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // devices))
    try:
        want = th.train_plain(ref, epochs, seed=SEED, **options)
    finally:
        torch.set_num_threads(threads)
    assert [r["loss"] for r in results] == [r["loss"] for r in want]
    assert [r["val_loss"] for r in results] == [r["val_loss"] for r in want]
    got, expected = model.state_dict(), ref.model.state_dict()
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(
            got[key], expected[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}"
        )


def assert_disk_used(host: dict[str, Any], trace: Any, host_memory: int) -> None:
    """The run (its engine closed) wrote shard states to disk and read them back, its own
    account of host memory stayed within ``host_memory``, and the trace agrees."""
    assert host["budget"] == host_memory
    assert host["written_bytes"] > 0 and host["read_bytes"] > 0, host
    assert host["spills"] > 0 and host["loads"] > 0, host
    assert host["peak_held_bytes"] <= host_memory, host
    disk = trace.summary()["disk"]
    assert disk["written_bytes"] == host["written_bytes"], (disk, host)
    assert disk["read_bytes"] == host["read_bytes"], (disk, host)
    trace.validate(host_budget=host_memory)


# Four tasks, one of each optimizer (Adam twice, one narrower): with the host budget at
# (devices + 2) x the largest shard state their states sum to more than 4x the budget.
PARITY_TASKS = {
    "sgd": ("sgd", 8, 16),
    "adam": ("adam", 8, 16),
    "adamw": ("adamw", 8, 16),
    "narrow": ("adam", 8, 12),
}


@pytest.mark.parametrize(
    ("devices", "prefetch", "copy_on_cpu", "options"),
    [
        pytest.param(1, True, True, CLIP_ACCUM, id="1dev-prefetch-accum-clip"),
        pytest.param(1, False, True, {}, id="1dev-no-prefetch"),
        pytest.param(2, True, True, {}, id="2dev-prefetch"),
        pytest.param(2, False, True, CLIP_ACCUM, id="2dev-no-prefetch-accum-clip"),
        pytest.param(1, True, False, CLIP_ACCUM, id="1dev-no-copy-accum-clip"),
        pytest.param(2, True, False, {}, id="2dev-no-copy"),
    ],
)
def test_float64_parity_with_the_disk_tier(
    tmp_path: Path, devices: int, prefetch: bool, copy_on_cpu: bool, options: dict[str, Any]
) -> None:
    tasks = build(PARITY_TASKS)
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, total = state_sizes(tasks)
    host_memory = (devices + 2) * largest + parked(tasks, options)  # strict: no slack
    assert total >= 4 * host_memory, (total, host_memory)
    results, host, trace = run_engine(
        tasks,
        2,
        ["cpu"] * devices,
        host_memory,
        tmp_path,
        options,
        prefetch=prefetch,
        copy_on_cpu=copy_on_cpu,
    )
    assert_disk_used(host, trace, host_memory)
    for name, task in tasks.items():
        assert_plain(results[name], task.model, refs[name], 2, devices, options)


def test_host_memory_of_one_shard_trains_exactly_within_the_slack(tmp_path: Path) -> None:
    """At host_memory = the largest shard state (the least accepted), host memory may go
    over by at most (devices + 1) x that state, and training is still exact."""
    tasks = build({"a": ("adam", 6, 16), "b": ("sgd", 6, 16)})
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, _ = state_sizes(tasks)
    devices = 2
    results, host, trace = run_engine(tasks, 2, ["cpu"] * devices, largest, tmp_path, CLIP_ACCUM)
    assert host["written_bytes"] > 0 and host["read_bytes"] > 0, host
    slack = largest + (devices + 1) * largest
    assert host["peak_held_bytes"] <= slack, host
    trace.validate(host_budget=slack)
    for name, task in tasks.items():
        assert_plain(results[name], task.model, refs[name], 2, devices, CLIP_ACCUM)


# Three iterations of 3 batches over epochs of 4, in groups of 2: each checkpoint falls in
# the middle of an epoch and of an accumulation group.
MID_GROUP = {"accumulate_steps": 2, "iteration_batches": 3, "max_grad_norm": 0.05}
RESUME_TASKS = {"a": ("adam", 8, 16), "b": ("sgd", 8, 16), "c": ("adamw", 8, 16)}


def _first_leg(spill_dir: Path | None, host_memory: int | None, total: int) -> dict[str, Any]:
    """One iteration of each resume task (their states sum to ``total``); their
    checkpoints, taken in the engine."""
    tasks = build(RESUME_TASKS, n=4)
    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=host_memory,
        spill_dir=spill_dir,
    ) as eng:
        for name, task in tasks.items():
            eng.add_task(name, task, seed=SEED, **MID_GROUP)
        for fut in [eng.train(name, 1) for name in tasks]:
            fut.result(timeout=120)
        if host_memory is not None:
            # Some states are on disk now: the engine holds less than all of them in RAM.
            host = eng.summary()["host"]
            assert host["written_bytes"] > 0, host
            assert host["held_bytes"] <= host_memory < total, (host, total)
        return {name: eng.get_state(name) for name in tasks}


@pytest.mark.parametrize("second_on_disk", [True, False], ids=["disk-then-disk", "disk-then-ram"])
def test_resume_from_a_checkpoint_taken_while_shards_were_on_disk(
    tmp_path: Path, second_on_disk: bool
) -> None:
    largest, total = state_sizes(build(RESUME_TASKS, n=4))
    host_memory = 3 * largest
    states = _first_leg(tmp_path, host_memory, total)
    # The same checkpoints as an engine without the disk tier takes.
    for name, state in _first_leg(None, None, total).items():
        assert_equal(states[name], state, name)
    # Fresh models of other weights: the checkpoints bring theirs.
    fresh = {
        name: make_task(stack(depth, width, seed=99), opt, n=4)
        for name, (opt, depth, width) in RESUME_TASKS.items()
    }
    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=host_memory if second_on_disk else None,
        spill_dir=tmp_path if second_on_disk else None,
    ) as eng:
        for name, task in fresh.items():
            eng.add_task(name, task, seed=SEED, **MID_GROUP)
            eng.set_state(name, copy.deepcopy(states[name]))
        for fut in [eng.train(name, 3) for name in fresh]:
            fut.result(timeout=120)
        final = {name: eng.get_state(name)["model"] for name in fresh}
    if second_on_disk:
        assert_disk_used(eng.summary()["host"], eng.trace, host_memory)
    # 4 iterations of 3 batches = 3 epochs of 4 batches, uninterrupted and plain.
    options = {k: v for k, v in MID_GROUP.items() if k != "iteration_batches"}
    for name, task in build(RESUME_TASKS, n=4).items():
        th.train_plain(task, 3, seed=SEED, **options)
        assert_equal(final[name], task.model.state_dict(), name)
        assert_equal(fresh[name].model.state_dict(), task.model.state_dict(), name)


# -- errors ----------------------------------------------------------------------------


def test_a_missing_spill_dir_is_refused_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(SpillDirError, match=re.escape(str(missing))):
        Engine("cpu", host_memory=10**6, spill_dir=missing)
    with pytest.raises(SpillDirError):
        th.train_models(
            build({"a": ("sgd", 3, 8)}), devices=["cpu"], host_memory=10**6, spill_dir=missing
        )


def test_a_file_as_spill_dir_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    with pytest.raises(SpillDirError, match=re.escape(str(path))):
        Engine("cpu", host_memory=10**6, spill_dir=path)
    assert path.read_text() == "not a folder"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_spill_dir_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(SpillDirError, match=re.escape(str(folder))):
            Engine("cpu", host_memory=10**6, spill_dir=folder)
    finally:
        folder.chmod(0o700)


def test_host_memory_needs_a_spill_dir() -> None:
    with pytest.raises(SpillDirError, match="spill_dir"):
        Engine("cpu", host_memory="1GiB")


def test_a_host_budget_below_one_shard_state_is_refused_with_the_numbers(
    tmp_path: Path,
) -> None:
    specs = {"big": ("adam", 4, 32)}
    largest, _ = state_sizes(build(specs))
    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=largest - 1,
        spill_dir=tmp_path,
    ) as eng:
        with pytest.raises(HostBudgetError) as err:
            eng.add_task("big", build(specs)["big"], seed=SEED)
        assert "big" not in eng.tasks()
    assert (err.value.task, err.value.nbytes, err.value.budget) == ("big", largest, largest - 1)
    assert f"{largest} bytes" in str(err.value) and f"{largest - 1} bytes" in str(err.value)
    # exactly one shard's state is enough to register
    with Engine(
        "cpu", max_layers_per_shard=CUT, copy_on_cpu=True, host_memory=largest, spill_dir=tmp_path
    ) as eng:
        assert eng.add_task("big", build(specs)["big"], seed=SEED) > 1


def test_a_full_disk_fails_the_task_that_could_not_spill_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tune_hydra.engine.storage import disk

    # "doomed" alone holds more state than host memory: some of it must go to disk.
    specs = {"alpha": ("adam", 8, 16), "beta": ("sgd", 8, 16), "doomed": ("adamw", 10, 16)}
    tasks = build(specs)
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, _ = state_sizes(tasks)
    host_memory = 3 * largest
    _, doomed_total = state_sizes({"doomed": tasks["doomed"]})
    assert doomed_total > host_memory
    original = disk.write_at
    refused: list[str] = []

    def write_at(path: Any, fd: Any, data: Any, offset: int) -> Any:
        if "doomed" in os.path.basename(os.fspath(path)):
            refused.append(os.fspath(path))
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, fd, data, offset)

    with Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=host_memory,
        spill_dir=tmp_path,
    ) as eng:
        for name, task in tasks.items():
            eng.add_task(name, task, seed=SEED)
        monkeypatch.setattr(disk, "write_at", write_at)  # the disk fills up mid-run
        futures = {name: eng.train(name, 2) for name in tasks}
        with pytest.raises(SpillDiskFullError) as err:
            futures["doomed"].result(timeout=120)
        results = {name: futures[name].result(timeout=120) for name in ("alpha", "beta")}
        state = eng.get_state("doomed")
    assert refused, "no write of the doomed task's state was attempted"
    assert err.value.task == "doomed"
    assert str(tmp_path) in err.value.path
    assert "No space left on device" in str(err.value)
    # The failed task's model is whole: finite, and what its checkpoint says.
    model = tasks["doomed"].model.state_dict()
    assert list(model) == list(state["model"])
    for key, value in state["model"].items():
        assert torch.isfinite(value).all(), key
        torch.testing.assert_close(model[key], value, rtol=0, atol=0)
    for name in ("alpha", "beta"):
        assert_plain(results[name], tasks[name].model, refs[name], 2, 1, {})


# -- the scratch folder ----------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _spilling_engine(spill_dir: Path) -> tuple[Engine, dict[str, th.ModelTask]]:
    tasks = build({"a": ("adam", 6, 16), "b": ("adam", 6, 16)})
    largest, total = state_sizes(tasks)
    assert total > 3 * largest
    eng = Engine(
        "cpu",
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=3 * largest,
        spill_dir=spill_dir,
    )
    for name, task in tasks.items():
        eng.add_task(name, task, seed=SEED)
    return eng, tasks


def test_the_engine_folder_lives_as_long_as_the_engine(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    eng, tasks = _spilling_engine(tmp_path)
    try:
        for fut in [eng.train(name, 1) for name in tasks]:
            fut.result(timeout=120)
        assert eng.summary()["host"]["written_bytes"] > 0
        mine = [p for p in tmp_path.iterdir() if p.name != "notes.txt"]
        assert len(mine) == 1 and mine[0].is_dir(), mine
        assert mine[0].name.startswith("tune_hydra-")
        assert f"-{os.getpid()}-" in mine[0].name
        assert eng.summary()["host"]["spill_dir"] == str(mine[0])
    finally:
        eng.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_folders_of_dead_engines_of_this_host_are_removed_at_start(tmp_path: Path) -> None:
    # The engine's own folder name tells how it writes this host's name.
    eng, _ = _spilling_engine(tmp_path)
    own = [p.name for p in tmp_path.iterdir()]
    eng.close()
    assert len(own) == 1 and f"-{os.getpid()}-" in own[0], own
    prefix = own[0][: own[0].rindex(f"-{os.getpid()}-")]  # "tune_hydra-<host>"
    dead = _dead_pid()
    stale = tmp_path / f"{prefix}-{dead}-abc"
    live = tmp_path / f"{prefix}-{os.getpid()}-abc"
    elsewhere = tmp_path / f"tune_hydra-not{prefix[len('tune_hydra-') :]}x-{dead}-abc"
    data = tmp_path / "data"
    for folder in (stale, live, elsewhere, data):
        folder.mkdir()
        (folder / "shard.bin").write_bytes(b"\0" * 64)
    (tmp_path / "notes.txt").write_text("mine")
    with Engine(
        "cpu", max_layers_per_shard=CUT, copy_on_cpu=True, host_memory=10**6, spill_dir=tmp_path
    ):
        assert not stale.exists()
        for folder in (live, elsewhere, data):
            assert (folder / "shard.bin").read_bytes() == b"\0" * 64, folder
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([live.name, elsewhere.name, data.name, "notes.txt"])
    assert (tmp_path / "notes.txt").read_text() == "mine"


# -- randomized ------------------------------------------------------------------------


@pytest.mark.parametrize("draw", range(10))
def test_random_configurations_are_exact_and_within_the_host_budget(
    tmp_path: Path, draw: int
) -> None:
    rng = random.Random(1400 + draw)
    devices = rng.choice([1, 2])
    specs = {
        f"t{i}": (
            rng.choice(["sgd", "adam", "adamw"]),
            rng.choice([3, 4, 6, 8]),
            rng.choice([8, 12, 16, 24, 32]),
        )
        for i in range(rng.choice([2, 3, 4]))
    }
    options = rng.choice([{}, {"accumulate_steps": 2}, CLIP_ACCUM])
    prefetch = rng.random() < 0.5
    tasks = build(specs, n=rng.choice([2, 3]))
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    largest, total = state_sizes(tasks)
    # The strict range: (devices + 2) x the largest shard state, or up to 1.5x more, plus
    # the boundary tensors the tasks may park.
    host_memory = math.floor((devices + 2 + rng.random() * 1.5 * (devices + 2)) * largest)
    host_memory += parked(tasks, options)
    results, host, trace = run_engine(
        tasks, 2, ["cpu"] * devices, host_memory, tmp_path, options, prefetch=prefetch
    )
    config = (devices, specs, options, prefetch, host_memory, largest, total)
    assert host["peak_held_bytes"] <= host_memory, (config, host)
    trace.validate(host_budget=host_memory)
    if total > host_memory:
        assert host["written_bytes"] > 0, (config, host)
    for name, task in tasks.items():
        assert_plain(results[name], task.model, refs[name], 2, devices, options)


_CRASHING_ENGINE = """
import os, signal, sys
import torch
from torch import nn
import tune_hydra as th
from tune_hydra.engine import Engine

torch.manual_seed(0)
engine = Engine("cpu", max_layers_per_shard=1, host_memory=40_000, spill_dir=sys.argv[1])
for i in range(3):
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)).double()
    data = [(torch.randn(4, 32, dtype=torch.float64), torch.randint(0, 4, (4,)))]
    engine.add_task(f"t{i}", th.ModelTask(model, nn.CrossEntropyLoss(),
                                           lambda p: torch.optim.Adam(p), data))
engine.train("t0", 1).result(timeout=60)
print(engine.summary()["host"]["spill_dir"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: a crash
"""


def test_the_folder_of_a_killed_engine_is_removed_by_the_next_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_ENGINE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    left = Path(proc.stdout.strip().splitlines()[-1])
    assert left.parent == tmp_path and any(left.glob("*.bin")), "it spilled, then died"
    with Engine("cpu", host_memory="1MiB", spill_dir=tmp_path) as engine:
        assert not left.exists()
        assert Path(engine.summary()["host"]["spill_dir"]).exists()
    assert not list(tmp_path.iterdir())
