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
    initializer_range: float = 0.02        # std of a from-scratch model's random weights (init_weights)
    qk_norm: bool = False                  # Qwen3: RMSNorm over each head's q and k, before rotary
    # mixture of experts (qwen3_moe); num_experts == 0: every layer is a dense MLP
    num_experts: int = 0                   # routed experts per MoE layer (E)
    num_experts_per_tok: int = 0           # experts each token goes to (top-k of E)
    moe_intermediate_size: int = 0         # each expert's SwiGLU inner width
    norm_topk_prob: bool = True            # renormalise the top-k gate probabilities to sum to 1
    decoder_sparse_step: int = 1           # layer i is MoE when (i + 1) % decoder_sparse_step == 0
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (those stay dense)
    router_aux_loss_coef: float = 0.0      # kept for export; the learner's own option switches the loss on
    architecture: str = "llama"            # the HF model_type written on save (a key of ARCHITECTURES)
    sliding_window: int | None = None      # tokens a sliding layer's query sees, itself included
    layer_types: list[str] | None = None   # per layer "full_attention" | "sliding_attention";
                                           # None = every layer sliding if sliding_window is set (Mistral)
    # Gemma 3 (gemma3_text); None = the Llama behaviour
    query_pre_attn_scalar: float | None = None    # attention logits scaled by this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # LM-head logits -> cap * tanh(logits / cap)
    rope_local_base_freq: float | None = None     # rotary base of the sliding layers (None: rope_theta)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    vision: dict | None = None             # a vision-language model's tower ("kind", sizes, image_token_id,
                                           # marker: models/vision.py); None = text only

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        self.validate()

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers whose MLP is a routed MoE block (HF Qwen3-MoE's rule)."""
        if self.num_experts <= 0:
            return ()
        return tuple(i for i in range(self.num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

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
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelConfigError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ModelConfigError(f"layer_types has {len(self.layer_types)} entries for "
                                       f"{self.num_layers} layers; give one per layer")
            kinds = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if kinds:
                raise ModelConfigError(f"layer_types {sorted(kinds)} are not supported; use "
                                       "'full_attention' or 'sliding_attention'")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ModelConfigError("layer_types has sliding layers but sliding_window is not set")
        if self.num_experts > 0 and not (0 < self.num_experts_per_tok <= self.num_experts
                                         and self.moe_intermediate_size > 0 and self.decoder_sparse_step >= 1):
            raise ModelConfigError(
                f"a MoE config needs 0 < num_experts_per_tok <= num_experts, moe_intermediate_size > 0 and "
                f"decoder_sparse_step >= 1; got num_experts={self.num_experts}, num_experts_per_tok="
                f"{self.num_experts_per_tok}, moe_intermediate_size={self.moe_intermediate_size}, "
                f"decoder_sparse_step={self.decoder_sparse_step}")
        rope_type = rope_type_of(self.rope_scaling)
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported; "
                                   "use None, 'linear' or 'llama3'")

    def window_of(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx` in tokens, or None for full attention."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @property
    def num_params(self) -> int:
        """Parameters of the model (biases and per-head norms aside)."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layer_params() + self.hidden_size + head

    def num_layer_params(self, active: bool = False) -> int:
        """Parameters of the decoder layers; `active`: only those one token runs through (the
        top-k experts of each MoE layer, not all of them)."""
        h, kv, q = self.hidden_size, self.num_kv_heads * self.head_dim, self.num_heads * self.head_dim
        attention = 2 * h * q + 2 * h * kv + 2 * h
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = experts * 3 * h * self.moe_intermediate_size + self.num_experts * h   # experts and router
        num_moe = len(self.moe_layers)
        dense = (self.num_layers - num_moe) * 3 * h * self.intermediate_size
        return self.num_layers * attention + dense + num_moe * moe

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)



# Built-in configs for runs and tests that start from scratch with the byte tokenizer
# (postrain.actors.models.tokenizer: 256 bytes + 8 specials = vocab 264).
BUILTIN_CONFIGS: dict[str, ModelConfig] = {
    # tiny: every head its own keys and values, a fast rotary base and a wider init make the copying
    # that the default run's warm start must learn form within ~90-150 steps of tool demonstrations
    # on every seed tried (0-5), where GQA, base 10000 and std 0.02 left it to chance (docs/performance-history.md, "The warm start's
    # copying jump").
    "tiny": ModelConfig(vocab_size=264, hidden_size=192, intermediate_size=512, num_layers=4,
                        num_heads=6, num_kv_heads=6, max_position_embeddings=1024,
                        tie_word_embeddings=True, rope_theta=100.0, initializer_range=0.05),
    "small": ModelConfig(vocab_size=264, hidden_size=384, intermediate_size=1024, num_layers=8,
                         num_heads=6, num_kv_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=10000.0),
}
# tiny-vl: tiny reading images through the built-in patch tower (models/vision.py): a 96 x 128 image
# (the charts' 3:4) in 8-pixel patches, 2 x 2 merged: 48 image tokens at the byte tokenizer's <|image|>
BUILTIN_CONFIGS["tiny-vl"] = dataclasses.replace(BUILTIN_CONFIGS["tiny"], vision={
    "kind": "patch", "image_size": [96, 128], "patch_size": 8, "merge": 2, "width": 128, "heads": 4, "mlp": 256,
    "layers": 2, "image_token_id": 6, "marker": "<|image|>"})
