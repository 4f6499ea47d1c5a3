"""One trial writing its shared frozen base leaves the other trials untouched (issue #29).

Four peft LoRA trials over one tiny Llama (hidden 32, 2 layers, built with
``from_config``, float64), each a ``th.shard`` loop in a thread of its own, share their
base through the engine's frozen pool. Trial 1 writes a base weight mid-run:

- from the user's thread between epochs (``with torch.no_grad(): w.add_(1)``, and peft's
  ``merge_adapter()`` / ``unmerge_adapter()`` around an evaluation): the write reaches
  only trial 1's copy-on-write alias of the pool's tensor, which becomes its own; trial 1
  goes on exactly as plain PyTorch with the same write, and the pool keeps the original
  for the others;
- inside its forward (a forward pre-hook): trial 1 fails alone with
  ``FrozenTensorModifiedError``.

In every case the 3 other trials train as each alone in plain PyTorch, on 2 emulated CPU
devices copying or computing in place: bit for bit with ``batch_shared`` off, and within
the batched pass's parity (1e-12 relative, tests/engine/dispatch/test_batched.py) with it on, where
the frozen GEMMs run over the concatenated rows, which the BLAS may block otherwise (on
an AMD EPYC: 1.7e-16 apart; a write that reached them would be ~1 apart).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tune_hydra.engine.storage.frozen import address, canonical_name
from tune_hydra.exceptions import FrozenTensorModifiedError

peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'tune_hydra[lora]'")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

VOCAB = 40
WRITTEN = "base_model.model.model.layers.0.self_attn.k_proj.weight"  # trial 1 adapts k_proj
TRIALS: list[dict[str, Any]] = [
    {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "lr": 1e-2},
    {"r": 4, "lora_alpha": 4, "target_modules": ["k_proj", "o_proj"], "lr": 3e-2},
    {"r": 8, "lora_alpha": 16, "target_modules": ["up_proj", "down_proj"], "lr": 5e-3},
    {"r": 3, "lora_alpha": 6, "target_modules": "all-linear", "lr": 2e-2},
]
ENGINES: dict[str, dict[str, Any]] = {
    "copying": {"copy_on_cpu": True},
    "copying-batched": {"copy_on_cpu": True, "batch_shared": True},
    "in-place": {"copy_on_cpu": False},
    "in-place-batched": {"copy_on_cpu": False, "recompute": True, "batch_shared": True},
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread: a reduction split over threads rounds by how it is split."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config() -> Any:
    return transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=16,
    )


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    """The 'pretrained' base every trial loads."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config()).double()
    return {k: v.clone() for k, v in model.state_dict().items()}


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 7), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def data(seed: int, n: int = 3) -> list[dict[str, torch.Tensor]]:
    return [batch(seed * 100 + j) for j in range(n)]


Trial = tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]


def trial(base: dict[str, torch.Tensor], i: int) -> Trial:
    """Trial ``i``'s model and AdamW, and the same on a deepcopy for the plain run."""
    spec = dict(TRIALS[i])
    lr = spec.pop("lr")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config()).double()
    model.load_state_dict(base)
    torch.manual_seed(i)  # the adapters' initial weights
    lora = peft.LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **spec)
    peft_model = peft.get_peft_model(model, lora)
    ref = copy.deepcopy(peft_model)

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)

    return peft_model, adamw(peft_model), ref, adamw(ref)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    i: int,
    between: Callable[[int], list[float]] | None = None,
    cut: threading.Barrier | None = None,
) -> list[float]:
    """Trial ``i``'s loop: 2 epochs of training and evaluation; ``between(epoch)`` after
    each (what it returns goes into the history); ``cut``: waited on after the first
    forward, so that every trial's model is cut (its base in the pool) before any goes on."""
    history = []
    for epoch in range(2):
        model.train()
        for b in data(i + 1):
            optimizer.zero_grad()
            loss = model(**b).loss
            if cut is not None:
                with contextlib.suppress(threading.BrokenBarrierError):
                    cut.wait(120)
                cut = None
            loss.backward()
            optimizer.step()
            history.append(loss.item())
        model.eval()
        with torch.no_grad():
            history.extend(model(**b).loss.item() for b in data(i + 51, n=2))
        if between is not None:
            history.extend(between(epoch))
    return history


def add_one(model: nn.Module) -> Callable[[int], list[float]]:
    """After epoch 0, from the loop's thread: ``w.add_(1)`` on a frozen base weight."""
    w = dict(model.named_parameters())[WRITTEN.replace("k_proj.", "k_proj.base_layer.")]
    assert not w.requires_grad

    def between(epoch: int) -> list[float]:
        if epoch == 0:
            with torch.no_grad():
                w.add_(1.0)
        return []

    return between


def merge(model: Any) -> Callable[[int], list[float]]:
    """After epoch 0: evaluate with the adapters merged into the base, then unmerge."""

    def between(epoch: int) -> list[float]:
        if epoch != 0:
            return []
        model.merge_adapter()
        with torch.no_grad():
            loss = model(**batch(999)).loss.item()
        model.unmerge_adapter()
        return [loss]

    return between


def run_loops(
    eng: th.Engine, trials: list[Trial], between: dict[int, Callable[[int], list[float]]]
) -> dict[int, Any]:
    """Each trial's loop in a thread of its own, sharded on ``eng``; its stream starts
    from ``torch.manual_seed(100 + i)``. Every loop waits after its first forward until
    all are cut: which trials share the base when one writes it must not depend on how
    the threads happen to be scheduled (under load a late thread had not joined yet)."""
    lock = threading.Lock()
    results: dict[int, Any] = {}
    cut = threading.Barrier(len(trials))

    def loop(i: int) -> None:
        try:
            with lock:
                torch.manual_seed(100 + i)
                m, o = th.shard(trials[i][0], trials[i][1], engine=eng)
            results[i] = train(m, o, i, between.get(i), cut)
        except BaseException as err:
            cut.abort()  # a loop that fails before its first forward ends holds up none
            results[i] = err

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(trials))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def plain(t: Trial, i: int, between: Callable[[int], list[float]] | None = None) -> list[float]:
    torch.manual_seed(100 + i)
    return train(t[2], t[3], i, between)


#: How near a batched trial is to plain (the batched pass's parity, float64).
BATCHED_TOL = 1e-12


def assert_same(a: nn.Module, b: nn.Module, mode: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sb:
        if ENGINES[mode].get("batch_shared"):
            torch.testing.assert_close(sa[k], sb[k], rtol=BATCHED_TOL, atol=BATCHED_TOL, msg=k)
        else:
            assert torch.equal(sa[k], sb[k]), k


def assert_history(got: list[float], want: list[float], mode: str) -> None:
    if ENGINES[mode].get("batch_shared"):
        assert got == pytest.approx(want, rel=BATCHED_TOL, abs=0)
    else:
        assert got == want


def engine(mode: str) -> th.Engine:
    return th.Engine(devices=["cpu", "cpu"], max_layers_per_shard=1, **ENGINES[mode])


def written_entry(eng: th.Engine) -> Any:
    return next(e for e in eng._registry.frozen.entries() if e.name == canonical_name(WRITTEN))


@pytest.mark.parametrize("mode", list(ENGINES))
@pytest.mark.parametrize("write", ["add_", "merge_adapter"])
def test_a_write_between_ops_gives_the_writer_its_own_copy(
    write: str, mode: str, base: dict[str, torch.Tensor]
) -> None:
    """Trial 1 writes its base from its loop's thread: it goes on, exactly as plain
    PyTorch with the same write, on its own copy; the 3 others are exact as alone, and
    the pool keeps the original values for them."""
    trials = [trial(base, i) for i in range(4)]
    make = add_one if write == "add_" else merge
    original = base["model.layers.0.self_attn.k_proj.weight"]
    with engine(mode) as eng:
        results = run_loops(eng, trials, {1: make(trials[1][0])})
        entry = written_entry(eng)
        # The written tensor is trial 1's own now (merge_adapter writes every adapted one).
        assert len(entry.tasks) == 3 and torch.equal(entry.host, original)
        mine = dict(nn.Module.named_parameters(trials[1][0]))[
            WRITTEN.replace("k_proj.", "k_proj.base_layer.")
        ]
        assert address(mine) != address(entry.host)
    for i, t in enumerate(trials):
        assert not isinstance(results[i], BaseException), (i, results[i])
        assert_history(results[i], plain(t, i, make(t[2]) if i == 1 else None), mode)
        assert_same(t[0], t[2], mode)


class WriteInForward:
    """A forward pre-hook writing its module's (shared, frozen) weight in place at the
    loop's third training forward."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self.calls += 1
            if self.calls == 3:
                with torch.no_grad():
                    module.weight.add_(1.0)  # type: ignore[operator]


@pytest.mark.parametrize("mode", list(ENGINES))
def test_a_write_inside_an_op_fails_the_writer_alone(
    mode: str, base: dict[str, torch.Tensor]
) -> None:
    """Trial 1's forward writes its base: it fails alone with FrozenTensorModifiedError;
    the 3 others never read the write and train exactly as alone."""
    trials = [trial(base, i) for i in range(4)]
    peft_model: Any = trials[1][0]
    layer = peft_model.get_base_model().model.layers[0].self_attn.k_proj.base_layer
    layer.register_forward_pre_hook(WriteInForward())
    original = base["model.layers.0.self_attn.k_proj.weight"]
    with engine(mode) as eng:
        results = run_loops(eng, trials, {})
        entry = written_entry(eng)
        assert torch.equal(entry.host, original)
    err = results[1]
    assert isinstance(err, FrozenTensorModifiedError), err
    assert canonical_name(err.tensor) == canonical_name(WRITTEN) and err.others == 3
    for i in (0, 2, 3):
        t = trials[i]
        assert not isinstance(results[i], BaseException), (i, results[i])
        assert_history(results[i], plain(t, i), mode)
        assert_same(t[0], t[2], mode)
