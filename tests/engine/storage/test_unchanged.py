"""A visit that leaves a shard's state as it was (an eval, a forward of a shard without
buffers) drops its device copy instead of writing it back, and keeps a still-valid host
or disk copy instead of rewriting it; a visit that changes the state (a forward in train
mode through BatchNorm, a backward, a step, a deferred step at the start of an eval
visit) is written back. Training stays exact (float64, bit for bit against plain
PyTorch) with and without the disk tier, and the trace shows which visits wrote.

The tasks train as TaskLoops: an optimizer step (and the ``zero_grad`` of the next
batch) is applied at the start of the shard's next op, whatever its kind."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, make_task, mlp, plain_copy
from tests.engine.storage.test_disk_tier import (
    CUT,  # 2 layers per shard: every model below has >= 4 shards
    assert_disk_used,
    assert_plain,
    disk_folder,
    loops,
    stack,
    state_sizes,
)
from tune_hydra.core.ops import OpKind
from tune_hydra.core.trace import TraceEvent
from tune_hydra.engine import Engine
from tune_hydra.engine.storage import Residency, ShardStore


@pytest.fixture
def disk_path(tmp_path: Path) -> Iterator[Path]:
    yield from disk_folder(tmp_path)


def _task(model: str, opt: str, seed: int) -> th.ModelTask:
    net = mlp(seed=seed) if model == "bn" else stack(6, seed=seed)
    return make_task(net, opt, n=5, eval_data=True)


def _run(
    tasks: dict[str, th.ModelTask],
    devices: int,
    options: dict[str, Any],
    host_memory: int | None = None,
    spill_dir: Path | None = None,
    **engine: Any,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any], Any, dict[str, Any]]:
    with Engine(
        ["cpu"] * devices,
        max_layers_per_shard=CUT,
        copy_on_cpu=True,
        host_memory=host_memory,
        spill_dir=spill_dir,
        **engine,
    ) as eng:
        registered = loops(eng, tasks, cut=True, **options)
        plans = {name: eng.plan(name) for name in tasks}
        futures = {name: loop.start(2) for name, loop in registered.items()}
        results = {name: f.result(timeout=120) for name, f in futures.items()}
    return results, eng.summary()["host"], eng.trace, plans


def _largest_state(tasks: dict[str, th.ModelTask]) -> int:
    return state_sizes(tasks)[0]


ACCUM = {"accumulate_steps": 2}  # 5 batches: the epoch's last group steps late (at eval)
CLIP = {"max_grad_norm": 0.5}  # steps deferred to the shards' next visits


@pytest.mark.parametrize(
    ("model", "opt", "devices", "options", "disk"),
    [
        pytest.param("bn", "sgd", 1, {}, False, id="bn-sgd-1dev"),
        pytest.param("plain", "adam", 1, {}, False, id="plain-adam-1dev"),
        pytest.param("bn", "adam", 2, ACCUM, False, id="bn-adam-2dev-accum"),
        pytest.param("plain", "sgd", 2, CLIP, False, id="plain-sgd-2dev-clip"),
        pytest.param("bn", "adam", 1, ACCUM, True, id="bn-adam-1dev-accum-disk"),
        pytest.param("plain", "sgd", 1, {**ACCUM, **CLIP}, True, id="plain-sgd-1dev-clip-disk"),
        pytest.param("bn", "sgd", 2, CLIP, True, id="bn-sgd-2dev-clip-disk"),
        pytest.param("plain", "adam", 2, ACCUM, True, id="plain-adam-2dev-accum-disk"),
    ],
)
def test_float64_parity_with_dropped_copies(
    tmp_path: Path,
    model: str,
    opt: str,
    devices: int,
    options: dict[str, Any],
    disk: bool,
) -> None:
    """Eval data, BatchNorm or not, SGD-momentum or Adam, accumulation (a late step at an
    eval visit) or clipping (steps deferred to the next visit): exact, and some copies
    were dropped."""
    tasks = {f"{model}{i}": _task(model, opt, seed=i) for i in range(3)}
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    host_memory = None
    with _folder(tmp_path, disk) as spill:
        if disk:
            host_memory = (devices + 2) * _largest_state(tasks)
        results, host, trace, _ = _run(tasks, devices, options, host_memory, spill)
        if disk:
            assert host_memory is not None
            assert_disk_used(host, trace, host_memory)
    for name, task in tasks.items():
        assert_plain(results[name], task.model, refs[name], 2, devices, options)
    dropped = [e for e in trace.events if e.op == "copy_out" and not e.bytes_moved]
    assert dropped, "no visit dropped its copy"


@contextlib.contextmanager
def _folder(tmp_path: Path, disk: bool) -> Iterator[Path | None]:
    """A folder on a disk for the disk tier (``disk``), else None."""
    if disk:
        yield from disk_folder(tmp_path)
    else:
        yield None


def _visits(events: list[TraceEvent]) -> list[tuple[TraceEvent, list[TraceEvent]]]:
    """Each stay of a shard on a device: its ``copy_out`` and the ops run in between."""
    open_: dict[tuple[str, int], tuple[str, list[TraceEvent]]] = {}
    out = []
    for e in sorted(events, key=lambda e: (e.start, e.op != "copy_in")):
        key = (e.task, e.shard)
        if e.op == "copy_in":
            open_[key] = (e.device, [])
        elif e.is_compute and key in open_ and open_[key][0] == e.device:
            open_[key][1].append(e)
        elif e.op == "copy_out" and key in open_ and open_[key][0] == e.device:
            out.append((e, open_.pop(key)[1]))
    return out


def _changing(events: list[TraceEvent], buffers: dict[tuple[str, int], bool]) -> set[int]:
    """The ids of the compute events that changed their shard's state: a forward through
    BatchNorm (``buffers``), a backward (``L`` or ``B``), and the first op of the shard
    after a backward, which applies the optimizer step left pending (and the first
    training op after it, which applies the next batch's ``zero_grad``)."""
    out: set[int] = set()
    pending: dict[tuple[str, int], tuple[bool, bool]] = {}  # (step, zero_grad) to apply
    for e in sorted(events, key=lambda e: e.start):
        if not e.is_compute:
            continue
        key = (e.task, e.shard)
        step, zero = pending.get(key, (False, False))
        training = e.op in ("F", "L", "B")
        if e.op in ("L", "B") or (e.op == "F" and buffers[key]) or step or (zero and training):
            out.add(id(e))
        grads = e.op in ("L", "B")
        pending[key] = (grads, grads or (zero and not training))
    return out


@pytest.mark.parametrize("disk", [False, True], ids=["ram", "disk"])
def test_only_visits_that_changed_a_state_write_it_back(tmp_path: Path, disk: bool) -> None:
    """Tasks with eval data (BatchNorm in their first shards), one copying device: a
    visit's copy goes back to host memory exactly when one of its ops changed the state
    (a forward through BatchNorm, a backward, a step or zero_grad applied at its start);
    evals and forwards of shards without buffers that apply none drop theirs. With the
    disk tier, a state is written to disk only after such a change (never twice for the
    same values)."""
    tasks = {f"t{i}": make_task(mlp(seed=i), "adam", n=5, eval_data=True) for i in range(3)}
    refs = {name: plain_copy(task) for name, task in tasks.items()}
    with _folder(tmp_path, disk) as spill:
        host_memory = 3 * _largest_state(tasks) if disk else None
        results, host, trace, plans = _run(tasks, 1, {}, host_memory, spill, prefetch=False)
    for name, task in tasks.items():
        assert_plain(results[name], task.model, refs[name], 2, 1, {})
    buffers = {
        (name, s.index): any(isinstance(m, nn.BatchNorm1d) for m in _layers(task.model, s))
        for name, task in tasks.items()
        for s in plans[name].shards
    }
    assert any(buffers.values()) and not all(buffers.values())
    visits = _visits(trace.events)
    changing = _changing(trace.events, buffers)
    evals = [
        v for v in visits if v[1] and all(op.op == "E" and id(op) not in changing for op in v[1])
    ]
    assert evals, "no visit ran only evals that applied no step"
    kept = 0
    for out, ops in visits:
        changed = not ops or any(id(op) in changing for op in ops)
        if changed or not disk:
            assert (out.bytes_moved > 0) == changed, (out, [op.op for op in ops])
        # With the disk tier, an unchanged state whose host copy was dropped for room
        # while it was on the device is copied back, unless its file holds its values.
        kept += not out.bytes_moved
    assert kept >= (len(evals) if not disk else 1)
    copied_in = sum(e.bytes_moved for e in trace.events if e.op == "copy_in")
    copied_out = sum(e.bytes_moved for e in trace.events if e.op == "copy_out")
    assert 0 < copied_out < copied_in  # before: every copy in went back out
    if not disk:
        return
    assert host_memory is not None
    assert_disk_used(host, trace, host_memory)
    # Between two writes of a shard, something changed it (before, a forward's or an
    # eval's visit wrote it back and spilled it again).
    last: dict[tuple[str, int], str] = {}
    changed_since: dict[tuple[str, int], bool] = {}
    for e in sorted(trace.events, key=lambda e: e.start):
        key = (e.task, e.shard)
        if id(e) in changing:
            changed_since[key] = True
        elif e.op == "to_disk":
            if last.get(key) == "to_disk":
                assert changed_since.get(key), f"{key} written twice, unchanged between"
            last[key] = "to_disk"
            changed_since[key] = False
    assert host["written_bytes"] < copied_in


def _layers(model: nn.Sequential, spec: Any) -> list[nn.Module]:
    return list(model)[spec.start : spec.stop]


# -- the store on its own -------------------------------------------------------------------


def _shard(buffers: bool) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 3)]
    if buffers:
        layers.append(nn.BatchNorm1d(3))
    mod = nn.Sequential(*layers).double()
    opt = OPTIMIZERS["sgd"](list(mod.parameters()))
    mod(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    return mod, opt


def _visit(store: ShardStore, kind: OpKind, work: Any = None) -> int:
    cpu = torch.device("cpu")
    store.promote(cpu, copy=True, owner="w")
    store.begin_op(kind)
    if work is not None:
        work()
    store.end_op()
    return store.demote()


def test_a_store_drops_copies_of_visits_that_change_nothing() -> None:
    mod, opt = _shard(buffers=True)
    store = ShardStore([mod], opt)
    x = torch.randn(5, 4, dtype=torch.float64)
    before = {k: v.clone() for k, v in mod.state_dict().items()}

    def evaluate() -> None:
        mod.eval()
        with torch.no_grad():
            mod(x)
        mod.train()

    assert _visit(store, OpKind.EVAL, evaluate) == 0  # dropped
    assert store.residency is Residency.HOST
    assert all(torch.equal(v, before[k]) for k, v in mod.state_dict().items())
    # A forward in train mode through BatchNorm changes its statistics: written back.
    assert _visit(store, OpKind.FORWARD, lambda: mod(x)) > 0
    assert not torch.equal(mod[1].running_mean, before["1.running_mean"])
    # No op said anything: a change nobody announced is never dropped.
    assert _visit(store, OpKind.EVAL) == 0
    store.promote(torch.device("cpu"), copy=True, owner="w")
    assert store.demote() > 0
    # While on a device, its host copy is valid until an op changes the state (host
    # memory drops such copies after the useless ones).
    assert not store.host_copy_valid
    store.promote(torch.device("cpu"), copy=True, owner="w")
    assert store.host_copy_valid
    store.begin_op(OpKind.EVAL)
    assert store.host_copy_valid
    store.begin_op(OpKind.BACKWARD)
    assert not store.host_copy_valid
    store.end_op()
    assert store.demote() > 0 and not store.host_copy_valid


def test_a_step_or_a_write_during_a_read_only_visit_is_kept() -> None:
    mod, opt = _shard(buffers=False)
    store = ShardStore([mod], opt)
    x = torch.randn(5, 4, dtype=torch.float64)

    def step() -> None:  # a deferred step at the start of a visit
        mod(x).sum().backward()
        opt.step()

    weight = mod[0].weight.detach().clone()
    assert _visit(store, OpKind.FORWARD, step) > 0  # the step hook saw it
    assert not torch.equal(mod[0].weight, weight)

    def write() -> None:  # a module writing into its parameter in eval
        with torch.no_grad():
            mod[0].bias.mul_(2.0)

    bias = mod[0].bias.detach().clone()
    assert _visit(store, OpKind.EVAL, write) > 0  # its version counter moved
    assert torch.equal(mod[0].bias, 2.0 * bias)

    def replace() -> None:  # a tensor replaced: its gradient set to None
        mod[0].weight.grad = None

    assert _visit(store, OpKind.EVAL, replace) > 0
    assert mod[0].weight.grad is None


def test_an_unchanged_state_goes_back_to_disk_without_a_write(disk_path: Path) -> None:
    """A state read back from disk, whose host copy was dropped while it was on a device
    (host memory wanted), and that changed nothing there, returns to disk unwritten."""
    from tests.engine.storage.test_disk import _Host
    from tune_hydra.engine.storage import SpillFolder

    mod, opt = _shard(buffers=True)
    folder = SpillFolder(disk_path)
    host = _Host()
    store = ShardStore([mod], opt, host=host, spill_file=folder.file(("a", 0)))
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    assert store.try_spill() and host.calls.count("to_disk") == 1
    store.promote(torch.device("cpu"), copy=True, owner="w")  # read back, then copied
    assert store.try_spill()  # drops the stale host copy (the device has it)
    store.begin_op(OpKind.EVAL)
    store.end_op()
    assert store.demote() == 0
    assert store.residency is Residency.DISK and host.calls.count("to_disk") == 1
    for k, v in mod.state_dict().items():
        assert torch.equal(v, before[k]), k
    # Changed on its device (a step): copied home, and written at the next spill.
    store.promote(torch.device("cpu"), copy=True, owner="w")
    assert store.try_spill()
    store.begin_op(OpKind.STEP)
    store.end_op()
    assert store.demote() > 0 and store.residency is Residency.HOST
    assert store.try_spill() and host.calls.count("to_disk") == 2
    folder.close()
