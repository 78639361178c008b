"""On-policy distillation: the per-token reverse KL(student || teacher), or the forward
KL(teacher || student), over a teacher's top-k support plus one tail bucket, or over the full
vocabulary.

    loss, kl = rl_ops.distill_kl(student_topk_logp, teacher_topk_logp, teacher_tail_logmass, mask,
                                 student_tail_logmass=student_tail)          # (B, T, k), (B, T)
    logp, entropy, part = rl_ops.distill_head_from_hidden(hidden, lm_head.weight, targets,
                                                          topk_ids=ids)     # part (N, k + 1)
    logp, entropy, kl = rl_ops.distill_head_from_hidden(hidden, lm_head.weight, targets,
                                                        teacher_hidden=th, teacher_weight=tw)  # kl (N,)

Top-k. For one trained token, S = the teacher's k most likely ids, p_s / p_t the student's and
the teacher's next-token distributions (log_softmax of the logits at temperature 1), and
tail = every id outside S. The KL is taken over the partition {each v in S} u {tail}:

    KL_k = sum_{v in S} p_s(v) (log p_s(v) - log p_t(v)) + p_s(tail) (log p_s(tail) - log p_t(tail))
    p_s(tail) = 1 - sum_{v in S} p_s(v),   log p_t(tail) = the teacher's `tail_logmass`

Bound: merging the tail's ids into one bucket can only lose information (the log-sum
inequality, i.e. data processing for KL), so KL_k <= KL(p_s || p_t), the full reverse KL, and
the gap is exactly p_s(tail) * KL(p_s(. | tail) || p_t(. | tail)), the tail's conditional
distributions' KL weighted by the student's tail mass. KL_k = KL when k = V (no tail), and the
gap is small wherever the student puts little mass outside the teacher's top k, which
on-policy training drives it to. KL_k is >= 0 and 0 iff the student matches the teacher on
every id of S (and hence on the tail's total).

The student's tail log-mass is best taken exactly from its logits (log of the sum of exp
over the ids outside S, minus the logsumexp): `distill_head_from_hidden` gives it in the last
column of its top-k output. Without it, `distill_kl` computes it from the top-k log-probs as
log(-expm1(logsumexp(student_topk_logp))), stable down to the rounding of that sum (about k
ulps of 1): a tail below that is read as 0, whose gradient is then unreliable.

The forward divergence (`divergence="forward"`) swaps the two distributions on the same partition:

    KLf_k = sum_{v in S} p_t(v) (log p_t(v) - log p_s(v)) + p_t(tail) (log p_t(tail) - log p_s(tail))

with the same bound (KLf_k <= KL(p_t || p_s), the gap p_t(tail) times the tails' conditional
KL). The two teach differently where the student is sure of a token the teacher is not: the
reverse KL's pull toward the teacher's token v is p_s(v) (log-ratio terms aside), so a token
the student puts ~0 on is barely pulled up (a lock-in), where the forward KL's gradient on
the logits is p_s - p_t, a cross-entropy to the teacher's distribution that pulls v up by
p_t(v) whatever the student thinks of it (mode covering, where the reverse is mode seeking).

Full vocabulary (a teacher on the learner's host): KL = sum_v p_s(v) (log p_s(v) - log p_t(v)),
exact. `distill_head_from_hidden` computes it chunk by chunk from both models' final hidden
states and LM heads, so neither model's (tokens x vocab) logits exist in full.

Gradients, with z the student's logits, p = softmax(z), l = log p (N: the token's terms):

    d KL / d z_j            = p_j (l_j - log p_t(j) - KL)                        full vocabulary
    d KLf / d z_j           = p_j - p_t(j)                                       full vocabulary, forward
    d log p(v) / d z_j      = [j == v] - p_j                                     a top-k column
    d log p(tail) / d z_j   = [j not in S] q_j - p_j,  q = softmax of z over the tail's ids

Aggregation: the per-token KL is reduced like every other loss (`aggregate_loss`: the mask,
agg_mode and the whole batch's token / sequence counts for micro-batches and ranks).

No fused CuPy kernel: every function here is torch (on any device). The head function walks
the tokens in chunks of `chunk_size_tokens` (the LM-head projection included) and recomputes
each chunk's softmax in backward, keeping only the last chunk's logits from forward (backward
walks the chunks last first), as `logprobs.token_logprobs_from_hidden` does.
"""
from __future__ import annotations

import math

import torch

from .logprobs import auto_chunk_size_tokens, even_chunk
from .rl_ops_errors import RLOpsError
from .rl_ops_loss import aggregate_loss

#: The teacher's tail log-mass floor (log 1e-20): a teacher whose top k hold all the mass in
#: float32 reports this instead of -inf, so the tail term stays finite.
TAIL_LOGMASS_FLOOR = math.log(1e-20)

#: Which KL a distillation takes: "reverse" KL(student || teacher) or "forward" KL(teacher || student).
DIVERGENCES = ("reverse", "forward")


def _kl_terms(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """p_s (log p_s - log p_t) elementwise from log-probs s, t; 0 where p_s = 0 (s = -inf), with
    a zero (not NaN) gradient there."""
    present = s > float("-inf")
    s_safe = torch.where(present, s, torch.zeros_like(s))
    return torch.where(present, s_safe.exp() * (s_safe - t), torch.zeros_like(s))


def _divergence_terms(s: torch.Tensor, t: torch.Tensor, forward: bool) -> torch.Tensor:
    """The per-id terms of KL(student || teacher), or of KL(teacher || student) when `forward`,
    from the student's log-probs s and the teacher's t."""
    return _kl_terms(t, s) if forward else _kl_terms(s, t)


def tail_logmass_from_topk(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(topk_logprobs))) over the last dim, stably (log of -expm1 of the
    logsumexp); -inf where the top k hold all the mass up to rounding (module docstring)."""
    lse = torch.logsumexp(topk_logprobs, dim=-1).clamp(max=0.0)
    return torch.log(-torch.expm1(lse))


def _check_divergence(divergence: str) -> None:
    if divergence not in DIVERGENCES:
        raise RLOpsError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")


def topk_kl_per_token(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor,
                      teacher_tail_logmass: torch.Tensor, *,
                      student_tail_logmass: torch.Tensor | None = None, divergence: str = "reverse") -> torch.Tensor:
    """KL_k (or, `divergence="forward"`, KLf_k) per token (module docstring): student and
    teacher top-k log-probs (..., k) at the same ids, the teacher's tail log-mass (...), the
    student's (...) or None (computed from its top k) -> (...). Differentiable in the student's
    log-probs; float32 or wider."""
    _check_divergence(divergence)
    s, t = student_topk_logprobs, teacher_topk_logprobs
    if s.shape != t.shape or s.dim() < 1:
        raise RLOpsError(f"student and teacher top-k log-probs must have one shape (..., k), got "
                         f"{tuple(s.shape)} and {tuple(t.shape)}")
    if tuple(teacher_tail_logmass.shape) != tuple(s.shape[:-1]):
        raise RLOpsError(f"teacher_tail_logmass must be {tuple(s.shape[:-1])} (one per token), got "
                         f"{tuple(teacher_tail_logmass.shape)}")
    if student_tail_logmass is None:
        student_tail_logmass = tail_logmass_from_topk(s)
    elif tuple(student_tail_logmass.shape) != tuple(s.shape[:-1]):
        raise RLOpsError(f"student_tail_logmass must be {tuple(s.shape[:-1])} (one per token), got "
                         f"{tuple(student_tail_logmass.shape)}")
    dtype = torch.promote_types(s.dtype, torch.float32)
    s_all = torch.cat([s.to(dtype), student_tail_logmass.to(dtype)[..., None]], dim=-1)
    t_all = torch.cat([t.to(dtype), teacher_tail_logmass.to(dtype)[..., None]], dim=-1)
    if divergence == "forward":
        # no tail ids (k = V): the teacher's tail is a scorer's floor, not mass; it takes no term
        no_tail = torch.isneginf(s_all[..., -1])
        t_all[..., -1] = torch.where(no_tail, torch.full_like(t_all[..., -1], float("-inf")), t_all[..., -1])
    return _divergence_terms(s_all, t_all, divergence == "forward").sum(-1)


def full_kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      divergence: str = "reverse") -> torch.Tensor:
    """KL(softmax(student) || softmax(teacher)) per token over the full vocabulary, plainly (the
    forward KL(teacher || student) with `divergence="forward"`): logits (..., V) -> (...) float32
    or wider, differentiable in the student's logits (the reference of the chunked head; the
    learner's path for a softcapped or "naive" head)."""
    _check_divergence(divergence)
    if student_logits.shape != teacher_logits.shape:
        raise RLOpsError(f"student and teacher logits must have one shape (..., V), got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}; the teacher "
                         "needs the student's vocabulary")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s = torch.log_softmax(student_logits.to(dtype), dim=-1)
    t = torch.log_softmax(teacher_logits.detach().to(dtype), dim=-1)
    return _divergence_terms(s, t, divergence == "forward").sum(-1)


def distill_kl(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor,
               teacher_tail_logmass: torch.Tensor, mask: torch.Tensor, *,
               student_tail_logmass: torch.Tensor | None = None, agg_mode: str = "token-mean",
               loss_norm_constant: float | None = None, global_num_tokens: float | None = None,
               global_num_seqs: float | None = None, divergence: str = "reverse") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-token KL (B, T)): the top-k distillation KL (module docstring; `divergence`
    picks reverse or forward) aggregated over
    the mask's tokens by `agg_mode` like the policy loss (`aggregate_loss`; pass the whole
    batch's counts for micro-batches and ranks). Shapes: top-k log-probs (B, T, k), tails and
    mask (B, T). The per-token KL is 0 where the mask is 0."""
    if mask.shape != student_topk_logprobs.shape[:-1]:
        raise RLOpsError(f"mask must be {tuple(student_topk_logprobs.shape[:-1])} (the log-probs' tokens), "
                         f"got {tuple(mask.shape)}")
    kl = topk_kl_per_token(student_topk_logprobs, teacher_topk_logprobs, teacher_tail_logmass,
                           student_tail_logmass=student_tail_logmass, divergence=divergence)
    kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    loss = aggregate_loss(kl, mask, agg_mode, loss_norm_constant=loss_norm_constant,
                          global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs)
    return loss, kl


# ------------------------------------------------------------------ the student's head, with the teacher's

def _check_head(hidden, weight, targets, topk_ids, teacher_hidden, teacher_weight) -> None:
    if weight.dim() != 2 or hidden.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise RLOpsError(f"hidden must be (N, H) and weight (V, H), got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if tuple(targets.shape) != (hidden.shape[0],):
        raise RLOpsError(f"targets must be ({hidden.shape[0]},) (one id per row), got {tuple(targets.shape)}")
    if (topk_ids is None) == (teacher_hidden is None):
        raise RLOpsError("give topk_ids (the teacher's top-k ids per row) or teacher_hidden and teacher_weight "
                         "(the teacher's full vocabulary), one of the two")
    if topk_ids is not None and (topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]):
        raise RLOpsError(f"topk_ids must be ({hidden.shape[0]}, k), got {tuple(topk_ids.shape)}")
    if teacher_hidden is not None:
        if teacher_weight is None or teacher_hidden.shape[0] != hidden.shape[0]:
            raise RLOpsError("teacher_hidden needs teacher_weight, and one row per student row")
        if teacher_weight.shape[0] != weight.shape[0]:
            raise RLOpsError(f"the teacher's vocabulary ({teacher_weight.shape[0]}) differs from the student's "
                             f"({weight.shape[0]}); distillation needs one tokenizer")


def _teacher_logp(teacher_hidden, teacher_weight, softcap) -> torch.Tensor:
    """The teacher's log-softmax (C, V) float32 at temperature 1, no gradient."""
    with torch.no_grad():
        z = (teacher_hidden @ teacher_weight.t()).float()
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        return torch.log_softmax(z, dim=-1)


def _chunk_forward(z, targets, temperature, topk_ids, teacher_lp, forward_kl):
    """One chunk's (logp, entropy at temperature; lse_T, lse_1; extra, tail_lse or kl) from
    raw fp32 logits z (C, V)."""
    zt = z / temperature if temperature != 1.0 else z
    lse_t = torch.logsumexp(zt, dim=-1)
    logp = zt.gather(-1, targets[:, None]).squeeze(-1) - lse_t
    lp_t = zt - lse_t[:, None]
    entropy = -(lp_t.exp() * lp_t).nan_to_num_(nan=0.0).sum(-1)
    lse_1 = lse_t if temperature == 1.0 else torch.logsumexp(z, dim=-1)
    if topk_ids is not None:
        tail_lse = torch.logsumexp(z.scatter(-1, topk_ids, float("-inf")), dim=-1)     # absolute
        extra = torch.cat([z.gather(-1, topk_ids) - lse_1[:, None], (tail_lse - lse_1)[:, None]], dim=-1)
        return logp, entropy, lse_t, lse_1, extra, tail_lse
    lp_1 = z - lse_1[:, None]
    kl = _divergence_terms(lp_1, teacher_lp, forward_kl).sum(-1)
    return logp, entropy, lse_t, lse_1, kl, kl


def _chunk_backward(z, targets, temperature, topk_ids, teacher_lp, forward_kl, lse_t, lse_1, entropy, aux,
                    g_logp, g_ent, g_extra) -> torch.Tensor:
    """d(loss)/dz (C, V) fp32 of one chunk from its saved statistics (formulas in the module
    docstring and in logprobs.py). At temperature 1 the two softmaxes are one, computed once, and
    the tail's softmax is the student's scaled: q = p / p(tail) outside the top k."""
    grad = torch.zeros_like(z)
    lp_t = p_t = None
    if g_logp is not None or g_ent is not None:
        zt = z / temperature if temperature != 1.0 else z
        lp_t = zt - lse_t[:, None]
        p_t = lp_t.exp()
        if g_logp is not None:
            grad -= p_t * g_logp[:, None]
            grad.scatter_add_(-1, targets[:, None], g_logp[:, None])
        if g_ent is not None:
            grad -= (p_t * (lp_t + entropy[:, None])).nan_to_num_(nan=0.0) * g_ent[:, None]
        if temperature != 1.0:
            grad /= temperature
    if g_extra is None:
        return grad
    if temperature == 1.0 and lp_t is not None and p_t is not None:
        lp_1, p_1 = lp_t, p_t
    else:
        lp_1 = z - lse_1[:, None]
        p_1 = lp_1.exp()
    if topk_ids is not None:
        k = topk_ids.shape[1]
        g_top, g_tail = g_extra[:, :k], g_extra[:, k]
        grad.scatter_add_(-1, topk_ids, g_top)
        tail_lse = aux
        has_tail = torch.isfinite(tail_lse)
        inv_tail = torch.where(has_tail, (lse_1 - tail_lse).exp(), torch.zeros_like(tail_lse))   # 1 / p(tail)
        grad -= p_1 * (g_top.sum(-1) + g_tail)[:, None]
        q = (p_1 * (g_tail * inv_tail)[:, None]).scatter_(-1, topk_ids, 0.0)   # zeroed, not subtracted:
        grad += q                                                              # exact for a tiny tail
        return grad
    if forward_kl:
        grad += (p_1 - teacher_lp.exp()) * g_extra[:, None]
        return grad
    kl = aux
    diff = (lp_1 - teacher_lp - kl[:, None]).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    grad += p_1 * diff * g_extra[:, None]
    return grad


class _ChunkedDistillHead(torch.autograd.Function):
    """hidden (N, H) @ weight (V, H)^T -> logp (N,), entropy (N,) at the temperature, and the
    distillation output at temperature 1: the top-k and tail log-probs (N, k + 1), or the full
    KL to the teacher (N,); in token chunks, never holding (N, V) logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, topk_ids, teacher_hidden, teacher_weight, teacher_softcap,
                forward_kl, temperature, chunk):
        n = hidden.shape[0]
        chunk = even_chunk(n, chunk)
        out = {"logp": torch.empty(n, dtype=torch.float32, device=hidden.device)}
        for name in ("entropy", "lse_t", "lse_1", "aux"):
            out[name] = torch.empty_like(out["logp"])
        extra = (torch.empty(n, topk_ids.shape[1] + 1, dtype=torch.float32, device=hidden.device)
                 if topk_ids is not None else torch.empty_like(out["logp"]))
        z = None
        for s in range(0, n, chunk):
            sl = slice(s, s + chunk)
            z = (hidden[sl] @ weight.t()).float()
            teacher_lp = (None if teacher_hidden is None else
                          _teacher_logp(teacher_hidden[sl], teacher_weight, teacher_softcap))
            ids = None if topk_ids is None else topk_ids[sl]
            (out["logp"][sl], out["entropy"][sl], out["lse_t"][sl], out["lse_1"][sl], extra[sl],
             out["aux"][sl]) = _chunk_forward(z, targets[sl], temperature, ids, teacher_lp, forward_kl)
        ctx.save_for_backward(hidden, weight, targets, topk_ids, teacher_hidden, teacher_weight,
                              out["lse_t"], out["lse_1"], out["entropy"], out["aux"])
        ctx.set_materialize_grads(False)   # an unused output's gradient arrives as None
        ctx.teacher_softcap, ctx.forward_kl = teacher_softcap, forward_kl
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.last_logits = z                # backward walks the chunks last first: one projection fewer
        return out["logp"], out["entropy"], extra

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_extra):
        (hidden, weight, targets, topk_ids, teacher_hidden, teacher_weight,
         lse_t, lse_1, entropy, aux) = ctx.saved_tensors
        last_logits, ctx.last_logits = ctx.last_logits, None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for s in reversed(range(0, hidden.shape[0], ctx.chunk)):
            sl = slice(s, s + ctx.chunk)
            z = (hidden[sl] @ weight.t()).float() if last_logits is None else last_logits
            last_logits = None             # (gone on a second backward of a retained graph: recomputed)
            teacher_lp = (None if teacher_hidden is None or g_extra is None else
                          _teacher_logp(teacher_hidden[sl], teacher_weight, ctx.teacher_softcap))
            gz = _chunk_backward(
                z, targets[sl], ctx.temperature, None if topk_ids is None else topk_ids[sl], teacher_lp,
                ctx.forward_kl, lse_t[sl], lse_1[sl], entropy[sl], aux[sl],
                None if g_logp is None else g_logp[sl].float(), None if g_ent is None else g_ent[sl].float(),
                None if g_extra is None else g_extra[sl].float())
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
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def distill_head_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             topk_ids: torch.Tensor | None = None, teacher_hidden: torch.Tensor | None = None,
                             teacher_weight: torch.Tensor | None = None, teacher_softcap: float | None = None,
                             divergence: str = "reverse", temperature: float = 1.0,
                             chunk_size_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp (N,), entropy (N,), distill) from the student's final hidden rows (N, H) and LM head
    (V, H), chunk by chunk. logp and entropy are those of `targets` at `temperature`, as
    `token_logprobs_from_hidden` gives them; `distill` is at temperature 1: with `topk_ids`
    (N, k), the student's log-probs at those ids then its tail log-mass, (N, k + 1); with the
    teacher's final hidden rows (N, H_t) and LM head (V, H_t) (softcap: Gemma's final logit
    cap), the full-vocabulary KL(student || teacher) per row (N,). Differentiable in hidden and
    weight; the teacher gets no gradient. All float32 (torch; no CuPy kernel)."""
    _check_head(hidden, weight, targets, topk_ids, teacher_hidden, teacher_weight)
    if temperature <= 0:
        raise RLOpsError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_size_tokens or auto_chunk_size_tokens(weight.shape[0])
    if chunk < 1:
        raise RLOpsError(f"chunk_size_tokens must be >= 1, got {chunk_size_tokens}")
    if topk_ids is not None:
        topk_ids = topk_ids.to(torch.int64)
    if teacher_hidden is not None and teacher_weight is not None:
        teacher_hidden = teacher_hidden.detach().to(teacher_weight.dtype)
        teacher_weight = teacher_weight.detach()
    return _ChunkedDistillHead.apply(hidden, weight, targets, topk_ids, teacher_hidden, teacher_weight,
                                     teacher_softcap, divergence == "forward", float(temperature), int(chunk))


def distill_head_naive(logits: torch.Tensor, targets: torch.Tensor, *, topk_ids: torch.Tensor | None = None,
                       teacher_logits: torch.Tensor | None = None, divergence: str = "reverse",
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`distill_head_from_hidden` on full logits (N, V), plainly (autograd through a full
    log-softmax): the path of a softcapped head or `logprob_path = "naive"`, and its reference."""
    if (topk_ids is None) == (teacher_logits is None):
        raise RLOpsError("give topk_ids or teacher_logits, one of the two")
    z = logits.float()
    lp_t = torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)
    logp = lp_t.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(lp_t.exp() * lp_t).nan_to_num(nan=0.0).sum(-1)
    if teacher_logits is not None:
        return logp, entropy, full_kl_per_token(z, teacher_logits, divergence)
    assert topk_ids is not None
    ids = topk_ids.to(torch.int64)
    lp_1 = torch.log_softmax(z, dim=-1)
    outside = torch.ones_like(lp_1, dtype=torch.bool).scatter(-1, ids, False)
    has_tail = outside.any(-1)                # k = V: no tail (-inf), and no NaN in its gradient
    tail = torch.logsumexp(torch.where(outside | ~has_tail[:, None], lp_1, float("-inf")), dim=-1)
    tail = torch.where(has_tail, tail, torch.full_like(tail, float("-inf")))
    return logp, entropy, torch.cat([lp_1.gather(-1, ids), tail[:, None]], dim=-1)
