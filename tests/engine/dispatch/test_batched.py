"""One pass of a shared frozen shard for several LoRA trials (tune_hydra.engine.dispatch.batched):
outputs, input gradients and adapter gradients equal each trial's shard run alone
(float64, within 1e-12 relative), and what is not batchable is refused with a reason."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from tune_hydra.engine.dispatch.batched import BatchedShard, why_not_batchable
from tune_hydra.engine.registration.factory import use_generator
from tune_hydra.engine.runtime.boundary import backward
from tune_hydra.engine.storage.frozen import canonical_name
from tune_hydra.exceptions import NotBatchableError

peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'tune_hydra[lora]'")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from tune_hydra.models import peft_layers  # noqa: E402


def detach(obj: Any, requires_grad: bool) -> Any:
    """``obj``'s tensors detached (floating ones needing grad with ``requires_grad``)."""
    return tree_map(
        lambda t: (
            t.detach().requires_grad_(requires_grad and t.is_floating_point())
            if isinstance(t, torch.Tensor)
            else t
        ),
        obj,
    )


def grads_of(inputs: Any) -> Any:
    """The gradients of ``inputs``' tensors (``None`` where none)."""
    return tree_map(lambda t: t.grad if isinstance(t, torch.Tensor) else None, inputs)


VOCAB = 40
TOL = 1e-12
SIZES = [3, 2, 4, 3]  # each trial's batch size

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Four trials per base: rank, alpha, target modules and adapter dropout differ.
TRIALS: dict[str, list[dict[str, Any]]] = {
    "llama": [
        {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
        {"r": 4, "lora_alpha": 4, "target_modules": ["k_proj", "o_proj"], "lora_dropout": 0.1},
        {"r": 8, "lora_alpha": 32, "target_modules": ["up_proj", "down_proj"]},
        {
            "r": 3,
            "lora_alpha": 6,
            "target_modules": [*LLAMA_ALL, "embed_tokens"],
            "lora_dropout": 0.2,
        },
    ],
    "gpt2": [
        {"r": 2, "lora_alpha": 4, "target_modules": ["c_attn"]},
        {"r": 4, "lora_alpha": 8, "target_modules": ["c_proj"], "lora_dropout": 0.1},
        {"r": 8, "lora_alpha": 16, "target_modules": ["c_fc"]},
        {"r": 3, "lora_alpha": 3, "target_modules": ["c_attn", "c_fc"], "lora_dropout": 0.2},
    ],
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(kind: str, dropout: float = 0.0) -> Any:
    if kind == "llama":
        return transformers.LlamaConfig(
            num_hidden_layers=3,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=16,
            attention_dropout=dropout,
        )
    return transformers.GPT2Config(
        n_layer=3,
        n_embd=16,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=16,
        bos_token_id=1,
        eos_token_id=1,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random base per kind, saved as a user's pretrained checkpoint."""
    out = {}
    for kind in ("llama", "gpt2"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(kind))
        out[kind] = tmp_path_factory.mktemp(kind)
        model.save_pretrained(out[kind])
    return out


def trials(kind: str, folder: Path, share: bool = True) -> list[nn.Module]:
    """The four trials as users build them: load the base, wrap it; their frozen tensors
    then shared as the engine's frozen pool shares them (``share``)."""
    models = []
    for i, spec in enumerate(TRIALS[kind]):
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
        torch.manual_seed(i)
        extra = {"fan_in_fan_out": True} if kind == "gpt2" else {}
        lora = peft.LoraConfig(task_type="CAUSAL_LM", **{"lora_dropout": 0.0, **spec}, **extra)
        model = peft.get_peft_model(base, lora)
        for p in model.parameters():
            if p.requires_grad:  # non-zero B: the adapters' gradients reach their inputs
                with torch.no_grad():
                    p.normal_(0, 0.3)
        models.append(model.train())  # as training does
    if share:
        pool = {canonical_name(n): p.data for n, p in models[0].named_parameters()}
        for m in models[1:]:
            for n, p in m.named_parameters():
                if not p.requires_grad:
                    p.data = pool[canonical_name(n)]
    return models


def shards(model: nn.Module) -> list[nn.Sequential]:
    """The model cut as the engine cuts it: [embed, block 0], [blocks 1, 2], [head]."""
    stages = [m for _, m in peft_layers(model)]
    return [nn.Sequential(*stages[:2]), nn.Sequential(*stages[2:4]), nn.Sequential(stages[4])]


def batch(seed: int, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, 7), generator=g)
    mask = torch.ones(size, 7, dtype=torch.long)
    mask[1, 5:] = 0  # right padding: every trial's block gets a mask tensor
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads_like(out: Any, seed: int) -> Any:
    """Random gradients for every floating tensor of ``out``, None elsewhere."""
    g = torch.Generator().manual_seed(seed)

    def f(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, generator=g)
        return None

    return tree_map(f, out)


def adapter_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in module.named_parameters():
        if p.requires_grad and p.grad is not None:
            out[n] = p.grad.clone()
            p.grad = None
    return out


def tensors(obj: Any) -> list[torch.Tensor | None]:
    return [t if isinstance(t, torch.Tensor) or t is None else None for t in tree_flatten(obj)[0]]


def compare(got: Any, want: Any, worst: list[float]) -> None:
    """Assert equal tensors within TOL relative (norm-wise); track the worst error."""
    a, b = tensors(got), tensors(want)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is None or y is None:
            continue
        assert x.shape == y.shape and x.dtype == y.dtype
        if not x.is_floating_point():
            assert torch.equal(x, y)
            continue
        scale = y.abs().max().item()
        err = (x - y).abs().max().item() / (scale if scale > 0 else 1.0)
        worst.append(err)
        assert err <= TOL, err


def gen(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(50 + i)


def alone(module: nn.Module, x: Any, grad: Any, i: int) -> tuple[Any, Any, dict[str, Any]]:
    """Trial ``i``'s shard run alone: forward, backward; outputs, input and adapter grads."""
    inp = detach(x, requires_grad=True)
    with use_generator(gen(i)):
        out = module(inp)
    backward(out, grad)
    return detach(out, False), grads_of(inp), adapter_grads(module)


@pytest.mark.parametrize("recompute", [False, True], ids=["graph", "recompute"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_batched_equals_each_trial_alone(
    kind: str, recompute: bool, saved: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    models = trials(kind, saved[kind])
    cut = [shards(m) for m in models]
    worst: list[float] = []
    inputs: list[Any] = [batch(10 + i, b) for i, b in enumerate(SIZES)]
    for k in range(2):  # the embed shard (a batch dict in), then two blocks
        mods = [c[k] for c in cut]
        want = []
        for i, m in enumerate(mods):
            with torch.no_grad():
                out = m(detach(inputs[i], False))  # only for the gradients' shapes
            grad = grads_like(out, 90 + i)
            want.append((*alone(m, inputs[i], grad, i), grad))
        shard = BatchedShard(mods)
        assert shard.draws == [t.get("lora_dropout", 0) > 0 for t in TRIALS[kind]]
        leaves = [detach(x, requires_grad=True) for x in inputs]
        gens = [gen(i) for i in range(4)]
        if recompute:  # a no-grad forward, then the backward's re-run on replayed streams
            states = [g.get_state() for g in gens]
            with torch.no_grad():
                first = shard.forward(leaves, gens)
            for g, s in zip(gens, states, strict=True):
                g.set_state(s)
        run = shard.forward(leaves, gens)
        BatchedShard.backward(run, [w[3] for w in want])
        for i, (out, in_grad, grads, _) in enumerate(want):
            compare(run.outputs[i], out, worst)
            if recompute:
                compare(first.outputs[i], out, worst)
            compare(grads_of(leaves[i]), in_grad, worst)
            mine = adapter_grads(mods[i])
            assert mine.keys() == grads.keys() and mine  # every trial's adapters got grads
            for n in grads:
                compare(mine[n], grads[n], worst)
        inputs = [w[0] for w in want]  # the next shard's inputs, as each trial's alone
    exact = max(worst) == 0.0
    with capsys.disabled():
        print(f"\n{kind} batched vs alone: {'exact' if exact else f'max rel {max(worst):.2e}'}")


def test_eval_mode_and_dropout_in_the_base(saved: dict[str, Path], tmp_path: Path) -> None:
    """A base with dropout is refused in training mode (one pass would draw other
    numbers), and batched in eval mode, where it draws none."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("gpt2", dropout=0.1))
    model.save_pretrained(tmp_path)
    models = trials("gpt2", tmp_path)  # kept: a Hugging Face stage holds its model weakly
    mods = [shards(m)[1] for m in models]
    with pytest.raises(NotBatchableError, match="active dropout"):
        BatchedShard(mods)
    for m in mods:
        m.eval()
    assert why_not_batchable(mods) is None
    firsts = trials("gpt2", tmp_path)
    x = [
        detach(s[0](batch(i, b)), False)
        for i, (s, b) in enumerate(zip([shards(m)[0] for m in firsts], SIZES, strict=True))
    ]
    with torch.no_grad():
        got = BatchedShard(mods).forward(x).outputs
        want = [m(xi) for m, xi in zip(mods, x, strict=True)]
    worst: list[float] = []
    for g, w in zip(got, want, strict=True):
        compare(g, w, worst)


def test_llama_attention_dropout_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config("llama", 0.1)).save_pretrained(tmp_path)
    mods = [shards(m)[1] for m in trials("llama", tmp_path)]
    with pytest.raises(NotBatchableError, match=r"attention_dropout=0\.1"):
        BatchedShard(mods)


def test_refusals(saved: dict[str, Path]) -> None:
    # Frozen tensors not shared (each trial's own copy): not one base to run once.
    mods = [shards(m)[1] for m in trials("llama", saved["llama"], share=False)]
    with pytest.raises(NotBatchableError, match="is not trial 0's tensor"):
        BatchedShard(mods)
    models = trials("llama", saved["llama"])
    cut = [shards(m) for m in models]
    # The head computes the loss: never over the concatenation.
    with pytest.raises(NotBatchableError, match="head"):
        BatchedShard([c[2] for c in cut])
    # Different shards of the trials.
    with pytest.raises(NotBatchableError, match="not trial 0's apart from the adapters"):
        BatchedShard([cut[0][0], cut[1][1]])
    # A trial training a parameter outside its adapters.
    other = copy.deepcopy(cut[1][1])
    next(p for n, p in other.named_parameters() if "norm" in n).requires_grad_(True)
    with pytest.raises(NotBatchableError, match="outside its LoRA adapters"):
        BatchedShard([cut[0][1], other])
    # Active adapter dropout without the trial's generator.
    shard = BatchedShard([c[1] for c in cut])
    x = [detach(c[0](batch(i, b)), False) for i, (c, b) in enumerate(zip(cut, SIZES, strict=True))]
    with pytest.raises(NotBatchableError, match=r"trials \[1, 3\] have active LoRA dropout"):
        shard.forward(x)
    # Inputs that do not concatenate: another sequence length in one trial.
    y = [detach(c[0](batch(i, 3)), False) for i, c in enumerate(cut)]
    short = batch(7, 3)
    y[2] = detach(cut[2][0]({k: v[:, :5] for k, v in short.items()}), False)
    with pytest.raises(NotBatchableError):
        shard.forward(y, [gen(i) for i in range(4)])
    assert "at least 2" in (why_not_batchable([cut[0][1]]) or "")


# -- through the engine (Engine(batch_shared=True)) ----------------------------------------


def lora_task(kind: str, folder: Path, i: int) -> Any:
    """Trial ``i`` as a task factory writes it: load the base, wrap it, AdamW."""
    import tune_hydra as th

    spec = TRIALS[kind][i]
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    torch.manual_seed(i)
    extra = {"fan_in_fan_out": True} if kind == "gpt2" else {}
    lora = peft.LoraConfig(task_type="CAUSAL_LM", **{"lora_dropout": 0.0, **spec}, **extra)
    model = peft.get_peft_model(base, lora)
    lr = [1e-2, 3e-2, 5e-3, 2e-2][i]
    data = [batch(100 * i + j, SIZES[i]) for j in range(3)]
    return th.ModelTask(model, None, lambda p: torch.optim.AdamW(p, lr=lr), data)


class _Together:
    """A trial's batches, each yielded once every trial asks for its own (a trial that
    failed breaks the barrier after a few seconds: the others go on alone)."""

    def __init__(self, data: list[Any], barrier: Any) -> None:
        self.data, self.barrier = data, barrier

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Any]:
        import threading

        for item in self.data:
            try:
                self.barrier.wait(timeout=5)
            except threading.BrokenBarrierError:
                self.barrier.abort()  # broken for good: nobody waits again
            yield item


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


@pytest.mark.parametrize(
    ("kind", "clip"), [("llama", None), ("gpt2", None), ("llama", 0.05)], ids=str
)
def test_engine_batch_shared_trains_as_each_alone(
    kind: str, clip: float | None, saved: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """4 LoRA trials on 2 emulated copying devices with batch_shared=True, trained as
    TaskLoops (each on its thread; th.optimize's runtime): each batch's chain of ops
    (F.., L, B..) batches on the shared base, the engine ran batched passes, and each
    trial's losses and adapters equal it trained alone in plain PyTorch within 1e-12
    relative (float64); with clipping too (the norms a batched backward takes)."""
    import tune_hydra as th
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.task_loop import TaskLoop

    tasks = {f"t{i}": lora_task(kind, saved[kind], i) for i in range(4)}
    refs = {
        k: th.ModelTask(copy.deepcopy(t.model), None, t.optimizer, t.train_data)
        for k, t in tasks.items()
    }
    with Engine(["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2, batch_shared=True) as eng:
        loops = {
            name: TaskLoop(name, task, eng, seed=3, max_grad_norm=clip)
            for name, task in tasks.items()
        }
        futures = {name: loop.start(2) for name, loop in loops.items()}
        results = {name: f.result(timeout=600) for name, f in futures.items()}
        for loop in loops.values():  # the last steps (left pending: no eval data) applied
            loop.close()
        assert eng.batcher is not None
        passes, ops = eng.batcher.passes, eng.batcher.batched_ops
        # The head's ops (not batchable: it computes the loss) run in their group, one
        # after another: the group stays together for the backward's batched passes
        # (GPT-2's head is tied to its embedding: its ops run alone).
        along = {e.op for e in eng.trace.events if e.along}
    assert passes > 0 and ops > passes  # batched passes ran, of 2 trials' ops or more
    assert {"F", "B"} | ({"L"} if kind == "llama" else set()) <= along, along
    worst = 0.0
    for name, task in tasks.items():
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads // 2))  # as an emulated device of two runs it
        try:
            want = th.train_plain(refs[name], 2, seed=3, max_grad_norm=clip)
        finally:
            torch.set_num_threads(threads)
        for got, w in zip(results[name], want, strict=True):
            err = abs(got["loss"] - w["loss"]) / abs(w["loss"])
            worst = max(worst, err)
            assert err <= TOL, (name, got["loss"], w["loss"])
        mine = dict(task.model.named_parameters())
        for n, p in refs[name].model.named_parameters():
            if p.requires_grad:
                worst = max(worst, rel(mine[n].detach(), p.detach()))
                assert rel(mine[n].detach(), p.detach()) <= TOL, n
    with capsys.disabled():
        print(
            f"\n{kind} engine batch_shared: {passes} batched passes of {ops} ops; vs alone: "
            f"{'exact' if worst == 0 else f'max rel {worst:.2e}'}"
        )


def test_engine_batch_shared_needs_recompute() -> None:
    from tune_hydra.engine import Engine
    from tune_hydra.exceptions import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="recomputing ops only"):
        Engine(["cpu"], recompute=False, batch_shared=True)


def test_engine_group_not_batchable_runs_each_alone(tmp_path: Path) -> None:
    """A base with dropout: the tasks' ops on a shared shard are grouped, found not
    batchable on the device, and run one after another in their assignment, bit for
    bit as each trained alone (no batched pass)."""
    import tune_hydra as th
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.task_loop import TaskLoop

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config("gpt2", 0.1)).save_pretrained(tmp_path)
    tasks = {f"t{i}": lora_task("gpt2", tmp_path, i) for i in range(3)}
    refs = {
        k: th.ModelTask(copy.deepcopy(t.model), None, t.optimizer, t.train_data)
        for k, t in tasks.items()
    }
    with Engine(["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2, batch_shared=True) as eng:
        loops = {name: TaskLoop(name, task, eng, seed=3) for name, task in tasks.items()}
        futures = {name: loop.start(1) for name, loop in loops.items()}
        results = {name: f.result(timeout=600) for name, f in futures.items()}
        for loop in loops.values():  # the last steps (left pending: no eval data) applied
            loop.close()
        assert eng.batcher is not None and eng.batcher.passes == 0
    for name, task in tasks.items():
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads // 2))
        try:
            want = th.train_plain(refs[name], 1, seed=3)
        finally:
            torch.set_num_threads(threads)
        assert [r["loss"] for r in results[name]] == [w["loss"] for w in want]
        mine = dict(task.model.named_parameters())
        for n, p in refs[name].model.named_parameters():
            assert torch.equal(mine[n], p), n


class AdapterBoom(RuntimeError):
    """The error one trial's adapter raises."""


def test_engine_one_trial_failing_leaves_the_others_exact(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 LoRA trials batched on 2 emulated copying devices; trial t1's adapter breaks at
    its first forward inside a batched pass from its 3rd forward on (and once a pass ran),
    and raises from then on: t1 fails alone with its own error, the other 3 train as each
    alone in plain PyTorch, and batched passes did run."""
    import threading

    import tune_hydra as th
    from tune_hydra.engine import Engine
    from tune_hydra.engine.dispatch import batched
    from tune_hydra.frontends.task_loop import TaskLoop

    raised: list[BaseException] = []
    real_op = batched._batched_op
    in_pass = threading.local()  # on the device's thread, while it runs a batched pass
    passed = [0]  # the passes that succeeded

    def watched(todo: Any, device: torch.device) -> Any:
        in_pass.on = True
        try:
            errors = real_op(todo, device)
        except Exception as err:
            raised.append(err)
            raise
        finally:
            in_pass.on = False
        passed[0] += 1
        return errors

    monkeypatch.setattr(batched, "_batched_op", watched)

    tasks = {f"t{i}": lora_task("gpt2", saved["gpt2"], i) for i in range(4)}
    refs = {
        k: th.ModelTask(copy.deepcopy(t.model), None, t.optimizer, t.train_data)
        for k, t in tasks.items()
    }
    calls = [0]
    broken = [False]

    def boom(module: nn.Module, args: Any, out: Any) -> None:
        calls[0] += 1
        # Broken in a pass (a loop's op runs alone when no other loop's is ready beside
        # it; and after one, which the loops' timing does not promise later), then for
        # good: t1's op fails alone too, after the pass.
        in_a_pass = getattr(in_pass, "on", False)
        broken[0] = broken[0] or (calls[0] >= 3 and in_a_pass and passed[0] > 0)
        if broken[0]:
            raise AdapterBoom(f"t1's adapter failed at call {calls[0]}")

    # The last block's adapter: its shard's ops batch (the first shard holds the
    # embedding, tied to the head: its ops run alone).
    lora_a = [m for n, m in tasks["t1"].model.named_modules() if n.endswith("lora_A.default")][-1]
    lora_a.register_forward_hook(boom)
    # The trials' batches start together, so that their ops on the shared base are ready
    # at once whatever else the machine runs (left to chance under CI's load, no pass
    # held t1's op once); t1 failing, the others go on without it.
    together = threading.Barrier(len(tasks))
    for task in tasks.values():
        task.train_data = _Together(task.train_data, together)
    with Engine(["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2, batch_shared=True) as eng:
        loops = {name: TaskLoop(name, task, eng, seed=3) for name, task in tasks.items()}
        futures = {name: loop.start(2) for name, loop in loops.items()}
        with pytest.raises(Exception, match="t1's adapter failed at call") as failed:
            futures["t1"].result(timeout=600)
        results = {n: f.result(timeout=600) for n, f in futures.items() if n != "t1"}
        for name in results:  # the last steps (left pending: no eval data) applied
            loops[name].close()
        assert eng.batcher is not None and eng.batcher.passes > 0
    chain = [failed.value, failed.value.__cause__]
    assert any(isinstance(e, AdapterBoom) for e in chain), chain
    assert any(isinstance(e, AdapterBoom) for e in raised), raised  # inside a batched pass
    for name, got_all in results.items():
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads // 2))
        try:
            want = th.train_plain(refs[name], 2, seed=3)
        finally:
            torch.set_num_threads(threads)
        for got, w in zip(got_all, want, strict=True):
            assert abs(got["loss"] - w["loss"]) <= TOL * abs(w["loss"]), (name, got, w)
        mine = dict(tasks[name].model.named_parameters())
        for n, p in refs[name].model.named_parameters():
            if p.requires_grad:
                assert rel(mine[n].detach(), p.detach()) <= TOL, (name, n)


def test_engine_one_shard_models_grouped_train_as_each_alone(saved: dict[str, Path]) -> None:
    """Models of one shard: their LAST ops (forward, loss and backward in one) may be
    grouped in one assignment, and each task trains on its own batches bit for bit as
    alone."""
    import tune_hydra as th
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.task_loop import TaskLoop

    tasks = {f"t{i}": lora_task("gpt2", saved["gpt2"], i) for i in range(3)}
    refs = {
        k: th.ModelTask(copy.deepcopy(t.model), None, t.optimizer, t.train_data)
        for k, t in tasks.items()
    }
    with Engine(["cpu"], copy_on_cpu=True, max_layers_per_shard=100, batch_shared=True) as eng:
        loops = {name: TaskLoop(name, task, eng, seed=3) for name, task in tasks.items()}
        futures = {name: loop.start(1) for name, loop in loops.items()}
        results = {name: f.result(timeout=600) for name, f in futures.items()}
        for loop in loops.values():  # the last steps (left pending: no eval data) applied
            loop.close()
    for name, task in tasks.items():
        want = th.train_plain(refs[name], 1, seed=3)
        assert [r["batches"] for r in results[name]] == [3]
        assert [r["loss"] for r in results[name]] == [w["loss"] for w in want]
        mine = dict(task.model.named_parameters())
        for n, p in refs[name].model.named_parameters():
            assert torch.equal(mine[n], p), n


# -- th.shard loops (Engine(batch_shared=True)) --------------------------------------------


def _loop_trial(kind: str, folder: Path, i: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    task = lora_task(kind, folder, i)
    model = task.model
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _train_loop(
    model: nn.Module, opt: torch.optim.Optimizer, i: int, together: Any = None
) -> list[float]:
    """A user's LoRA loop: 2 epochs of 3 batches, then an evaluation; ``together``: a
    ``threading.Barrier`` the loops meet at before each batch (so that their ops are ready
    at once, whatever else the machine runs: the batcher groups ops only then)."""
    losses = []
    for _ in range(2):
        model.train()
        for j in range(3):
            if together is not None:
                together.wait(120)
            opt.zero_grad()
            loss = model(**batch(100 * i + j, SIZES[i])).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        losses.append(model(**batch(999, 2)).loss.item())
    return losses


@pytest.mark.parametrize(("kind", "budget"), [("llama", None), ("gpt2", None), ("llama", 200_000)])
def test_shard_loops_batch_shared_train_as_each_alone(
    kind: str, budget: int | None, saved: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """4 LoRA loops of users' code under th.shard, each in its thread, on 2 emulated
    copying devices with batch_shared=True: the engine ran batched passes (counted in
    summary()["batched_passes"]), each loop's losses and adapters equal the same loop on
    a deepcopy in plain PyTorch within 1e-12 relative (float64), and the loops left the
    engine. Under a device budget too (the ops run along are counted on the device:
    their states as queued, their activations beside the pass's), below what the four
    loops' shards need at once: the trace replays within it."""
    passes, ops, worst = _four_loops(kind, budget, saved)
    assert passes > 0 and ops > passes, (passes, ops)
    with capsys.disabled():
        print(
            f"\n{kind} th.shard loops batch_shared: {passes} batched passes of {ops} ops; vs "
            f"alone: {'exact' if worst == 0 else f'max rel {worst:.2e}'}"
        )


def test_an_op_with_no_room_to_run_along_leaves_the_group_and_runs_later(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state of an op grouped to run along is leased by the device's run thread as
    the pass starts, and must not wait there (only its own op could make room: a full run
    hung). When it gets no room, the op leaves the group, is offered again, and runs
    later on its own: here no op ever gets room along, so no pass batches, and every loop
    still trains as alone and leaves the engine."""
    from tune_hydra.engine.dispatch.workers import DeviceWorker

    lease = DeviceWorker.lease
    refused = []

    def no_room(self: Any, store: Any, **kw: Any) -> Any:
        if kw.get("room_now"):
            refused.append(store.name)
            return None
        return lease(self, store, **kw)

    monkeypatch.setattr(DeviceWorker, "lease", no_room)
    passes, ops, _ = _four_loops("llama", 200_000, saved)
    assert refused and passes == 0 and ops == 0, (len(refused), passes, ops)


def _four_loops(kind: str, budget: int | None, saved: dict[str, Path]) -> tuple[int, int, float]:
    """Four LoRA loops at once on a batch_shared engine, each checked against its plain
    run; returns the batched passes, the ops run in them and the largest relative
    difference."""
    import threading

    import tune_hydra as th
    from tune_hydra.engine import Engine

    trials = [_loop_trial(kind, saved[kind], i) for i in range(4)]
    refs = [copy.deepcopy(m) for m, _ in trials]
    results: dict[int, Any] = {}
    lock = threading.Lock()
    together = threading.Barrier(4)
    acts: dict[tuple[str, int], int] = {}
    with Engine(
        ["cpu", "cpu"],
        copy_on_cpu=True,
        max_layers_per_shard=2,
        device_memory=budget,
        batch_shared=True,
    ) as eng:

        def loop(i: int) -> None:
            try:
                with lock:  # the loop's stream (adapter dropout) starts from this seed
                    torch.manual_seed(100 + i)
                    m, o = th.shard(*trials[i], engine=eng)
                results[i] = _train_loop(m, o, i, together)
                name = m.__dict__["_th_shard"].loop.name
                for spec in eng.plan(name).shards:
                    acts[(name, spec.index)] = spec.activation_bytes
                th.unshard(m)
            except BaseException as err:
                together.abort()  # the others do not wait for this one
                results[i] = err

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        passes = eng.summary()["batched_passes"]
        assert eng.batcher is not None
        ops = eng.batcher.batched_ops
        assert not eng.tasks()
        if budget is not None:
            # The loops' shards did not fit at once: states went back to host memory.
            assert any(e.op == "copy_out" for e in eng.trace.events)
            eng.trace.validate(state_budget=budget, activation_bytes=acts)
    worst = 0.0
    for i, ref in enumerate(refs):
        assert not isinstance(results[i], BaseException), results[i]
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
        torch.manual_seed(100 + i)
        want = _train_loop(ref, opt, i)
        for got, w in zip(results[i], want, strict=True):
            worst = max(worst, abs(got - w) / abs(w))
        assert worst <= TOL, (i, results[i], want)
        mine = dict(trials[i][0].named_parameters())
        for n, p in ref.named_parameters():
            if p.requires_grad:
                worst = max(worst, rel(mine[n].detach(), p.detach()))
                assert rel(mine[n].detach(), p.detach()) <= TOL, n
    return passes, ops, worst


def test_shard_loops_batched_forward_gives_each_loop_its_own_outputs(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Llama LoRA loops whose first shard's forward ops run as one batched pass (held
    back until both are ready, then dispatched together): the pass computes the rotary
    cos/sin once for both, and each loop still gets tensor objects of its own (one
    returned by both loops' autograd nodes gets the grad_fn of the last: one loop's
    backward would run the other's ops, a race seen in benchmarks/lora_batched.py), and
    both train exactly as alone."""
    import threading

    import tune_hydra as th
    from tune_hydra.engine import Engine
    from tune_hydra.engine.runtime.loop import LoopRunner

    taken: list[tuple[str, list[torch.Tensor]]] = []  # held: their ids stay theirs
    take = LoopRunner.take_forward

    def recording(self: Any, op: Any, start: Any, out: Any, cpu_after: Any) -> None:
        take(self, op, start, out, cpu_after)
        leaves = [t for t in tree_flatten(self._result[1])[0] if isinstance(t, torch.Tensor)]
        taken.append((self.name, leaves))

    monkeypatch.setattr(LoopRunner, "take_forward", recording)

    trials = [_loop_trial("llama", saved["llama"], i) for i in (0, 2)]
    refs = [copy.deepcopy(m) for m, _ in trials]
    x = [batch(7, 3), batch(8, 2)]
    with Engine(["cpu"], copy_on_cpu=True, max_layers_per_shard=2, batch_shared=True) as eng:
        sharded = [th.shard(m, o, engine=eng) for m, o in trials]
        for (m, o), b in zip(sharded, x, strict=True):  # the cut, each alone
            o.zero_grad()
            m(**b).loss.backward()
            o.step()
        losses: dict[int, Any] = {}

        def step(i: int) -> None:
            m, o = sharded[i]
            try:
                o.zero_grad()
                loss = m(**x[i]).loss
                loss.backward()
                o.step()
                losses[i] = loss.item()
            except BaseException as err:
                losses[i] = err

        with eng.hold_dispatch():  # both first forward ops ready before any decision
            threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            names = [m.__dict__["_th_shard"].loop.name for m, _ in sharded]
            deadline = time.monotonic() + 60
            while not all(eng._registry.tasks[n].runner.current for n in names):
                assert time.monotonic() < deadline
                time.sleep(0.001)
        for t in threads:
            t.join(120)
        assert eng.batcher is not None and eng.batcher.passes > 0
        for m, _ in sharded:
            th.unshard(m)
    assert taken  # ops' outputs taken from batched passes: no tensor in two loops' results
    owner: dict[int, str] = {}
    for name, leaves in taken:
        for t in leaves:
            assert owner.setdefault(id(t), name) == name, (name, tuple(t.shape))
    for i, ref in enumerate(refs):
        assert not isinstance(losses[i], BaseException), losses[i]
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
        want = []
        for _ in range(2):
            opt.zero_grad()
            loss = ref(**x[i]).loss
            loss.backward()
            opt.step()
            want.append(loss.item())
        assert abs(losses[i] - want[1]) <= TOL * abs(want[1]), (i, losses[i], want)
        mine = dict(trials[i][0].named_parameters())
        for n, p in ref.named_parameters():
            if p.requires_grad:
                assert rel(mine[n].detach(), p.detach()) <= TOL, n
