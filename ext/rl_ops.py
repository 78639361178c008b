"""postrain's RL math in one import: rewards -> advantages -> policy loss, KL, logprobs.

Usable on its own (it imports nothing of postrain outside ext/):

    from postrain.ext import rl_ops
    res = rl_ops.compute_advantages({"correct": correct, "format": fmt}, {"format": 0.1}, group_size=8)
    logp = rl_ops.token_logprobs_from_hidden(hidden, lm_head.weight, targets)      # (B, T)
    loss, metrics = rl_ops.policy_loss(logp, old_logp, res.advantages, mask,
                                       rl_ops.PolicyLossConfig(agg_mode="token-mean"))
    loss.backward()

The formulas are in the docstrings of the modules this one gathers:
`advantages` (shaping, GRPO / Dr. GRPO / RLOO, DAPO dynamic sampling), `kl` (k1/k2/k3,
KL in the reward, controllers), `rl_ops_loss` (PPO clip-higher, dual clip, decoupled
objective, aggregation modes, metrics) and `logprobs` (chunked log-softmax + gather +
entropy); `stabilisers` (GSPO, CISPO, TIS / MIS / geometric MIS / IcePop) and their named
presets in `loss_presets`; `distill` (on-policy distillation: the reverse KL to a teacher over
its top k plus a tail bucket, with its bound, or over the full vocabulary; torch only). Functions that have a fused CuPy kernel (`compute_advantages`, `policy_loss`,
`token_logprobs`, `token_logprobs_from_hidden`) take backend="auto" | "torch" | "cupy".
"""
from __future__ import annotations

from .advantages import (ADVANTAGE_MODES, GRPO_EPS, AdvantageResult, GroupFilter, OverlongPenalty,
                         compute_advantages, compute_advantages_reference, filter_groups,
                         group_advantages, overlong_penalty, shape_rewards)
from .cupy_ops import cupy_available
from .distill import (DIVERGENCES, TAIL_LOGMASS_FLOOR, distill_head_from_hidden, distill_head_naive, distill_kl,
                      full_kl_per_token, tail_logmass_from_topk, topk_kl_per_token)
from .kl import (KL_KINDS, AdaptiveKLController, FixedKLController, fold_kl_into_rewards,
                 kl_estimate)
from .loss_presets import LOSS_PRESETS, LossPreset, loss_preset
from .logprobs import naive_token_logprobs, token_logprobs, token_logprobs_from_hidden
from .rl_ops_loss import (AGG_MODES, PolicyLossConfig, aggregate_loss, global_grad_norm, policy_loss,
                          policy_loss_reference, row_weights)
from .rl_ops_errors import RLOpsError
from .stabilisers import IS_MODES, LOSS_TYPES

__all__ = [
    "ADVANTAGE_MODES", "AGG_MODES", "GRPO_EPS", "IS_MODES", "KL_KINDS", "LOSS_PRESETS", "LOSS_TYPES",
    "DIVERGENCES", "TAIL_LOGMASS_FLOOR", "distill_head_from_hidden", "distill_head_naive", "distill_kl", "full_kl_per_token",
    "tail_logmass_from_topk", "topk_kl_per_token",
    "LossPreset", "loss_preset", "AdaptiveKLController", "AdvantageResult",
    "FixedKLController", "GroupFilter", "OverlongPenalty", "PolicyLossConfig", "RLOpsError",
    "aggregate_loss", "compute_advantages", "compute_advantages_reference", "cupy_available",
    "filter_groups", "fold_kl_into_rewards", "global_grad_norm", "group_advantages", "kl_estimate",
    "naive_token_logprobs", "overlong_penalty", "policy_loss", "policy_loss_reference", "row_weights",
    "shape_rewards", "token_logprobs", "token_logprobs_from_hidden",
]
