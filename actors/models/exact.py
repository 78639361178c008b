"""Batch-invariant forward ops: with `exact = true` the generator's recorded logprob of every
sampled token equals the learner's recomputation bit for bit.

    make_exact(model)            # in place: its Linear layers, activations and attention
    hidden = model.hidden_states(ids, mask)   # an exact model's training path: ExactSelfAttention
    logp = exact_token_logprobs(logits, targets, temperature)

Why the two sides differ without it. A float32 result depends on the order its terms are
added in, and torch's CPU kernels choose that order by shape: a matmul of one row runs a
matrix-vector kernel that sums differently from the matrix-matrix kernel of many rows; SDPA
tiles keys by the sequence's length; a reduction over one long row is split across threads
where many rows are not; an elementwise op runs a vector kernel on most elements and a
scalar one on a chunk's tail, and for some ops (SiLU, rsqrt) the two round differently. The
generator decodes a few rows over a paged cache; the learner scores whole padded batches.

What `exact` fixes, op by op (each one's row depends on that row alone, never on the batch):

- Linear: rows are computed by the matrix-matrix kernel only (a call of fewer than
  `MIN_ROWS` rows is padded with zero rows). That kernel's row is independent of the row
  count and the thread count: a property of the BLAS, so `check_row_invariance` measures it
  on the model's own shapes at load and refuses `exact` where it does not hold.
- Attention: each query's keys are laid out by absolute position, the scores are one matmul of
  at least `MIN_ROWS` query rows, the softmax's sums and weighted values run over fixed blocks
  of `KEY_BLOCK` positions combined left to right (a cumulative sum): the same blocks for a
  decode step, a chunked prefill, a prefix hit and the learner's padded batch. Keys a query
  cannot see add exact zeros.
- Activations: SiLU and tanh-GELU are written with exp, tanh and IEEE arithmetic, whose
  scalar and vector kernels agree (`tail_consistent` checks the ops used).
- Logprobs: log-softmax with the vocabulary's sum in fixed chunks of `VOCAB_CHUNK` combined
  left to right, in float32 on both sides.
- Left unchanged because already row-local: embeddings, RMSNorm (`F.rms_norm`), rotary
  tables (cos and sin of the same float32 products), residual adds.

Invariant: the generator and the learner both run `make_exact` on float32 models and read
logprobs through `exact_token_logprobs`; the first micro-step's importance ratio is then
exactly 1 (tests/actors/test_exact.py). Costs: `postrain bench exact` (docs/exactness.md).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfigError

MIN_ROWS = 16          # the fewest rows a Linear call multiplies (fewer are padded with zeros)
KEY_BLOCK = 16         # keys per softmax block (by absolute position)
VOCAB_CHUNK = 256      # vocabulary entries per partial sum of the log-softmax


class ExactnessError(ModelConfigError):
    """`exact = true` cannot hold for this model or on this machine; the message says why."""


# ---- elementwise -------------------------------------------------------------------------

def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) from exp and division (F.silu's scalar tail rounds unlike its vector body)."""
    return x / (1.0 + torch.exp(-x))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU from tanh and IEEE arithmetic."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def tail_consistent(op, values: torch.Tensor) -> bool:
    """True when op gives each element the same bits alone (a scalar tail) as in a long tensor
    (the vector body): what an elementwise op of the exact path must satisfy."""
    whole = op(values)
    return all(torch.equal(op(values[i:i + 1]), whole[i:i + 1]) for i in range(values.shape[0]))


# ---- linear ------------------------------------------------------------------------------

def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed by the matrix-matrix kernel, whatever x's row count."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count < MIN_ROWS:
        rows = F.pad(rows, (0, 0, 0, MIN_ROWS - count))
    out = F.linear(rows, weight, bias)[:count]
    return out.reshape(*x.shape[:-1], weight.shape[0])


class ExactLinear(nn.Linear):
    """An nn.Linear whose forward is `exact_linear` (`make_exact` swaps the class in place: the
    parameters, their names and the state dict are untouched)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_linear(x, self.weight, self.bias)


def check_row_invariance(model: nn.Module, probes: int = 3) -> None:
    """Raise ExactnessError unless this machine's matmul gives a row the same bits at every row
    count from MIN_ROWS up and at 1 and 2 threads, for up to `probes` of the model's Linear
    shapes, and an attention score the same bits at every query, key and batch count."""
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)})
    device = next(model.parameters()).device                      # the BLAS the model will run on
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(device)   # noqa: E731
    threads = torch.get_num_threads()
    try:
        for out_features, in_features in shapes[:probes]:
            weight, x = randn(out_features, in_features), randn(97, in_features)
            whole = F.linear(x, weight)
            results = [F.linear(x[:rows], weight) for rows in (MIN_ROWS, MIN_ROWS + 1, 33, 64)]
            torch.set_num_threads(1 if threads > 1 else 2)
            results.append(F.linear(x, weight))
            torch.set_num_threads(threads)
            if not all(torch.equal(r, whole[:r.shape[0]]) for r in results):
                raise ExactnessError(
                    f"this machine's matmul computes a row of a ({in_features} -> {out_features}) projection "
                    "differently by the batch's size or thread count, so exact = true cannot hold here; set "
                    "exact = false")
        head_dim = getattr(getattr(model, "config", None), "head_dim", 64)
        q, k = randn(3, 2, 40, head_dim), randn(3, 2, 80, head_dim)
        whole = q @ k.transpose(2, 3)
        parts = [(q[:b, :, :rows] @ k[:b, :, :keys].transpose(2, 3), b, rows, keys)
                 for b, rows, keys in ((1, MIN_ROWS, KEY_BLOCK), (2, 33, 48), (3, 40, 64))]
        if not all(torch.equal(part, whole[:b, :, :rows, :keys]) for part, b, rows, keys in parts):
            raise ExactnessError(f"this machine's batched matmul computes an attention score (head_dim {head_dim}) "
                                 "differently by the number of queries, keys or sequences, so exact = true cannot "
                                 "hold here; set exact = false")
    finally:
        torch.set_num_threads(threads)


def make_exact(model: nn.Module) -> nn.Module:
    """Switch `model` to the batch-invariant ops in place and return it: its Linear layers
    become `ExactLinear`, its activations the exact ones. Refuses (ExactnessError) a model
    that is not float32 and a machine whose matmul is not row-invariant."""
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if wrong:
        raise ExactnessError(f"exact = true needs a float32 model, this one has {', '.join(wrong)} "
                             "parameters; set the learner's dtype to float32 and drop autocast")
    check_row_invariance(model)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = ExactLinear
        activation = getattr(type(module), "exact_activation", None)
        if activation is not None:
            module.activation = activation
        if isinstance(getattr(type(module), "exact", None), bool):   # the model, attention, MoE blocks
            setattr(module, "exact", True)
    return model


# ---- attention ---------------------------------------------------------------------------

def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor | None, k_real: torch.Tensor, *, window: int | None = None,
                    scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention whose every query row depends on its visible keys only.

    q (B, T, H, D) at positions q_pos (B, T); k, v (B, L, Hkv, D) at positions k_pos (B, L),
    k_real (B, L) marking the keys that exist (the others are dropped, whatever their
    position); k_pos None: key j of every row is at position j (a gathered cache, right
    padding). A query at position p sees the real keys at positions j <= p (and p - j <
    window). Keys are laid out by position (scattered there when k_pos is given), so the
    blocks of KEY_BLOCK positions are the same however the caller laid them out. The scores
    are one matmul of at least MIN_ROWS query rows against every key (a row's dot products do
    not depend on the row or key counts: `check_row_invariance`); each block's weighted values
    are a matmul over its KEY_BLOCK keys, and the blocks are summed left to right (a cumulative
    sum), as are the softmax's denominators. Returns (B, T, H, D)."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    if k_pos is not None:
        k, v, k_real = _by_position(k, v, k_pos, k_real)
    width = -(-k.shape[1] // KEY_BLOCK) * KEY_BLOCK
    blocks = width // KEY_BLOCK
    keys, values = (_heads_first(t, width) for t in (k, v))                    # (B, Hkv, W, D)
    present = F.pad(k_real, (0, width - k_real.shape[1]))                      # (B, W)
    rows = groups * seq
    padded_rows = max(rows, MIN_ROWS)           # a matmul of fewer rows would sum in another order
    queries = q.reshape(batch, seq, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, rows, dim)
    queries = F.pad(queries, (0, 0, 0, padded_rows - rows))
    scores = (queries @ keys.transpose(2, 3))[:, :, :rows] * scale             # (B, Hkv, G*T, W)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    key_positions = torch.arange(width, device=q.device)
    visible = present[:, None, :] & (key_positions[None, None, :] <= q_pos[:, :, None])   # (B, T, W)
    if window is not None:
        visible = visible & (q_pos[:, :, None] - key_positions[None, None, :] < window)
    visible = visible[:, None].expand(-1, groups, -1, -1).reshape(batch, 1, rows, width)
    scores = scores.masked_fill(~visible, float("-inf"))
    top_score = scores.amax(-1, keepdim=True)
    top_score = torch.where(torch.isfinite(top_score), top_score, torch.zeros_like(top_score))
    weights = torch.exp(scores - top_score).view(batch, kv_heads, rows, blocks, KEY_BLOCK)   # 0 where unseen
    total = weights.sum(-1).cumsum(-1)[..., -1:]                               # (B, Hkv, G*T, 1)
    weights = F.pad(weights, (0, 0, 0, 0, 0, padded_rows - rows)).transpose(2, 3)   # (B, Hkv, N, R, K)
    per_block = (weights @ values.view(batch, kv_heads, blocks, KEY_BLOCK, dim))[:, :, :, :rows]  # (.., N, G*T, D)
    mixed = per_block.cumsum(2)[:, :, -1]                                      # (B, Hkv, G*T, D)
    out = mixed / total.clamp(min=torch.finfo(total.dtype).tiny)
    return out.reshape(batch, kv_heads, groups, seq, dim).permute(0, 3, 1, 2, 4).reshape(batch, seq, heads, dim)


def _heads_first(t: torch.Tensor, width: int) -> torch.Tensor:
    """(B, L, Hkv, D) -> (B, Hkv, width, D), zeros past L: one copy."""
    batch, length, heads, dim = t.shape
    out = t.new_empty(batch, heads, width, dim)
    out[:, :, :length] = t.transpose(1, 2)
    out[:, :, length:] = 0
    return out


def _by_position(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, k_real: torch.Tensor):
    """(keys, values (B, W, Hkv, D), present (B, W)): the real keys scattered to their positions
    0 .. W - 1, W the last real position + 1 rounded up to KEY_BLOCK."""
    batch, _, kv_heads, dim = k.shape
    top = int(torch.where(k_real, k_pos, 0).max()) + 1 if bool(k_real.any()) else 1
    width = -(-top // KEY_BLOCK) * KEY_BLOCK
    slots = torch.where(k_real, k_pos, width)                                  # width = discarded
    index = slots[:, :, None, None].expand(-1, -1, kv_heads, dim)
    keys = k.new_zeros(batch, width + 1, kv_heads, dim).scatter(1, index, k)[:, :width]
    values = v.new_zeros(batch, width + 1, kv_heads, dim).scatter(1, index, v)[:, :width]
    present = torch.zeros(batch, width + 1, dtype=torch.bool, device=k.device).scatter(
        1, slots, torch.ones_like(slots, dtype=torch.bool))[:, :width]
    return keys, values, present


class ExactSelfAttention:
    """The learner's attention with `exact`: a `PagedAttention` over the sequence itself, so
    `model.hidden_states(ids, paged=ExactSelfAttention.of(mask))` scores a padded batch with
    the same blocks the generator's `ExactGatherBackend` uses. Positions count real tokens only
    (left or right padding), as on the model's own training path."""

    def __init__(self, positions: torch.Tensor, real: torch.Tensor):
        self.positions = positions            # (B, T) int64
        self.real = real                      # (B, T) bool
        index = torch.arange(positions.shape[1], device=positions.device).expand_as(positions)
        # None when every real token sits at its index (right padding): no scatter needed
        self.key_positions = None if bool((positions == index)[real].all()) else positions

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> "ExactSelfAttention":
        if attention_mask is None:
            real = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        else:
            real = attention_mask.bool()
        return cls((real.long().cumsum(-1) - 1).clamp(min=0), real)

    def attend(self, layer_idx: int, q, k, v, *, window=None, scale=None, softcap=None):
        return exact_attention(q, k, v, self.positions, self.key_positions, self.real,
                               window=window, scale=scale, softcap=softcap)


# ---- logprobs ----------------------------------------------------------------------------

def exact_log_normalizer(z: torch.Tensor) -> torch.Tensor:
    """logsumexp(z) over the last dim (N, V) -> (N,), summed in fixed vocabulary chunks."""
    vocab = z.shape[-1]
    padded = -(-vocab // VOCAB_CHUNK) * VOCAB_CHUNK
    top = z.amax(-1, keepdim=True)
    shifted = F.pad(z - top, (0, padded - vocab), value=float("-inf"))
    sums = torch.exp(shifted).reshape(*z.shape[:-1], padded // VOCAB_CHUNK, VOCAB_CHUNK).sum(-1)
    return top[..., 0] + torch.log(sums.cumsum(-1)[..., -1])


def exact_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0
                         ) -> torch.Tensor:
    """log_softmax(logits / temperature)[target] per row, float32: logits (N, V), targets (N,);
    temperature a number or (N,) per row (0 means 1, as the sampler's logprobs)."""
    rows = logits.shape[0]
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(rows)
    temps = torch.where(temps > 0, temps, torch.ones_like(temps))
    z = logits.float() / temps[:, None]            # always a (N, 1) divisor: one kernel on both sides
    return z.gather(-1, targets[:, None])[:, 0] - exact_log_normalizer(z)
