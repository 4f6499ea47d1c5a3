"""peft models cut as their base is cut: the stages are the PeftModel's own forward bit for
bit (LoRA with dropout, DoRA, IA3, LoHa, LoKr), LoRA searches over one saved base train
exactly as each trial alone in plain PyTorch (float64; 2 emulated copying devices,
recompute on and off, with and without the disk tier), frozen tensors stay frozen, the
trained adapters save and load with peft's own ``save_pretrained`` / ``from_pretrained``,
and what cannot be cut is refused with a clear error."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tests.models.test_traced import assert_exact, plain_on_emulated_device
from tune_hydra.exceptions import InvalidModelError, InvalidTaskError, TrainingError
from tune_hydra.models import frozen_base_tensors, is_hf_model, is_peft_model, peft_layers

peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'tune_hydra[lora]'")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

VOCAB = 40
KINDS = ["llama", "gpt2"]


def config(kind: str) -> Any:
    t = transformers
    if kind == "llama":
        return t.LlamaConfig(
            num_hidden_layers=3,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=16,
            attention_dropout=0.1,
        )
    # GPT-2: dropout in the base too, lm_head tied to the (frozen) input embeddings.
    return t.GPT2Config(
        n_layer=3,
        n_embd=16,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=16,
        bos_token_id=1,  # within the tiny vocabulary
        eos_token_id=1,
    )


# Four trials per base: rank, alpha, learning rate, target modules and dropout differ.
TRIALS: dict[str, list[dict[str, Any]]] = {
    "llama": [
        {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "lr": 1e-2},
        {"r": 4, "lora_alpha": 4, "target_modules": ["k_proj", "o_proj"], "lr": 3e-2},
        {"r": 8, "lora_alpha": 32, "target_modules": ["up_proj", "down_proj"], "lr": 5e-3},
        {"r": 3, "lora_alpha": 6, "target_modules": "all-linear", "lr": 2e-2},
    ],
    "gpt2": [
        {"r": 2, "lora_alpha": 4, "target_modules": ["c_attn"], "lr": 1e-2},
        {"r": 4, "lora_alpha": 8, "target_modules": ["c_proj"], "lr": 3e-2},
        {"r": 8, "lora_alpha": 16, "target_modules": ["c_fc"], "lr": 5e-3},
        {"r": 3, "lora_alpha": 3, "target_modules": ["c_attn", "c_fc"], "lr": 2e-2},
    ],
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random base per kind, saved as a user's pretrained checkpoint."""
    folders = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(kind))
        folders[kind] = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folders[kind])
    return folders


def load(kind: str, folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0  # right padding, ignored by the loss
    ids[1, 5:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def data(seed: int, n: int = 3) -> list[dict[str, torch.Tensor]]:
    return [batch(seed * 100 + i) for i in range(n)]


def accuracy(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return (out.logits.argmax(-1) == labels).double().mean()


def lora_config(kind: str, dropout: float = 0.1, **spec: Any) -> Any:
    extra = {"fan_in_fan_out": True} if kind == "gpt2" else {}  # GPT-2's Conv1D layers
    return peft.LoraConfig(task_type="CAUSAL_LM", lora_dropout=dropout, **spec, **extra)


def trial(kind: str, folder: Path, i: int) -> th.ModelTask:
    """Trial ``i`` as a user's task factory writes it: load the base, wrap it."""
    spec = dict(TRIALS[kind][i])
    lr = spec.pop("lr")
    base = load(kind, folder)
    torch.manual_seed(i)  # the adapters' initial weights
    model = peft.get_peft_model(base, lora_config(kind, dropout=0.1 * (i % 2), **spec))
    return th.ModelTask(
        model,
        None,  # the model's own loss
        lambda p: torch.optim.AdamW(p, lr=lr),
        data(i + 1),
        eval_data=data(i + 51, n=2),
        metrics={"accuracy": accuracy},
    )


def alone(task: th.ModelTask) -> th.ModelTask:
    """The same task on a deepcopy of its model, to train alone in plain PyTorch."""
    return th.ModelTask(
        copy.deepcopy(task.model),
        task.loss_fn,
        task.optimizer,
        task.train_data,
        eval_data=task.eval_data,
        metrics=task.metrics,
    )


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_stages(stages: list[tuple[str, nn.Module]], x: Any) -> Any:
    for _, stage in stages:
        x = stage(x)
    return x


# -- the cut ------------------------------------------------------------------------------


ADAPTERS = {
    "lora": lambda kind: lora_config(kind, r=4, lora_alpha=8, target_modules=None),
    "dora": lambda kind: lora_config(kind, r=2, lora_alpha=2, use_dora=True),
    "ia3": lambda kind: peft.IA3Config(
        task_type="CAUSAL_LM",
        init_ia3_weights=False,  # random, not ones: the adapters change the output
        **({"fan_in_fan_out": True} if kind == "gpt2" else {}),
    ),
    "loha": lambda kind: peft.LoHaConfig(
        r=2, target_modules=["q_proj", "v_proj"] if kind == "llama" else ["c_fc"]
    ),
    "lokr": lambda kind: peft.LoKrConfig(
        r=2, target_modules=["q_proj", "v_proj"] if kind == "llama" else ["c_fc"]
    ),
}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
@pytest.mark.parametrize("kind", KINDS)
def test_stages_are_the_peft_models_forward_exactly(
    kind: str, adapter: str, saved: dict[str, Path]
) -> None:
    cfg = ADAPTERS[adapter](kind)
    if adapter == "lora":
        cfg.target_modules = ["q_proj", "o_proj"] if kind == "llama" else ["c_attn"]
    if adapter in ("loha", "lokr") and kind == "gpt2":
        pytest.skip(f"peft's {adapter} does not wrap GPT-2's Conv1D layers")
    torch.manual_seed(0)
    model = peft.get_peft_model(load(kind, saved[kind]), cfg).train()
    for p in model.parameters():  # B = 0 at init: make every adapter count
        if p.requires_grad:
            with torch.no_grad():
                p.add_(0.1 * torch.randn_like(p))
    plain = copy.deepcopy(model)
    stages = peft_layers(model, "t")
    blocks = [n for n, _ in stages[1:-1]]
    assert stages[0][0] == "embed" and stages[-1][0] == "head" and len(blocks) == 3
    # Blocks are named as in the PeftModel, adapters inside them.
    assert all(isinstance(model.get_submodule(n), nn.Module) for n in blocks)
    assert blocks[0].startswith("base_model.model.")
    every = set().union(*({id(p) for p in s.parameters()} for _, s in stages))
    assert every == {id(p) for p in model.parameters()}
    for seed in range(2):
        b = batch(seed)
        torch.manual_seed(seed)
        want = plain(**b)
        want.loss.backward()
        torch.manual_seed(seed)
        got = run_stages(stages, b)
        got.loss.backward()
        assert torch.equal(got.loss, want.loss)
        assert torch.equal(got.logits, want.logits)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(run_stages(stages, batch(9)).logits, plain(**batch(9)).logits)
    assert not any("forward" in vars(m) for m in model.modules())  # no stub left behind


def test_recognised_without_importing_peft_for_other_models(saved: dict[str, Path]) -> None:
    model = peft.get_peft_model(load("llama", saved["llama"]), lora_config("llama", r=2))
    assert is_peft_model(model) and is_hf_model(model)  # a batch dict is its keywords
    assert not is_peft_model(model.get_base_model())
    assert not is_peft_model(nn.Linear(2, 2))
    seq = peft.get_peft_model(
        nn.Sequential(nn.Linear(2, 2)), peft.LoraConfig(r=1, target_modules=["0"])
    )
    assert is_peft_model(seq) and not is_hf_model(seq)


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_base_tensors_are_named_as_in_the_base(kind: str, saved: dict[str, Path]) -> None:
    """Trials over one base with other target modules name each frozen tensor alike, as
    the base names it; a stage's share of them is found by its tensors."""
    base = load(kind, saved[kind])
    base_keys = {n for n, _ in (*base.named_parameters(), *base.named_buffers())}
    found = []
    for i in range(4):
        model = trial(kind, saved[kind], i).model
        frozen = frozen_base_tensors(model)
        assert set(frozen) == base_keys, sorted(set(frozen) ^ base_keys)
        assert all(not t.requires_grad for t in frozen.values())
        per_stage = [frozen_base_tensors(model, s) for _, s in peft_layers(model)]
        assert set().union(*per_stage) == set(frozen)
        found.append(frozen)
    for other in found[1:]:
        assert other.keys() == found[0].keys()
        assert all(torch.equal(other[k], found[0][k]) for k in other)


# -- through the engine: four trials, each exactly as alone -----------------------------


@pytest.mark.parametrize("disk", [False, True], ids=["ram", "disk"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
@pytest.mark.parametrize("kind", KINDS)
def test_four_lora_trials_multiplexed_are_exact(
    kind: str, recompute: bool, disk: bool, saved: dict[str, Path], tmp_path: Path
) -> None:
    tasks = {f"t{i}": trial(kind, saved[kind], i) for i in range(4)}
    refs = {k: alone(t) for k, t in tasks.items()}
    frozen = {
        k: {n: t.clone() for n, t in frozen_base_tensors(t.model).items()} for k, t in tasks.items()
    }
    before = {k: trainable(t.model) for k, t in tasks.items()}
    spill: dict[str, Any] = {}
    if disk:  # half of the four models' weights: shards go to disk and back
        weights = sum(
            p.numel() * p.element_size() for t in tasks.values() for p in t.model.parameters()
        )
        spill = {"host_memory": weights // 2, "spill_dir": tmp_path}
    h = th.train_models(
        tasks,
        devices=["cpu", "cpu"],
        max_layers_per_shard=2,  # embed+block, block+block, block+head: 3 shards
        epochs=2,
        seed=5,
        recompute=recompute,
        copy_on_cpu=True,
        **spill,
    )
    h.validate()
    if disk:
        assert h.summary["host"]["written_bytes"] > 0 and h.summary["host"]["read_bytes"] > 0
    for name, task in tasks.items():
        want = plain_on_emulated_device(refs[name], 2, seed=5, devices=2)
        for g, w in zip(h[name], want, strict=True):
            assert (g["loss"], g["val_loss"], g["accuracy"]) == (
                w["loss"],
                w["val_loss"],
                w["accuracy"],
            )
        assert_exact(task.model, refs[name].model)  # adapters, base and gradients
        after = trainable(task.model)
        assert all(not torch.equal(after[n], before[name][n]) for n in after), name
        for n, t in frozen_base_tensors(task.model).items():
            assert torch.equal(t, frozen[name][n]), (name, n)
        assert all(p.grad is None for p in task.model.parameters() if not p.requires_grad)
        assert len({e.shard for e in h.trace.events if e.task == name and e.shard >= 0}) == 3
    assert len({e.device for e in h.trace.events if e.op in "FLBE"}) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_four_lora_trials_hold_one_base(kind: str, saved: dict[str, Path], tmp_path: Path) -> None:
    """Whatever modules each trial adapts, the base is held once: each base tensor is one
    pool entry of all four trials, counted once in the host ledger and copied to a device
    once per residency; and each trial still trains exactly as alone."""
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.task_loop import TaskLoop

    tasks = {f"t{i}": trial(kind, saved[kind], i) for i in range(4)}
    refs = {k: alone(t) for k, t in tasks.items()}
    base = load(kind, saved[kind])
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    copied = {}
    for share in (True, False):
        runs = tasks if share else {k: alone(t) for k, t in refs.items()}
        with Engine(
            ["cpu", "cpu"],
            max_layers_per_shard=2,
            copy_on_cpu=True,
            host_memory=2**30,
            spill_dir=tmp_path,
            share_frozen=share,
        ) as eng:
            loops = {name: TaskLoop(name, task, eng, seed=5) for name, task in runs.items()}
            for loop in loops.values():
                loop.cut()  # each joins the pool at its cut
            pool = eng._registry.frozen
            if share:
                entries = pool.entries()
                assert len(entries) == len(list(base.parameters()))
                assert all(e.users == 4 and len(e.tasks) == 4 for e in entries)
                assert pool.held_bytes() == base_bytes
                ledger = eng.host.ledger.states
                assert sum(v for k, v in ledger.items() if isinstance(k, tuple)) == base_bytes
            futures = {name: loop.start(2) for name, loop in loops.items()}
            results = {name: f.result(timeout=300) for name, f in futures.items()}
            copied[share] = sum(e.bytes_moved for e in eng.trace.events if e.op == "copy_in")
            for loop in loops.values():
                loop.close()  # each model back on the CPU with its trained weights
        if share:
            for name, task in tasks.items():
                want = plain_on_emulated_device(refs[name], 2, seed=5, devices=2)
                got = [(r["loss"], r["val_loss"], r["accuracy"]) for r in results[name]]
                assert got == [(r["loss"], r["val_loss"], r["accuracy"]) for r in want]
                assert_exact(task.model, refs[name].model)
    assert copied[True] < copied[False]


def test_a_trial_whose_base_was_merged_in_place_keeps_its_own_merged_tensors(
    saved: dict[str, Path],
) -> None:
    """A trial that merged an earlier adapter into its base in place (merge_and_unload)
    before wrapping it again: the merged tensors differ from the others' base, so it keeps
    its own copies of them and shares the rest; every trial trains exactly as alone."""
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.task_loop import TaskLoop

    tasks = {f"t{i}": trial("llama", saved["llama"], i) for i in range(3)}
    torch.manual_seed(7)
    first = peft.get_peft_model(
        load("llama", saved["llama"]), lora_config("llama", r=2, target_modules=["q_proj"])
    )
    for n, p in first.named_parameters():
        if "lora_B" in n:  # B = 0 at init: a merge would change nothing
            with torch.no_grad():
                p.add_(0.1)
    merged = first.merge_and_unload()  # writes the base's q_proj weights in place
    torch.manual_seed(3)
    model = peft.get_peft_model(merged, lora_config("llama", r=2, target_modules=["v_proj"]))
    lr = 1e-2
    tasks["merged"] = th.ModelTask(
        model, None, lambda p: torch.optim.AdamW(p, lr=lr), data(9), eval_data=data(59, n=2)
    )
    refs = {k: alone(t) for k, t in tasks.items()}
    with Engine(["cpu", "cpu"], max_layers_per_shard=2, copy_on_cpu=True) as eng:
        loops = {name: TaskLoop(name, task, eng, seed=5) for name, task in tasks.items()}
        for loop in loops.values():
            loop.cut()  # each joins the pool at its cut
        users = {}
        for e in eng._registry.frozen.entries():
            users.setdefault(e.name, []).append(e.users)
        q = [n for n in users if "q_proj" in n]
        assert q and all(sorted(users[n]) == [1, 3] for n in q)  # its own, the others'
        assert all(u == [4] for n, u in users.items() if n not in q)
        futures = {name: loop.start(2) for name, loop in loops.items()}
        results = {name: f.result(timeout=300) for name, f in futures.items()}
        for loop in loops.values():
            loop.close()  # each model back on the CPU with its trained weights
    for name, task in tasks.items():
        want = plain_on_emulated_device(refs[name], 2, seed=5, devices=2)
        assert [(r["loss"], r["val_loss"]) for r in results[name]] == [
            (r["loss"], r["val_loss"]) for r in want
        ]
        assert_exact(task.model, refs[name].model)


@pytest.mark.parametrize("kind", KINDS)
def test_ia3_trials_multiplexed_are_exact(kind: str, saved: dict[str, Path]) -> None:
    tasks = {}
    for i in range(2):
        torch.manual_seed(i)
        model = peft.get_peft_model(load(kind, saved[kind]), ADAPTERS["ia3"](kind))
        lr = 0.05 * (i + 1)
        opt = lambda p, lr=lr: torch.optim.Adam(p, lr=lr)  # noqa: E731
        tasks[f"t{i}"] = th.ModelTask(model, None, opt, data(i + 1), eval_data=data(i + 9, 2))
    refs = {k: alone(t) for k, t in tasks.items()}
    h = th.train_models(
        tasks, devices=["cpu", "cpu"], max_layers_per_shard=2, epochs=2, seed=7, copy_on_cpu=True
    )
    for name, task in tasks.items():
        want = plain_on_emulated_device(refs[name], 2, seed=7, devices=2)
        assert [(r["loss"], r["val_loss"]) for r in h[name]] == [
            (r["loss"], r["val_loss"]) for r in want
        ]
        assert_exact(task.model, refs[name].model)


def test_gradient_checkpointing_as_peft_users_enable_it_is_exact(saved: dict[str, Path]) -> None:
    """The usual LoRA recipe: transformers' gradient checkpointing in the blocks, and a
    hook on the input embeddings so that their frozen output requires grad."""
    task = trial("llama", saved["llama"], 1)
    task.model.gradient_checkpointing_enable()
    task.model.enable_input_require_grads()
    ref = alone(task)
    h = th.train_models(
        {"a": task},
        devices=["cpu", "cpu"],
        max_layers_per_shard=2,
        epochs=2,
        seed=0,
        copy_on_cpu=True,
    )
    want = plain_on_emulated_device(ref, 2, seed=0, devices=2)
    assert [r["loss"] for r in h["a"]] == [r["loss"] for r in want]
    assert_exact(task.model, ref.model)


def test_frozen_tensors_have_no_gradient_nor_optimizer_state(saved: dict[str, Path]) -> None:
    task = trial("llama", saved["llama"], 1)
    names = set(trainable(task.model))
    from tune_hydra.frontends.task_loop import TaskLoop

    with th.Engine(devices=["cpu", "cpu"], max_layers_per_shard=2, copy_on_cpu=True) as engine:
        loop = TaskLoop("a", task, engine, seed=0)
        loop.start(1).result(timeout=120)
        state = loop.state()
        loop.close()
    assert set(state["optimizer"]["state"]) == names
    assert set(state["param_grads"]) == names


@pytest.mark.parametrize("kind", KINDS)
def test_trained_adapters_save_and_load_as_peft_does(
    kind: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    task = trial(kind, saved[kind], 3)
    th.train_models({"a": task}, devices=["cpu"], max_layers_per_shard=2, seed=1)
    model = task.model
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    again = peft.PeftModel.from_pretrained(load(kind, saved[kind]), tmp_path / "adapter")
    got = trainable(model)
    loaded = dict(again.named_parameters())
    assert got and all(torch.equal(loaded[n], t) for n, t in got.items())
    sa, sb = again.state_dict(), model.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    # The front ends' model.pt is the whole state dict, peft's keys: it loads into the
    # same peft model built afresh, and holds peft's adapter state.
    fresh = peft.get_peft_model(load(kind, saved[kind]), again.peft_config["default"])
    fresh.load_state_dict(model.state_dict())
    adapter = peft.get_peft_model_state_dict(fresh)
    want = peft.get_peft_model_state_dict(model)
    assert list(adapter) == list(want) and all(torch.equal(adapter[k], want[k]) for k in want)


class Residual(nn.Module):
    """A module that is not an nn.Sequential: cut by tracing its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + torch.relu(self.hidden(h)))


@pytest.mark.parametrize("base", ["sequential", "traced"])
def test_peft_around_a_module_that_is_not_hugging_face_is_exact(base: str) -> None:
    torch.manual_seed(0)
    if base == "sequential":
        net: nn.Module = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        targets, first = ["0", "2"], "base_model.model.0"
    else:
        net, targets, first = Residual(), ["inp", "hidden"], "base_model.model.inp"
    lora = peft.LoraConfig(r=2, target_modules=targets, lora_dropout=0.1)
    model = peft.get_peft_model(net.double(), lora)
    g = torch.Generator().manual_seed(1)
    train = [
        (
            torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randn(4, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(4)
    ]
    task = th.ModelTask(model, nn.MSELoss(), lambda p: torch.optim.Adam(p, lr=0.05), train)
    ref = alone(task)
    stages = peft_layers(model)
    assert stages[0][0] == first
    assert isinstance(stages[0][1], peft.tuners.lora.Linear) == (base == "sequential")
    h = th.train_models(
        {"a": task},
        devices=["cpu", "cpu"],
        max_layers_per_shard=1,
        epochs=2,
        seed=3,
        copy_on_cpu=True,
    )
    assert len(h.plans["a"]) == len(stages) >= 3
    want = plain_on_emulated_device(ref, 2, seed=3, devices=2)
    assert [r["loss"] for r in h["a"]] == [r["loss"] for r in want]
    assert_exact(task.model, ref.model)


# -- what cannot be cut -------------------------------------------------------------------


def test_a_base_that_cannot_be_cut_says_what_to_do() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return y if y.sum() > 0 else -y  # control flow on a value: not traceable

    model = peft.get_peft_model(Branchy(), peft.LoraConfig(r=1, target_modules=["a"]))
    with pytest.raises(InvalidModelError, match=r"task 't'.*Branchy.*y.sum.*get_peft_model"):
        peft_layers(model, "t")
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=8, num_attention_heads=2, intermediate_size=16
    )
    bert = peft.get_peft_model(
        transformers.BertForMaskedLM(cfg), peft.LoraConfig(r=1, target_modules=["query"])
    )
    with pytest.raises(InvalidModelError, match=r"task 't'.*BertForMaskedLM.*decoder") as err:
        peft_layers(bert, "t")
    assert str(err.value).count("task 't'") == 1


def test_adapters_that_are_not_inside_the_layers_are_refused(saved: dict[str, Path]) -> None:
    prompt = peft.get_peft_model(
        load("llama", saved["llama"]),
        peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2),
    )
    with pytest.raises(InvalidModelError, match=r"PROMPT_TUNING.*LoraConfig"):
        peft_layers(prompt, "t")
    ada = peft.get_peft_model(
        load("llama", saved["llama"]),
        peft.AdaLoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj"], total_step=10),
    )
    with pytest.raises(InvalidModelError, match=r"ADALORA"):
        peft_layers(ada, "t")


def test_a_batch_with_per_call_adapters_fails_its_task_alone(saved: dict[str, Path]) -> None:
    good, bad = trial("llama", saved["llama"], 0), trial("llama", saved["llama"], 1)
    bad.train_data = [{**b, "adapter_names": ["default"] * 3} for b in bad.train_data]
    with pytest.raises(TrainingError) as err:
        th.train_models({"good": good, "bad": bad}, devices=["cpu"], max_layers_per_shard=2)
    assert set(err.value.errors) == {"bad"}
    assert isinstance(err.value.errors["bad"], InvalidTaskError)
    assert "adapter_names" in str(err.value.errors["bad"])
    assert len(err.value.history["good"]) == 1
