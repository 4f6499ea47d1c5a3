"""Hugging Face ``PreTrainedModel`` s cut at their list of decoder blocks.

Tracing a whole transformers model is fragile (rotary embeddings computed once per
forward and handed to every layer, masks built by helpers that branch on the input,
caches), so :func:`hf_layers` does not trace. It cuts where transformers itself says a
model may be split: the ``nn.ModuleList`` of the blocks named in ``_no_split_modules``
(``GPT2Block``, ``LlamaDecoderLayer`` ...). The stages are

- ``embed``: the model's own ``forward`` run up to its first block, with every block
  replaced by a recorder: what the model computes once and hands to the blocks
  (embeddings after dropout, the causal mask of each layer, rotary ``(cos, sin)``,
  position ids) is recorded as the model computed it, not re-implemented;
- one stage per block, called with the arguments recorded for it and the hidden state the
  previous stage handed on;
- ``head``: the final norm, then the model's own ``forward`` again with its base model
  answering with that hidden state: the head, the slicing and the loss
  (``self.loss_function``, label shifting, ``-100`` ignored; a classifier's pooling on the
  last non-pad token) are the model's own code.

The boundary between stages is ``(hidden, context, calls, batch)``: the hidden state,
the tensors the blocks share (each once), the remaining blocks' recorded arguments
(pointing into ``context``) and the batch (the head needs ``labels``, a classifier
``input_ids``). The stages hold the user's own modules, so training them trains the
model, and ``state_dict()`` / ``save_pretrained`` are untouched. ``lm_head`` tied to the
input embeddings (GPT-2) is a parameter of both the first and the last stage.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tune_hydra.exceptions import InvalidModelError

FINAL_NORMS = ("ln_f", "norm", "final_layernorm", "final_layer_norm", "final_norm")
"""Names of the norm a base model applies after its last block, in transformers."""


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``, or a peft ``PeftModel``
    around one (either takes a batch's dict as keyword arguments). Neither library is
    imported: a model of another library never loads them."""
    if _is_a(model, "PeftModel", "peft"):
        model = model.get_base_model()
    return _is_a(model, "PreTrainedModel", "transformers")


def _is_a(obj: Any, name: str, package: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith(package) for c in type(obj).__mro__)


def hf_layers(
    model: nn.Module, task: str | None = None, *, wrapper: nn.Module | None = None
) -> list[tuple[str, nn.Module]]:
    """Cut a transformers model into ``embed``, one stage per block, and ``head``.

    Args:
        model: a ``PreTrainedModel`` with a head (``GPT2LMHeadModel``,
            ``GPT2ForSequenceClassification``, ``LlamaForCausalLM``, Mistral, Qwen2 ...).
        task: the task's name, for errors.
        wrapper: a module holding ``model`` whose ``forward`` runs it (a peft
            ``PeftModel``, see :mod:`tune_hydra.models.peft`): the ``embed`` and ``head``
            stages run the wrapper's ``forward``, so whatever it adds around the model's
            is kept, and the blocks are named by their qualified names in the wrapper.

    Returns:
        ``(name, stage)`` in execution order: ``"embed"``, the blocks by their qualified
        names (``"transformer.h.0"`` ...), ``"head"``.

    Raises:
        InvalidModelError: no list of blocks, no final norm, or no head: the message says
            how to make the model cut.

    Example:
        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> cfg = GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
        >>> model = GPT2LMHeadModel(cfg).eval()
        >>> stages = hf_layers(model)
        >>> [name for name, _ in stages]
        ['embed', 'transformer.h.0', 'transformer.h.1', 'head']
        >>> batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
        >>> x = batch
        >>> for _, stage in stages:
        ...     x = stage(x)
        >>> torch.equal(x.loss, model(**batch).loss)
        True
    """
    of = f"task {task!r}: " if task is not None else ""
    name = type(model).__name__
    blocks_name, blocks = _find_blocks(model, of)
    base_name, _, list_attr = blocks_name.rpartition(".")
    base = model.get_submodule(base_name) if base_name else model
    if base is model:
        raise InvalidModelError(
            f"{of}{name} is a base model without a head: its output has no loss to train "
            f"on. Use the model class with the head you train (e.g. "
            f"{name.removesuffix('Model')}ForCausalLM), or give the model as an "
            f"nn.Sequential of its stages"
        )
    norms = [n for n in FINAL_NORMS if isinstance(getattr(base, n, None), nn.Module)]
    if not norms:
        base_class = type(base).__name__
        raise _unknown(of, name, f"its base model ({base_class}) has no final norm")
    norm_attr = norms[0]
    norm = getattr(base, norm_attr)
    embeds = {
        n: m for n, m in base.named_children() if n not in (list_attr, norm_attr)
    }  # wte, wpe, drop / embed_tokens, rotary_emb
    path = base_name.split(".")
    heads = {n: m for n, m in model.named_children() if n != path[0]}
    if len(path) > 1:  # a base nested deeper than one level: its wrappers are not handled
        why = f"its blocks' base model {base_name!r} is not a child of the model"
        raise _unknown(of, name, why)
    runs, shells, prefix = model, [model, base], ""
    if wrapper is not None:
        inner = _qualified_name(wrapper, model, of)
        prefix = f"{inner}." if inner else ""
        # The modules from the wrapper down to the model: their forwards run, and read
        # their own training flags.
        path = inner.split(".") if inner else []
        chain = [wrapper, *(wrapper.get_submodule(".".join(path[:i])) for i in range(1, len(path)))]
        runs, shells = wrapper, [*chain, model, base]
    embed = EmbedStage(runs, shells, blocks, norm, embeds)
    stages: list[tuple[str, nn.Module]] = [("embed", embed)]
    stages += [(f"{prefix}{blocks_name}.{i}", BlockStage(b)) for i, b in enumerate(blocks)]
    stages.append(("head", HeadStage(runs, shells, norm, heads)))
    return stages


def _qualified_name(wrapper: nn.Module, model: nn.Module, of: str) -> str:
    for n, m in wrapper.named_modules():
        if m is model:
            return n
    raise InvalidModelError(
        f"{of}{type(model).__name__} is not a submodule of its wrapper {type(wrapper).__name__}"
    )


class _Stage(nn.Module):
    """A stage that runs parts of the whole model's ``forward``: the model and its base
    are referenced, not registered (their parameters belong to the stages that use
    them), and follow the stage's train/eval mode.

    They are referenced weakly: the stages are the engine's, the model its owner's (a
    ``ModelTask``, or the user's, whose ``th.shard`` loop leaves the engine when the model
    is garbage-collected, which a strong reference from its own cut would prevent).

    Args:
        model: the module whose ``forward`` the stage runs (the model, or its wrapper).
        shells: the modules whose ``forward`` runs around the blocks, down to the base
            model (the last one): they follow the stage's mode.
    """

    def __init__(self, model: nn.Module, shells: list[nn.Module]) -> None:
        super().__init__()
        # Not registered as submodules.
        self.__dict__["_refs"] = (weakref.ref(model), [weakref.ref(s) for s in shells])

    @staticmethod
    def _alive(ref: weakref.ref[nn.Module]) -> nn.Module:
        module = ref()
        if module is None:
            raise InvalidModelError(
                "the model this Hugging Face stage runs was garbage-collected: keep the "
                "model while its stages (or its task) are used"
            )
        return module

    @property
    def _model(self) -> nn.Module:
        return self._alive(self.__dict__["_refs"][0])

    @property
    def _base(self) -> nn.Module:
        return self._alive(self.__dict__["_refs"][1][-1])

    def train(self, mode: bool = True) -> _Stage:
        super().train(mode)
        # The flags only (forwards read them); their submodules follow their own stages.
        for ref in self.__dict__["_refs"][1]:
            shell = ref()
            if shell is not None:
                shell.training = mode
        return self


class EmbedStage(_Stage):
    """The model's ``forward`` up to its first block: records what each block gets."""

    def __init__(
        self,
        model: nn.Module,
        shells: list[nn.Module],
        blocks: nn.ModuleList,
        norm: nn.Module,
        embeds: Mapping[str, nn.Module],
    ) -> None:
        super().__init__(model, shells)
        self.embeds = nn.ModuleDict(dict(embeds))
        self.__dict__["_around"] = (list(blocks), norm)  # their own stages hold them

    @property
    def _blocks(self) -> list[nn.Module]:
        return self.__dict__["_around"][0]

    @property
    def _norm(self) -> nn.Module:
        return self.__dict__["_around"][1]

    def forward(self, batch: Any) -> tuple[Any, ...]:
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        with (
            _recording(self._blocks, calls),
            _stop_before(self._norm) as stop,
            contextlib.suppress(_Stop),
        ):
            _call(self._model, batch)
        if stop.hidden is None or len(calls) != len(self._blocks):
            raise InvalidModelError(
                f"{type(self._model).__name__}.forward called {len(calls)} of its "
                f"{len(self._blocks)} blocks before its final norm; it cannot be cut at its "
                f"blocks. Give the model as an nn.Sequential of its stages"
            )
        hidden = stop.hidden
        context: list[torch.Tensor] = []
        index: dict[int, int] = {}

        def ref(v: Any) -> Any:
            if v is hidden:
                return _HIDDEN
            if isinstance(v, torch.Tensor):
                if id(v) not in index:
                    index[id(v)] = len(context)
                    context.append(v)
                return _Ref(index[id(v)])
            if isinstance(v, (tuple, list)):
                return type(v)(ref(x) for x in v)
            if isinstance(v, dict):
                return {k: ref(x) for k, x in v.items()}
            if _is_cache(v):
                # A key/value cache the model made (use_cache in its config) fills as the
                # blocks run, so a block re-run for its backward would see its own keys
                # twice: each block call gets a fresh copy of it as it was before the
                # blocks. Not None: the cache hands attention the keys and values it
                # concatenated (contiguous), not views of the projection, and a matmul
                # rounds by its operands' layout (plain's arithmetic needs the cache).
                return _FreshCache(copy.deepcopy(v))
            return v

        recorded = tuple((ref(args), ref(kwargs)) for args, kwargs in calls)
        return hidden, tuple(context), recorded, batch


class BlockStage(nn.Module):
    """One block, called with the arguments the model's ``forward`` gave it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, context, calls, batch = carry
        args, kwargs = _resolve(calls[0], hidden, context)
        out = self.block(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise InvalidModelError(
                f"{type(self.block).__name__} returned {type(out).__name__}, not the hidden "
                f"state tensor; tune_hydra cuts transformers models whose blocks return "
                f"their hidden state (transformers >= 5). Give the model as an "
                f"nn.Sequential of its stages"
            )
        return out, context, calls[1:], batch


class HeadStage(_Stage):
    """The final norm, then the model's ``forward`` with its base model answering with
    the normed hidden state: the head and the loss are the model's own."""

    def __init__(
        self,
        model: nn.Module,
        shells: list[nn.Module],
        norm: nn.Module,
        heads: Mapping[str, nn.Module],
    ) -> None:
        super().__init__(model, shells)
        self.norm = norm
        self.heads = nn.ModuleDict(dict(heads))

    def forward(self, carry: tuple[Any, ...]) -> Any:
        hidden, _, _, batch = carry
        hidden = self.norm(hidden)
        base = self._base
        # On the instance, for this call only: the model's forward gets its base model's
        # output without running it again.
        setattr(base, "forward", lambda *a, **k: _BaseOutput(hidden))  # noqa: B010
        try:
            return _call(self._model, batch)
        finally:
            delattr(base, "forward")


# -- recording and stopping ------------------------------------------------------------


class _Stop(Exception):
    """Raised before the final norm: the embed stage has what it needs."""


class _Ref:
    """A recorded argument: the ``index`` th tensor of the boundary's context."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"_Ref({self.index})"


_HIDDEN = "<hidden>"


class _StopState:
    hidden: torch.Tensor | None = None


@contextlib.contextmanager
def _recording(blocks: list[nn.Module], calls: list[Any]) -> Iterator[None]:
    """Replace each block's ``forward`` (on the instance) by one that records its
    arguments and hands the hidden state on unchanged."""

    def recorder(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return args[0] if args else kwargs["hidden_states"]

    for b in blocks:
        setattr(b, "forward", recorder)  # noqa: B010
    try:
        yield
    finally:
        for b in blocks:
            delattr(b, "forward")


@contextlib.contextmanager
def _stop_before(norm: nn.Module) -> Iterator[_StopState]:
    state = _StopState()

    def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
        state.hidden = args[0]
        raise _Stop

    handle = norm.register_forward_pre_hook(hook)
    try:
        yield state
    finally:
        handle.remove()


def _call(model: nn.Module, batch: Any) -> Any:
    """``model.forward(**batch)`` for a dict batch, else ``model.forward(batch)`` (the
    model's hooks run once, in plain training's one call: not here)."""
    if isinstance(batch, Mapping):
        return model.forward(**batch)
    if isinstance(batch, (tuple, list)):
        return model.forward(*batch)
    return model.forward(batch)


def _is_cache(v: Any) -> bool:
    cls = type(v)
    return cls.__module__.startswith("transformers") and cls.__name__.endswith("Cache")


class _FreshCache:
    """A recorded key/value cache: each block call gets a copy of it as the model made it
    (a pytree leaf, not the cache: transformers may register caches as pytree nodes).
    Two are equal (interchangeable, for the batched engine) when both are empty caches of
    the same structure."""

    __slots__ = ("cache", "structure")

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        try:
            self.structure: Any = _structure(cache)
        except _HoldsTensor:
            self.structure = None  # a cache with keys in it: equal to itself only

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _FreshCache):
            return NotImplemented
        if self.structure is None or other.structure is None:
            return self is other
        return bool(self.structure == other.structure)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"_FreshCache({type(self.cache).__name__})"


class _HoldsTensor(Exception):
    pass


def _structure(obj: Any, depth: int = 0) -> Any:
    """A comparable description of an object without tensors (an empty cache: its class,
    its layers' classes and settings); raises :class:`_HoldsTensor` on a tensor."""
    if isinstance(obj, torch.Tensor) or depth > 8:
        raise _HoldsTensor
    if obj is None or isinstance(obj, (bool, int, float, str, type)):
        return obj
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_structure(x, depth + 1) for x in obj))
    if isinstance(obj, dict):
        return (dict, tuple((repr(k), _structure(v, depth + 1)) for k, v in obj.items()))
    if hasattr(obj, "__dict__"):
        return (type(obj), _structure(vars(obj), depth + 1))
    raise _HoldsTensor  # unknown: compared by identity


def _resolve(call: Any, hidden: torch.Tensor, context: tuple[torch.Tensor, ...]) -> Any:
    def get(v: Any) -> Any:
        if isinstance(v, _Ref):
            return context[v.index]
        if isinstance(v, _FreshCache):
            return copy.deepcopy(v.cache)
        if isinstance(v, str) and v == _HIDDEN:
            return hidden
        if isinstance(v, (tuple, list)):
            return type(v)(get(x) for x in v)
        if isinstance(v, dict):
            return {k: get(x) for k, x in v.items()}
        return v

    return get(call)


class _BaseOutput:
    """What the head's ``forward`` reads from its base model's output: the last hidden
    state; anything else (cache, hidden states, attentions) is ``None``."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:
        return None

    def __getitem__(self, i: int) -> Any:
        if i == 0:
            return self.last_hidden_state
        raise IndexError(i)


def _find_blocks(model: nn.Module, of: str) -> tuple[str, nn.ModuleList]:
    """The model's list of blocks: the ``nn.ModuleList`` of ``_no_split_modules``
    classes (transformers' own word for where a model may be split)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and all(type(b).__name__ in names for b in m)
    ]
    if len(found) != 1:
        why = (
            "no nn.ModuleList of its blocks " + (f"({sorted(names)})" if names else "")
            if not found
            else f"several lists of blocks ({', '.join(n for n, _ in found)}: an encoder-decoder)"
        )
        raise _unknown(of, type(model).__name__, why)
    return found[0]


def _unknown(of: str, name: str, why: str) -> InvalidModelError:
    return InvalidModelError(
        f"{of}cannot cut the transformers model {name}: {why}. tune_hydra cuts decoder "
        f"models (GPT-2, Llama, Mistral, Qwen2 ...) at the one nn.ModuleList of the blocks "
        f"named in _no_split_modules, followed by a final norm ({', '.join(FINAL_NORMS)}) "
        f"and a head. For another architecture give the model as an nn.Sequential of its "
        f"stages (each taking the previous one's output)"
    )
