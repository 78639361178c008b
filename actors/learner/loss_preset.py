"""The learner's `loss` preset and `loss_options`: which PolicyLossConfig a LearnerConfig means.

    learner.loss = "gspo"                             # a name of rl_ops.LOSS_PRESETS
    learner.loss_options = {is_high = 3.0}            # PolicyLossConfig fields over the preset's

Precedence, last wins: the learner's classic loss fields (clip_low, clip_high, dual_clip,
behavior_weight_cap, agg_mode, loss_norm_constant, kl_kind), then the preset's loss fields, then
any classic field set to other than its default, then `loss_options`. The preset's learner
fields (objective "decoupled" for the mismatch corrections; kl_coef and reference_model for
"kl") are set only where the config leaves them at their defaults. `loss = "ppo"` (the
default) is the classic fields alone, as before presets existed.

`loss = "opd"` is the learner's own name, not an rl_ops preset: on-policy distillation, the
reverse KL to a teacher alone (actors/learner/distill.py). Its policy-gradient term is off
(the step passes zero advantages); the classic fields still give the PolicyLossConfig of the
metrics and of a reference KL term.
"""
from __future__ import annotations

import dataclasses

from postrain.ext import rl_ops

from .batch import LearnerError

LEARNER_ONLY_LOSS = "opd"   # on-policy distillation (module docstring)
CLASSIC_LOSS_FIELDS = ("clip_low", "clip_high", "dual_clip", "behavior_weight_cap", "agg_mode",
                       "loss_norm_constant", "kl_kind")


def _defaults(config) -> dict:
    return {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}


def apply_loss_preset(config) -> None:
    """Check `loss` and `loss_options`, and set the preset's learner fields left at their defaults."""
    try:
        preset = rl_ops.loss_preset("ppo" if config.loss == LEARNER_ONLY_LOSS else config.loss)
    except rl_ops.RLOpsError as exc:
        raise LearnerError(f"learner.loss: {exc}, or {LEARNER_ONLY_LOSS!r} (on-policy distillation)") from None
    known = {f.name for f in dataclasses.fields(rl_ops.PolicyLossConfig)} - {"kl_coef"}
    unknown = sorted(set(config.loss_options or {}) - known)
    if unknown:
        raise LearnerError(f"unknown learner.loss_options {unknown}; known: {sorted(known)} (kl_coef is the "
                           "learner's own field)")
    defaults = _defaults(config)
    for name, value in preset.learner.items():
        if getattr(config, name) == defaults[name]:
            setattr(config, name, value)


def preset_loss_config(config, kl_coef: float | None = None) -> rl_ops.PolicyLossConfig:
    """The PolicyLossConfig of a LearnerConfig (precedence in the module docstring)."""
    classic = {name: getattr(config, name) for name in CLASSIC_LOSS_FIELDS}
    if config.objective != "decoupled":
        classic["behavior_weight_cap"] = None
    fields = dict(classic)
    if config.loss not in ("ppo", LEARNER_ONLY_LOSS):
        defaults = _defaults(config)
        fields.update(rl_ops.loss_preset(config.loss).loss)
        fields.update({k: v for k, v in classic.items() if getattr(config, k) != defaults[k]})
    fields.update(config.loss_options or {})
    fields["kl_coef"] = config.kl_coef if kl_coef is None else kl_coef
    loss = rl_ops.PolicyLossConfig(**fields)
    if loss.is_mode != "token-tis" and config.objective != "decoupled":
        raise LearnerError(f"is_mode={loss.is_mode!r} corrects the rollout/learner mismatch and needs "
                           f"objective = \"decoupled\", got {config.objective!r}; set it, or use the "
                           "'mis' / 'geo-mis' / 'icepop' presets, which set it")
    return loss
