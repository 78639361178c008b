"""KL to a reference policy: the k1/k2/k3 estimators, KL folded into rewards, KL controllers.

Per token, with x = logp_ref - logp (log of the ratio ref / policy, sampled from the policy):

    k1 = -x                   unbiased, high variance, can be negative
    k2 = x^2 / 2              biased, low variance, >= 0
    k3 = exp(x) - x - 1       unbiased, low variance, >= 0 (Schulman's estimator)

k3 evaluates exp on x clamped to [-20, 20] so a far-off token cannot overflow
(the gradient is zero beyond the clamp, as torch.clamp gives).

KL as a loss term: loss_t += kl_coef * k(x_t) (see `policy_loss`).
KL in the reward (outcome rewards): r' = r - kl_coef * sum_t mask_t * k(x_t).

Adaptive controller (Ziegler et al. 2019): after each step with measured KL,

    e = clip(KL / target - 1, -0.2, 0.2);   coef <- coef * (1 + e * n_steps / horizon)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .rl_ops_errors import RLOpsError

KL_KINDS = ("k1", "k2", "k3")
K3_LOG_RATIO_CLAMP = 20.0


def check_kl_kind(kind: str) -> None:
    if kind not in KL_KINDS:
        raise RLOpsError(f"kl estimator must be one of {KL_KINDS}, got {kind!r}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate k1, k2 or k3 (formulas in the module docstring); same shape as logp."""
    check_kl_kind(kind)
    x = ref_logp - logp
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x * x
    xc = x.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.exp(xc) - xc - 1.0


def fold_kl_into_rewards(rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float, kind: str = "k1") -> torch.Tensor:
    """r' = r - kl_coef * sum_t mask_t * k(x_t): rewards (B,), logp/ref_logp/mask (B, T) -> (B,).

    The KL is a fixed penalty in the reward, so it carries no gradient (computed under no_grad).
    """
    if rewards.shape != logp.shape[:1] or logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise RLOpsError("fold_kl_into_rewards needs rewards (B,) and logp, ref_logp, mask (B, T); got "
                         f"{tuple(rewards.shape)}, {tuple(logp.shape)}, {tuple(ref_logp.shape)}, "
                         f"{tuple(mask.shape)}")
    with torch.no_grad():
        kl = (kl_estimate(logp, ref_logp, kind) * mask.to(logp.dtype)).sum(-1)  # (B,)
    return rewards - kl_coef * kl.to(rewards.dtype)


@dataclass
class FixedKLController:
    """A constant KL coefficient, with the same interface as `AdaptiveKLController`."""

    coef: float

    def update(self, current_kl: float, num_steps: int) -> float:
        return self.coef


@dataclass
class AdaptiveKLController:
    """coef <- coef * (1 + clip(KL / target - 1, -0.2, 0.2) * num_steps / horizon).

    coef: the current coefficient (the initial one at construction); target: the KL per
    sequence or token that the run aims for (the same unit as `current_kl`); horizon: steps
    over which a full 20% correction is applied (10000 in Ziegler et al.).
    """

    coef: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0 or self.coef < 0:
            raise RLOpsError("AdaptiveKLController needs coef >= 0, target > 0 and horizon > 0, got "
                             f"coef={self.coef}, target={self.target}, horizon={self.horizon}")

    def update(self, current_kl: float, num_steps: int) -> float:
        """Apply one update after `num_steps` steps that measured `current_kl`; returns the new coef."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * num_steps / self.horizon
        return self.coef
