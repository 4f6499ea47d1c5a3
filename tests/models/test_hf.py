"""Hugging Face models cut at their blocks: the stages, run one after the other, are the
model's own forward bit for bit (float64, dropout on, padded batches, -100 labels),
gradients included; the model is left as it was; clear errors for what cannot be cut."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tune_hydra.exceptions import InvalidModelError
from tune_hydra.models.hf import hf_layers, is_hf_model

transformers = pytest.importorskip("transformers")

VOCAB = 32


def tiny(kind: str) -> Any:
    """Tiny random models via their configs (no download)."""
    t = transformers
    gpt2 = dict(n_layer=3, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16)
    llama = dict(
        num_hidden_layers=3,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=VOCAB,
        max_position_embeddings=16,
        attention_dropout=0.1,
    )
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(**gpt2))
    if kind == "gpt2-cls":
        cfg = t.GPT2Config(**gpt2, num_labels=3, pad_token_id=0)
        return t.GPT2ForSequenceClassification(cfg)
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**llama))
    if kind == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**llama, sliding_window=4))
    if kind == "qwen2":  # sliding window on some layers only: each layer gets its own mask
        cfg = t.Qwen2Config(**llama, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        return t.Qwen2ForCausalLM(cfg)
    raise AssertionError(kind)


def batch(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0  # right padding
    ids[1, 5:] = 0
    if kind == "gpt2-cls":
        labels = torch.tensor([0, 2, 1])
    else:
        labels = ids.clone()
        labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


KINDS = ["gpt2", "gpt2-cls", "llama", "mistral", "qwen2"]


def run_stages(stages: list[tuple[str, torch.nn.Module]], x: Any) -> Any:
    for _, stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_stages_are_the_models_forward_exactly(kind: str) -> None:
    torch.manual_seed(0)
    model = tiny(kind).double().train()
    plain = copy.deepcopy(model)
    stages = hf_layers(model)
    assert stages[0][0] == "embed" and stages[-1][0] == "head" and len(stages) == 5
    for seed in range(2):  # twice: the first call sets what the model sets once
        b = batch(kind, seed)
        torch.manual_seed(seed)
        want = plain(**b)
        want.loss.backward()
        torch.manual_seed(seed)
        got = run_stages(stages, b)
        got.loss.backward()
        assert torch.equal(got.loss, want.loss)
        assert torch.equal(got.logits, want.logits)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(run_stages(stages, batch(kind)).logits, plain(**batch(kind)).logits)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_model_is_left_as_it_was(kind: str, tmp_path: Any) -> None:
    model = tiny(kind).double()
    keys = list(model.state_dict())
    stages = hf_layers(model)
    run_stages(stages, batch(kind))
    # No recorder or stub is left on any module, and the user's checkpoints round-trip.
    assert not any("forward" in vars(m) for m in model.modules())
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path, dtype=torch.float64)
    saved = again.state_dict().items()
    for (name, p), (_, q) in zip(model.state_dict().items(), saved, strict=True):
        assert torch.equal(p, q), name
    # A failing stage leaves nothing behind either.
    with pytest.raises(IndexError):
        stages[0][1]({"input_ids": torch.full((2, 3), 999)})  # past the vocabulary
    assert not any("forward" in vars(m) for m in model.modules())


def test_parameters_belong_to_the_stages_that_use_them() -> None:
    model = tiny("gpt2")
    stages = dict(hf_layers(model))
    embed = {id(p) for p in stages["embed"].parameters()}
    head = {id(p) for p in stages["head"].parameters()}
    block = {id(p) for p in stages["transformer.h.1"].parameters()}
    assert id(model.transformer.wpe.weight) in embed
    assert id(model.transformer.ln_f.weight) in head
    assert block == {id(p) for p in model.transformer.h[1].parameters()}
    # GPT-2's lm_head is tied to the input embeddings: one parameter, in both stages.
    assert id(model.transformer.wte.weight) in embed & head
    every = set().union(*({id(p) for p in s.parameters()} for s in stages.values()))
    assert every == {id(p) for p in model.parameters()}


def test_is_hf_model() -> None:
    assert is_hf_model(tiny("gpt2"))
    assert not is_hf_model(torch.nn.Linear(2, 2))


def test_a_base_model_without_a_head_is_refused() -> None:
    base = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2))
    with pytest.raises(InvalidModelError, match=r"without a head.*ForCausalLM"):
        hf_layers(base, "t")


def test_an_unknown_architecture_says_how_to_make_it_cut() -> None:
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=8, num_attention_heads=2, intermediate_size=16
    )
    with pytest.raises(InvalidModelError, match=r"task 't'.*BertForMaskedLM.*nn.Sequential"):
        hf_layers(transformers.BertForMaskedLM(cfg), "t")


# -- through the engine: exact parity with plain training of a deepcopy ------------------


def data(kind: str, seed: int, n: int = 3) -> list[dict[str, torch.Tensor]]:
    return [batch(kind, seed * 100 + i) for i in range(n)]


def accuracy(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return (out.logits.argmax(-1) == labels).double().mean()


def hf_task(kind: str, seed: int) -> Any:
    import tune_hydra as th

    torch.manual_seed(seed)
    model = tiny(kind).double()
    return th.ModelTask(
        model,
        None,  # the model's own loss (output.loss), from the batch's labels
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        data(kind, seed),
        eval_data=data(kind, seed + 50, n=2),
        metrics={"accuracy": accuracy} if kind == "gpt2-cls" else None,
        # warm-up then linear decay, transformers' own schedule
        lr_scheduler=lambda opt: transformers.get_scheduler(
            "linear", opt, num_warmup_steps=2, num_training_steps=6
        ),
    )


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt2-cls", "qwen2", "mistral"])
def test_engine_parity_exact(kind: str, recompute: bool) -> None:
    import tune_hydra as th
    from tests.models.test_traced import assert_exact, plain_on_emulated_device

    tasks = {"a": hf_task(kind, 1), "b": hf_task(kind, 2)}
    refs = {
        k: th.ModelTask(
            copy.deepcopy(t.model),
            t.loss_fn,
            t.optimizer,
            t.train_data,
            eval_data=t.eval_data,
            metrics=t.metrics,
            lr_scheduler=t.lr_scheduler,
        )
        for k, t in tasks.items()
    }
    models = {k: t.model for k, t in tasks.items()}
    h = th.train_models(
        tasks,
        devices=["cpu", "cpu"],
        max_layers_per_shard=2,  # embed+block, block+block, block+head: 3 shards
        epochs=2,
        seed=5,
        recompute=recompute,
        copy_on_cpu=True,
    )
    h.validate()
    for name, task in tasks.items():
        assert task.model is models[name]
        want = plain_on_emulated_device(refs[name], 2, seed=5, devices=2)
        for g, w in zip(h[name], want, strict=True):
            assert g["loss"] == w["loss"] and g["val_loss"] == w["val_loss"]
            if kind == "gpt2-cls":
                assert g["accuracy"] == w["accuracy"]
        assert_exact(task.model, refs[name].model)
        assert len({e.shard for e in h.trace.events if e.task == name}) == 3
    assert len({e.device for e in h.trace.events if e.op in "FLBE"}) == 2


def test_a_model_output_without_loss_fails_its_task_alone() -> None:
    import tune_hydra as th

    good = hf_task("llama", 1)
    bad = hf_task("llama", 2)
    bad.train_data = [{k: v for k, v in b.items() if k != "labels"} for b in bad.train_data]
    with pytest.raises(th.exceptions.TrainingError) as err:
        th.train_models({"good": good, "bad": bad}, devices=["cpu"], epochs=1)
    assert set(err.value.errors) == {"bad"}
    assert isinstance(err.value.errors["bad"], th.exceptions.InvalidLossError)
    assert "labels" in str(err.value.errors["bad"])
    assert len(err.value.history["good"]) == 1


@pytest.mark.parametrize(
    ("recompute", "disk"), [(True, False), (False, False), (True, True)], ids=str
)
def test_tied_gpt2_with_accumulation_and_clipping_is_exact(
    recompute: bool, disk: bool, tmp_path: Any
) -> None:
    """lm_head is the input embedding: one parameter in the first and the last shard, its
    two gradients summed per micro-batch as autograd does, stepped and clipped once. With
    the disk tier, the shared parameter's store goes to disk and back as the others do."""
    import tune_hydra as th
    from tests.models.test_traced import assert_exact

    tasks = {"a": hf_task("gpt2", 1), "b": hf_task("gpt2", 2)}
    for t in tasks.values():
        t.train_data = data("gpt2", 7, n=5)  # two groups of 2 and a partial one
    refs = {
        k: th.ModelTask(
            copy.deepcopy(t.model), None, t.optimizer, t.train_data, lr_scheduler=t.lr_scheduler
        )
        for k, t in tasks.items()
    }
    model = tasks["a"].model
    assert model.lm_head.weight is model.transformer.wte.weight
    # Half of both models' states (weights, grads, Adam's two moments): most go to disk.
    total = 2 * 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    spill = {"host_memory": total // 2, "spill_dir": tmp_path} if disk else {}
    h = th.train_models(
        tasks,
        devices=["cpu", "cpu"],
        max_layers_per_shard=2,
        epochs=2,
        seed=3,
        recompute=recompute,
        copy_on_cpu=True,
        accumulate_steps=2,
        max_grad_norm=0.5,
        **spill,
    )
    h.validate()
    if disk:
        assert h.summary["host"]["written_bytes"] > 0 and h.summary["host"]["read_bytes"] > 0
        assert not list(tmp_path.iterdir())  # the engine's folder is gone
    for name, task in tasks.items():
        ref = refs[name]
        threads = torch.get_num_threads()  # as one of 2 emulated devices has
        torch.set_num_threads(max(1, threads // 2))
        try:
            w = th.train_plain(ref, 2, seed=3, accumulate_steps=2, max_grad_norm=0.5)
        finally:
            torch.set_num_threads(threads)
        assert [r["loss"] for r in h[name]] == [r["loss"] for r in w]
        assert_exact(task.model, ref.model)
        assert task.model.lm_head.weight is task.model.transformer.wte.weight  # still tied


def test_dict_batches_for_a_module_that_is_not_hugging_face_are_refused() -> None:
    import tune_hydra as th

    task = th.ModelTask(
        torch.nn.Sequential(torch.nn.Linear(2, 1)),
        torch.nn.MSELoss(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        [{"x": torch.ones(1, 2), "labels": torch.zeros(1, 1)}],
    )
    with pytest.raises(th.exceptions.TrainingError) as err:
        th.train_models({"t": task}, devices=["cpu"])
    assert isinstance(err.value.errors["t"], th.exceptions.InvalidTaskError)
    assert "model(**batch)" in str(err.value.errors["t"])
