"""Frozen tensors equal across tasks are held once (tune_hydra.engine.storage.frozen), and each
task still trains exactly as alone with its own copy."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS, assert_same_model, batches
from tune_hydra.core.ledger import DeviceLedger, state_of
from tune_hydra.engine import Engine
from tune_hydra.engine.registration.partition import plan_shards
from tune_hydra.engine.storage.disk import _bytes_of
from tune_hydra.engine.storage.frozen import FrozenPool, address, canonical_name, digest, lazy_clone
from tune_hydra.exceptions import (
    FrozenTensorModifiedError,
    ShardTooLargeError,
    SharedModelError,
    TrainingError,
)
from tune_hydra.frontends.task_loop import TaskLoop

SEED = 3
BASE = (8 * 32 + 32 + 2 * (32 * 32 + 32)) * 8  # float64 bytes of the frozen layers


def base_state() -> dict[str, torch.Tensor]:
    """A 'pretrained' base: what every trial loads."""
    torch.manual_seed(0)
    return model(0).state_dict()


def model(head_seed: int) -> nn.Sequential:
    torch.manual_seed(head_seed)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Dropout(0.1),
        nn.Linear(32, 4),
    ).double()


def trial(i: int, *, opt: str = "adam", change: str | None = None) -> th.ModelTask:
    """A fine-tuning trial as users write one: load the base, freeze it, train a head
    (``change``: the name of one base tensor that differs in this trial's checkpoint)."""
    m = model(100 + i)
    state = {k: v.clone() for k, v in base_state().items() if not k.startswith("6.")}
    if change is not None:
        state[change] = state[change] + 1.0
    m.load_state_dict(state, strict=False)
    for layer in (m[0], m[2], m[4]):
        layer.requires_grad_(False)
    return th.ModelTask(
        m, nn.CrossEntropyLoss(), OPTIMIZERS[opt], batches(4, seed=10 + i), eval_data=batches(2)
    )


def alone(task: th.ModelTask) -> th.ModelTask:
    return th.ModelTask(
        copy.deepcopy(task.model),
        task.loss_fn,
        task.optimizer,
        task.train_data,
        eval_data=task.eval_data,
    )


def engine(tmp_path: Path | None = None, **kw: Any) -> Engine:
    spill = {"host_memory": 10**8, "spill_dir": tmp_path} if tmp_path is not None else {}
    return Engine(
        ["cpu", "cpu"], max_layers_per_shard=2, copy_on_cpu=True, policy="lrtf", **spill, **kw
    )


def frozen_ptrs(m: nn.Module, *, writable: bool = False) -> dict[str, int]:
    # address(), not data_ptr(): a live task's parameter is a copy-on-write alias of the
    # pool's tensor (frozen.alias), which asking for a writable pointer would copy
    # (``writable``: ask for it, as a user writing their model does).
    ptr = (lambda p: p.data_ptr()) if writable else address
    return {n: ptr(p) for n, p in m.named_parameters() if not p.requires_grad}


def add(eng: Engine, tasks: dict[str, th.ModelTask]) -> dict[str, TaskLoop]:
    """A TaskLoop of each task, cut (registered, its frozen tensors in the pool) one after
    another in order: a trial is cut where an earlier one sharing its base was. Keep them
    referenced: a loop whose model is collected leaves the engine."""
    loops = {name: TaskLoop(name, task, eng, seed=SEED) for name, task in tasks.items()}
    for loop in loops.values():
        loop.cut()
    return loops


def run(loops: dict[str, TaskLoop], epochs: int) -> dict[str, Any]:
    """Train every loop ``epochs`` iterations at once; their results."""
    futures = {name: loop.start(epochs) for name, loop in loops.items()}
    return {name: f.result(timeout=120) for name, f in futures.items()}


def train(
    eng: Engine, tasks: dict[str, th.ModelTask], epochs: int = 2
) -> tuple[dict[str, Any], dict[str, TaskLoop]]:
    """:func:`add` then :func:`run`: the results and the loops."""
    loops = add(eng, tasks)
    return run(loops, epochs), loops


def assert_alone(results: list[dict[str, Any]], task: th.ModelTask, ref: th.ModelTask) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))  # as an emulated device of two runs it
    try:
        want = th.train_plain(ref, len(results), seed=SEED)
    finally:
        torch.set_num_threads(threads)
    assert [(r["loss"], r["val_loss"]) for r in results] == [
        (w["loss"], w["val_loss"]) for w in want
    ]
    assert_same_model(task.model, ref.model, atol=0, rtol=0)


# -- the pool on its own ------------------------------------------------------------------


def test_names_and_digests() -> None:
    assert canonical_name("m.q_proj.base_layer.weight") == "m.q_proj.weight"
    t = torch.arange(6.0)
    assert digest(t) == digest(t.clone()) != digest(t + 1)
    assert digest(torch.zeros(3)) != digest(-torch.zeros(3))  # bytes, not values
    assert digest(t.view(2, 3).t()) == digest(t.view(2, 3).t().contiguous())


def test_pool_off_prepares_nothing() -> None:
    assert FrozenPool(None, enabled=False).prepare("t", model(0)) is None


# -- through the engine --------------------------------------------------------------------


@pytest.mark.parametrize("disk", [False, True], ids=["ram", "disk"])
def test_three_trials_hold_one_base_and_train_as_alone(disk: bool, tmp_path: Path) -> None:
    tasks = {f"t{i}": trial(i, opt=["adam", "sgd", "adamw"][i]) for i in range(3)}
    refs = {k: alone(t) for k, t in tasks.items()}
    own = {k: frozen_ptrs(t.model) for k, t in tasks.items()}
    with engine(tmp_path if disk else None) as eng:
        loops = add(eng, tasks)
        pool = eng._registry.frozen
        entries = pool.entries()
        assert len(entries) == 6 and all(e.users == 3 for e in entries)
        assert pool.held_bytes() == BASE and pool.shared_bytes == 2 * BASE
        ptrs = [frozen_ptrs(t.model) for t in tasks.values()]
        assert ptrs[0] == ptrs[1] == ptrs[2] == own["t0"]  # the first trial's tensors
        if disk:  # counted once in the host ledger, under keys of its own
            held = eng.summary()["host"]["held_bytes"]
            frozen = {k: v for k, v in eng.host.ledger.states.items() if isinstance(k, tuple)}
            assert sum(frozen.values()) == BASE and held >= BASE
        results = run(loops, 2)
    for name, task in tasks.items():
        assert_alone(results[name], task, refs[name])
    # Left the engine: each model holds its own tensors again (the user may change them).
    after = [frozen_ptrs(t.model, writable=True) for t in tasks.values()]
    assert len({tuple(p.values()) for p in after}) == 3
    assert not pool.entries() and pool.held_bytes() == 0


def deep_trial(i: int, opt: str) -> th.ModelTask:
    """A trial over a deeper frozen base (six Linear layers, 44544 bytes) with a head."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    base = nn.Sequential(*layers).double().requires_grad_(False)
    torch.manual_seed(100 + i)
    m = nn.Sequential(*base, nn.Linear(32, 4).double())
    return th.ModelTask(
        m, nn.CrossEntropyLoss(), OPTIMIZERS[opt], batches(4, seed=10 + i), eval_data=batches(2)
    )


@pytest.mark.parametrize("copy", [True, False], ids=["copying", "in-place"])
def test_the_base_spills_once_under_a_host_budget_below_base_and_adapters(
    tmp_path: Path, copy: bool
) -> None:
    """Four trials under a host budget below their shared base alone (and 4x the largest
    frozen tensor, the strict bound with 2 devices): the pool's entries go to disk (each
    written once, not once per trial), come back when a trial needs them, the budget
    holds, and every trial trains exactly as alone."""
    tasks = {f"t{i}": deep_trial(i, ["adam", "sgd", "adamw", "adam"][i]) for i in range(4)}
    refs = {k: alone(t) for k, t in tasks.items()}
    base = (8 * 32 + 32 + 5 * (32 * 32 + 32)) * 8
    budget = 34000
    assert 4 * 32 * 32 * 8 < budget < base
    with Engine(
        ["cpu", "cpu"],
        max_layers_per_shard=2,
        copy_on_cpu=copy,
        policy="lrtf",
        host_memory=budget,
        spill_dir=tmp_path,
    ) as eng:
        results, _ = train(eng, tasks, epochs=2)
        assert len(eng._registry.frozen.entries()) == 12
        host = eng.summary()["host"]
        trace = eng.trace
    assert host["peak_held_bytes"] <= budget, host
    trace.validate(host_budget=budget)
    frozen_io = [e for e in trace.events if e.device == "disk" and e.task == "frozen"]
    written = [e for e in frozen_io if e.op == "to_disk"]
    assert written and any(e.op == "from_disk" for e in frozen_io), host
    assert sum(e.bytes_moved for e in written) <= base  # each entry written at most once
    for name, task in tasks.items():
        assert_alone(results[name], task, refs[name])


def test_the_device_ledger_counts_a_shared_tensor_once_per_device() -> None:
    """Shard 1 of two trials (one frozen Linear(32, 32): 8448 bytes, all shared) is
    resident on one device with one copy of it: the device ledger counts it once, so
    both fit a budget that held one before; unshared, they still count twice."""
    budget = 8448 + 6000  # one shard 1 and its activations (4608 bytes)
    for share in (True, False):
        with engine(share_frozen=share) as eng:
            loops = add(eng, {f"t{i}": trial(i) for i in range(3)})
            stores = [loops[f"t{i}"].runner.store_of(1) for i in range(3)]
            assert [s.state_bytes for s in stores] == [8448] * 3
            ledger: DeviceLedger[Any] = DeviceLedger(budget)
            if share:
                assert state_of(stores) == 8448 and ledger.need(stores) is None
                for s in stores:
                    ledger.hold(s)
                assert ledger.usage().state == 8448
                # Evicting one of them frees nothing while another uses the tensor.
                assert ledger.victims(stores[:1], depth=2) == [stores[1]]
            else:
                assert state_of(stores) == 3 * 8448 and ledger.need(stores[:2])
        head = [loops[f"t{i}"].runner.store_of(3) for i in range(3)]
        assert state_of(head) == sum(s.state_bytes for s in head)  # trainable: not shared


def test_trials_sharing_a_base_under_a_device_budget_are_exact(tmp_path: Path) -> None:
    """Under a device budget the plans barely fit (each shard's state twice, for the
    prefetched one), the workers' ledgers counting a shared tensor once per device keep
    the budget: the trace's replay stays within it, and each trial is exact as alone."""
    tasks = {f"t{i}": trial(i, opt=["adam", "sgd", "adamw"][i]) for i in range(3)}
    refs = {k: alone(t) for k, t in tasks.items()}
    with engine(device_memory=24000) as eng:
        results, _ = train(eng, tasks, epochs=2)
        trace = eng.trace
    trace.validate(state_budget=24000)
    for name, task in tasks.items():
        assert_alone(results[name], task, refs[name])


def test_host_ledger_counts_the_base_once(tmp_path: Path) -> None:
    held = {}
    for share in (True, False):
        with engine(tmp_path, share_frozen=share) as eng:
            loops = add(eng, {f"t{i}": trial(i) for i in range(4)})
            assert list(loops) == eng.tasks()
            held[share] = eng.summary()["host"]["held_bytes"]
            ledger_keys = [k for k in eng.host.ledger.states if isinstance(k, tuple)]
            assert len(ledger_keys) == (6 if share else 0)
    assert held[False] - held[True] == 3 * BASE


def test_a_base_with_one_tensor_different_keeps_its_own_copy_of_it() -> None:
    tasks = {"a": trial(0), "b": trial(1), "odd": trial(2, change="2.weight")}
    refs = {k: alone(t) for k, t in tasks.items()}
    with engine() as eng:
        loops = add(eng, tasks)
        users = sorted((e.name, e.users) for e in eng._registry.frozen.entries())
        assert users == [
            ("0.bias", 3),
            ("0.weight", 3),
            ("2.bias", 3),
            ("2.weight", 1),
            ("2.weight", 2),
            ("4.bias", 3),
            ("4.weight", 3),
        ]
        a, odd = frozen_ptrs(tasks["a"].model), frozen_ptrs(tasks["odd"].model)
        assert a["2.weight"] != odd["2.weight"] and a["2.bias"] == odd["2.bias"]
        results = run(loops, 2)
    for name, task in tasks.items():
        assert_alone(results[name], task, refs[name])


def addresses(m: nn.Module) -> dict[str, int]:
    """The frozen tensors' data addresses, read without copying a copy-on-write one."""
    return {n: address(p.data) for n, p in m.named_parameters() if not p.requires_grad}


def test_a_task_leaving_drops_its_references() -> None:
    tasks = {f"t{i}": trial(i) for i in range(3)}
    refs = {k: alone(t) for k, t in tasks.items()}
    with engine() as eng:
        first, loops = train(eng, tasks, epochs=1)
        pool = eng._registry.frozen
        held = {e.name: address(e.host) for e in pool.entries()}
        loops.pop("t0").close()
        assert all(e.users == 2 for e in pool.entries())
        # No copy of the base for a finished trial: its model reads the pool's tensors.
        assert addresses(tasks["t0"].model) == held
        # The user writes into it (it is theirs now): only then it gets its own copy, and
        # no other task sees the write.
        with torch.no_grad():
            tasks["t0"].model[0].weight.add_(1.0)
        assert addresses(tasks["t0"].model)["0.weight"] != held["0.weight"]
        assert not torch.equal(tasks["t0"].model[0].weight, tasks["t1"].model[0].weight)
        # The others go on as alone, on the pool's tensors as they were (never copied).
        results = {n: first[n] + r for n, r in run(loops, 1).items()}
        assert {e.name: address(e.host) for e in pool.entries()} == held
        loops.pop("t1").close()
        loops.pop("t2").close()
        assert not pool.entries()
    for name in ("t1", "t2"):
        assert_alone(results[name], tasks[name], refs[name])


def test_a_finished_trials_base_is_untouched_when_the_pool_spills_it(tmp_path: Path) -> None:
    """A trial leaves (its model shares the pool's tensors copy-on-write), then the pool
    writes every entry to disk while the other trials' shards are still resident on the
    devices: neither side is copied for the write, the finished model keeps its values,
    and the others read the base back and go on exactly."""
    tasks = {f"t{i}": trial(i) for i in range(3)}
    refs = {k: alone(t) for k, t in tasks.items()}
    with engine(tmp_path) as eng:
        first, loops = train(eng, tasks, epochs=1)
        pool = eng._registry.frozen
        loops.pop("t0").close()
        mine = addresses(tasks["t0"].model)
        values = {n: p.detach().clone() for n, p in tasks["t0"].model.named_parameters()}
        # A device copy held while the pool spills (as a resident store holds one; which
        # stores stay resident after training depends on the op order, and under load
        # none did): only the pool's host tensors go to disk; the device copies stay.
        held = pool.entries()[0]
        before = held.host.clone()
        copy, _, key = pool.to_device(held, torch.device("cpu"), object(), None)
        assert any(entry.devices for entry in pool.entries())
        for entry in pool.entries():
            deadline = time.monotonic() + 10
            # A prefetch the copy threads still make may hold a store's lock a moment.
            while not pool.try_spill(entry, eng.host):
                assert time.monotonic() < deadline, entry.name
                time.sleep(0.01)
            assert entry.on_disk
        assert held.devices[key][0] is copy and torch.equal(copy, before)
        pool.off_device(held, key)
        assert addresses(tasks["t0"].model) == mine
        results = {n: first[n] + r for n, r in run(loops, 1).items()}
    for n, p in tasks["t0"].model.named_parameters():
        assert torch.equal(p, values[n]), n
    for name in ("t1", "t2"):
        assert_alone(results[name], tasks[name], refs[name])


def test_a_copy_on_write_tensor_is_written_to_disk_without_a_copy() -> None:
    a = torch.randn(100, dtype=torch.float64)
    c = lazy_clone(a)
    data = _bytes_of(a)
    assert address(a) == address(c)  # numpy() would have copied a's side
    assert bytes(data) == bytes(c.clone().view(torch.uint8).numpy())


def test_trainable_tensors_shared_between_tasks_stay_refused() -> None:
    a, b = trial(0), trial(1)
    b.model[6] = a.model[6]  # one trainable head in two trials
    with engine() as eng:
        loops = add(eng, {"a": a})
        loop = TaskLoop("b", b, eng, seed=SEED)
        with pytest.raises(SharedModelError):
            loop.cut()  # its registration claims the head
        assert list(loops) == eng.tasks() == ["a"]


# -- a task that writes a shared frozen tensor fails alone ---------------------------------


class OnBatch:
    """A forward pre-hook of the first layer doing ``action`` to it when it sees the third
    training batch (by its values: the same in the engine, in its probe and in plain
    training)."""

    def __init__(self, action: str, marker: float) -> None:
        self.action = action
        self.marker = marker

    def __call__(self, module: nn.Module, args: Any) -> None:
        if args[0].shape[0] != 6 or args[0][0, 0].item() != self.marker:
            return
        if self.action == "unfreeze":
            module.weight.requires_grad_(True)
        elif self.action == "write":
            with torch.no_grad():
                module.weight.mul_(0.5)
        elif self.action == "replace":
            module.weight.data = module.weight.data * 0.5
        elif self.action == "merge":  # peft's unsafe merge: weight.data += delta
            module.weight.data += 0.01


@pytest.mark.parametrize("action", ["unfreeze", "write", "replace", "merge"])
def test_a_task_that_changes_a_shared_frozen_tensor_fails_alone(action: str) -> None:
    tasks = {f"t{i}": trial(i) for i in range(3)}
    bad = tasks["t1"]
    marker = bad.train_data[2][0][0, 0].item()
    bad.model[0].register_forward_pre_hook(OnBatch(action, marker))
    good = {k: alone(t) for k, t in tasks.items() if k != "t1"}
    with engine() as eng:
        futures = {name: loop.start(2) for name, loop in add(eng, tasks).items()}
        results = {}
        for name, f in futures.items():
            if name == "t1":
                with pytest.raises(FrozenTensorModifiedError) as info:
                    f.result(timeout=120)
            else:
                results[name] = f.result(timeout=120)
    err = info.value
    assert err.task == "t1" and err.tensor == "0.weight" and err.others == 2
    assert "share_frozen=False" in str(err) and "'0.weight'" in str(err)
    for name, ref in good.items():
        assert_alone(results[name], tasks[name], ref)


def test_train_models_names_the_task_that_changed_a_shared_tensor() -> None:
    tasks = {f"t{i}": trial(i) for i in range(2)}
    marker = tasks["t0"].train_data[2][0][0, 0].item()
    tasks["t0"].model[0].register_forward_pre_hook(OnBatch("write", marker))
    with pytest.raises(TrainingError) as info:
        th.train_models(tasks, devices=["cpu", "cpu"], epochs=1, copy_on_cpu=True, seed=SEED)
    assert set(info.value.errors) == {"t0"}
    assert isinstance(info.value.errors["t0"], FrozenTensorModifiedError)


@pytest.mark.parametrize("action", ["unfreeze", "write", "merge"])
def test_a_frozen_tensor_no_other_task_uses_may_change_as_in_plain_training(
    action: str,
) -> None:
    """Gradual unfreezing (or a write) of a frozen tensor only this task holds: the slot
    goes back to the task's own state and trains exactly as plain PyTorch does; the tensor
    it shares with another task stays shared."""
    solo = trial(0, change="0.weight")  # its own 0.weight, the rest shared with "other"
    other = trial(1)
    marker = solo.train_data[2][0][0, 0].item()
    solo.model[0].register_forward_pre_hook(OnBatch(action, marker))
    refs = {"solo": alone(solo), "other": alone(other)}
    # Recomputing a forward would run the hook's write twice (plain training runs it once).
    with engine(recompute=action == "unfreeze") as eng:
        results, _ = train(eng, {"solo": solo, "other": other})
        left = sorted((e.name, e.users) for e in eng._registry.frozen.entries())
    # Its 0.weight left the pool; the other task's is still there.
    assert left.count(("0.weight", 1)) == 1 and ("0.bias", 2) in left
    for name, task in {"solo": solo, "other": other}.items():
        assert_alone(results[name], task, refs[name])
    if action == "unfreeze":
        assert solo.model[0].weight.requires_grad and solo.model[0].weight.grad is not None


def test_share_frozen_is_a_checked_engine_option() -> None:
    from tune_hydra.exceptions import InvalidOptionError
    from tune_hydra.options import EngineOptions

    assert EngineOptions().share_frozen is True
    with pytest.raises(InvalidOptionError, match="share_frozen"):
        EngineOptions(share_frozen="no")  # type: ignore[arg-type]
    with Engine("cpu", share_frozen=False) as eng:
        loops = add(eng, {"a": trial(0), "b": trial(1)})
        assert not eng._registry.frozen.entries()
        a, b = (frozen_ptrs(loops[k].model) for k in "ab")
        assert all(a[n] != b[n] for n in a)


def test_one_device_copy_per_device_while_any_user_is_resident() -> None:
    """Two tasks' shard 0 on one device holder: the shared frozen tensors are copied
    there by the first, reused by the second, and freed when the last one leaves."""
    with engine() as eng:
        loops = add(eng, {name: trial("ab".index(name)) for name in "ab"})
        a, b = (loops[k].runner.store_of(0) for k in "ab")
        frozen = (8 * 32 + 32) * 8  # layer 0's weight and bias, in shard 0
        own = a.nbytes()
        holder, other = object(), object()
        cpu = torch.device("cpu")
        assert a.promote(cpu, owner=holder) == own + frozen
        assert b.promote(cpu, owner=holder) == own  # b's own state only
        wa, wb = (loops[k].model[0].weight for k in "ab")
        assert address(wa) == address(wb) != address(eng._registry.frozen.entries()[0].host)
        c = trial(2)  # another holder of the same device type gets its own copy
        loops.update(add(eng, {"c": c}))
        sc = loops["c"].runner.store_of(0)
        assert sc.promote(cpu, owner=other) == own + frozen
        assert address(c.model[0].weight) != address(wa)
        a.demote()
        entry = next(e for e in eng._registry.frozen.entries() if e.name == "0.weight")
        assert sorted(slot[1] for slot in entry.devices.values()) == [1, 1]
        b.demote()
        sc.demote()
        assert not entry.devices
        assert address(wa) == address(wb) == address(entry.host)


def test_a_task_restored_from_its_state_shares_again_and_stays_exact() -> None:
    tasks = {f"t{i}": trial(i) for i in range(2)}
    refs = {k: alone(t) for k, t in tasks.items()}
    with engine() as eng:
        first, loops = train(eng, tasks, epochs=1)
        pool = eng._registry.frozen
        state = loops["t0"].state()
        # Loaded into the registered loop: the frozen tensors are written with their own
        # values (load_state_dict writes every tensor), and stay shared.
        loops["t0"].load_state(state)
        assert len(pool.entries()) == 6 and all(e.users == 2 for e in pool.entries())
        # Restored as a trial is (a new task, then the state): it joins the pool again.
        loops.pop("t0").close()
        assert all(e.users == 1 for e in pool.entries())
        tasks["t0"] = trial(0)
        loops["t0"] = TaskLoop("t0", tasks["t0"], eng, seed=SEED)
        loops["t0"].load_state(state)
        loops["t0"].cut()
        assert len(pool.entries()) == 6 and all(e.users == 2 for e in pool.entries())
        second = run(loops, 1)
    for name, task in tasks.items():
        assert_alone(first[name] + second[name], task, refs[name])


# -- aligned cuts --------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen ``Linear`` of the base plus a rank-``r`` adapter, then tanh."""

    def __init__(self, base: nn.Linear, r: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(0.1 * torch.randn(r, base.in_features, dtype=torch.float64))
        self.lora_b = nn.Parameter(0.1 * torch.randn(base.out_features, r, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + x @ self.lora_a.t() @ self.lora_b.t())


def lora_base() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6))).double()
    return base.state_dict()


def lora_model(r: int, seed: int) -> nn.Sequential:
    """Six LoRA layers over the one base (its weights loaded as a trial loads them)."""
    layers = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6))).double()
    layers.load_state_dict(lora_base())
    torch.manual_seed(seed)
    return nn.Sequential(*(LoRALinear(lin, r) for lin in layers))


def lora_data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(6, 32, generator=g, dtype=torch.float64),
            torch.randint(0, 32, (6,), generator=g),
        )
        for _ in range(3)
    ]


def lora_task(r: int, i: int) -> th.ModelTask:
    return th.ModelTask(
        lora_model(r, i),
        nn.CrossEntropyLoss(),
        OPTIMIZERS["adam"],
        lora_data(i),
        eval_data=lora_data(50 + i),
    )


RANKS = {"a": 8, "b": 1, "c": 16}  # b's layers are smaller than a's, c's larger


def lora_budget() -> int:
    """The smallest device budget that cuts trial a's six layers in two shards of three
    (with prefetch); b alone would fit in one shard there, c not in a's shards."""
    from tune_hydra.engine.registration.partition import layer_costs
    from tune_hydra.engine.task import model_layers

    task = lora_task(RANKS["a"], 0)
    costs = layer_costs(model_layers(task.model), task.optimizer, lora_data(0)[0][0])
    lo, hi = 1, 10**8
    while lo < hi:
        mid = (lo + hi) // 2
        fits = True
        try:
            fits = len(plan_shards(costs, mid)) <= 2
        except ShardTooLargeError:
            fits = False
        lo, hi = (lo, mid) if fits else (mid + 1, hi)
    return lo


def spans(plan: Any) -> list[tuple[int, int]]:
    return [(s.start, s.stop) for s in plan.shards]


def test_trials_sharing_a_base_are_cut_where_the_first_was_if_it_fits() -> None:
    budget = lora_budget()
    own = {}
    for name, r in RANKS.items():  # each alone on the engine: its own cut
        with Engine(["cpu", "cpu"], device_memory=budget, copy_on_cpu=True) as eng:
            loops = add(eng, {name: lora_task(r, 0)})
            own[name] = spans(eng.plan(name))
            assert list(loops) == eng.tasks()
    assert own["a"] == [(0, 3), (3, 6)] and own["b"] != own["a"] != own["c"]
    tasks = {name: lora_task(r, i) for i, (name, r) in enumerate(RANKS.items())}
    refs = {k: alone(t) for k, t in tasks.items()}
    with Engine(["cpu", "cpu"], device_memory=budget, copy_on_cpu=True, policy="lrtf") as eng:
        results, _ = train(eng, tasks)
        cuts = {name: spans(eng.plan(name)) for name in tasks}
        users = {len(e.tasks) for e in eng._registry.frozen.entries()}
    # b, of a smaller rank, is cut as a (shard k of both holds the same base layers);
    # c's shards would not fit there: its own cut. All three share the base, exactly.
    assert cuts == {"a": own["a"], "b": own["a"], "c": own["c"]} and users == {3}
    for name, task in tasks.items():
        assert_alone(results[name], task, refs[name])
    with Engine(["cpu", "cpu"], device_memory=budget, copy_on_cpu=True, share_frozen=False) as eng:
        loops = add(eng, {name: lora_task(RANKS[name], 0) for name in "ab"})
        assert list(loops) == eng.tasks() == ["a", "b"]
        assert spans(eng.plan("b")) == own["b"]  # nothing shared, nothing aligned


# -- the policy prefers a shard whose shared base is on the device already ----------------


def test_a_shard_whose_shared_base_is_on_the_device_is_offered_as_such() -> None:
    """Task a's shard 0 resident on worker 0: b's shard 0 (the same frozen layer) is
    offered there with those bytes as ``shared_bytes``, not in ``bring_in_bytes``; on
    worker 1, and with sharing off, it brings in its whole state."""
    from tune_hydra.core.ops import Op, OpKind

    frozen = (8 * 32 + 32) * 8  # layer 0's weight and bias, in shard 0
    offers = {}
    for share in (True, False):
        with engine(share_frozen=share) as eng:
            loops = add(eng, {name: trial("ab".index(name)) for name in "ab"})
            w0, w1 = eng.workers
            a, b = (eng._registry.tasks[k] for k in loops)
            a.runner.store_of(0).promote(w0.device, owner=w0)
            op = Op("b", OpKind.FORWARD, 0)
            offers[share] = [eng._dispatcher._offer(b, op, w, 1.0) for w in (w0, w1)]
            state = b.runner.store_of(0).state_bytes
            a.runner.store_of(0).demote()
    here, there = offers[True]
    assert (here.shared_bytes, here.bring_in_bytes) == (frozen, state - frozen)
    assert (there.shared_bytes, there.bring_in_bytes) == (0, state)
    assert all((c.shared_bytes, c.bring_in_bytes) == (0, state) for c in offers[False])


@pytest.mark.parametrize("policy", ["lrtf", "milestone"])
def test_policies_prefer_the_shared_base_on_the_device_within_their_band(policy: str) -> None:
    from tune_hydra.core.dispatch import offer
    from tune_hydra.core.ops import Op, OpKind
    from tune_hydra.core.policies import LRTFPolicy, MilestonePolicy

    def cand(task: str, remaining: float, shared: int, order: int) -> Any:
        return offer(
            Op(task, OpKind.FORWARD, 0),
            remaining,
            ready_since=0.0,
            order=order,
            bring_in_bytes=1000 - shared,
            shared_bytes=shared,
            milestone_s=None if policy == "lrtf" else remaining,
        )

    pol = LRTFPolicy() if policy == "lrtf" else MilestonePolicy(devices=1, slots_per_device=4)
    # Without the shared bytes, each policy would pick a: LRTF the longest, the milestone
    # policy the least work to its milestone among admitted trials.
    a, b = (100.0, 99.0) if policy == "lrtf" else (99.0, 100.0)
    longest, sharing = cand("a", a, 0, 0), cand("b", b, 600, 1)
    if policy == "milestone":  # admit both first (the admitted trials' rule decides)
        for c in (longest, sharing):
            assert pol.choose(0, [c]) is c
    assert pol.choose(0, [longest, sharing]) is sharing
    # Outside LRTF's band (5%) the longest still runs first.
    far = cand("c", 50.0, 600, 2)
    if policy == "lrtf":
        assert pol.choose(0, [longest, far]) is longest
