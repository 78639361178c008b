"""Shared decoder blocks: the parts every architecture in `postrain.actors.models` is built from.

    rotary       rope_type_of, rope_inv_freq, rotate_half (llama3 / linear scaling)
    RMSNorm      the norm
    Attention    q/k/v/o projections, rotary, grouped-query SDPA (the learner's path), and the
                 call into a `PagedAttention` on the generator's path
    MLP          SwiGLU
    SharedPrefixBatch   the learner's shared-prefix layout (prefixes once, suffixes attend to them)
    Float16Weights      inference-only float16 copies of the linear weights (`project`)
    OneRowMatvec        one-token steps' projections through a compiled float32 matrix-vector kernel
    default_projection  the generator's projection path (`ProjectionPath`): one of the two, or None

Design note: a model computes, it does not manage a KV cache. On the inference path a layer
hands its new tokens' rotated q, k and v to the `PagedAttention` it is given (an attention
backend of the generator bound to one step's paged metadata, `postrain.actors.generator.attention`),
which stores k and v where the step's plan says and returns the attention output. On the
training path the same projections and the same `grouped_attention` run over the sequence
itself, so the generator's logprobs equal the learner's up to float rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from . import exact as exact_ops
from .config import ModelConfig, ModelConfigError, rope_type_of  # noqa: F401  (re-exported)
from .vision import ImageRows

try:
    from postrain.ext._matvec import matvec_at
except ImportError:          # a source tree whose extensions were not built: torch's linear only
    matvec_at = None


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


def window_mask(mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None):
    """`mask` (T, L) or (B|1, 1, T, L) boolean, narrowed to a sliding window: query at position
    p sees a key at position j only if p - j < window (itself and the window - 1 before it, as
    in Hugging Face). q_pos (B, T), k_pos (B|1, L). None = `mask` unchanged."""
    if window is None:
        return mask
    near = (q_pos[:, :, None] - k_pos[:, None, :]) < window                  # (B, T, L)
    return (mask if mask.dim() == 4 else mask[None, None]) & near[:, None]


def grouped_attention(q, k, v, mask, scale: float | None = None, softcap: float | None = None):
    """GQA without copying K/V: the `groups` query heads that share a KV head become
    extra query rows of that head. q (B, T, H, D); k, v (B, L, Hkv, D);
    mask (B|1, 1, G*T, L) from `group_mask` (boolean, or an additive float bias).
    scale: the logits' scale (None = 1/sqrt(D)); softcap: logits -> softcap * tanh(logits /
    softcap) before the mask (Gemma; runs an explicit softmax instead of fused SDPA).
    Returns (B, T, Hkv, G, D): query head h = kv * G + g, as in Hugging Face's repeat_kv."""
    batch, seq, num_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = num_heads // kv_heads
    q = q.view(batch, seq, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, kv_heads, groups * seq, head_dim)                 # (B, Hkv, G*T, D)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=scale)
    else:
        scores = q @ k.permute(0, 2, 3, 1) * (head_dim ** -0.5 if scale is None else scale)
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v.transpose(1, 2)
    return out.view(batch, kv_heads, groups, seq, head_dim).permute(0, 3, 1, 2, 4)


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


class PagedAttention(Protocol):
    """What a layer calls on the inference path: a generator attention backend bound to one
    step (`postrain.actors.generator.attention.AttentionBackend.bind`). The model never sees
    the cache, the block tables or the slots; it passes each layer's new q, k, v."""

    positions: torch.Tensor          # (B, T) int64 absolute positions of the step's new tokens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None, scale: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """Store k, v (B, T, Hkv, D) of layer `layer_idx` in the cache, attend q (B, T, H, D)
        over each sequence's cached keys and values; returns (B, T, H, D). window: the layer's
        sliding window (`window_mask`), scale and softcap as in `grouped_attention`."""
        ...


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
    images: ImageRows | None = None   # image rows over the (1, R) ids, the prefixes' then the
                                      # suffixes', flattened (models/vision.py)

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
        seq = self.suffix_ids.shape[1]
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

    def __init__(self, model: nn.Module):
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


class OneRowMatvec:
    """The generator's projections of a one-token step (batch-1 decode) through a compiled float32
    matrix-vector kernel (`postrain.ext._matvec`): such a step reads every weight byte once for one
    multiply-add, so it is bound by memory bandwidth, which the kernel streams better than torch's
    float32 `linear` at one row does (docs/performance.md, "Limits"). Every other projection (more
    than one row, another dtype or device, a non-contiguous weight, a subclass of Linear such as
    `ExactLinear`, a source tree whose extensions were not built) is module(x). Sums are float32
    in another order than torch's: the results differ in the last bits, as the decode attention's
    do. Holds no copy, so nothing goes stale.
    """

    def project(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        # every projection of a step comes here: the test most of them fail (more than one row) first
        if (x.numel() != weight.shape[-1] or matvec_at is None or type(module) is not nn.Linear
                or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
                or weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous()):
            return module(x)
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        # the checks above are the kernel's contract: contiguous float32 buffers of these sizes
        matvec_at(weight.data_ptr(), x.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1])
        if module.bias is not None:
            out += module.bias
        return out


class ProjectionPath(Protocol):
    """How a generator's step multiplies by a linear layer's weight: Float16Weights or OneRowMatvec."""

    def project(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor: ...


def default_projection(model: nn.Module, weight_precision: str, exact: bool) -> ProjectionPath | None:
    """A generator's projection path: float16 copies of the weights where `weight_precision` is
    "float16", the one-row kernel on the CPU unless the engine is exact, else None (each module's
    own call)."""
    if weight_precision == "float16":
        return Float16Weights(model)
    if not exact and next(model.parameters()).device.type == "cpu":
        return OneRowMatvec()
    return None


def project(module: nn.Linear, x: torch.Tensor, weights: ProjectionPath | None = None) -> torch.Tensor:
    """module(x), or through the generator's `ProjectionPath` when given one."""
    if weights is None:
        return module(x)
    return weights.project(module, x)


class Attention(nn.Module):
    """Grouped-query attention of layer `layer_idx`. `window` (the config's `window_of`), `scale`
    and `softcap` go to the paged backend; on the training path the model's mask already holds
    the window (`window_mask`). Subclasses set scale / softcap (Gemma)."""

    scale: float | None = None
    softcap: float | None = None
    exact: bool = False            # batch-invariant attention (`exact_ops.make_exact` sets it)

    def __init__(self, config: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.window = config.window_of(layer_idx)
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_bias)
        self.qk_norm = config.qk_norm                  # Qwen3: RMSNorm over each head's q and k
        if config.qk_norm:
            self.q_norm: nn.Module = RMSNorm(d, config.rms_norm_eps)   # Gemma: its own norm
            self.k_norm: nn.Module = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, paged: PagedAttention | None, layer_idx: int,
                weights: ProjectionPath | None = None):
        """x (B, T, hidden); cos, sin (B, T, 1, D); mask (B|1, 1, G*T, L) from `group_mask`
        (training path; None with `paged`, whose backend masks)."""
        batch, seq, _ = x.shape
        q, k, v = self._rotated_qkv(x, cos, sin, weights)
        if paged is not None:
            out = paged.attend(layer_idx, q, k, v, window=self.window, scale=self.scale,
                               softcap=self.softcap)                        # (B, T, H, D)
        else:
            out = grouped_attention(q, k, v, mask, self.scale, self.softcap)  # (B, T, Hkv, G, D)
        return project(self.o_proj, out.reshape(batch, seq, -1), weights)

    def forward_shared(self, x, cos, sin, mask_p, mask_s, batch: "SharedPrefixBatch"):
        """x (1, G*P + B*S, hidden): the prefix rows, then the suffix rows (`batch`); cos, sin
        (1, G*P + B*S, 1, D); mask_p (G, 1, Gq*P, P), mask_s (B, 1, Gq*S, P + S) from
        `group_mask`. Prefixes attend among themselves; each suffix attends to its group's
        prefix keys, then to its own (keys (B, P + S)), so the gradients of every suffix reach
        the prefix through its keys and values. Projections run on all rows at once."""
        (qp, qs), (kp, ks), (vp, vs) = (batch.split_rows(t) for t in self._rotated_qkv(x, cos, sin, None))
        k = torch.cat([kp.index_select(0, batch.group_of), ks], dim=1)    # (B, P + S, Hkv, D)
        v = torch.cat([vp.index_select(0, batch.group_of), vs], dim=1)
        if self.exact:                                                     # models/exact.py
            out_p, out_s = self._exact_shared(qp, kp, vp, qs, k, v, batch)
        else:
            out_p = grouped_attention(qp, kp, vp, mask_p, self.scale, self.softcap)  # (G, P, Hkv, Gq, D)
            out_s = grouped_attention(qs, k, v, mask_s, self.scale, self.softcap)    # (B, S, Hkv, Gq, D)
        width = self.num_heads * self.head_dim
        out = torch.cat([out_p.reshape(1, -1, width), out_s.reshape(1, -1, width)], dim=1)
        return self.o_proj(out)

    def _exact_shared(self, qp, kp, vp, qs, k, v, batch: "SharedPrefixBatch"):
        """`forward_shared`'s two attentions through `exact_ops.exact_attention`, keys by position."""
        prefix_real = batch.prefix_mask.bool()
        prefix_pos = torch.arange(prefix_real.shape[1], device=qp.device).expand(prefix_real.shape[0], -1)
        suffix_pos = batch.suffix_positions()
        key_pos = torch.cat([prefix_pos.index_select(0, batch.group_of), suffix_pos], dim=1)   # (B, P + S)
        key_real = torch.cat([prefix_real.index_select(0, batch.group_of), batch.suffix_mask.bool()], dim=1)
        out_p = exact_ops.exact_attention(qp, kp, vp, prefix_pos, None, prefix_real,    # right-padded prefixes
                                          window=self.window, scale=self.scale, softcap=self.softcap)
        out_s = exact_ops.exact_attention(qs, k, v, suffix_pos, key_pos, key_real,
                                          window=self.window, scale=self.scale, softcap=self.softcap)
        return out_p, out_s

    def _rotated_qkv(self, x, cos, sin, weights: ProjectionPath | None):
        """q (B, T, H, D), k and v (B, T, Hkv, D); rotary applied to q and k."""
        batch, seq, _ = x.shape
        q = project(self.q_proj, x, weights).view(batch, seq, self.num_heads, self.head_dim)
        k = project(self.k_proj, x, weights).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = project(self.v_proj, x, weights).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = (q * cos + rotate_half(q) * sin).to(x.dtype)
        k = (k * cos + rotate_half(k) * sin).to(x.dtype)
        return q, k, v


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)). `activation` is F.silu; `exact.make_exact` sets the
    batch-invariant `exact_activation` on the instance."""

    activation = staticmethod(F.silu)
    exact_activation = staticmethod(exact_ops.silu)

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x, weights: ProjectionPath | None = None):
        hidden = self.activation(project(self.gate_proj, x, weights)) * project(self.up_proj, x, weights)
        return project(self.down_proj, hidden, weights)
