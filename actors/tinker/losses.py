"""The Tinker API's losses on per-token logprobs: each a sum over tokens, as the hosted service's.

    check_loss_inputs("ppo", config, datum_inputs, num_tokens, where)   # TinkerAPIError 400 before queueing
    loss, elementwise = token_loss("cross_entropy", logp, inputs, config)   # scalar sum, (L,) per token

Design note. Tinker's losses are sums over every token of every datum of the call, not means:
a caller who wants a token mean puts 1 / num_tokens in `weights` (cross_entropy) or scales its
advantages. Chunks of one `forward_backward` therefore add up exactly, and gradients of calls
before one `optim_step` accumulate. With r = exp(logp - sampling_logprobs) and A the advantages:

| loss | per-token term (the loss is its sum) | loss_fn_config |
|---|---|---|
| cross_entropy | -logp * weights | |
| importance_sampling | -r * A | |
| ppo | -min(r * A, clip(r, low, high) * A) | clip_low_threshold (0.8), clip_high_threshold (1.2) |
| cispo | -stop_grad(clip(r, low, high)) * logp * A | clip_low_threshold (0.8), clip_high_threshold (1.2) |
| dro | -(logp * A - beta / 2 * (logp - sampling_logprobs)^2) | beta (required) |
| gspo | -min(s_t * A, clip(s_t, low, high) * A) | clip_low_threshold (0.9997), clip_high_threshold (1.0004) |
| stable_reinforce | on sampled tokens: -m * rho * A + kl_coeff * (1 / rho - 1 + log rho) | kl_coeff (0), mask_low_threshold (0.5), mask_high_threshold (2) |

GSPO (Zheng et al. 2025, arXiv:2507.18071) in its GSPO-token form, as the learner's `gspo`
preset (ext/stabilisers.py): the datum is one sequence, M its tokens where `sequence_ratio_mask`
(an optional input) is nonzero, or where the advantage is nonzero when it is not sent (a
prompt's positions carry A = 0 and sampling logprobs 0, and would swamp the mean), and

    s   = exp(clamp(mean over t in M of (sg(logp_t) - sampling_logprobs_t), -20, 20))   (M empty: s = 1)
    s_t = s * exp(logp_t - sg(logp_t))          value s on every token, d s_t / d logp_t = s

so a sequence is clipped or kept whole. The default thresholds are the preset's 1 - 3e-4 and
1 + 4e-4 (the paper's clip ranges), as ratios like ppo's.

stable_reinforce is REINFORCE with the importance ratio taken against the sampler's own
logprobs, which the server recorded when it sampled (stability.py), never the client's: with
rho = exp(clamp(logp - recorded, -20, 20)) on each target that provenance names a sampled
token, a token whose ratio (without gradient) lies outside [mask_low, mask_high] is left out
(m = 0), so a token the learner and the sampler disagree on, by staleness or by numerics,
moves nothing; the optional kl_coeff term is the k3 estimate of KL(pi || sampler) per token,
which pulls the policy back toward what sampled it. Targets that are not sampled tokens (the
prompt) contribute 0. The hosted service does not publish its formula: this is postrain's, and
docs/tinker.md says so.

Each is checked against a float64 reference (tests/actors/tinker/test_losses.py). A loss not in
the table is refused by name.
"""
from __future__ import annotations

import numpy as np
import torch

from postrain.ext.loss_presets import loss_preset
from postrain.ext.stabilisers import LOG_RATIO_CLAMP

from .errors import TinkerAPIError
from .stability import SAMPLED, SAMPLER_LOGPROBS

_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),            # weights optional: 1 where absent
    "importance_sampling": _POLICY_INPUTS,
    "ppo": _POLICY_INPUTS,
    "cispo": _POLICY_INPUTS,
    "dro": _POLICY_INPUTS,
    "gspo": _POLICY_INPUTS,                         # sequence_ratio_mask optional: where A != 0 when absent
    "stable_reinforce": ("target_tokens", "advantages"),   # logprobs accepted, unused: the recorded ones count
}
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {"gspo": ("sequence_ratio_mask",)}
_GSPO_PRESET = loss_preset("gspo").loss                    # the learner's: clip_low 3e-4, clip_high 4e-4
GSPO_CLIP_LOW, GSPO_CLIP_HIGH = 1.0 - _GSPO_PRESET["clip_low"], 1.0 + _GSPO_PRESET["clip_high"]   # 0.9997, 1.0004
CONFIG_KEYS: dict[str, dict[str, float | None]] = {
    "cross_entropy": {}, "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
    "gspo": {"clip_low_threshold": GSPO_CLIP_LOW, "clip_high_threshold": GSPO_CLIP_HIGH},
    "stable_reinforce": {"kl_coeff": 0.0, "mask_low_threshold": 0.5, "mask_high_threshold": 2.0},
}


def loss_config(loss_fn: str, config: dict[str, float | str]) -> dict[str, float]:
    """The loss's config with defaults; TinkerAPIError 400 for an unknown loss, key or value."""
    if loss_fn not in INPUTS:
        raise TinkerAPIError(400, f"loss_fn {loss_fn!r} is not supported by this server; supported: "
                                  f"{sorted(INPUTS)} (forward_backward_custom runs any loss through cross_entropy)")
    known = CONFIG_KEYS[loss_fn]
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise TinkerAPIError(400, f"loss_fn_config {unknown} is not a setting of {loss_fn!r}; its settings: "
                                  f"{sorted(known)}")
    out = {}
    for key, default in known.items():
        value = config.get(key, default)
        if not isinstance(value, float) and not isinstance(value, int):
            raise TinkerAPIError(400, f"loss_fn_config[{key!r}] of {loss_fn!r} must be a number, got {value!r}")
        out[key] = float(value)
    if loss_fn == "stable_reinforce" and not (0.0 <= out["mask_low_threshold"] <= 1.0 <= out["mask_high_threshold"]
                                              and out["kl_coeff"] >= 0.0):
        raise TinkerAPIError(400, f"loss_fn_config of 'stable_reinforce' needs 0 <= mask_low_threshold <= 1 <= "
                                  f"mask_high_threshold and kl_coeff >= 0, got {out}")
    return out


def check_loss_inputs(loss_fn: str, inputs: dict[str, np.ndarray], num_tokens: int, where: str) -> None:
    """Every input the loss needs is present, 1-D and as long as the datum's tokens."""
    needed = INPUTS[loss_fn]
    allowed = set(needed) | {"weights", "target_tokens", "logprobs", "advantages", *OPTIONAL_INPUTS.get(loss_fn, ())}
    for name in needed:
        if name not in inputs:
            raise TinkerAPIError(400, f"{where}: loss {loss_fn!r} needs loss_fn_inputs {list(needed)}, "
                                      f"{name!r} is missing")
    for name, value in inputs.items():
        if name not in allowed:
            raise TinkerAPIError(400, f"{where}: loss_fn_inputs[{name!r}] is not an input of {loss_fn!r}; "
                                      f"its inputs: {sorted(allowed)}")
        if value.shape != (num_tokens,):
            raise TinkerAPIError(400, f"{where}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}, the "
                                      f"model_input has {num_tokens} tokens; send one value per token")


def token_loss(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor],
               config: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss: a scalar sum, the per-token terms (L,)) of one datum; logp (L,) carries the gradient."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        term = -logp * (weights if weights is not None else torch.ones_like(logp))
        return term.sum(), term
    if loss_fn == "stable_reinforce":
        term = stable_reinforce_terms(logp, inputs[SAMPLER_LOGPROBS], inputs[SAMPLED], inputs["advantages"], config)
        return term.sum(), term
    old, advantages = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(logp - old)                                                       # (L,)
    if loss_fn == "importance_sampling":
        term = -ratio * advantages
    elif loss_fn == "ppo":
        clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
        term = -torch.minimum(ratio * advantages, clipped * advantages)
    elif loss_fn == "gspo":
        term = gspo_token_terms(logp, old, advantages, inputs.get("sequence_ratio_mask"), config)
    elif loss_fn == "cispo":
        clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
        term = -clipped * logp * advantages
    else:   # dro
        term = -(logp * advantages - 0.5 * config["beta"] * (logp - old) ** 2)
    return term.sum(), term


def gspo_token_terms(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                     sequence_ratio_mask: torch.Tensor | None, config: dict[str, float]) -> torch.Tensor:
    """GSPO-token's per-token terms (L,) of one sequence (module docstring): every token carries
    the sequence's ratio s, with its own logp's gradient."""
    in_ratio = (sequence_ratio_mask if sequence_ratio_mask is not None else advantages) != 0     # (L,) bool
    num_in_ratio = in_ratio.sum().clamp_min(1)
    log_ratio = ((logp.detach() - old) * in_ratio).sum() / num_in_ratio                        # scalar
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + logp - logp.detach())  # (L,)
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


def stable_reinforce_terms(logp: torch.Tensor, recorded: torch.Tensor, sampled: torch.Tensor,
                           advantages: torch.Tensor, config: dict[str, float]) -> torch.Tensor:
    """stable_reinforce's per-token terms (L,) (module docstring): `recorded` the sampler's
    logprobs, `sampled` 1 where the target is a sampled token, else 0 (and the term 0)."""
    log_ratio = ((logp - recorded) * sampled).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)      # (L,)
    ratio = torch.exp(log_ratio)
    kept = sampled * ((ratio.detach() >= config["mask_low_threshold"])
                      & (ratio.detach() <= config["mask_high_threshold"])).to(logp.dtype)
    k3 = torch.exp(-log_ratio) - 1.0 + log_ratio                       # >= 0, 0 where the two agree
    return -kept * ratio * advantages + config["kl_coeff"] * sampled * k3
