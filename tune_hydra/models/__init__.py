"""How a model is cut into the ordered layers the engine packs into shards.

- :func:`sequential_layers`: an ``nn.Sequential`` (nested ones flattened), as written.
- :func:`trace_layers`: any other ``nn.Module``, cut into stages by tracing its
  ``forward`` with ``torch.fx``; values that live across a cut travel with the boundary.
- :func:`hf_layers`: a Hugging Face ``PreTrainedModel``, cut at its list of blocks.
"""

from tune_hydra.models.hf import hf_layers, is_hf_model
from tune_hydra.models.sequential import sequential_layers
from tune_hydra.models.traced import trace_layers

__all__ = ["hf_layers", "is_hf_model", "sequential_layers", "trace_layers"]
