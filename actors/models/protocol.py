"""CausalLM: what the generator and the learner need of a model of the registry.

Every architecture in `ARCHITECTURES` (`postrain.actors.models`) is an `nn.Module` that
satisfies this protocol; the engine is typed by it, not by one architecture's class.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .blocks import PagedAttention, ProjectionPath
    from .llama import ModelConfig
    from .vision import ImageRows, VisionTower


@runtime_checkable
class CausalLM(Protocol):
    """A causal LM: `config` (vocab_size, num_layers, num_kv_heads, head_dim,
    max_position_embeddings, ...) and a forward that returns logits."""

    config: ModelConfig
    vision: VisionTower | None       # a vision-language model's tower (models/vision.py); None: text only

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 paged: PagedAttention | None = None, logits_to_keep: torch.Tensor | None = None,
                 weights: ProjectionPath | None = None, images: ImageRows | None = None) -> torch.Tensor:
        """Logits (B, T, V), or (B, V) with `logits_to_keep` (one position per row), or (N, V)
        with a (B, T) bool `logits_to_keep` (the positions it marks, row by row); `images`: the
        image feature rows spliced over image placeholders (models/vision.py)."""
        ...

    def parameters(self, recurse: bool = True): ...

    def modules(self): ...

    def eval(self): ...
