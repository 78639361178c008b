"""Each named loss preset (ext/loss_presets.py, ext/stabilisers.py): loss AND gradient against a
float64 reference written from the papers' formulas, one sequence at a time, independently of
the batched code; masking edge cases (everything masked, one token, a ratio exactly at a bound);
the learner's `loss` / `loss_options` fields, and a real train step with each preset."""
from __future__ import annotations

import math

import pytest
import torch

from postrain.ext import rl_ops
from postrain.ext.rl_ops import PolicyLossConfig, RLOpsError, policy_loss
from postrain.ext.stabilisers import gspo_token_ratio

F64 = torch.float64
# 3 sequences of up to 4 tokens; the last row has no trained token
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
LP = torch.tensor([[-1.0, -0.5, -2.0, -9.0], [-0.3, -1.2, -7.0, -7.0], [-1.0, -1.0, -1.0, -1.0]], dtype=F64)
ADV = torch.tensor([1.0, -0.5, 2.0], dtype=F64)


def preset_config(name: str, **over) -> PolicyLossConfig:
    base = PolicyLossConfig(dual_clip=None)  # the learner's classic fields are PolicyLossConfig's defaults
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    fields.update(rl_ops.loss_preset(name).loss)
    fields.update(over)
    return PolicyLossConfig(**fields)


def run(config, lp, old, adv, mask, behavior=None):
    """(loss, grad d loss / d lp, metrics) through rl_ops.policy_loss in float64."""
    lp = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old, adv, mask, config, behavior_logp=behavior, backend="auto")
    loss.backward()
    return loss.detach(), lp.grad, metrics


def rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]


# ------------------------------------------------------------------ GSPO

def gspo_reference(lp, old, adv, mask, lo, hi):
    """GSPO's sequence objective, eq. 5 of arXiv:2507.18071: mean over sequences of
    -min(s A, clip(s) A), s = exp(mean_t (lp - old)); its gradient by autograd of this scalar form."""
    x = lp.clone().requires_grad_(True)
    terms = []
    for b, toks in enumerate(rows(mask)):
        if not toks:
            continue
        s = torch.exp(sum(x[b, t] - old[b, t] for t in toks) / len(toks))
        terms.append(-torch.minimum(s * adv[b], s.clamp(1 - lo, 1 + hi) * adv[b]))
    loss = sum(terms) / len(terms)
    loss.backward()
    return loss.detach(), x.grad


def test_gspo_matches_the_sequence_objective_loss_and_gradient():
    # row 0: mean log ratio 0.05 -> s = 1.051 inside the band 0.9 .. 1.1; row 1 (A < 0): mean -0.2
    # -> s = 0.819 < 0.9: clipped, no gradient
    old = LP - torch.tensor([[0.1, 0.0, 0.05, 3.0], [-0.2, -0.2, 0.0, 0.0], [0.0] * 4], dtype=F64)
    config = preset_config("gspo", clip_low=0.1, clip_high=0.1)
    loss, grad, metrics = run(config, LP, old, ADV, MASK)
    want_loss, want_grad = gspo_reference(LP, old, ADV, MASK, 0.1, 0.1)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)
    s0 = math.exp(0.05)
    assert loss.item() == pytest.approx((-1.0 * s0 + 0.5 * 0.9) / 2)
    assert grad[0, 0].item() == pytest.approx(-1.0 * s0 / 3 / 2)          # -A s / n_b / B'
    assert grad[1].abs().sum().item() == 0.0 and grad[2].abs().sum().item() == 0.0
    assert metrics["clip_frac_low"] == pytest.approx(2 / 5)                   # row 1's two tokens of five


def test_gspo_preset_clips_whole_sequences_at_its_narrow_band():
    old = LP.clone()
    old[0, 0] += 0.01    # mean log ratio -0.0033: s = 0.9967 < 1 - 3e-4, A > 0: kept, on the clipped side
    config = preset_config("gspo")
    assert (config.clip_low, config.clip_high, config.agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    loss, grad, _ = run(config, LP, old, ADV, MASK)
    want_loss, want_grad = gspo_reference(LP, old, ADV, MASK, 3e-4, 4e-4)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)


# ------------------------------------------------------------------ CISPO

def test_cispo_keeps_every_tokens_gradient_with_a_clipped_stop_gradient_weight():
    # ratios: row 0 = e^0.5 (1.65), e^-2 (0.135), e^2 (7.39 > 5: clipped); row 1 = 1, 1
    old = LP - torch.tensor([[0.5, -2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0] * 4], dtype=F64)
    config = preset_config("cispo")
    loss, grad, metrics = run(config, LP, old, ADV, MASK)
    # hand: token-mean over 5 tokens of -A * clip(r, 0, 5); gradient -A * clip(r) / 5 on every token
    weights = {(0, 0): math.exp(0.5), (0, 1): math.exp(-2.0), (0, 2): 5.0, (1, 0): 1.0, (1, 1): 1.0}
    want_grad = torch.zeros_like(LP)
    total = 0.0
    for (b, t), w in weights.items():
        total += -ADV[b].item() * w
        want_grad[b, t] = -ADV[b].item() * w / 5
    assert loss.item() == pytest.approx(total / 5)
    torch.testing.assert_close(grad, want_grad)
    assert grad[0, 2].item() != 0.0                       # PPO's clip would have zeroed this one
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5)


# ------------------------------------------------------------------ mismatch corrections

# the learner's own logprobs (old = lp, ratio 1) against the rollout engine's: d = old - behaviour
D = torch.tensor([[0.2, 1.0, -0.1, 5.0], [-1.0, 0.3, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]], dtype=F64)


def mismatch_reference(weights):
    """loss = token-mean of w * (-A) (the PPO ratio is 1 at value), gradient -A w / N per token."""
    n = int(MASK.sum())
    grad = torch.zeros_like(LP)
    for b, toks in enumerate(rows(MASK)):
        for t in toks:
            grad[b, t] = -ADV[b] * weights[b][t] / n
    return grad.sum(), grad


@pytest.mark.parametrize("name", ["tis", "mis", "geo-mis", "icepop"])
def test_mismatch_presets_weigh_and_mask_by_the_rollout_learner_ratio(name):
    config = preset_config(name)
    behavior = LP - D
    r = D.exp()
    if name == "tis":    # min(r, 2) per token
        weights = r.clamp(max=2.0)
    elif name == "mis":  # rho_b = exp(sum d): row 0 exp(1.1) = 3.0 > 2 masked; row 1 exp(-0.7) = 0.50 kept
        weights = torch.tensor([[0.0] * 4, [math.exp(-0.7)] * 4, [0.0] * 4], dtype=F64)
    elif name == "geo-mis":  # geometric means exp(1.1/3) = 1.44 and exp(-0.35) = 0.70: both outside
        weights = torch.zeros_like(LP)
    else:                # icepop: r in [0.5, 5] kept: e^0.2, e^1, e^-0.1 kept; e^-1 = 0.37 masked; e^0.3 kept
        weights = torch.where((r >= 0.5) & (r <= 5.0), r, torch.zeros_like(r))
    loss, grad, metrics = run(config, LP, LP.clone(), ADV, MASK, behavior=behavior)
    want_loss, want_grad = mismatch_reference(weights)
    assert loss.item() == pytest.approx(float(want_loss))
    torch.testing.assert_close(grad, want_grad)
    masked = {"tis": (0.0, 0.0), "mis": (3 / 5, 1 / 2), "geo-mis": (1.0, 1.0), "icepop": (1 / 5, 0.0)}[name]
    assert (metrics["masked_token_frac"], metrics["masked_seq_frac"]) == pytest.approx(masked)


# ------------------------------------------------------------------ edge cases

ALL_PRESET_CONFIGS = ["ppo", "dapo", "gspo", "cispo", "tis", "mis", "geo-mis", "icepop"]


@pytest.mark.parametrize("name", ALL_PRESET_CONFIGS)
def test_everything_masked_gives_zero_loss_and_gradient_not_nan(name):
    mask = torch.zeros_like(MASK)
    loss, grad, metrics = run(preset_config(name), LP, LP - 0.3, ADV, mask, behavior=LP - 0.7)
    assert loss.item() == 0.0 and grad.abs().sum().item() == 0.0
    assert not torch.isnan(grad).any() and metrics["masked_token_frac"] == metrics["masked_seq_frac"] == 0.0


@pytest.mark.parametrize("name", ALL_PRESET_CONFIGS)
def test_one_token_is_the_token_formula(name):
    mask = torch.zeros_like(MASK)
    mask[0, 1] = True
    d = 0.05                                  # small everywhere: inside every band but gspo's / geo-mis's
    config = preset_config(name, **({"clip_low": 0.2, "clip_high": 0.2} if name == "gspo" else {}),
                           **({"is_low": 0.9, "is_high": 1.1} if name == "geo-mis" else {}))
    loss, grad, _ = run(config, LP, LP - d, ADV, mask, behavior=LP - d)
    want = -1.0 * math.exp(d)   # -A r, A = 1, r = e^d inside every band; mismatch weight exp(old - beh) = 1
    assert loss.item() == pytest.approx(want)
    assert grad[0, 1].item() == pytest.approx(want) and grad.abs().sum().item() == pytest.approx(abs(want))


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_a_ratio_exactly_at_the_clip_bound_keeps_its_gradient(name):
    # ratio exactly 1 with clip_low = clip_high = 0 (cispo: its weight 1 bound on both sides)
    config = preset_config(name, clip_low=0.0, clip_high=0.0)
    loss, grad, metrics = run(config, LP, LP.clone(), ADV, MASK)
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0
    scale = 1 / 5 if config.agg_mode == "token-mean" else None
    for b, toks in enumerate(rows(MASK)):
        for t in toks:
            want = -ADV[b].item() * (scale if scale is not None else 1 / len(toks) / 2)
            assert grad[b, t].item() == pytest.approx(want)


@pytest.mark.parametrize("mode", ["seq-mis", "geo-mis", "icepop"])
def test_a_mismatch_ratio_exactly_at_a_bound_is_kept(mode):
    config = PolicyLossConfig(is_mode=mode, is_low=1.0, is_high=1.0)
    loss, grad, metrics = run(config, LP, LP.clone(), ADV, MASK, behavior=LP.clone())
    assert metrics["masked_token_frac"] == 0.0 and metrics["masked_seq_frac"] == 0.0
    assert grad[0, 0].item() == pytest.approx(-1.0 / 5)


# ------------------------------------------------------------------ names, rules, backends

def test_unknown_preset_and_bad_fields_are_refused_naming_the_fix():
    with pytest.raises(RLOpsError, match=r"unknown loss preset 'gpso'; known: \['cispo', 'dapo'"):
        rl_ops.loss_preset("gpso")
    with pytest.raises(RLOpsError, match="loss_type must be one of"):
        PolicyLossConfig(loss_type="grpo")
    with pytest.raises(RLOpsError, match="is_mode='icepop' needs 0 <= is_low <= is_high"):
        PolicyLossConfig(is_mode="icepop")
    with pytest.raises(RLOpsError, match="set dual_clip = None with loss_type 'cispo'"):
        PolicyLossConfig(loss_type="cispo", dual_clip=3.0)
    with pytest.raises(RLOpsError, match="have no CuPy kernel"):
        policy_loss(LP, LP, ADV, MASK, preset_config("gspo"), backend="cupy")
    with pytest.raises(RLOpsError, match="needs the loss mask"):
        gspo_token_ratio(LP, LP, None)


def test_every_preset_has_a_reference_and_builds_a_valid_config():
    for name, preset in rl_ops.LOSS_PRESETS.items():
        assert preset.reference and preset.summary
        preset_config(name)
