"""The field's stabilisers of the policy loss: GSPO's sequence ratio, CISPO's clipped weight, and
the train-inference mismatch corrections (TIS, MIS, geometric MIS, IcePop). Torch only.

`rl_ops_loss.per_token_loss` calls these; `PolicyLossConfig.loss_type` and `.is_mode` pick them,
and the named presets of `loss_presets` set both. Notation per token t of sequence b (m: mask,
n_b = sum_t m_bt, lp: the trained policy's logp with gradient, lp_old: the proximal policy's,
lp_beh: the rollout engine's, sg: stop-gradient, A: advantage):

GSPO (Zheng et al. 2025, arXiv:2507.18071), its GSPO-token form:

    s_b  = exp( (1/n_b) sum_t m_bt (lp_bt - lp_old_bt) )            the sequence's length-normalised ratio
    s_bt = sg(s_b) * exp(lp_bt - sg(lp_bt))                         value s_b, d s_bt / d lp_bt = s_b
    l_bt = max(-A s_bt, -A clip(s_bt, 1 - clip_low, 1 + clip_high))

  With one advantage per sequence and seq-mean-token-mean aggregation this is GSPO's sequence
  objective (1/B') sum_b max(-A s_b, -A clip(s_b)) exactly, loss and gradient: every token of a
  sequence is clipped or kept together.

CISPO (MiniMax-M1, arXiv:2506.13585): the importance weight is clipped and carries no gradient,
so no token loses its gradient (PPO's clip zeroes it):

    r_bt = exp(lp_bt - lp_old_bt);   l_bt = -A * sg(clip(r_bt, 1 - clip_low, 1 + clip_high)) * exp(lp_bt - sg(lp_bt))

  value -A * clip(r), gradient -A * clip(r) * d lp (the paper's sg(clip(r)) A grad log pi).

Mismatch corrections multiply the per-token loss by a weight w_bt without gradient, from
d_bt = lp_old_bt - lp_beh_bt (the learner's logp against the rollout engine's for the same
tokens; needs behaviour logprobs, i.e. the learner's "decoupled" objective):

    token-tis  w = min(exp(d), cap)                                  TIS (Yao et al. 2025, "Your efficient RL
                                                                     framework secretly brings you off-policy RL")
    seq-mis    rho_b = exp(sum_t m d);  w = rho_b * [is_low <= rho_b <= is_high]     MIS (Liu et al. 2025,
                                                                     "When speed kills stability")
    geo-mis    g_b = exp((1/n_b) sum_t m d);  w = [is_low <= g_b <= is_high]        geometric-mean MIS:
                                                                     a length-fair rejection, weight 1 when kept
    icepop     r = exp(d);  w = r * [is_low <= r <= is_high]         IcePop (Ling team 2025, Ring-1T,
                                                                     arXiv:2510.18855): token masking

The bounds are inclusive (a ratio exactly at a bound is kept). Log ratios are clamped to
[-20, 20] before exp. A sequence without trained tokens (n_b = 0) has s_b = rho_b = g_b = 1 and
counts as neither masked nor kept.
"""
from __future__ import annotations

import torch

from .rl_ops_errors import RLOpsError

LOSS_TYPES = ("ppo", "gspo", "cispo")
IS_MODES = ("token-tis", "seq-mis", "geo-mis", "icepop")
MASKING_IS_MODES = ("seq-mis", "geo-mis", "icepop")
LOG_RATIO_CLAMP = 20.0


def _need_mask(mask: torch.Tensor | None, what: str) -> torch.Tensor:
    if mask is None:
        raise RLOpsError(f"{what} works per sequence and needs the loss mask (B, T), got None; pass mask=")
    return mask


def gspo_token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """s_bt of GSPO-token (module docstring): (B, T), value s_b on every token of row b."""
    m = _need_mask(mask, "loss_type='gspo'").to(logp.dtype)
    n = m.sum(-1).clamp_min(1.0)                                               # (B,)
    mean_log_ratio = ((logp.detach() - old_logp.to(logp.dtype)) * m).sum(-1) / n  # (B,)
    seq_ratio = torch.exp(mean_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return seq_ratio[:, None] * torch.exp(logp - logp.detach())


def cispo_token_loss(logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                     clip_high: float) -> torch.Tensor:
    """l_bt of CISPO (module docstring): (B, T); the clipped weight carries no gradient."""
    weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    return -advantages * weight * torch.exp(logp - logp.detach())


@torch.no_grad()
def mismatch_weights(old_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor | None,
                     mode: str, *, cap: float | None = None, low: float | None = None,
                     high: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w (B, T), token masked (B, T) bool, sequence masked (B,) bool) of a mismatch correction.

    Invariant: w == 0 wherever a token or its sequence is masked; w >= 0 everywhere."""
    d = (old_logp - behavior_logp.to(old_logp.dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    none_b = torch.zeros(d.shape[0], dtype=torch.bool, device=d.device)
    if mode == "token-tis":
        w = torch.exp(d)
        return (w if cap is None else w.clamp(max=cap)), torch.zeros_like(d, dtype=torch.bool), none_b
    # the modes past token-tis mask: check_stabiliser_fields made sure both bounds are set
    assert low is not None and high is not None, (mode, low, high)
    if mode == "icepop":
        r = torch.exp(d)
        keep = (r >= low) & (r <= high)
        return torch.where(keep, r, torch.zeros_like(r)), ~keep, none_b
    m = _need_mask(mask, f"is_mode={mode!r}").to(d.dtype)
    n = m.sum(-1)                                                               # (B,)
    log_rho = (d * m).sum(-1)
    if mode == "geo-mis":
        log_rho = log_rho / n.clamp_min(1.0)
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))           # (B,)
    keep = (rho >= low) & (rho <= high)
    seq_w = torch.where(keep, rho if mode == "seq-mis" else torch.ones_like(rho), torch.zeros_like(rho))
    seq_masked = ~keep & (n > 0)
    return seq_w[:, None].expand_as(d), seq_masked[:, None].expand_as(d), seq_masked


def check_stabiliser_fields(loss_type: str, is_mode: str, is_low: float | None, is_high: float | None,
                            clip_low: float, dual_clip: float | None) -> None:
    """The rules of PolicyLossConfig's stabiliser fields (raises RLOpsError naming the fix)."""
    if loss_type not in LOSS_TYPES:
        raise RLOpsError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if is_mode not in IS_MODES:
        raise RLOpsError(f"is_mode must be one of {IS_MODES}, got {is_mode!r}")
    if is_mode in MASKING_IS_MODES:
        if is_low is None or is_high is None or not 0 <= is_low <= is_high:
            raise RLOpsError(f"is_mode={is_mode!r} needs 0 <= is_low <= is_high (the kept range of the "
                             f"rollout/learner ratio), got is_low={is_low}, is_high={is_high}; e.g. the "
                             "'icepop' preset's 0.5 and 5.0")
    if loss_type == "cispo":
        if not 0 <= clip_low <= 1:
            raise RLOpsError(f"CISPO needs 0 <= clip_low <= 1 (1: no lower bound on the weight), got {clip_low}")
        if dual_clip is not None:
            raise RLOpsError(f"dual_clip={dual_clip} applies to the PPO clip, not to CISPO's weight; set "
                             "dual_clip = None with loss_type 'cispo'")
    elif not 0 <= clip_low < 1:
        raise RLOpsError(f"clip range needs 0 <= clip_low < 1, got clip_low={clip_low}")


def stabiliser_metrics(token_masked: torch.Tensor, seq_masked: torch.Tensor, mask: torch.Tensor) -> list:
    """[masked_token_frac, masked_seq_frac] as 0-d tensors: the share of trained tokens whose weight a
    mismatch mask zeroed, and of non-empty sequences a sequence mask dropped."""
    m = mask.to(torch.bool)
    n_tok = m.sum().clamp_min(1)
    nonempty = m.any(-1)
    n_seq = nonempty.sum().clamp_min(1)
    return [(token_masked & m).sum() / n_tok, (seq_masked & nonempty).sum() / n_seq]
