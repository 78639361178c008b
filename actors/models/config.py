"""A decoder's shape: `ModelConfig`, its rules, and the built-in configs of runs that start from scratch.

    config = ModelConfig(vocab_size=264, hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2)
    config = BUILTIN_CONFIGS["tiny"]
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from postrain.core.errors import PostrainError


class ModelConfigError(PostrainError, ValueError):
    """A model config that cannot describe a supported model."""


def rope_type_of(rope_scaling: dict | None) -> str:
    """The rotary scaling type a Hugging Face `rope_scaling` map names ("default" when none)."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder. Defaults are a Llama; units in names."""

    vocab_size: int = 32000                # rows of the embedding and of the LM head
    hidden_size: int = 4096                # model width
    intermediate_size: int = 11008         # SwiGLU inner width
    num_layers: int = 32                   # decoder blocks
    num_heads: int = 32                    # query heads
    num_kv_heads: int = 32                 # key/value heads (GQA: divides num_heads)
    head_dim: int = 0                      # 0 = hidden_size // num_heads
    rms_norm_eps: float = 1e-6             # RMSNorm epsilon
    rope_theta: float = 10000.0            # rotary base
    rope_scaling: dict | None = None       # None | {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_position_embeddings: int = 4096    # context length in tokens (prompt + generation)
    qkv_bias: bool = False                 # Qwen2: bias on q/k/v projections
    o_bias: bool = False                   # Llama attention_bias=True: bias on o_proj too
    mlp_bias: bool = False                 # Llama mlp_bias
    tie_word_embeddings: bool = False      # LM head shares the embedding matrix (SmolLM, small Qwen2)
    architecture: str = "llama"            # "llama" | "qwen2": the HF model_type written on save
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                                   f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = rope_type_of(self.rope_scaling)
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported; "
                                   "use None, 'linear' or 'llama3'")

    @property
    def num_params(self) -> int:
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)



# Built-in configs for runs and tests that start from scratch with the byte tokenizer
# (postrain.actors.models.tokenizer: 256 bytes + 8 specials = vocab 264).
BUILTIN_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=264, hidden_size=192, intermediate_size=512, num_layers=4,
                        num_heads=6, num_kv_heads=2, max_position_embeddings=1024,
                        tie_word_embeddings=True, rope_theta=10000.0),
    "small": ModelConfig(vocab_size=264, hidden_size=384, intermediate_size=1024, num_layers=8,
                         num_heads=6, num_kv_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=10000.0),
}
