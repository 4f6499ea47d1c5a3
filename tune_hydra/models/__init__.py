"""How a model is cut into the ordered layers the engine packs into shards.

- :func:`sequential_layers`: an ``nn.Sequential`` (nested ones flattened), as written.
- :func:`trace_layers`: any other ``nn.Module``, cut into stages by tracing its
  ``forward`` with ``torch.fx``; values that live across a cut travel with the boundary.
- :func:`hf_layers`: a Hugging Face ``PreTrainedModel``, cut at its list of blocks.
- :func:`peft_layers`: a peft ``PeftModel`` (LoRA ...), cut as its base model is.
"""

from tune_hydra.models.hf import hf_layers, is_hf_model
from tune_hydra.models.peft import frozen_base_tensors, is_peft_model, peft_layers
from tune_hydra.models.sequential import sequential_layers
from tune_hydra.models.traced import trace_layers

__all__ = [
    "frozen_base_tensors",
    "hf_layers",
    "is_hf_model",
    "is_peft_model",
    "peft_layers",
    "sequential_layers",
    "trace_layers",
]
