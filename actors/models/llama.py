"""The policy model: one compact Llama-family decoder for training and inference.

Covers Llama (1/2/3, with llama3 / linear rope scaling), Qwen2 (bias on the q/k/v
projections) and SmolLM (Llama layout, tied embeddings). Parameter names are the
Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`, ...), so a Hugging
Face state dict loads as is and our checkpoints load in `transformers`.

Design note: the learner and the generator run the SAME modules; only the source
of keys and values differs. `forward(input_ids, attention_mask=...)` attends over
the sequence itself (training, scoring: causal, padded batches through a 0/1
mask, left or right padding). `forward(input_ids, paged=PagedBatch(...))` first
writes each new token's key and value into a paged cache (one pair of tensors per
layer, `(num_blocks, block_size_tokens, num_kv_heads, head_dim)`) at its slot,
then gathers every sequence's keys and values back through its block table and
attends with a causal mask on absolute positions. Both paths call the same
rotary, projection and attention code, so the generator's logprobs equal the
learner's up to float rounding (tests/actors/models/test_llama.py pins it). The learner's
`shared_prefix_hidden_states(SharedPrefixBatch)` runs each shared prefix once and lets the
samples' own tokens attend to its keys and values (same layers, same numbers). A paged
batch may carry `Float16Weights` (inference-only float16 copies of the linear
weights, opt-in per engine); the learner's path never does.

Run `python -m postrain.actors.models.llama` to print the built-in configs' sizes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from postrain.core.errors import PostrainError


class ModelConfigError(PostrainError, ValueError):
    """A model config that cannot describe a supported model."""


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


def rope_type_of(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


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


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim // 2,), float32, with the config's scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = rope_type_of(config.rope_scaling)
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """A (T, L) or (B|1, 1, T, L) mask repeated for the `groups` query heads that share a KV
    head: (B|1, 1, groups * T, L), row g * T + t = row t (the layout of `_grouped_attention`)."""
    if mask.dim() == 2:
        mask = mask[None, None]
    seq, keys = mask.shape[-2:]
    return mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * seq, keys)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)   # one op, same numbers
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))             # at least float32
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@dataclass
class PagedBatch:
    """Where a batch's keys and values live in the paged cache (inference path).

    Shapes: B sequences, T = the longest number of new tokens among them (1 for
    pure decode). Padding rows/columns carry slot -1 and are never written.
    Invariants: positions[b, :query_lens[b]] == context_lens[b] - query_lens[b] + arange;
    every slot in slot_mapping belongs to a block in block_tables[b].
    """

    positions: torch.Tensor        # (B, T) int64 absolute positions of the new tokens
    slot_mapping: torch.Tensor     # (B, T) int64 block_id * block_size_tokens + offset; -1 = padding
    block_tables: torch.Tensor     # (B, max_blocks) int64 block ids, padded with 0
    context_lens: torch.Tensor     # (B,) int64 tokens in the cache after this step's writes
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # one (key, value) per layer, each (num_blocks, block_size_tokens, num_kv_heads, head_dim)
    num_padding: int = -1          # slots equal to -1; -1 = count them in __post_init__
    weights: "Float16Weights | None" = None   # float16 copies of the linear weights; None = the model's

    def __post_init__(self):
        if self.num_padding < 0:
            self.num_padding = int((self.slot_mapping < 0).sum())

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, T, L) bool: query t may see cached key j iff j <= its position."""
        block_size = self.kv_caches[0][0].shape[1]
        keys = torch.arange(self.block_tables.shape[1] * block_size, device=self.positions.device)
        mask = keys[None, None, :] <= self.positions[:, :, None]          # (B, T, L)
        return mask[:, None]

    def attention_bias(self, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, groups * T, L) additive mask for grouped attention (0 or -inf), built once per
        forward: every layer shares it, so no layer expands or converts a boolean mask."""
        mask = group_mask(self.attention_mask(), groups)
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill_(~mask, float("-inf"))


@dataclass
class SharedPrefixBatch:
    """Samples that continue shared prefixes (training path): each of G prefixes runs once and
    the B samples' own tokens (suffixes) attend to their group's prefix, then to themselves.

    Shapes: G prefixes right-padded to P tokens, B suffixes right-padded to S tokens.
    Invariants: a real suffix token s of sample b sits at position prefix_lens[group_of[b]] + s;
    every group has at least one sample; prefix_mask[g].sum() == prefix_lens[g] (0 allowed: a
    sample with no shared prefix).
    """

    prefix_ids: torch.Tensor       # (G, P) int64, 0 past each prefix's end
    prefix_mask: torch.Tensor      # (G, P) int64, 1 = real token
    suffix_ids: torch.Tensor       # (B, S) int64, 0 past each suffix's end
    suffix_mask: torch.Tensor      # (B, S) int64, 1 = real token
    group_of: torch.Tensor         # (B,) int64: the prefix sample b continues

    @property
    def prefix_lens(self) -> torch.Tensor:
        return self.prefix_mask.sum(-1)                                   # (G,)

    def split_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, G*P + B*S, ...) -> the prefix rows (G, P, ...) and the suffix rows (B, S, ...)."""
        (num_prefixes, prefix_len), (num, seq) = self.prefix_ids.shape, self.suffix_ids.shape
        rest = rows.shape[2:]
        return (rows[0, :num_prefixes * prefix_len].reshape(num_prefixes, prefix_len, *rest),
                rows[0, num_prefixes * prefix_len:].reshape(num, seq, *rest))

    def suffix_positions(self) -> torch.Tensor:
        """(B, S) absolute positions of the suffix tokens."""
        offsets = torch.arange(self.suffix_ids.shape[1], device=self.suffix_ids.device)
        return self.prefix_lens.index_select(0, self.group_of)[:, None] + offsets[None, :]

    def suffix_attention_mask(self) -> torch.Tensor:
        """(B, 1, S, P + S) bool: suffix token s sees its group's real prefix tokens and its own
        tokens up to s (a padding row also sees itself, so no row is empty)."""
        device = self.suffix_ids.device
        prefix_len, seq = self.prefix_mask.shape[1], self.suffix_ids.shape[1]
        to_prefix = self.prefix_mask.bool().index_select(0, self.group_of)[:, None, :]   # (B, 1, P)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        own = causal[None] & self.suffix_mask.bool()[:, None, :]                          # (B, S, S)
        own = own | torch.eye(seq, dtype=torch.bool, device=device)[None]
        return torch.cat([to_prefix.expand(-1, seq, -1), own], dim=-1)[:, None]


class Float16Weights:
    """Inference-only float16 copies of every linear weight of a float32 model (x86 CPU, fbgemm).

    `project` multiplies float32 activations by the float16 copy (fbgemm widens it to float32
    in registers and accumulates in float32): half the weight bytes per token, the matmuls
    that bound decoding. Activations, the KV cache and the logits stay float32; only the
    weights are rounded (relative error ~2e-4 per projection). The model's own parameters are
    untouched, so training, scoring and checkpoints still see float32; a generator that
    samples with these copies draws from a slightly different policy than the float32 model
    the learner scores (the decoupled objective's behaviour policy; `postrain bench generate`
    measures the logprob gap). The copies go stale when a parameter changes: `is_stale()`.
    """

    def __init__(self, model: "LlamaModel"):
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ModelConfigError("float16 inference weights need torch's fbgemm backend (x86 CPUs); "
                                   "use weight_precision='float32' on this machine")
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        bad = [m.weight for m in linears if m.weight.dtype != torch.float32 or m.weight.device.type != "cpu"]
        if bad:
            raise ModelConfigError(f"float16 inference weights need a float32 model on the CPU, got "
                                   f"{bad[0].dtype} on {bad[0].device}; use weight_precision='float32'")
        self._linears = linears
        self._key = self._parameters_key()
        self._packed = {                        # module -> fbgemm packed float16 weight (+ float32 bias)
            m: torch.ops.quantized.linear_prepack_fp16(
                m.weight.detach(), None if m.bias is None else m.bias.detach())
            for m in linears}

    def _parameters_key(self) -> tuple:
        params = [p for m in self._linears for p in (m.weight, m.bias) if p is not None]
        return tuple((p.data_ptr(), p._version) for p in params)

    def is_stale(self) -> bool:
        """True once any linear parameter was replaced or changed in place since packing."""
        return self._parameters_key() != self._key

    def project(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed[module])


def project(module: nn.Linear, x: torch.Tensor, paged: PagedBatch | None) -> torch.Tensor:
    """module(x), through the batch's float16 weight copies when it carries them."""
    if paged is None or paged.weights is None:
        return module(x)
    return paged.weights.project(module, x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_bias)

    def forward(self, x, cos, sin, mask, paged: PagedBatch | None, layer_idx: int):
        """x (B, T, hidden); cos, sin (B, T, 1, D); mask (B|1, 1, G*T, L) from `group_mask`."""
        batch, seq, _ = x.shape
        q, k, v = self._rotated_qkv(x, cos, sin, paged)
        if paged is not None:
            k, v = self._write_and_gather(k, v, paged, layer_idx)       # (B, L, Hkv, D)
        out = self._grouped_attention(q, k, v, mask)                     # (B, T, H, D)
        return project(self.o_proj, out.reshape(batch, seq, -1), paged)

    def forward_shared(self, x, cos, sin, mask_p, mask_s, batch: "SharedPrefixBatch"):
        """x (1, G*P + B*S, hidden): the prefix rows, then the suffix rows (`batch`); cos, sin
        (1, G*P + B*S, 1, D); mask_p (G, 1, Gq*P, P), mask_s (B, 1, Gq*S, P + S) from
        `group_mask`. Prefixes attend among themselves; each suffix attends to its group's
        prefix keys, then to its own (keys (B, P + S)), so the gradients of every suffix reach
        the prefix through its keys and values. Projections run on all rows at once."""
        (qp, qs), (kp, ks), (vp, vs) = (batch.split_rows(t) for t in self._rotated_qkv(x, cos, sin, None))
        k = torch.cat([kp.index_select(0, batch.group_of), ks], dim=1)    # (B, P + S, Hkv, D)
        v = torch.cat([vp.index_select(0, batch.group_of), vs], dim=1)
        out_p = self._grouped_attention(qp, kp, vp, mask_p)               # (G, P, Hkv, Gq, D)
        out_s = self._grouped_attention(qs, k, v, mask_s)                 # (B, S, Hkv, Gq, D)
        width = self.num_heads * self.head_dim
        out = torch.cat([out_p.reshape(1, -1, width), out_s.reshape(1, -1, width)], dim=1)
        return self.o_proj(out)

    def _rotated_qkv(self, x, cos, sin, paged: PagedBatch | None):
        """q (B, T, H, D), k and v (B, T, Hkv, D); rotary applied to q and k."""
        batch, seq, _ = x.shape
        q = project(self.q_proj, x, paged).view(batch, seq, self.num_heads, self.head_dim)
        k = project(self.k_proj, x, paged).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = project(self.v_proj, x, paged).view(batch, seq, self.num_kv_heads, self.head_dim)
        q = (q * cos + rotate_half(q) * sin).to(x.dtype)
        k = (k * cos + rotate_half(k) * sin).to(x.dtype)
        return q, k, v

    def _grouped_attention(self, q, k, v, mask):
        """GQA without copying K/V: the `groups` query heads that share a KV head become
        extra query rows of that head. q (B, T, H, D); k, v (B, L, Hkv, D);
        mask (B|1, 1, G*T, L), grouped once per forward by `group_mask`."""
        batch, seq = q.shape[:2]
        kv_heads, groups = self.num_kv_heads, self.num_heads // self.num_kv_heads
        # query head h = kv * groups + g, as in Hugging Face's repeat_kv
        q = q.view(batch, seq, kv_heads, groups, self.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, kv_heads, groups * seq, self.head_dim)           # (B, Hkv, G*T, D)
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        out = out.view(batch, kv_heads, groups, seq, self.head_dim).permute(0, 3, 1, 2, 4)
        return out                                                            # (B, T, Hkv, G, D)

    @staticmethod
    def _write_and_gather(k, v, paged: PagedBatch, layer_idx: int):
        key_cache, value_cache = paged.kv_caches[layer_idx]
        num_blocks, block_size, heads, dim = key_cache.shape
        slots = paged.slot_mapping.reshape(-1)
        new_k, new_v = k.reshape(-1, heads, dim), v.reshape(-1, heads, dim)
        if paged.num_padding:
            valid = slots >= 0
            slots, new_k, new_v = slots[valid], new_k[valid], new_v[valid]
        key_cache.view(-1, heads, dim).index_copy_(0, slots, new_k.to(key_cache.dtype))
        value_cache.view(-1, heads, dim).index_copy_(0, slots, new_v.to(value_cache.dtype))
        batch = paged.block_tables.shape[0]
        flat_tables = paged.block_tables.reshape(-1)
        gathered_k = key_cache.index_select(0, flat_tables).view(batch, -1, heads, dim)  # (B, L, Hkv, D)
        gathered_v = value_cache.index_select(0, flat_tables).view(batch, -1, heads, dim)
        return gathered_k.to(k.dtype), gathered_v.to(v.dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x, paged: PagedBatch | None = None):
        hidden = F.silu(project(self.gate_proj, x, paged)) * project(self.up_proj, x, paged)
        return project(self.down_proj, hidden, paged)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, paged, layer_idx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, paged, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x), paged)

    def forward_shared(self, x, cos, sin, mask_p, mask_s, batch: "SharedPrefixBatch"):
        """The layer on the rows of a shared-prefix batch (Attention.forward_shared)."""
        x = x + self.self_attn.forward_shared(self.input_layernorm(x), cos, sin, mask_p, mask_s, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named `model` inside `LlamaModel` so parameter names match Hugging Face's."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Causal LM: `forward` returns logits (B, T, vocab_size), float32 unless told otherwise."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @classmethod
    def empty(cls, config: ModelConfig) -> "LlamaModel":
        """A model with uninitialised weights (fast: for loading a checkpoint into)."""
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
        try:
            return cls(config)
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "LlamaModel":
        """Random normal(0, std) weights, ones for norms, zero biases; deterministic in seed."""
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

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin (B, T, head_dim) for absolute positions (B, T); computed in float32."""
        freqs = positions[..., None].float() * self.inv_freq.float()          # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      paged: PagedBatch | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, hidden_size). See `forward` for the arguments."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        x = self.model.embed_tokens(input_ids)                                # (B, T, H)
        groups = self.config.num_heads // self.config.num_kv_heads
        if paged is not None:
            positions = paged.positions
            mask = paged.attention_bias(groups, x.dtype)                      # (B, 1, G*T, L)
        else:
            positions, mask = self._training_positions_and_mask(input_ids, attention_mask)
            mask = group_mask(mask, groups)                                   # (B|1, 1, G*T, T)
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is past the context length "
                             f"max_position_embeddings={self.config.max_position_embeddings}; "
                             "shorten the prompt or lower max_new_tokens")
        cos, sin = self.rotary(positions, x.dtype)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]                     # (B, T, 1, D)
        for idx, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, paged, idx)
        return self.model.norm(x)

    def shared_prefix_hidden_states(self, batch: SharedPrefixBatch) -> torch.Tensor:
        """Final-norm hidden states (G*P + B*S, hidden): the prefixes' rows, then the suffixes'.
        Row for row they equal `hidden_states` of the whole samples (prefix + suffix) up to float
        rounding, in value and in gradient (tests/actors/learner/test_shared_prefix.py)."""
        ids = torch.cat([batch.prefix_ids.reshape(-1), batch.suffix_ids.reshape(-1)])[None]  # (1, R)
        x = self.model.embed_tokens(ids)                                       # (1, R, H)
        groups = self.config.num_heads // self.config.num_kv_heads
        pos_p, mask_p = self._training_positions_and_mask(batch.prefix_ids, batch.prefix_mask)
        positions = torch.cat([pos_p.reshape(-1), batch.suffix_positions().reshape(-1)])[None]
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is past the context length "
                             f"max_position_embeddings={self.config.max_position_embeddings}; "
                             "shorten the samples")
        cos, sin = (t[:, :, None, :] for t in self.rotary(positions, x.dtype))  # (1, R, 1, D)
        mask_p = group_mask(mask_p, groups)                                    # (G, 1, Gq*P, P)
        mask_s = group_mask(batch.suffix_attention_mask(), groups)             # (B, 1, Gq*S, P + S)
        for layer in self.model.layers:
            x = layer.forward_shared(x, cos, sin, mask_p, mask_s, batch)
        return self.model.norm(x)[0]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                paged: PagedBatch | None = None, logits_to_keep: torch.Tensor | None = None):
        """Logits for `input_ids` (B, T).

        attention_mask: (B, T) 1 = real token, 0 = padding (left or right); positions
            count real tokens only, so a left-padded row scores like the unpadded one.
        paged: use and extend the paged KV cache instead (inference).
        logits_to_keep: (B,) index of the one position per row whose logits to return
            (shape (B, vocab)); saves the LM head on prefill. None = all positions.
        """
        hidden = self.hidden_states(input_ids, attention_mask, paged)
        if logits_to_keep is not None:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), logits_to_keep]
        return project(self.lm_head, hidden, paged)

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

    def new_kv_caches(self, num_blocks: int, block_size_tokens: int, dtype=None, device=None):
        """Zeroed per-layer (key, value) caches, each (num_blocks, block_size_tokens, Hkv, D)."""
        cfg = self.config
        ref = self.lm_head.weight
        shape = (num_blocks, block_size_tokens, cfg.num_kv_heads, cfg.head_dim)
        return [(torch.zeros(shape, dtype=dtype or ref.dtype, device=device or ref.device),
                 torch.zeros(shape, dtype=dtype or ref.dtype, device=device or ref.device))
                for _ in range(cfg.num_layers)]


def build_model(config: ModelConfig | str, seed: int = 0) -> LlamaModel:
    """A randomly initialised model from a ModelConfig or a built-in config name."""
    if isinstance(config, str):
        if config not in BUILTIN_CONFIGS:
            raise ModelConfigError(f"unknown built-in config {config!r}; "
                                   f"choose one of {sorted(BUILTIN_CONFIGS)}")
        config = dataclasses.replace(BUILTIN_CONFIGS[config])
    return LlamaModel(config).init_weights(seed)


if __name__ == "__main__":
    for name, cfg in BUILTIN_CONFIGS.items():
        print(f"{name}: {cfg.num_params / 1e6:.2f}M params")
