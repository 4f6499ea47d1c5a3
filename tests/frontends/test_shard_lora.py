"""A LoRA search written as users write it with ``th.shard``: each trial's loop (an
Optuna objective, a Ray function trainable) loads the base with ``from_pretrained``,
wraps it with ``peft.get_peft_model`` and adds the ``th.shard`` line. The loops share the
base's frozen tensors through the engine's frozen pool (one host copy, counted once), and
each still trains bit for bit as plain PyTorch on its own copy of the base (float64, 2
emulated copying devices, recomputing or keeping graphs; a tiny Llama, and a GPT-2 whose
frozen input embedding is its lm_head, used by the first and the last shard; with and
without the disk tier). What the user reads and writes (``state_dict``,
``load_state_dict``, ``th.unshard``) is their model's own, as in plain PyTorch, while
other loops still share the tensors."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.conftest import assert_same
from tests.models.test_peft import TRIALS, config, data, lora_config
from tune_hydra.engine.storage.frozen import address, canonical_name
from tune_hydra.exceptions import FrozenTensorModifiedError

peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'tune_hydra[lora]'")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

KIND = "llama"


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread: a reduction split over threads rounds by how it is split."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Llama and GPT-2 (tied lm_head, dropout in the base) saved as a
    user's pretrained checkpoints."""
    out = {}
    for kind in ("llama", "gpt2"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(kind))
        out[kind] = tmp_path_factory.mktemp(kind)
        model.save_pretrained(out[kind])
    return out


@pytest.fixture(scope="module")
def folder(folders: dict[str, Path]) -> Path:
    return folders[KIND]


def trial(
    folder: Path, i: int, kind: str = KIND
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, Any]:
    """Trial ``i``'s model and optimizer as its objective builds them, and the same on a
    deepcopy (its own copy of the base) for the plain run."""
    spec = dict(TRIALS[kind][i])
    lr = spec.pop("lr")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    torch.manual_seed(i)  # the adapters' initial weights
    model = peft.get_peft_model(base, lora_config(kind, dropout=0.1 * (i % 2), **spec))
    ref = copy.deepcopy(model)

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)

    return model, adamw(model), ref, adamw(ref)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    i: int,
    epochs: int = 2,
    between: Callable[[int], None] | None = None,
) -> list[float]:
    """Trial ``i``'s loop: train an epoch, evaluate; ``between(epoch)`` after each."""
    history = []
    for epoch in range(epochs):
        model.train()
        for batch in data(i + 1):
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            history.append(loss.item())
        model.eval()
        with torch.no_grad():
            history.extend(model(**b).loss.item() for b in data(i + 51, n=2))
        if between is not None:
            between(epoch)
    return history


def run_loops(
    engine: th.Engine,
    trials: list[tuple[nn.Module, torch.optim.Optimizer]],
    between: dict[int, Callable[[int], None]] | None = None,
    epochs: dict[int, int] | None = None,
) -> dict[int, Any]:
    """Each trial's loop in a thread of its own (``study.optimize(n_jobs=...)``), sharded
    on ``engine``; the loop's stream starts from ``torch.manual_seed(100 + i)``.
    ``between``, ``epochs``: a trial's :func:`train` arguments (2 epochs by default)."""
    lock = threading.Lock()
    results: dict[int, Any] = {}

    def loop(i: int) -> None:
        try:
            with lock:
                torch.manual_seed(100 + i)
                m, o = th.shard(*trials[i], engine=engine)
            n = (epochs or {}).get(i, 2)
            results[i] = train(m, o, i, epochs=n, between=(between or {}).get(i))
        except BaseException as err:
            results[i] = err

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(trials))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def plain(ref: nn.Module, opt: torch.optim.Optimizer, i: int, **kw: Any) -> list[float]:
    torch.manual_seed(100 + i)
    return train(ref, opt, i, **kw)


def frozen_ptrs(m: nn.Module, *, writable: bool = False) -> dict[str, int]:
    """The frozen tensors' addresses at home, by name (peft's ``.base_layer`` left out);
    ``writable``: as a writer asks for them (``data_ptr()`` copies a copy-on-write alias,
    see frozen.alias; address() does not)."""
    m.state_dict()  # a th.shard model's: every state home
    ptr = (lambda p: p.data_ptr()) if writable else address
    return {
        canonical_name(n): ptr(p) for n, p in nn.Module.named_parameters(m) if not p.requires_grad
    }


def engine(tmp_path: Path, **kw: Any) -> th.Engine:
    """2 emulated copying devices, at most 2 layers a shard (3 shards of the tiny Llama),
    a host ledger (with a disk tier that nothing needs)."""
    tmp_path.mkdir(exist_ok=True)
    return th.Engine(
        devices=["cpu", "cpu"],
        copy_on_cpu=True,
        max_layers_per_shard=2,
        host_memory=2**30,
        spill_dir=tmp_path,
        **kw,
    )


def base_bytes(folder: Path) -> int:
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    return sum(p.numel() * p.element_size() for p in base.parameters())


# -- parity and one base --------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_lora_loops_share_one_base_and_train_as_alone(
    kind: str, recompute: bool, folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = folders[kind]
    B = base_bytes(folder)
    held: dict[bool, int] = {}
    for share in (True, False):
        trials = [trial(folder, i, kind) for i in range(4)]
        with engine(tmp_path / str(share), recompute=recompute, share_frozen=share) as eng:
            results = run_loops(eng, [(m, o) for m, o, _, _ in trials])
            pool = eng._registry.frozen
            ledger = eng.host.ledger.states
            frozen_held = sum(v for k, v in ledger.items() if isinstance(k, tuple))
            held[share] = eng.summary()["host"]["held_bytes"]
            if share:
                entries = pool.entries()
                n_base = sum(not p.requires_grad for p in trials[0][2].parameters())
                assert len(entries) == n_base and all(len(e.tasks) == 4 for e in entries)
                assert pool.held_bytes() == B == frozen_held
                ptrs = [frozen_ptrs(m) for m, _, _, _ in trials]
                assert all(p == ptrs[0] for p in ptrs)  # one tensor each, for all four
                loops = [m._th_shard.loop for m, _, _, _ in trials]
                assert all(lp.keep is not recompute for lp in loops)
                assert all(len(lp.shards) == 3 for lp in loops)
            else:
                assert frozen_held == 0 and not pool.entries()
            for i, (model, _, ref, ref_opt) in enumerate(trials):
                assert not isinstance(results[i], BaseException), results[i]
                assert results[i] == plain(ref, ref_opt, i), i
                assert_same(model, ref)
                assert_same(model.get_base_model(), ref.get_base_model())
    # The base counted once, not four times.
    assert held[False] - held[True] == 3 * B


# -- what the user reads and writes ---------------------------------------------------------


def test_unshard_gives_the_user_their_own_weights_while_others_share(
    folder: Path, tmp_path: Path
) -> None:
    trials = [trial(folder, i) for i in range(3)]
    with engine(tmp_path) as eng:
        pool = eng._registry.frozen
        seen: dict[str, Any] = {}

        def leave(epoch: int) -> None:  # trial 0's last epoch: it leaves the engine
            model = trials[0][0]
            seen["shared"] = frozen_ptrs(model)
            seen["state"] = {k: v.clone() for k, v in model.state_dict().items()}
            th.unshard(model)

        results = run_loops(
            eng, [(m, o) for m, o, _, _ in trials], between={0: leave}, epochs={0: 1}
        )
        # The loop that left got a private copy of the base; the others still share one.
        own = frozen_ptrs(trials[0][0], writable=True)
        others = frozen_ptrs(trials[1][0])
        assert all(own[n] != others[n] for n in own) and seen["shared"] == others
        assert all(len(e.tasks) == 2 for e in pool.entries())
        with torch.no_grad():  # the user's model: writing it reaches no other loop
            for p in trials[0][0].parameters():
                p.add_(1.0)
        for i in (1, 2):
            model, _, ref, ref_opt = trials[i]
            assert results[i] == plain(ref, ref_opt, i), i
            assert_same(model, ref)
            th.unshard(model)
        assert not pool.entries() and pool.held_bytes() == 0
    model, _, ref, ref_opt = trials[0]
    assert results[0] == plain(ref, ref_opt, 0, epochs=1)
    want = ref.state_dict()
    assert list(seen["state"]) == list(want)
    assert all(torch.equal(seen["state"][k], want[k]) for k in want)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    assert_same(model, ref)


def test_load_state_dict_writes_the_loops_own_copy(folder: Path, tmp_path: Path) -> None:
    """A checkpoint of the same base loaded mid-run (resuming) keeps the base shared; one
    whose base tensor differs gives that loop its own copy of it (the others unaffected);
    every loop trains as plain PyTorch does with the same loads."""
    trials = [trial(folder, i) for i in range(3)]
    name = "base_model.model.model.layers.1.mlp.up_proj.weight"
    assert name in dict(trials[0][0].named_parameters())

    def reload(model: nn.Module, change: bool) -> Callable[[int], None]:
        def between(epoch: int) -> None:
            if epoch == 0:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                if change:
                    state[name] = state[name] * 0.5
                model.load_state_dict(state)

        return between

    with engine(tmp_path) as eng:
        pool = eng._registry.frozen
        results = run_loops(
            eng,
            [(m, o) for m, o, _, _ in trials],
            between={0: reload(trials[0][0], False), 1: reload(trials[1][0], True)},
        )
        entries = {e.name: len(e.tasks) for e in pool.entries()}
        assert entries.pop(name) == 2  # loop 1's own now; loops 0 and 2 share it
        assert all(n == 3 for n in entries.values())
        ptrs = [frozen_ptrs(m) for m, _, _, _ in trials]  # (up_proj is trial 2's adapted)
        assert ptrs[0][name] == ptrs[2][name] != ptrs[1][name]
    for i, (model, _, ref, ref_opt) in enumerate(trials):
        assert not isinstance(results[i], BaseException), results[i]
        assert results[i] == plain(ref, ref_opt, i, between=reload(ref, i == 1)), i
        assert_same(model, ref)


class WriteBase:
    """A forward pre-hook writing its module's (shared, frozen) weight in place at the
    loop's fourth training forward."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self.calls += 1
            if self.calls == 4:
                with torch.no_grad():
                    module.weight.mul_(0.5)


def test_a_loop_writing_a_shared_base_tensor_fails_alone(folder: Path, tmp_path: Path) -> None:
    trials = [trial(folder, i) for i in range(3)]
    bad = trials[1][0].get_base_model().model.layers[0].mlp.gate_proj
    bad.register_forward_pre_hook(WriteBase())
    with engine(tmp_path) as eng:
        results = run_loops(eng, [(m, o) for m, o, _, _ in trials])
    err = results[1]
    assert isinstance(err, FrozenTensorModifiedError), err
    # The loops sharing the base when the write was found: both others, or one when the
    # other had finished all its batches and left by then (seen beside a CPU hog).
    assert err.tensor.endswith("layers.0.mlp.gate_proj.weight") and err.others in (1, 2)
    for i in (0, 2):
        model, _, ref, ref_opt = trials[i]
        assert results[i] == plain(ref, ref_opt, i), i
        assert_same(model, ref)


def test_loops_sharing_a_base_are_cut_where_the_first_was_if_it_fits() -> None:
    """th.shard loops of three ranks over one base, on a budget that cuts rank 8 in two
    shards of three layers: rank 1 (alone: one shard) is cut there too, rank 16 (which
    does not fit there) keeps its own cut; each trains exactly as plain."""
    from tests.engine.storage.test_frozen import RANKS, lora_budget, lora_data, lora_model

    budget = lora_budget()
    models = {name: lora_model(r, i) for i, (name, r) in enumerate(RANKS.items())}
    refs = {name: copy.deepcopy(m) for name, m in models.items()}

    def opt(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)

    def fit(m: nn.Module, o: torch.optim.Optimizer, i: int) -> list[float]:
        out = []
        for _ in range(2):
            for x, y in lora_data(i):
                o.zero_grad()
                loss = nn.functional.cross_entropy(m(x), y)
                loss.backward()
                o.step()
                out.append(loss.item())
        return out

    with th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, device_memory=budget) as eng:
        loops = {}
        for i, (name, m) in enumerate(models.items()):  # cut in this order: a first
            m, o = th.shard(m, opt(m), engine=eng)
            with torch.no_grad():  # no state changes, no random numbers: plain's as is
                m(lora_data(i)[0][0])
            loops[name] = (m, o)
        cuts = {
            n: [(s.start, s.stop) for s in m._th_shard.loop.plan.shards]
            for n, (m, _) in loops.items()
        }
        results: dict[str, Any] = {}

        def run(i: int, name: str) -> None:
            try:
                results[name] = fit(*loops[name], i)
            except BaseException as err:
                results[name] = err

        threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(loops)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        users = {len(e.tasks) for e in eng._registry.frozen.entries()}
        assert cuts["a"] == cuts["b"] == [(0, 3), (3, 6)] != cuts["c"] and users == {3}
        for i, (name, ref) in enumerate(refs.items()):
            assert results[name] == fit(ref, opt(ref), i), name
            assert_same(loops[name][0], ref)


@pytest.mark.parametrize("below_base", [False, True], ids=["above-base", "below-base"])
def test_lora_loops_with_the_disk_tier_share_the_base_and_train_as_alone(
    folder: Path, tmp_path: Path, below_base: bool
) -> None:
    """A host budget below the trials' states: their own states go to disk and back, each
    loop exact as plain. Below the base itself, the base goes to disk too, each tensor
    written once (not once per trial) and read back when a loop needs it."""
    trials = [trial(folder, i) for i in range(3)]
    own = sum(
        p.numel() * p.element_size()
        for m, _, _, _ in trials
        for p in nn.Module.parameters(m)
        if p.requires_grad
    )
    B = base_bytes(folder)
    with th.Engine(
        devices=["cpu", "cpu"],
        copy_on_cpu=True,
        max_layers_per_shard=2,
        # Adapters, gradients and AdamW: 4x own, and activations.
        host_memory=(B * 2 // 3 if below_base else B) + own * 2,
        spill_dir=tmp_path,
    ) as eng:
        results = run_loops(eng, [(m, o) for m, o, _, _ in trials])
        host = eng.summary()["host"]
        assert eng._registry.frozen.held_bytes() == B  # held once, in RAM or on disk
        frozen_io = [e for e in eng.trace.events if e.device == "disk" and e.task == "frozen"]
        written = sum(e.bytes_moved for e in frozen_io if e.op == "to_disk")
        assert written <= B  # each base tensor written at most once
        if below_base:
            assert written > 0 and any(e.op == "from_disk" for e in frozen_io)
            # Within the documented slack: (devices + 1) x the largest state or tensor.
            big = max(
                *(e.nbytes for e in eng._registry.frozen.entries()),
                *(st.state_bytes for r in eng._registry.tasks.values() for st in r.runner.stores),
            )
            assert host["peak_held_bytes"] <= host["budget"] + 3 * big, (host, big)
        for i, (model, _, ref, ref_opt) in enumerate(trials):
            assert not isinstance(results[i], BaseException), results[i]
            assert results[i] == plain(ref, ref_opt, i), i
            assert_same(model, ref)
    assert host["written_bytes"] > 0 and host["read_bytes"] > 0
