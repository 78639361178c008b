"""Mistral (HF `model_type` "mistral"): the Llama decoder with sliding-window attention on every
layer when config.json sets `sliding_window` (a query sees itself and the window - 1 tokens
before it); `sliding_window: null` is a plain Llama.

The window reaches both paths through the shared blocks: the training mask
(`LlamaModel.layer_masks` -> `blocks.window_mask`) and the generator's attention backend
(`Attention.window` -> `PagedAttention.attend(window=)`, which gathers only the blocks the window
reaches). The KV manager keeps every block of a sequence (blocks that left the window are not
freed: prefix caching and forks share them): memory as for a Llama of the same shape.

Supported config.json fields beyond Llama's: `sliding_window`, `head_dim`. Refused at load:
`hidden_act` other than "silu" (loading.config_from_hf).
"""
from __future__ import annotations

from .llama import LlamaModel


class MistralModel(LlamaModel):
    """A Mistral causal LM: LlamaModel with `config.sliding_window` on every layer."""

    @staticmethod
    def config_fields_from_hf(hf: dict) -> dict:
        """The ModelConfig fields a Mistral config.json sets beyond the Llama ones."""
        return {"sliding_window": hf.get("sliding_window"), "layer_types": None,
                "qkv_bias": False, "o_bias": False}

    @staticmethod
    def hf_config_fields(config) -> dict:
        """The config.json fields transformers' MistralConfig needs beyond the common ones."""
        return {"architectures": ["MistralForCausalLM"], "sliding_window": config.sliding_window}


MODEL_CLASS = MistralModel
