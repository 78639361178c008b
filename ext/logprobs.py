"""Token logprobs (and entropy) in chunks, so the learner never holds a (tokens x vocab) fp32 tensor.

With z = logits / temperature for one token and y its target id:

    logp(y)  = z_y - logsumexp(z)
    entropy  = logsumexp(z) - sum_j p_j z_j,              p = softmax(z)
    d logp(y) / d z_j = [j == y] - p_j
    d entropy / d z_j = -p_j (log p_j + entropy)

Design: the naive path (`naive_token_logprobs`) materialises the fp32 logits, their
log-softmax and, in backward, a gradient of the same size: several (N, V) fp32 tensors at
once. Here a custom autograd Function walks the tokens in chunks of `chunk_size_tokens`;
forward keeps only (N,) vectors (logp, logsumexp, entropy), and backward recomputes each
chunk's softmax from the saved logsumexp. `token_logprobs_from_hidden` goes further: it also
chunks the LM-head projection, so not even the logits exist in full (peak extra memory is
O(chunk_size_tokens x V), independent of N). On CUDA tensors the per-chunk log-softmax,
gather and entropy run in one CuPy kernel (`cupy_ops.logprob_gather`) that never writes a
(chunk x V) fp32 temporary.
"""
from __future__ import annotations

import torch

from .rl_ops_errors import RLOpsError

# chunk_size_tokens=None picks the largest chunk whose fp32 (chunk x V) block fits this budget.
CHUNK_BUDGET_BYTES = 32 * 2**20
MAX_CHUNK_SIZE_TOKENS = 4096


def auto_chunk_size_tokens(vocab: int) -> int:
    """Tokens per chunk so one (chunk x vocab) fp32 block is <= 32 MiB: 256 at a 32k vocabulary."""
    return max(1, min(MAX_CHUNK_SIZE_TOKENS, CHUNK_BUDGET_BYTES // (4 * vocab)))


def naive_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         return_entropy: bool = False):
    """The reference: full fp32 log-softmax then gather. logits (..., V), targets (...) -> (...)."""
    z = logits.float()
    logp_all = torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _chunk_stats(z: torch.Tensor, targets: torch.Tensor, temperature: float, backend: str):
    """One chunk's (logp, logsumexp, entropy) of z / temperature; z (C, V) raw logits, any dtype.

    Torch path: besides z it holds one (C, V) fp32 temporary (z is never written: it may be
    the caller's logits).
    """
    from . import cupy_ops

    if cupy_ops.use_cupy(backend, z.device) and cupy_ops.logprob_kernel_supports(z):
        return cupy_ops.logprob_gather(z, targets, temperature)
    z = z.float()
    z = z / temperature if temperature != 1.0 else z
    m = z.amax(dim=-1)  # (C,)
    m = m.masked_fill(~torch.isfinite(m), 0.0)
    p = torch.sub(z, m[:, None]).exp_()  # (C, V), unnormalised
    s = p.sum(-1)
    lse = m + s.log()
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    p.div_(s[:, None]).mul_(z).nan_to_num_(nan=0.0)  # p * z, with 0 where p = 0 and z = -inf
    return logp, lse, lse - p.sum(-1)


def _chunk_grad(z: torch.Tensor, targets, lse, entropy, grad_logp, grad_entropy) -> torch.Tensor:
    """d(loss)/dz for one chunk (C, V) fp32, from the saved logsumexp and entropy.

    grad = grad_logp * (onehot - p) - grad_entropy * p * (log p + entropy); two (C, V) temporaries.
    """
    logp_all = torch.sub(z.float(), lse[:, None])  # (C, V)
    p = logp_all.exp()
    if grad_entropy is not None:
        term = logp_all.add_(entropy[:, None]).mul_(p).nan_to_num_(nan=0.0)  # p (log p + H)
        grad = p.mul_(-grad_logp[:, None]).sub_(term.mul_(grad_entropy[:, None]))
    else:
        del logp_all
        grad = p.mul_(-grad_logp[:, None])
    grad.scatter_add_(-1, targets[:, None], grad_logp[:, None])
    return grad


def _torch_chunk_grad(z, targets, lse, entropy, grad_logp, grad_entropy, temperature: float):
    """`_chunk_grad` for raw logits z: scale by 1/temperature going in and coming out."""
    if temperature == 1.0:
        return _chunk_grad(z, targets, lse, entropy, grad_logp, grad_entropy)
    grad = _chunk_grad(z.float() / temperature, targets, lse, entropy, grad_logp, grad_entropy)
    return grad.div_(temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    """logits (N, V) -> logp (N,), entropy (N,); forward and backward in token chunks."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, backend):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse, entropy = torch.empty_like(logp), torch.empty_like(logp)
        for s in range(0, n, chunk):
            z = logits[s:s + chunk]
            logp[s:s + chunk], lse[s:s + chunk], entropy[s:s + chunk] = _chunk_stats(
                z, targets[s:s + chunk], temperature, backend)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.temperature, ctx.chunk, ctx.backend = temperature, chunk, backend
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        from . import cupy_ops

        logits, targets, lse, entropy = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            sl = slice(s, s + ctx.chunk)
            ge = None if grad_entropy is None else grad_entropy[sl].float()
            gl = torch.zeros_like(lse[sl]) if grad_logp is None else grad_logp[sl].float()
            z = logits[sl]
            if cupy_ops.use_cupy(ctx.backend, z.device) and cupy_ops.logprob_kernel_supports(z):
                grad_logits[sl] = cupy_ops.logprob_gather_backward(
                    z, targets[sl], lse[sl], entropy[sl], gl, ge, ctx.temperature)
                continue
            grad_logits[sl] = _torch_chunk_grad(z, targets[sl], lse[sl], entropy[sl], gl, ge,
                                                ctx.temperature)
        return grad_logits, None, None, None, None


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """hidden (N, H) @ weight (V, H)^T -> logp (N,), entropy (N,), never holding (N, V) logits.

    Forward keeps the last chunk's logits for backward, which walks the chunks last first, so
    a batch of one chunk projects through the LM head three times (forward, two gradients),
    not four; the peak is unchanged: backward would recompute that block at its start anyway."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, backend):
        n = hidden.shape[0]
        chunk = even_chunk(n, chunk)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, entropy = torch.empty_like(logp), torch.empty_like(logp)
        z = None
        for s in range(0, n, chunk):
            z = hidden[s:s + chunk] @ weight.t()  # (C, V) in the model dtype
            logp[s:s + chunk], lse[s:s + chunk], entropy[s:s + chunk] = _chunk_stats(
                z, targets[s:s + chunk], temperature, backend)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk, ctx.backend, ctx.last_logits = temperature, chunk, backend, z
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        from . import cupy_ops

        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        last_logits, ctx.last_logits = ctx.last_logits, None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        starts = range(0, hidden.shape[0], ctx.chunk)
        for s in reversed(starts):
            sl = slice(s, s + ctx.chunk)
            ge = None if grad_entropy is None else grad_entropy[sl].float()
            gl = torch.zeros_like(lse[sl]) if grad_logp is None else grad_logp[sl].float()
            z = hidden[sl] @ weight.t() if last_logits is None else last_logits  # (C, V)
            last_logits = None          # (gone on a second backward of a retained graph: recomputed)
            if cupy_ops.use_cupy(ctx.backend, z.device) and cupy_ops.logprob_kernel_supports(z):
                gz = cupy_ops.logprob_gather_backward(z, targets[sl], lse[sl], entropy[sl], gl, ge,
                                                      ctx.temperature)
            else:
                gz = _torch_chunk_grad(z, targets[sl], lse[sl], entropy[sl], gl, ge, ctx.temperature)
            del z
            gz = gz.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[sl] = gz @ weight
            if grad_weight is not None:
                if gz.dtype == torch.float32:
                    grad_weight.addmm_(gz.t(), hidden[sl])      # no (V, H) temporary per chunk
                else:
                    grad_weight += (gz.t() @ hidden[sl]).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def even_chunk(n: int, chunk: int) -> int:
    """The chunk size <= `chunk` that cuts n tokens into as few chunks as `chunk` does, all of one
    size but the last (128 tokens at chunk 85: 64 + 64, not 85 + 43; a thin chunk multiplies slowly).
    At least 1: no tokens (a context-parallel rank whose slice holds none trained) is no chunks."""
    num_chunks = max(1, -(-n // chunk))
    return max(1, -(-n // num_chunks))


def _check(targets: torch.Tensor, lead_shape, temperature: float, chunk: int) -> None:
    if tuple(targets.shape) != tuple(lead_shape):
        raise RLOpsError(f"targets must have shape {tuple(lead_shape)} (one id per token), got "
                         f"{tuple(targets.shape)}")
    if temperature <= 0 or chunk < 1:
        raise RLOpsError(f"need temperature > 0 and chunk_size_tokens >= 1, got temperature="
                         f"{temperature}, chunk_size_tokens={chunk}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size_tokens: int | None = None, return_entropy: bool = False,
                   backend: str = "auto"):
    """logp of each target under softmax(logits / temperature), chunked; entropy too if asked.

    logits (..., V) in any float dtype (never upcast whole), targets (...) int64 -> (...) fp32.
    Differentiable in logits (and through entropy). chunk_size_tokens: None picks
    `auto_chunk_size_tokens(V)`. backend: "auto", "torch" or "cupy".
    """
    lead = logits.shape[:-1]
    if chunk_size_tokens is None:
        chunk_size_tokens = auto_chunk_size_tokens(logits.shape[-1])
    _check(targets, lead, temperature, chunk_size_tokens)
    flat = logits.reshape(-1, logits.shape[-1])
    logp, entropy = _ChunkedLogprobs.apply(flat, targets.reshape(-1), float(temperature),
                                           int(chunk_size_tokens), backend)
    logp, entropy = logp.view(lead), entropy.view(lead)
    return (logp, entropy) if return_entropy else logp


def token_logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               temperature: float = 1.0,
                               chunk_size_tokens: int | None = None,
                               return_entropy: bool = False, backend: str = "auto"):
    """Like `token_logprobs` on logits = hidden @ weight^T (the LM head), computed chunk by chunk.

    hidden (..., H), weight (V, H), targets (...) -> (...) fp32. Differentiable in hidden and
    weight; the full logits never exist, in forward or backward.
    """
    lead = hidden.shape[:-1]
    if chunk_size_tokens is None:
        chunk_size_tokens = auto_chunk_size_tokens(weight.shape[0])
    _check(targets, lead, temperature, chunk_size_tokens)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise RLOpsError(f"weight must be (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}, got "
                         f"{tuple(weight.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy = _ChunkedLinearLogprobs.apply(flat, weight, targets.reshape(-1), float(temperature),
                                                 int(chunk_size_tokens), backend)
    logp, entropy = logp.view(lead), entropy.view(lead)
    return (logp, entropy) if return_entropy else logp
