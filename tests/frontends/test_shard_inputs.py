"""th.shard takes the model's inputs as its ``forward`` takes them: positional and keyword
arguments, defaults omitted or given, ``None``, Python scalars, nested tuples/dicts,
``*args``/``**kwargs``; outputs of any pytree shape; the user's ``forward`` signature.

Every reference is the same loop on a ``copy.deepcopy`` of the model without
``th.shard`` (float64, bit-equal per-step losses, final weights and input gradients); the
sharded runs use 2 emulated copying devices, at most 2 layers a shard (the ``engine``
fixture), so each model is cut into several shards and every tensor argument crosses
shard boundaries. A traced model's non-tensor arguments are constants of its cut: a later
call giving others is refused, never run with the first call's.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tests.conftest import OPTIMIZERS
from tune_hydra.exceptions import InvalidModelError, UnsupportedCallError

W = 8  # width


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread (LayerNorm's weight gradient rounds by how it is split)."""


# -- the users' models ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.fc = nn.Linear(W, W)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc(self.norm(x))
        if mask is not None:
            y = y.masked_fill(~mask[..., None], 0.0)
        return x + F.gelu(y)


class Stack(nn.Module):
    """Transformer-ish: ``forward(x, mask=None)`` hands the mask to every block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The stack's own docstring."""
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


class LMLike(nn.Module):
    """A plain module with Hugging Face's call pattern: labels in, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, W)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.lm_head = nn.Linear(W, 11)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        x = self.embed(input_ids)
        mask = None if attention_mask is None else attention_mask.bool()
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lm_head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


class Flags(nn.Module):
    """Python scalars steering ``forward``: constants of the trace."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)
        self.fc3 = nn.Linear(W, 2)

    def forward(
        self, x: torch.Tensor, scale: float = 1.0, square: bool = False, return_dict: bool = True
    ) -> Any:
        h = self.fc1(x) * scale
        if square:
            h = h * h
        out = self.fc3(self.fc2(h))
        if return_dict:
            return {"out": out, "aux": None}
        return out, None


Out = namedtuple("Out", ["out", "parts"])


class Nested(nn.Module):
    """Nested dict/tuple inputs, ``*rest`` and ``**opts``; a namedtuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)
        self.fc3 = nn.Linear(W, 2)

    def forward(self, batch: dict[str, Any], extra: Any = None, *rest: Any, **opts: Any) -> Out:
        a, b = batch["pair"]
        h = self.fc1(batch["x"] + a) * b
        for t in rest:
            h = h + t
        h = self.fc2(h)
        if extra is not None:
            h = h + extra[0]
        out = self.fc3(h)
        gain = opts.get("gain")
        if gain is not None:
            out = out * gain
        return Out(out, [h, None, len(rest)])


@dataclasses.dataclass
class Registered:
    logits: torch.Tensor
    hidden: torch.Tensor


torch.export.register_dataclass(Registered)


@dataclasses.dataclass
class Unregistered:
    logits: torch.Tensor


class Returns(nn.Module):
    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)
        self.fc3 = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.fc2(self.fc1(x))
        out = self.fc3(h)
        return self.cls(out, h) if self.cls is Registered else self.cls(out)


def build(cls: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls().double()


# -- the loop, plain and sharded -----------------------------------------------------------


def data(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(3, 5, W, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    ids = torch.randint(0, 11, (3, 5), generator=g)
    labels = ids.clone()
    labels[0, -2:] = -100
    return {"x": x, "mask": mask, "ids": ids, "att": mask.long(), "labels": labels}


Step = Callable[[nn.Module, int], torch.Tensor]


def train(
    model: nn.Module, opt: torch.optim.Optimizer, step: Step, steps: int = 3
) -> list[torch.Tensor]:
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = step(model, i)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def assert_parity(
    make: Callable[[], nn.Module],
    step: Step,
    engine: th.Engine,
    optimizer: str = "adam",
    steps: int = 3,
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """Train a model sharded and a deepcopy plain (each from the same global seed: a
    Hugging Face model's dropout draws from it); returns (sharded, its optimizer, plain,
    its optimizer) after asserting bit-equal losses and weights, and that the model was
    cut in several shards."""
    model = build(make)
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    ref_opt = OPTIMIZERS[optimizer](list(ref.parameters()))
    model, opt = th.shard(model, opt, engine=engine)
    torch.manual_seed(1)
    got = train(model, opt, step, steps)
    torch.manual_seed(1)
    want = train(ref, ref_opt, step, steps)
    assert th.shard_count(model) >= 2
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), (i, a, b)
    sa, sb = model.state_dict(), ref.state_dict()
    assert list(sa) == list(sb)
    for k in sb:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)
    return model, opt, ref, ref_opt


# -- call forms ------------------------------------------------------------------------------

FORMS: dict[str, Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]] = {
    "keyword": lambda m, d: m(d["x"], mask=d["mask"]),
    "positional": lambda m, d: m(d["x"], d["mask"]),
    "all-keywords": lambda m, d: m(mask=d["mask"], x=d["x"]),
    "default-omitted": lambda m, d: m(d["x"]),
    "default-given": lambda m, d: m(d["x"], mask=None),
}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("form", list(FORMS))
def test_call_forms_are_exact(form: str, optimizer: str, engine: th.Engine) -> None:
    """``model(x, mask=m)``, ``model(x, m)``, defaults omitted or given: losses, weights,
    the input's gradient, and an evaluation forward, all equal plain's."""
    call = FORMS[form]
    grads: dict[int, list[torch.Tensor]] = {}

    def step(model: nn.Module, i: int) -> torch.Tensor:
        d = data(i)
        d["x"].requires_grad_(True)
        loss = call(model, d).square().mean()
        grads.setdefault(id(model), []).append(d["x"])
        return loss

    model, _, ref, _ = assert_parity(Stack, step, engine, optimizer)
    for xs, ys in zip(grads[id(model)], grads[id(ref)], strict=True):
        assert xs.grad is not None and torch.equal(xs.grad, ys.grad)
    model.eval()
    ref.eval()
    with torch.no_grad():
        d = data(9)
        assert torch.equal(call(model, d), call(ref, d))


def test_the_default_given_or_omitted_is_one_call(engine: th.Engine) -> None:
    """``model(x)`` then ``model(x, mask=None)``: the same call (defaults applied); a mask
    tensor after that is another (the cut traced ``mask is None``): refused."""

    def step(model: nn.Module, i: int) -> torch.Tensor:
        d = data(i)
        out = model(d["x"]) if i % 2 else model(d["x"], mask=None)
        return out.square().mean()

    model, *_ = assert_parity(Stack, step, engine, "sgd", steps=4)
    with pytest.raises(UnsupportedCallError, match=r"mask=<tensor> where the first call had None"):
        model(data(0)["x"], mask=data(0)["mask"])


def test_a_plain_module_with_hugging_faces_call_pattern(engine: th.Engine) -> None:
    """``forward(input_ids, attention_mask=None, labels=None)`` returning a dict with the
    loss: keywords in, ``out["loss"]`` out, ignore_index in the labels."""

    def step(model: nn.Module, i: int) -> torch.Tensor:
        d = data(i)
        out = model(d["ids"], attention_mask=d["att"], labels=d["labels"])
        assert set(out) == {"loss", "logits"}
        return out["loss"]

    model, _, ref, _ = assert_parity(LMLike, step, engine)
    d = data(5)
    with torch.no_grad():
        got = model(input_ids=d["ids"], attention_mask=d["att"], labels=d["labels"])
        want = ref(input_ids=d["ids"], attention_mask=d["att"], labels=d["labels"])
    assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["loss"], want["loss"])
    # Predicting without labels is another call than the one cut: refused, with the fix.
    with pytest.raises(UnsupportedCallError, match=r"labels=None where the first call had"):
        model(d["ids"], attention_mask=d["att"])


def test_python_scalars_are_constants_of_the_cut(engine: th.Engine) -> None:
    """bool/float arguments steer the trace (``if square``, a tuple out for
    ``return_dict=False``); the same values given another way are the same call; other
    values are refused before anything runs, and training goes on exactly."""

    def step(model: nn.Module, i: int) -> torch.Tensor:
        d = data(i)
        if i == 1:  # the same values, positionally
            out, aux = model(d["x"], 0.5, True, False)
        else:
            out, aux = model(d["x"], scale=0.5, square=True, return_dict=False)
        assert aux is None
        return out.square().mean()

    model, opt, ref, ref_opt = assert_parity(Flags, step, engine, "sgd")
    x = data(0)["x"]
    refused = {
        "scale=0.25 where the first call had 0.5": dict(scale=0.25, square=True, return_dict=False),
        "square=1 where the first call had True": dict(scale=0.5, square=1, return_dict=False),
        "scale=1.0 where": dict(square=True, return_dict=False),  # its default
        "return_dict=True where": dict(scale=0.5, square=True),
    }
    for message, kwargs in refused.items():
        with pytest.raises(UnsupportedCallError, match=message):
            model(x, **kwargs)
    # Nothing of the refused calls ran: a step more is still plain's.
    a = train(model, opt, lambda m, i: step(m, 3))
    b = train(ref, ref_opt, lambda m, i: step(m, 3))
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_nested_inputs_varargs_and_a_namedtuple_out(engine: th.Engine) -> None:
    """A dict holding a tuple, a tuple with a None, ``*rest`` and ``**opts`` tensors; the
    output a namedtuple holding a list with a None and an int."""

    def step(model: nn.Module, i: int) -> torch.Tensor:
        d = data(i)
        x = d["x"][:, 0]
        batch = {"x": x, "pair": (x.cos(), x.sin())}
        out = model(batch, (x.exp(), None), x * 2, x * 3, gain=x[:, :2].tanh())
        assert isinstance(out, Out) and out.parts[1:] == [None, 2]
        return out.out.square().mean() + out.parts[0].mean()

    assert_parity(Nested, step, engine, "adam")


def test_a_registered_dataclass_out(engine: th.Engine) -> None:
    def step(model: nn.Module, i: int) -> torch.Tensor:
        out = model(data(i)["x"])
        assert isinstance(out, Registered)
        return out.logits.square().mean() + out.hidden.mean()

    assert_parity(lambda: Returns(Registered), step, engine, "sgd")


def test_what_a_cut_cannot_carry_is_refused(engine: th.Engine) -> None:
    """An output class torch's pytree does not know (its tensors would not reach the
    backward), an argument object hiding its tensors from the trace, and a call that does
    not fit ``forward`` (as plain Python refuses it)."""
    x = data(0)["x"]
    model = th.shard(build(lambda: Returns(Unregistered)), engine=engine)
    with pytest.raises(InvalidModelError, match=r"register_dataclass\(Unregistered\)"):
        model(x)
    th.unshard(model)

    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    model = th.shard(build(Stack), engine=engine)
    with pytest.raises(UnsupportedCallError, match=r"x=Box\(\.\.\.\).*register"):
        model(Box(x))
    plain = build(Stack)
    for bad in (lambda m: m(x, nope=1), lambda m: m(x, None, 3), lambda m: m()):
        with pytest.raises(TypeError):
            bad(plain)
        with pytest.raises(TypeError):
            bad(model)
    th.unshard(model)


# -- the signature -----------------------------------------------------------------------


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, pad_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(torch.float64)


@pytest.mark.parametrize("make", [Stack, LMLike, tiny_gpt2], ids=["stack", "lm-like", "gpt2"])
def test_the_sharded_model_keeps_the_forward_signature(
    make: Callable[[], nn.Module], engine: th.Engine
) -> None:
    """``inspect.signature`` of ``model.forward`` and of its class's, as Trainer's
    ``remove_unused_columns`` reads it, are the user's; so is the docstring."""
    plain = make()
    model = th.shard(copy.deepcopy(plain), engine=engine)
    assert type(model) is not type(plain)
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)
    assert inspect.signature(type(model).forward) == inspect.signature(type(plain).forward)
    assert model.forward.__doc__ == plain.forward.__doc__
    assert "labels" in inspect.signature(model.forward).parameters or make is Stack
    th.unshard(model)
    assert type(model) is type(plain)


# -- Hugging Face models: keyword and positional inputs ------------------------------------


def lm_batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + i)
    ids = torch.randint(1, 32, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    ids[1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


HF_FORMS: dict[str, Callable[[nn.Module, dict[str, torch.Tensor]], Any]] = {
    "keywords": lambda m, b: m(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]
    ),
    # GPT2LMHeadModel.forward(input_ids, cache, attention_mask, ...): bound to the names.
    "positional": lambda m, b: m(b["input_ids"], None, b["attention_mask"], labels=b["labels"]),
}


@pytest.mark.parametrize("form", list(HF_FORMS))
def test_hugging_face_keyword_and_positional_inputs(form: str, engine: th.Engine) -> None:
    call = HF_FORMS[form]

    def step(model: nn.Module, i: int) -> torch.Tensor:
        return call(model, lm_batch(i)).loss

    model, _, ref, _ = assert_parity(tiny_gpt2, step, engine, "adam")
    # A Hugging Face model's arguments are passed on every call (its stages run its own
    # forward): a call of another form (no labels, a scalar) is honoured.
    b = lm_batch(4)
    del b["labels"]
    model.eval()
    ref.eval()
    with torch.no_grad():
        got = model(**b, logits_to_keep=1)
        want = ref(**b, logits_to_keep=1)
    assert got.logits.shape[1] == 1
    assert torch.equal(got.logits, want.logits)
