"""Qwen3 (HF `model_type` "qwen3"): the Llama-family decoder with an RMSNorm over each head's
query and key before rotary (`ModelConfig.qk_norm`) and an explicit `head_dim` (Qwen3 heads
are wider than hidden_size / num_heads: 128 at hidden 1024 with 16 heads).

Parameter names are Hugging Face's (`model.layers.0.self_attn.q_norm.weight`, ...), so a
Qwen3 folder's state dict loads as is. Supported config.json fields beyond Llama's: `head_dim`,
`attention_bias` (bias on q/k/v/o). Refused at load: `use_sliding_window: true` (Qwen3's
window on the upper layers is not implemented; the released checkpoints leave it off).
"""
from __future__ import annotations

from .config import ModelConfigError
from .llama import LlamaModel


class Qwen3Model(LlamaModel):
    """A Qwen3 causal LM: LlamaModel's layers with `config.qk_norm` set (blocks.Attention)."""

    @staticmethod
    def config_fields_from_hf(hf: dict) -> dict:
        """The ModelConfig fields a Qwen3 config.json sets beyond the Llama ones."""
        if hf.get("use_sliding_window"):
            raise ModelConfigError("field use_sliding_window=true is not implemented (Qwen3's window on the "
                                   "upper layers); set it to false, as the released Qwen3 models do")
        bias = bool(hf.get("attention_bias", False))
        return {"qk_norm": True, "qkv_bias": bias, "o_bias": bias, "sliding_window": None,
                "layer_types": None}

    @staticmethod
    def hf_config_fields(config) -> dict:
        """The config.json fields transformers' Qwen3Config needs beyond the common ones."""
        return {"architectures": ["Qwen3ForCausalLM"], "attention_bias": config.qkv_bias,
                "use_sliding_window": False, "sliding_window": None}


MODEL_CLASS = Qwen3Model
