"""The policy model: one compact Llama-family decoder for training and inference.

Covers Llama (1/2/3, with llama3 / linear rope scaling), Qwen2 (bias on the q/k/v
projections) and SmolLM (Llama layout, tied embeddings). Parameter names are the
Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`, ...), so a Hugging
Face state dict loads as is and our checkpoints load in `transformers`. The layers
are the shared blocks of `postrain.actors.models.blocks`.

Design note: the learner and the generator run the SAME modules; only the source
of keys and values differs. `forward(input_ids, attention_mask=...)` attends over
the sequence itself (training, scoring: causal, padded batches through a 0/1
mask, left or right padding). `forward(input_ids, paged=...)` hands each layer's
new q, k, v to a `PagedAttention` (a generator attention backend bound to one
step: it stores k and v in the paged cache and attends over each sequence's
cached keys; `postrain.actors.generator.attention`): the model computes, the
generator's KV manager owns the cache. Both paths call the same rotary, projection
and attention code, so the generator's logprobs equal the learner's up to float
rounding (tests/actors/models/test_llama.py pins it). The learner's
`shared_prefix_hidden_states(SharedPrefixBatch)` runs each shared prefix once and lets the
samples' own tokens attend to its keys and values (same layers, same numbers). The
generator may pass `weights=` a `ProjectionPath` (`Float16Weights`: inference-only float16 copies
of the linear weights, opt-in per engine; `OneRowMatvec`: a compiled kernel for one-token
steps); the learner's path never does.

Run `python -m postrain.actors.models.llama` to print the built-in configs' sizes.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import nn

from .blocks import (
    MLP, Attention, PagedAttention, ProjectionPath, RMSNorm, SharedPrefixBatch, group_mask, project,
    rope_inv_freq, window_mask,
)
from .config import BUILTIN_CONFIGS, ModelConfig, ModelConfigError
from .exact import ExactSelfAttention
from .vision import ImageRows, VisionTower, build_tower

__all__ = ["BUILTIN_CONFIGS", "LlamaModel", "ModelConfig", "ModelConfigError", "build_model"]

class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, paged: PagedAttention | None, layer_idx: int,
                weights: ProjectionPath | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, paged, layer_idx, weights)
        return x + self.mlp(self.post_attention_layernorm(x), weights)

    def forward_shared(self, x, cos, sin, mask_p, mask_s, batch: "SharedPrefixBatch"):
        """The layer on the rows of a shared-prefix batch (Attention.forward_shared)."""
        x = x + self.self_attn.forward_shared(self.input_layernorm(x), cos, sin, mask_p, mask_s, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named `model` inside `LlamaModel` so parameter names match Hugging Face's."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, idx) for idx in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class BackboneParts(Protocol):
    """What LlamaModel reads of its `model`: a Backbone, or an architecture's own (gemma3.py)."""

    @property
    def embed_tokens(self) -> nn.Embedding: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def norm(self) -> nn.Module: ...


class LlamaModel(nn.Module):
    """Causal LM: `forward` returns logits (B, T, vocab_size), float32 unless told otherwise."""

    inv_freq: torch.Tensor   # a buffer (register_buffer): the rotary inverse frequencies
    exact: bool = False      # batch-invariant ops (models/exact.py `make_exact` sets it)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model: BackboneParts = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a vision-language model's tower and projector (models/vision.py); None: text only
        self.vision: VisionTower | None = build_tower(config.vision, config.hidden_size) if config.vision else None
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @classmethod
    def empty(cls, config: ModelConfig) -> "LlamaModel":
        """A model with uninitialised weights (fast: for loading a checkpoint into)."""
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        # type ignores: torch's init is patched out for the call (its methods, one shared no-op)
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = (  # type: ignore[method-assign, assignment]
            lambda self: None)
        try:
            return cls(config)
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]

    def init_weights(self, seed: int = 0, std: float | None = None) -> "LlamaModel":
        """Random normal(0, std) weights (std: the config's initializer_range unless given), ones
        for norms, zero biases; deterministic in seed."""
        std = self.config.initializer_range if std is None else std
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
        return self

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor | None = None):
        """cos, sin (B, T, head_dim) for absolute positions (B, T); computed in float32."""
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        freqs = positions[..., None].float() * inv_freq.float()               # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    # Hooks an architecture over these layers overrides (gemma3.py): the embedding, the rotary
    # table of each layer, the logits from final hidden states.

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_with_images(self, input_ids: torch.Tensor, images: ImageRows | None) -> torch.Tensor:
        """The token embeddings, with the image feature rows spliced over their positions."""
        x = self.embed(input_ids)
        if images is None:
            return x
        if self.vision is None:
            raise ValueError("image rows were given to a text-only model; fix: use a vision-language model")
        return images.splice(x)

    def layer_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin), each (B, T, 1, D), for every layer (one shared table here)."""
        cos, sin = self.rotary(positions, dtype)
        return [(cos[:, :, None, :], sin[:, :, None, :])] * self.config.num_layers

    def rotary_positions(self, positions: torch.Tensor, images: ImageRows | None) -> torch.Tensor:
        """The positions the rotary turns by: the tokens' (B, T) positions here; a multimodal rotary
        takes the (3, B, T) ones its images carry (qwen2_5_vl.py)."""
        return positions

    def layer_masks(self, mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's grouped mask (`group_mask`) from the causal/padding `mask`, narrowed to
        the layer's sliding window on positions q_pos (B, T) and k_pos (B|1, L); built once per window."""
        groups = self.config.num_heads // self.config.num_kv_heads
        by_window: dict = {}
        for layer in self.model.layers:   # type ignores: a ModuleList's items are Modules to torch's stubs
            window: int | None = layer.self_attn.window  # type: ignore[union-attr, assignment]
            if window not in by_window:
                by_window[window] = group_mask(window_mask(mask, q_pos, k_pos, window), groups)
        return [by_window[layer.self_attn.window] for layer in self.model.layers]  # type: ignore[union-attr]

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      paged: PagedAttention | None = None,
                      weights: ProjectionPath | None = None,
                      images: ImageRows | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, hidden_size). See `forward` for the arguments."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        x = self.embed_with_images(input_ids, images)                     # (B, T, H)
        if paged is None and self.exact:                  # models/exact.py
            paged = ExactSelfAttention.of(input_ids, attention_mask)
        if paged is not None:
            positions = paged.positions                                       # the backend masks
            masks: list[torch.Tensor] | list[None] = [None] * self.config.num_layers
        else:
            positions, mask = self._training_positions_and_mask(input_ids, attention_mask)
            if images is not None and self.vision is not None and self.vision.bidirectional:
                mask = mask | images.runs_mask()[:, None]     # an image's tokens see each other (Gemma 3)
            masks = self.layer_masks(mask, positions, positions)              # (B|1, 1, G*T, T) each
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is past the context length "
                             f"max_position_embeddings={self.config.max_position_embeddings}; "
                             "shorten the prompt or lower max_new_tokens")
        rotary = self.layer_rotary(self.rotary_positions(positions, images), x.dtype)   # (B, T, 1, D) each
        for idx, layer in enumerate(self.model.layers):
            x = layer(x, *rotary[idx], masks[idx], paged, idx, weights)
        return self.model.norm(x)

    def shared_prefix_hidden_states(self, batch: SharedPrefixBatch) -> torch.Tensor:
        """Final-norm hidden states (G*P + B*S, hidden): the prefixes' rows, then the suffixes'.
        Row for row they equal `hidden_states` of the whole samples (prefix + suffix) up to float
        rounding, in value and in gradient (tests/actors/learner/test_shared_prefix.py)."""
        ids = torch.cat([batch.prefix_ids.reshape(-1), batch.suffix_ids.reshape(-1)])[None]  # (1, R)
        x = self.embed_with_images(ids, batch.images)                     # (1, R, H)
        pos_p, mask_p = self._training_positions_and_mask(batch.prefix_ids, batch.prefix_mask)
        pos_s = batch.suffix_positions()                                       # (B, S)
        positions = torch.cat([pos_p.reshape(-1), pos_s.reshape(-1)])[None]
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is past the context length "
                             f"max_position_embeddings={self.config.max_position_embeddings}; "
                             "shorten the samples")
        rotary = self.layer_rotary(positions, x.dtype)                         # (1, R, 1, D) each
        masks_p = self.layer_masks(mask_p, pos_p, pos_p)                       # (G, 1, Gq*P, P) each
        keys_s = torch.cat([pos_p.index_select(0, batch.group_of), pos_s], dim=1)   # (B, P + S)
        masks_s = self.layer_masks(batch.suffix_attention_mask(), pos_s, keys_s)  # (B, 1, Gq*S, P + S)
        for idx, layer in enumerate(self.model.layers):
            # type ignore: a ModuleList's items are Modules to torch's stubs (their methods dynamic)
            x = layer.forward_shared(x, *rotary[idx], masks_p[idx], masks_s[idx], batch)  # type: ignore[operator]
        return self.model.norm(x)[0]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                paged: PagedAttention | None = None, logits_to_keep: torch.Tensor | None = None,
                weights: ProjectionPath | None = None, images: ImageRows | None = None):
        """Logits for `input_ids` (B, T).

        attention_mask: (B, T) 1 = real token, 0 = padding (left or right); positions
            count real tokens only, so a left-padded row scores like the unpadded one.
        paged: attend through a generator attention backend bound to this step instead
            (inference: it stores the new keys and values in the paged cache).
        weights: float16 copies of the linear weights to multiply by (inference, opt-in).
        logits_to_keep: (B,) index of the one position per row whose logits to return
            (shape (B, vocab)); saves the LM head on prefill. Or a (B, T) bool mask of the
            positions to return, row by row (shape (N, vocab), N = mask.sum(): a scoring
            prefill's positions, without the padding's). None = all positions.
        images: a vision-language model's image feature rows and the positions they replace
            (models/vision.py `ImageRows`), spliced over those positions' token embeddings.
        """
        hidden = self.hidden_states(input_ids, attention_mask, paged, weights, images)
        if logits_to_keep is not None and logits_to_keep.dtype == torch.bool:
            hidden = hidden[logits_to_keep]
        elif logits_to_keep is not None:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), logits_to_keep]
        return project(self.lm_head, hidden, weights)

    @staticmethod
    def _training_positions_and_mask(input_ids, attention_mask):
        batch, seq = input_ids.shape
        device = input_ids.device
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        if attention_mask is None:
            positions = torch.arange(seq, device=device).expand(batch, seq)
            return positions, causal
        real = attention_mask.bool()
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        mask = causal[None] & real[:, None, :]                                # (B, T, T)
        # A padding query row would see no key and produce NaN; let it see itself.
        mask = mask | torch.eye(seq, dtype=torch.bool, device=device)[None]
        return positions, mask[:, None]


def build_model(config: ModelConfig | str, seed: int = 0) -> LlamaModel:
    """A randomly initialised model from a ModelConfig or a built-in config name."""
    if isinstance(config, str):
        if config not in BUILTIN_CONFIGS:
            raise ModelConfigError(f"unknown built-in config {config!r}; "
                                   f"choose one of {sorted(BUILTIN_CONFIGS)}")
        config = dataclasses.replace(BUILTIN_CONFIGS[config])
    return LlamaModel(config).init_weights(seed)


MODEL_CLASS = LlamaModel      # the registry's entry point (postrain.actors.models.model_class)


if __name__ == "__main__":
    for name, cfg in BUILTIN_CONFIGS.items():
        print(f"{name}: {cfg.num_params / 1e6:.2f}M params")
