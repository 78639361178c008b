"""Gemma 3 text (HF `model_type` "gemma3_text"): a decoder of interleaved local (sliding-window)
and global layers over the shared blocks.

What differs from the Llama decoder (`llama.py`), each switched by config.json:
- `layer_types` (or, in older configs, `sliding_window_pattern`: every pattern-th layer global):
  a local layer attends over `sliding_window` tokens and rotates with its own base
  (`rope_local_base_freq`, no scaling); a global layer attends over everything and rotates with
  `rope_theta` and `rope_scaling` (linear / llama3 / default);
- sandwich norms: RMSNorm before and after the attention and before and after the MLP, all
  Gemma's RMSNorm, which scales by (1 + weight) (a zero weight is the identity);
- the embedding is scaled by sqrt(hidden_size); the LM head (tied) is not;
- q/k RMSNorm per head (Gemma's) before rotary; attention logits scaled by
  `query_pre_attn_scalar` ** -0.5 instead of head_dim ** -0.5;
- GELU (tanh approximation) gated MLP;
- `final_logit_softcapping`: LM-head logits -> cap * tanh(logits / cap) where the config sets it
  (the released Gemma 3 checkpoints do not).

Refused at load, naming the field: `attn_logit_softcapping` set (transformers' Gemma 3 does not
apply it either, so honouring it would break equality with the reference; the attention
soft cap itself lives in `blocks.grouped_attention` for an architecture that uses it),
`use_bidirectional_attention: true`, a `hidden_activation` other than gelu_pytorch_tanh, a
sliding-layer rope type other than default, an unknown global rope type. Parameter names are Hugging Face's (Gemma3ForCausalLM), so folders load as is and
exports load in transformers. Written from transformers' modeling_gemma3.py as the reference.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from . import exact as exact_ops
from .blocks import Attention, PagedAttention, ProjectionPath, SharedPrefixBatch, project, rope_inv_freq
from .config import ModelConfig, ModelConfigError
from .llama import LlamaModel
from .vision import ImageRows, VisionTower, build_tower

GEMMA_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 4096,
                  "query_pre_attn_scalar": 256, "sliding_window_pattern": 6}


class GemmaRMSNorm(nn.Module):
    """RMSNorm that scales by (1 + weight), computed in float32 (weights start at zero)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), scale.shape, scale, self.eps).to(x.dtype)


class GeluMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)); `exact.make_exact` sets `exact_activation`."""

    activation = staticmethod(partial(F.gelu, approximate="tanh"))
    exact_activation = staticmethod(exact_ops.gelu_tanh)

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x, weights: ProjectionPath | None = None):
        gate = self.activation(project(self.gate_proj, x, weights))
        return project(self.down_proj, gate * project(self.up_proj, x, weights), weights)


class Gemma3Attention(Attention):
    """The shared Attention with Gemma's q/k norms, query scale and optional logit soft cap."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.qk_norm = True
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        if config.query_pre_attn_scalar is not None:   # None: the Llama scale, head_dim ** -0.5 (ModelConfig)
            self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.softcap = None                    # config_fields_from_hf refuses attn_logit_softcapping


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = GeluMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, cos, sin, mask, paged: PagedAttention | None, layer_idx: int,
                weights: ProjectionPath | None = None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, paged, layer_idx, weights)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), weights))

    def forward_shared(self, x, cos, sin, mask_p, mask_s, batch: SharedPrefixBatch):
        attn = self.self_attn.forward_shared(self.input_layernorm(x), cos, sin, mask_p, mask_s, batch)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Backbone(nn.Module):
    """Named `model` inside `Gemma3Model` so parameter names match Hugging Face's."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, idx) for idx in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3Model(LlamaModel):
    """A Gemma 3 causal LM: LlamaModel's paths (training, shared prefix, paged) over Gemma layers.
    Invariant: `inv_freq` rotates the global layers, `inv_freq_local` the sliding ones."""

    inv_freq_local: torch.Tensor   # a buffer (register_buffer)

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        # the image tower and projector of a Gemma 3 vision-language model (gemma3_vision.py); None: text only
        self.vision: VisionTower | None = build_tower(config.vision, config.hidden_size) if config.vision else None
        self.model = Gemma3Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        local = dataclasses.replace(config, rope_theta=config.rope_local_base_freq or config.rope_theta,
                                    rope_scaling=None)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(local), persistent=False)

    def init_weights(self, seed: int = 0, std: float | None = None) -> "Gemma3Model":
        super().init_weights(seed, std)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, GemmaRMSNorm):
                    module.weight.zero_()                                      # scale 1 + 0
        return self

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        return self.model.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size ** 0.5,
                                                                 dtype=weight.dtype)

    def layer_rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        tables = {}
        for local, inv_freq in ((False, self.inv_freq), (True, self.inv_freq_local)):
            cos, sin = self.rotary(positions, dtype, inv_freq)
            tables[local] = (cos[:, :, None, :], sin[:, :, None, :])
        # type ignore: a ModuleList's items are Modules to torch's stubs (their attributes dynamic)
        return [tables[layer.self_attn.window is not None]  # type: ignore[union-attr]
                for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                paged: PagedAttention | None = None, logits_to_keep: torch.Tensor | None = None,
                weights: ProjectionPath | None = None, images: ImageRows | None = None):
        logits = super().forward(input_ids, attention_mask, paged, logits_to_keep, weights, images)
        return softcap_logits(logits, self.config.final_logit_softcapping)

    @staticmethod
    def config_fields_from_hf(hf: dict) -> dict:
        """The ModelConfig fields a gemma3_text config.json sets beyond the Llama ones (4.x or 5.x)."""
        if hf.get("use_bidirectional_attention"):
            raise ModelConfigError("config.json sets use_bidirectional_attention=true (Gemma 3 as an "
                                   "encoder), which postrain does not implement; set it to false")
        if hf.get("attn_logit_softcapping") is not None:
            raise ModelConfigError(f"config.json sets attn_logit_softcapping={hf['attn_logit_softcapping']}, "
                                   "which transformers' Gemma 3 ignores (its checkpoints set null); postrain "
                                   "refuses it rather than differ from the reference: set it to null")
        num_layers = hf["num_hidden_layers"]
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern",
                                                          GEMMA_DEFAULTS["sliding_window_pattern"]))
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        rope = hf.get("rope_parameters") or {}
        if "full_attention" in rope:                                           # transformers 5.x
            full, local = dict(rope["full_attention"]), dict(rope.get("sliding_attention") or {})
        else:                                                                  # transformers 4.x
            full = dict(hf.get("rope_scaling") or {})
            full.setdefault("rope_theta", hf.get("rope_theta"))
            local = {"rope_theta": hf.get("rope_local_base_freq")}
        theta = full.pop("rope_theta", None) or GEMMA_DEFAULTS["rope_theta"]
        local_type = local.get("rope_type", local.get("type", "default"))
        if local_type != "default":
            raise ModelConfigError(f"config.json: the sliding layers' rope type {local_type!r} "
                                   "(rope_parameters.sliding_attention) is not supported; use 'default'")
        scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
        bias = bool(hf.get("attention_bias", False))
        return {
            "layer_types": list(layer_types), "qk_norm": True, "qkv_bias": bias, "o_bias": bias,
            "sliding_window": hf.get("sliding_window") or GEMMA_DEFAULTS["sliding_window"],
            "rope_theta": float(theta), "rope_scaling": scaling,
            "rope_local_base_freq": float(local.get("rope_theta") or GEMMA_DEFAULTS["rope_local_base_freq"]),
            "query_pre_attn_scalar": hf.get("query_pre_attn_scalar") or GEMMA_DEFAULTS["query_pre_attn_scalar"],
            "final_logit_softcapping": hf.get("final_logit_softcapping"),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        }

    @staticmethod
    def hf_config_fields(config: ModelConfig) -> dict:
        """The config.json fields transformers' Gemma3TextConfig reads beyond the common ones."""
        full = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
        local = {"rope_type": "default", "rope_theta": config.rope_local_base_freq or config.rope_theta}
        return {
            "architectures": ["Gemma3ForCausalLM"], "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh", "layer_types": list(config.layer_types or []),
            "sliding_window": config.sliding_window, "rope_scaling": None,
            "rope_parameters": {"full_attention": full, "sliding_attention": local},
            "rope_local_base_freq": local["rope_theta"], "query_pre_attn_scalar": config.query_pre_attn_scalar,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": config.final_logit_softcapping,
            "attention_bias": config.qkv_bias, "use_bidirectional_attention": False,
        }


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), or logits unchanged when cap is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


MODEL_CLASS = Gemma3Model
