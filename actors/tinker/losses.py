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

Each is checked against a float64 reference (tests/actors/tinker/test_losses.py). A loss not in
the table is refused by name.
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import TinkerAPIError

_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),            # weights optional: 1 where absent
    "importance_sampling": _POLICY_INPUTS,
    "ppo": _POLICY_INPUTS,
    "cispo": _POLICY_INPUTS,
    "dro": _POLICY_INPUTS,
}
CONFIG_KEYS: dict[str, dict[str, float | None]] = {
    "cross_entropy": {}, "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
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
    return out


def check_loss_inputs(loss_fn: str, inputs: dict[str, np.ndarray], num_tokens: int, where: str) -> None:
    """Every input the loss needs is present, 1-D and as long as the datum's tokens."""
    needed = INPUTS[loss_fn]
    allowed = set(needed) | {"weights", "target_tokens", "logprobs", "advantages"}
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
    old, advantages = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(logp - old)                                                       # (L,)
    if loss_fn == "importance_sampling":
        term = -ratio * advantages
    elif loss_fn == "ppo":
        clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
        term = -torch.minimum(ratio * advantages, clipped * advantages)
    elif loss_fn == "cispo":
        clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
        term = -clipped * logp * advantages
    else:   # dro
        term = -(logp * advantages - 0.5 * config["beta"] * (logp - old) ** 2)
    return term.sum(), term
