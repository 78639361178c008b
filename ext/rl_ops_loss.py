"""The GRPO-family policy loss per token, its aggregation over a batch, and its metrics.

(The module is `rl_ops_loss`, not `policy_loss`, so that `postrain.ext.policy_loss` stays the
function once the submodule is imported.)

Design: every aggregation mode is a weighted sum over tokens whose weights depend
only on the mask, loss = sum_{b,t} W_b * m_bt * l_bt. So one pass computes the
per-token loss l and per-row partial sums, and the mode only picks W_b; the
backward pass is d loss / d logp_bt = W_b * m_bt * dl_bt/dlogp_bt. The fused CuPy
kernel (`cupy_ops`) and the torch reference here follow this one rule.

Per token (A: advantage, lp: logp under the policy being trained, with gradient;
lp_old: the proximal policy's logp, lp_beh: the behaviour policy that sampled it):

    ratio   = exp(clamp(lp - lp_old, -20, 20))
    pg      = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))     PPO / DAPO clip-higher
    pg      = min(pg, -A * dual_clip)          where A < 0                        dual clip (c = 3)
    pg      = w * pg,  w = min(exp(lp_old - lp_beh), behavior_weight_cap)         decoupled (stale samples)
    l       = pg + kl_coef * k(lp_ref - lp)                                       KL as a loss (k1/k2/k3)

w carries no gradient. Without `behavior_logp`, lp_old is the behaviour policy (w = 1).

Stabilisers (`stabilisers.py`, formulas there; torch only, backend="auto" picks torch for them):
loss_type "gspo" replaces the token ratio by GSPO's sequence ratio, "cispo" replaces the clipped
surrogate by CISPO's stop-gradient clipped weight; is_mode other than "token-tis" replaces w by a
masking mismatch correction (seq-mis, geo-mis, icepop). `loss_presets.py` names the combinations.

Aggregation (m: mask, n_b = sum_t m_bt, B' = rows with n_b > 0, C = loss_norm_constant,
default T = mask.shape[1]):

    token-mean               sum_bt m l / sum_bt m
    seq-mean-token-sum       (1/B') sum_b sum_t m l
    seq-mean-token-mean      (1/B') sum_b (sum_t m l / n_b)
    seq-mean-token-sum-norm  (1/(B*C)) sum_bt m l         Dr. GRPO: a constant normaliser

For gradient accumulation across micro-batches or ranks, pass `global_num_tokens`
and `global_num_seqs` so every micro-batch divides by the whole batch's counts.

Clip fractions (over masked tokens): low = A < 0 and ratio < 1 - clip_low; high = A > 0
and ratio > 1 + clip_high; dual = A < 0 and ratio > dual_clip.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cupy_ops
from . import stabilisers
from .kl import check_kl_kind, kl_estimate
from .rl_ops_errors import RLOpsError

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0
# Order of the per-row partial sums the fused kernel writes; the reference builds the same.
ROW_STATS = ("loss", "pg", "kl", "num_tokens", "clip_low", "clip_high", "clip_dual", "ratio",
             "behavior_weight")


@dataclass(frozen=True)
class PolicyLossConfig:
    """The knobs of `policy_loss` (defaults: DAPO clip-higher with dual clip, token-mean).

    clip_low / clip_high: ratio clip range [1 - clip_low, 1 + clip_high] (0.2 / 0.28).
    dual_clip: constant c > 1 bounding the loss of A < 0 tokens at -c*A; None disables.
    behavior_weight_cap: cap on w = exp(lp_old - lp_beh) for stale samples; None: no cap.
    kl_coef, kl_kind: KL-to-reference loss term (0 disables the gradient; the KL metric is
    still reported when ref_logp is given).
    agg_mode: one of AGG_MODES; loss_norm_constant: C of seq-mean-token-sum-norm (None: T).
    loss_type: "ppo" | "gspo" | "cispo"; is_mode: "token-tis" (w capped at behavior_weight_cap) |
    "seq-mis" | "geo-mis" | "icepop", with is_low <= ratio <= is_high kept (stabilisers.py).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    behavior_weight_cap: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    agg_mode: str = "token-mean"
    loss_norm_constant: float | None = None
    loss_type: str = "ppo"
    is_mode: str = "token-tis"
    is_low: float | None = None
    is_high: float | None = None

    def __post_init__(self) -> None:
        stabilisers.check_stabiliser_fields(self.loss_type, self.is_mode, self.is_low, self.is_high,
                                            self.clip_low, self.dual_clip)
        if not (0 <= self.clip_low <= 1 and self.clip_high >= 0):
            raise RLOpsError(f"clip range needs 0 <= clip_low < 1 and clip_high >= 0, got "
                             f"clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1 + self.clip_high:
            raise RLOpsError(f"dual_clip must be > 1 + clip_high = {1 + self.clip_high}, got "
                             f"{self.dual_clip}; use 3.0 or None to disable it")
        if self.behavior_weight_cap is not None and self.behavior_weight_cap <= 0:
            raise RLOpsError(f"behavior_weight_cap must be > 0 or None, got {self.behavior_weight_cap}")
        if self.agg_mode not in AGG_MODES:
            raise RLOpsError(f"agg_mode must be one of {AGG_MODES}, got {self.agg_mode!r}")
        if self.loss_norm_constant is not None and self.loss_norm_constant <= 0:
            raise RLOpsError(f"loss_norm_constant must be > 0 or None, got {self.loss_norm_constant}")
        if self.kl_coef < 0:
            raise RLOpsError(f"kl_coef must be >= 0, got {self.kl_coef}")
        check_kl_kind(self.kl_kind)

    @property
    def torch_only(self) -> bool:
        """True where no fused CuPy kernel computes this loss (a stabiliser is on)."""
        return self.loss_type != "ppo" or self.is_mode != "token-tis"


def row_weights(mask: torch.Tensor, mode: str, *, loss_norm_constant: float | None = None,
                global_num_tokens: float | None = None,
                global_num_seqs: float | None = None) -> torch.Tensor:
    """W_b of the aggregation rule (module docstring): mask (B, T) -> (B,) float32, no gradient."""
    if mode not in AGG_MODES:
        raise RLOpsError(f"agg_mode must be one of {AGG_MODES}, got {mode!r}")
    m = mask.to(torch.float32)
    n_b = m.sum(-1)  # (B,)
    nonempty = (n_b > 0).to(torch.float32)
    if mode == "token-mean":
        total = n_b.sum().clamp_min(1.0) if global_num_tokens is None else global_num_tokens
        return torch.ones_like(n_b) / total
    if mode == "seq-mean-token-sum-norm":
        seqs: torch.Tensor | float = float(mask.shape[0]) if global_num_seqs is None else global_num_seqs
        const = float(mask.shape[1]) if loss_norm_constant is None else loss_norm_constant
        return torch.ones_like(n_b) / (seqs * const)
    seqs = nonempty.sum().clamp_min(1.0) if global_num_seqs is None else global_num_seqs
    if mode == "seq-mean-token-sum":
        return nonempty / seqs
    return nonempty / (seqs * n_b.clamp_min(1.0))


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
                   loss_norm_constant: float | None = None, global_num_tokens: float | None = None,
                   global_num_seqs: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar by `mode` (formulas in the module docstring)."""
    w = row_weights(mask, mode, loss_norm_constant=loss_norm_constant,
                    global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs)
    return (token_loss * mask.to(token_loss.dtype) * w[:, None].to(token_loss.dtype)).sum()


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.shape == like.shape:
        return advantages.to(torch.float32)
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.to(torch.float32)[:, None].expand_as(like)
    raise RLOpsError(f"advantages must be (B,) or (B, T) like logp {tuple(like.shape)}, got "
                     f"{tuple(advantages.shape)}")


def check_inputs(logp, old_logp, advantages, mask, behavior_logp, ref_logp) -> torch.Tensor:
    """Validate shapes; return advantages as (B, T) float32."""
    if logp.dim() != 2:
        raise RLOpsError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("behavior_logp", behavior_logp),
                    ("ref_logp", ref_logp)):
        if t is not None and t.shape != logp.shape:
            raise RLOpsError(f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(t.shape)}")
    return _broadcast_advantages(advantages, logp)


def per_token_loss(logp, old_logp, advantages, config: PolicyLossConfig, *, behavior_logp=None,
                   ref_logp=None, mask=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """l_bt and the per-token pieces the metrics need; all (B, T) (torch reference). `mask` is
    needed by the per-sequence stabilisers (GSPO, seq-mis, geo-mis).

    Computes in float32, or float64 where logp is float64 (for gradcheck)."""
    ftype = torch.promote_types(logp.dtype, torch.float32)
    lp = logp.to(ftype)
    adv = advantages.to(ftype)
    lo, hi = 1.0 - config.clip_low, 1.0 + config.clip_high
    if config.loss_type == "gspo":
        ratio = stabilisers.gspo_token_ratio(lp, old_logp, mask)
    else:
        ratio = torch.exp((lp - old_logp.to(ftype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    dual = torch.zeros_like(adv, dtype=torch.bool)
    if config.loss_type == "cispo":
        pg = stabilisers.cispo_token_loss(lp, ratio, adv, config.clip_low, config.clip_high)
        clip_low, clip_high = ratio.detach() < lo, ratio.detach() > hi
    else:
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
        clip_low, clip_high = (adv < 0) & (ratio < lo), (adv > 0) & (ratio > hi)
    if config.dual_clip is not None:
        pg3 = -adv * config.dual_clip
        dual = (adv < 0) & (pg3 < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    weight = torch.ones_like(adv)
    token_masked = torch.zeros_like(adv, dtype=torch.bool)
    seq_masked = torch.zeros(adv.shape[0], dtype=torch.bool, device=adv.device)
    if behavior_logp is not None:
        weight, token_masked, seq_masked = stabilisers.mismatch_weights(
            old_logp.to(ftype), behavior_logp, mask, config.is_mode, cap=config.behavior_weight_cap,
            low=config.is_low, high=config.is_high)
        pg = pg * weight
    kl = torch.zeros_like(adv)
    if ref_logp is not None:
        kl = kl_estimate(lp, ref_logp.to(ftype), config.kl_kind)
    loss = pg + config.kl_coef * kl if config.kl_coef else pg
    pieces = {"pg": pg, "kl": kl, "ratio": ratio, "behavior_weight": weight, "clip_low": clip_low,
              "clip_high": clip_high, "clip_dual": dual, "token_masked": token_masked,
              "seq_masked": seq_masked}
    return loss, pieces


def row_stats_reference(loss, pieces, mask) -> torch.Tensor:
    """Per-row partial sums in ROW_STATS order: (B, len(ROW_STATS)) float32, no gradient."""
    m = mask.to(torch.float32)
    cols = {"loss": loss.detach(), "num_tokens": torch.ones_like(m)}
    cols.update({k: v.detach().to(torch.float32) for k, v in pieces.items() if k in ROW_STATS})
    return torch.stack([(cols[name] * m).sum(-1) for name in ROW_STATS], dim=-1)


def loss_metrics(loss: torch.Tensor, stats: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 entropy: torch.Tensor | None = None) -> dict[str, float]:
    """Floats for logging: loss, pg_loss, kl, entropy, clip fractions, ratio, advantage stats.

    Token averages are over masked tokens; one host sync for all of them.
    """
    sums = stats.sum(0)  # (len(ROW_STATS),)
    n = sums[ROW_STATS.index("num_tokens")].clamp_min(1.0)
    m = mask.to(torch.bool)
    adv = advantages.detach()[m] if m.any() else torch.zeros(1, device=advantages.device)
    names = ["loss", "pg_loss", "kl", "clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_mean",
             "behavior_weight_mean", "num_tokens", "advantage_mean", "advantage_std", "advantage_min",
             "advantage_max"]
    values = [loss.detach().float(), sums[1] / n, sums[2] / n, sums[4] / n, sums[5] / n, sums[6] / n,
              sums[7] / n, sums[8] / n, sums[3], adv.mean(), adv.std(unbiased=False), adv.min(), adv.max()]
    if entropy is not None:
        names.append("entropy")
        values.append((entropy.detach().float() * mask.float()).sum() / n)
    return dict(zip(names, torch.stack([v.reshape(()).float() for v in values]).tolist()))


def policy_loss_reference(logp, old_logp, advantages, mask, config: PolicyLossConfig, *,
                          behavior_logp=None, ref_logp=None, global_num_tokens=None,
                          global_num_seqs=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: (scalar loss, per-row stats (B, len(ROW_STATS)), advantages (B, T))."""
    return _reference_with_pieces(logp, old_logp, advantages, mask, config, behavior_logp=behavior_logp,
                                  ref_logp=ref_logp, global_num_tokens=global_num_tokens,
                                  global_num_seqs=global_num_seqs)[:3]


def _reference_with_pieces(logp, old_logp, advantages, mask, config: PolicyLossConfig, *,
                           behavior_logp=None, ref_logp=None, global_num_tokens=None, global_num_seqs=None):
    """`policy_loss_reference` and the per-token pieces (`per_token_loss`)."""
    adv = check_inputs(logp, old_logp, advantages, mask, behavior_logp, ref_logp)
    loss_tok, pieces = per_token_loss(logp, old_logp, adv, config, behavior_logp=behavior_logp,
                                      ref_logp=ref_logp, mask=mask)
    loss = aggregate_loss(loss_tok, mask, config.agg_mode, loss_norm_constant=config.loss_norm_constant,
                          global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs)
    return loss, row_stats_reference(loss_tok, pieces, mask), adv, pieces


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, config: PolicyLossConfig | None = None, *,
                behavior_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, global_num_tokens: float | None = None,
                global_num_seqs: float | None = None,
                backend: str = "auto") -> tuple[torch.Tensor, dict[str, float]]:
    """The aggregated policy loss (scalar, differentiable in logp) and its metrics.

    Shapes: logp, old_logp, mask, behavior_logp, ref_logp, entropy (B, T); advantages (B,) or
    (B, T). backend: "auto" (fused CuPy kernel for CUDA tensors where CuPy imports, else torch),
    "torch" or "cupy". `entropy` only feeds the metric; add an entropy bonus yourself with
    `aggregate_loss(entropy, mask, mode)`.
    """
    config = config or PolicyLossConfig()
    if config.torch_only and backend == "cupy":
        raise RLOpsError(f"loss_type={config.loss_type!r} / is_mode={config.is_mode!r} have no CuPy kernel; "
                         "use backend='auto' (torch for them) or 'torch'")
    if config.kl_coef and ref_logp is None:
        raise RLOpsError(f"kl_coef={config.kl_coef} needs ref_logp (the reference policy's logp per "
                         "token), got None; pass ref_logp or set kl_coef=0")
    masked = [0.0, 0.0]   # the fused kernel's loss masks nothing
    if not config.torch_only and cupy_ops.use_cupy(backend, logp.device):
        adv = check_inputs(logp, old_logp, advantages, mask, behavior_logp, ref_logp)
        adv = adv.detach().float().contiguous()                       # (B, T)
        weights = row_weights(mask.detach().float().contiguous(), config.agg_mode,
                              loss_norm_constant=config.loss_norm_constant,
                              global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs)
        loss, stats = cupy_ops.policy_loss_fused(logp, old_logp, adv, mask, config, weights, len(ROW_STATS),
                                                 behavior_logp=behavior_logp, ref_logp=ref_logp)
    else:
        loss, stats, adv, pieces = _reference_with_pieces(
            logp, old_logp, advantages, mask, config, behavior_logp=behavior_logp, ref_logp=ref_logp,
            global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs)
        masked = [float(x) for x in stabilisers.stabiliser_metrics(pieces["token_masked"],
                                                                    pieces["seq_masked"], mask)]
    metrics = loss_metrics(loss, stats, adv, mask, entropy)
    metrics.update(masked_token_frac=masked[0], masked_seq_frac=masked[1])
    return loss, metrics


def global_grad_norm(parameters) -> float:
    """The L2 norm over all gradients (the grad-norm metric); parameters without grad are skipped."""
    grads = [p.grad.detach().float().norm() for p in parameters if p.grad is not None]
    return float(torch.stack(grads).norm().item()) if grads else 0.0
