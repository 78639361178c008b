"""Named loss presets: the field's stabilisers as one word (`learner.loss = "gspo"`).

A preset is two sets of fields: `loss`, fields of `PolicyLossConfig` (the formulas are in
`rl_ops_loss` and `stabilisers`), and `learner`, fields of the learner's config that the loss
needs to run (the "decoupled" objective, which hands the rollout engine's logprobs to the loss
as behaviour logprobs; a frozen reference policy and a KL weight). The learner applies a
preset's learner fields where its config leaves them at their defaults, and its loss fields
under any loss field set explicitly (actors/learner/loss_preset.py). Presets other than "ppo",
"dapo" and "kl" have no fused CuPy kernel: backend="auto" runs them in torch.

    preset = loss_preset("gspo")                       # RLOpsError naming the known ones if unknown
    config = PolicyLossConfig(**preset.loss)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .rl_ops_errors import RLOpsError


@dataclass(frozen=True)
class LossPreset:
    """One named combination of loss fields; `reference` cites where it comes from."""

    name: str
    summary: str
    reference: str
    loss: Mapping[str, Any] = field(default_factory=dict)       # PolicyLossConfig fields
    learner: Mapping[str, Any] = field(default_factory=dict)    # learner config fields it needs


def _preset(name: str, summary: str, reference: str, loss: dict | None = None,
            learner: dict | None = None) -> LossPreset:
    return LossPreset(name, summary, reference, MappingProxyType(loss or {}), MappingProxyType(learner or {}))


_DECOUPLED = {"objective": "decoupled"}

LOSS_PRESETS: Mapping[str, LossPreset] = MappingProxyType({p.name: p for p in (
    _preset("ppo", "PPO clip on the token ratio with the learner's own clip fields (default: DAPO's "
            "clip-higher 0.2 / 0.28, dual clip 3, token-mean)", "Schulman et al. 2017; Ye et al. 2020 (dual clip)"),
    _preset("dapo", "DAPO's loss: clip-higher 0.2 / 0.28, token-level mean, no dual clip; pair it with the "
            "orchestrator's dynamic sampling and overlong shaping", "Yu et al. 2025, arXiv:2503.14476",
            {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": None, "agg_mode": "token-mean"}),
    _preset("gspo", "GSPO: the sequence's length-normalised ratio, clipped per sequence at 1 -/+ 3e-4 / 4e-4",
            "Zheng et al. 2025, arXiv:2507.18071",
            {"loss_type": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "dual_clip": None,
             "agg_mode": "seq-mean-token-mean"}),
    _preset("cispo", "CISPO: the importance weight clipped above at 1 + 4 (not below) and without gradient; "
            "every token keeps its gradient", "MiniMax 2025 (MiniMax-M1), arXiv:2506.13585",
            {"loss_type": "cispo", "clip_low": 1.0, "clip_high": 4.0, "dual_clip": None,
             "agg_mode": "token-mean"}),
    _preset("tis", "PPO on the learner's own logprobs, each token weighted by the rollout/learner ratio "
            "truncated at 2 (truncated importance sampling)", "Yao et al. 2025, 'Your efficient RL "
            "framework secretly brings you off-policy RL training'",
            {"is_mode": "token-tis", "behavior_weight_cap": 2.0}, _DECOUPLED),
    _preset("mis", "PPO on the learner's own logprobs, each sequence weighted by its rollout/learner ratio, "
            "masked where that ratio exceeds 2 (masked importance sampling)", "Liu et al. 2025, 'When speed "
            "kills stability: demystifying RL collapse from the training-inference mismatch'",
            {"is_mode": "seq-mis", "is_low": 0.0, "is_high": 2.0}, _DECOUPLED),
    _preset("geo-mis", "as mis, with the geometric mean of the token ratios and a two-sided band 0.998 .. "
            "1.002: a sequence outside it is masked whatever its length", "Liu et al. 2025 (geometric "
            "rejection); verl's rollout_is 'geometric' level",
            {"is_mode": "geo-mis", "is_low": 0.998, "is_high": 1.002}, _DECOUPLED),
    _preset("icepop", "PPO on the learner's own logprobs, each token weighted by its rollout/learner ratio, "
            "masked outside 0.5 .. 5", "Ling team 2025 (Ring-1T), arXiv:2510.18855",
            {"is_mode": "icepop", "is_low": 0.5, "is_high": 5.0}, _DECOUPLED),
    _preset("kl", "the default PPO loss plus k3 KL to a frozen reference (a copy of the initial weights "
            "unless reference_model names one) at kl_coef 1e-3", "Schulman 2020 (k3); Ouyang et al. 2022",
            {"kl_kind": "k3"}, {"kl_coef": 1e-3, "reference_model": "initial"}),
)})


def loss_preset(name: str) -> LossPreset:
    """The preset called `name`; RLOpsError naming the known ones if there is none."""
    try:
        return LOSS_PRESETS[name]
    except (KeyError, TypeError):
        raise RLOpsError(f"unknown loss preset {name!r}; known: {sorted(LOSS_PRESETS)}") from None
