"""peft models (LoRA, IA3 ...) cut as their base model is cut.

``peft.get_peft_model(base, LoraConfig(...))`` injects its adapter layers in place into
the base model's modules (``q_proj`` becomes a ``lora.Linear`` holding the frozen
``base_layer`` and the trainable ``lora_A`` / ``lora_B``) and wraps the base in a
``PeftModel`` whose ``forward`` runs it. The base's blocks thus already hold their
adapters, and :func:`peft_layers` cuts the base as it would be cut alone
(:func:`~tune_hydra.models.hf_layers` for a transformers model,
:func:`~tune_hydra.models.sequential_layers` for an ``nn.Sequential``,
:func:`~tune_hydra.models.trace_layers` for any other module, peft's adapter layers
called as one layer each), except that the
stages that run the model's ``forward`` (a transformers model's ``embed`` and ``head``)
run the ``PeftModel`` 's: whatever peft adds around the base's forward (its forward hooks'
context, dropping its own arguments) runs as in plain training. Stages are named by
their qualified names in the ``PeftModel`` (``base_model.model.model.layers.0``).

Only adapters that live inside the base model's layers and add nothing to its forward
are cut (:data:`PEFT_TYPES`): prompt learning (prompt / prefix / p-tuning) changes the
inputs, AdaLoRA adds a loss over every layer's adapters in its forward, and aLoRA or a
batch's ``adapter_names`` hook the adapters for one call only; each is refused with a
clear error rather than trained wrongly.

Frozen tensors (``requires_grad=False``: the base's weights) get no gradient and, as
torch optimizers skip parameters without one, no optimizer state: training leaves them
as they were. :func:`frozen_base_tensors` names them as the base model's own state dict
does, so that trials over one base (whatever their ``target_modules``) name a frozen
tensor alike.

peft itself is never imported here: a model is recognised by its classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tune_hydra.exceptions import InvalidModelError, InvalidTaskError
from tune_hydra.models.hf import hf_layers, is_hf_model
from tune_hydra.models.sequential import sequential_layers
from tune_hydra.models.traced import trace_layers

PEFT_TYPES = ("LORA", "IA3", "LOHA", "LOKR")
"""peft types cut (``PeftType`` values): adapters inside the base model's layers whose
model adds nothing to the base's forward (LoRA includes DoRA and rsLoRA)."""


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (``PeftModelForCausalLM`` ...), without
    importing peft."""
    return any(
        c.__name__ == "PeftModel" and c.__module__.startswith("peft") for c in type(model).__mro__
    )


def peft_layers(model: nn.Module, task: str | None = None) -> list[tuple[str, nn.Module]]:
    """Cut a peft model at its base model's layers; see the module docstring.

    Args:
        model: a ``PeftModel`` (LoRA, IA3, LoHa, LoKr) around a transformers model the
            engine cuts at its blocks, an ``nn.Sequential``, or a module whose
            ``forward`` torch.fx traces.
        task: the task's name, for errors.

    Returns:
        ``(name, stage)`` in execution order, the adapter layers inside their stages.

    Raises:
        InvalidModelError: another kind of adapter, or a base model that cannot be cut;
            the message says what to do.

    Example:
        >>> import peft, torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> cfg = GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
        >>> lora = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
        >>> model = peft.get_peft_model(GPT2LMHeadModel(cfg), lora)
        >>> [name for name, _ in peft_layers(model)]
        ['embed', 'base_model.model.transformer.h.0', 'base_model.model.transformer.h.1', 'head']
    """
    of = f"task {task!r}: " if task is not None else ""
    _check_adapters(model, of)
    base = model.get_base_model()  # type: ignore[operator]
    if is_hf_model(base):
        try:
            stages = hf_layers(base, wrapper=model)  # the task is named below
        except InvalidModelError as err:
            raise _cannot_cut(of, model, base, str(err)) from err
        # The first stage runs the PeftModel's forward on the batch: refuse what peft
        # would apply there only (its hooks are gone when the blocks run).
        stages[0][1].register_forward_pre_hook(_RefuseOneCallArgs(model, task))
        return stages
    # The PeftModel's forward runs the base's with the batch's inputs as they are: the
    # base's own cut is the whole model's.
    try:
        # (the task is named below)
        layers = sequential_layers(base) if type(base) is nn.Sequential else trace_layers(base)
    except InvalidModelError as err:
        raise _cannot_cut(of, model, base, str(err)) from err
    prefix = _qualified_name(model, base)
    return [(f"{prefix}.{n}", m) for n, m in layers]


def frozen_base_tensors(
    model: nn.Module, within: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The frozen parameters (``requires_grad=False``) and the buffers of a peft model,
    by their names in its base model (as its ``named_parameters`` / ``named_buffers``
    and its state dict have them).

    peft renames what it wraps (``...q_proj.weight`` becomes
    ``base_model.model...q_proj.base_layer.weight`` when ``q_proj`` is a target): the
    names here undo that (the ``PeftModel`` 's prefix, ``.base_layer``,
    ``.original_module``), so two trials over one base name each frozen tensor alike
    whatever their ``target_modules``.

    Args:
        model: a ``PeftModel``.
        within: only the tensors this module holds (a stage or a shard of ``model``).

    Returns:
        ``{name in the base's state dict: tensor}``, in the model's order.

    Example:
        >>> import peft
        >>> from torch import nn
        >>> base = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))
        >>> sorted(frozen_base_tensors(model))
        ['0.bias', '0.weight', '2.bias', '2.weight']
    """
    held = None if within is None else {id(t) for t in (*within.parameters(), *within.buffers())}
    prefix = _qualified_name(model, model.get_base_model())  # type: ignore[operator]
    out: dict[str, torch.Tensor] = {}
    named = [
        *((n, p) for n, p in model.named_parameters() if not p.requires_grad),
        *model.named_buffers(),
    ]
    for name, t in named:
        if held is not None and id(t) not in held:
            continue
        out[base_name(name, prefix)] = t
    return out


def base_name(name: str, prefix: str = "base_model.model") -> str:
    """A peft model's tensor name as its base model's state dict has it.

    Example:
        >>> base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        'model.layers.0.self_attn.q_proj.weight'
    """
    if prefix and name.startswith(prefix + "."):
        name = name[len(prefix) + 1 :]
    for wrapped in (".base_layer.", ".original_module."):
        name = name.replace(wrapped, ".")
    return name


# -- checks ----------------------------------------------------------------------------


def _check_adapters(model: nn.Module, of: str) -> None:
    """Refuse the adapters whose forward is not their base model's forward."""
    name = type(model).__name__
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        raise InvalidModelError(f"{of}{name} has no peft_config; is it a peft model?")
    for adapter, config in configs.items():
        kind = str(getattr(getattr(config, "peft_type", None), "value", config.peft_type))
        if getattr(config, "is_prompt_learning", False) or kind not in PEFT_TYPES:
            raise InvalidModelError(
                f"{of}{name}'s adapter {adapter!r} is {kind}: tune_hydra cuts peft models "
                f"whose adapters sit inside the base model's layers and add nothing to its "
                f"forward ({', '.join(PEFT_TYPES)}); prompt learning changes the inputs and "
                f"other tuners compute across layers. Use a LoraConfig (or IA3Config) for "
                f"this search"
            )
        if getattr(config, "alora_invocation_tokens", None):
            raise InvalidModelError(
                f"{of}{name}'s adapter {adapter!r} is an activated LoRA "
                f"(alora_invocation_tokens): it hooks the adapters for one forward call, "
                f"which tune_hydra runs in several shards. Use a plain LoraConfig"
            )
    tuner = getattr(model, "base_model", None)
    definer = next((c for c in type(tuner).__mro__ if "forward" in vars(c)), None)
    if definer is None or definer.__name__ != "BaseTuner":
        raise InvalidModelError(
            f"{of}{name}'s tuner {type(tuner).__name__} has its own forward; tune_hydra "
            f"cuts peft models whose tuner runs the base model's forward as it is "
            f"({', '.join(PEFT_TYPES)}). Use a LoraConfig for this search"
        )


class _RefuseOneCallArgs:
    """A forward pre-hook on the first stage: a batch with peft's per-call arguments
    (``adapter_names`` ...) is refused."""

    def __init__(self, model: nn.Module, task: str | None) -> None:
        self.special = frozenset(getattr(model, "special_peft_forward_args", ()))
        self.of = f"task {task!r}: " if task is not None else ""

    def __call__(self, _: nn.Module, args: tuple[Any, ...]) -> None:
        batch = args[0] if args else None
        if isinstance(batch, Mapping) and (found := sorted(self.special & set(batch))):
            raise InvalidTaskError(
                f"{self.of}the batch holds {', '.join(map(repr, found))}, which peft applies "
                f"by hooking the adapters for one forward call; tune_hydra runs the model in "
                f"several shards, so it cannot. Train one adapter per trial (leave "
                f"{found[0]!r} out of the batch)"
            )


def _qualified_name(model: nn.Module, sub: nn.Module) -> str:
    for n, m in model.named_modules():
        if m is sub:
            return n
    raise InvalidModelError(f"{type(sub).__name__} is not a submodule of {type(model).__name__}")


def _cannot_cut(of: str, model: nn.Module, base: nn.Module, why: str) -> InvalidModelError:
    return InvalidModelError(
        f"{of}the peft model {type(model).__name__} cannot be cut: its base model "
        f"{type(base).__name__} cannot be ({why}). tune_hydra cuts a peft model at its base "
        f"model's layers: wrap a base the engine cuts (a transformers decoder model such as "
        f"GPT-2 or Llama, an nn.Sequential, a module torch.fx traces) with peft.get_peft_model"
    )
