"""RL math against values worked out by hand from the formulas in the docstrings."""
from __future__ import annotations

import math

import pytest
import torch

from postrain.ext import rl_ops
from postrain.ext.rl_ops import (AdaptiveKLController, OverlongPenalty, PolicyLossConfig, RLOpsError,
                                 aggregate_loss, compute_advantages, filter_groups, fold_kl_into_rewards,
                                 group_advantages, kl_estimate, policy_loss, shape_rewards)


def close(actual, expected, tol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.detach().float(), expected, rtol=tol, atol=tol)


# ------------------------------------------------------------------ advantages

def test_grpo_uses_unbiased_std_and_eps():
    # group [1, 2, 6]: mean 3, deviations (-2, -1, 3), sum of squares 14, unbiased std sqrt(14 / 2)
    # group [1, 0]: mean 0.5, std sqrt(0.5)
    rewards = torch.tensor([1.0, 2.0, 6.0, 1.0, 0.0, 0.0])
    adv = group_advantages(rewards[:3], 3, "grpo")
    close(adv, [d / (math.sqrt(7.0) + 1e-6) for d in (-2, -1, 3)])
    adv2 = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, "grpo")
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv2, [a, -a, -a, a])


def test_dr_grpo_and_rloo():
    rewards = torch.tensor([1.0, 2.0, 6.0])
    close(group_advantages(rewards, 3, "dr_grpo"), [-2.0, -1.0, 3.0])
    # RLOO: r_i - mean of the others: 1 - 4, 2 - 3.5, 6 - 1.5
    close(group_advantages(rewards, 3, "rloo"), [-3.0, -1.5, 4.5])


def test_zero_variance_group_gives_zero_advantage():
    close(group_advantages(torch.tensor([2.0, 2.0, 2.0]), 3, "grpo"), [0.0, 0.0, 0.0])


def test_shaping_weights_named_components_missing_weight_is_one():
    comps = {"correct": torch.tensor([1.0, 0.0]), "format": torch.tensor([1.0, 1.0])}
    close(shape_rewards(comps, {"format": 0.5}), [1.5, 0.5])
    close(shape_rewards(comps, {"correct": 2.0, "format": -1.0}), [1.0, -1.0])


def test_overlong_penalty_dapo():
    # L_max = 100, L_cache = 20: soft zone (80, 100], ramp (80 - L) / 20, beyond 100: -1
    pen = OverlongPenalty(max_response_len_tokens=100, buffer_len_tokens=20, penalty_factor=1.0)
    lengths = torch.tensor([50, 80, 90, 100, 101])
    close(rl_ops.overlong_penalty(lengths, pen), [0.0, 0.0, -0.5, -1.0, -1.0])
    comps = {"correct": torch.tensor([1.0, 1.0])}
    close(shape_rewards(comps, None, response_lengths=torch.tensor([10, 95]), overlong=pen), [1.0, 0.25])


def test_filter_groups_drops_and_counts_zero_variance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25])
    groups = filter_groups(rewards, 2)
    assert groups.keep_groups.tolist() == [False, True, False, True]
    assert groups.keep_samples.tolist() == [False, False, True, True, False, False, True, True]
    assert (groups.num_groups, groups.num_dropped_groups, groups.num_kept_groups) == (4, 2, 2)


def test_compute_advantages_shapes_then_normalises():
    comps = {"correct": torch.tensor([1.0, 0.0, 1.0, 1.0]), "format": torch.tensor([0.0, 1.0, 1.0, 1.0])}
    res = compute_advantages(comps, {"format": 0.5}, group_size=2, mode="dr_grpo", backend="torch")
    close(res.rewards, [1.0, 0.5, 1.5, 1.5])
    close(res.advantages, [0.25, -0.25, 0.0, 0.0])
    assert res.keep_samples.tolist() == [True, True, False, False]
    assert res.num_zero_variance_groups == 1


def test_advantage_errors_name_the_rule():
    with pytest.raises(RLOpsError, match="group_size must be >= 2"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(RLOpsError, match="divisible by group_size=3"):
        group_advantages(torch.ones(4), 3)
    with pytest.raises(RLOpsError, match="advantage mode must be one of"):
        group_advantages(torch.ones(4), 2, "ppo")
    with pytest.raises(RLOpsError, match=r"not given: \['lenght'\]"):
        shape_rewards({"length": torch.ones(2)}, {"lenght": 1.0})
    with pytest.raises(RLOpsError, match="needs response_lengths"):
        shape_rewards({"c": torch.ones(2)}, overlong=OverlongPenalty(10, 2))
    with pytest.raises(RLOpsError, match="buffer_len_tokens <= max_response_len_tokens"):
        OverlongPenalty(10, 20)
    with pytest.raises(RLOpsError, match="backend must be one of"):
        compute_advantages({"c": torch.ones(2)}, None, 2, backend="gpu")


# ------------------------------------------------------------------ KL

def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    x = math.log(0.5)  # ref - logp
    close(kl_estimate(logp, ref, "k1"), [-x])
    close(kl_estimate(logp, ref, "k2"), [x * x / 2])
    close(kl_estimate(logp, ref, "k3"), [math.exp(x) - x - 1])  # 0.5 + 0.693 - 1


def test_kl_gradients_by_hand():
    x = -0.7
    for kind, expected in (("k1", 1.0), ("k2", -x), ("k3", 1.0 - math.exp(x))):
        logp = torch.tensor([0.3], requires_grad=True)
        kl_estimate(logp, torch.tensor([0.3 + x]), kind).sum().backward()
        close(logp.grad, [expected])


def test_fold_kl_into_rewards_sums_masked_tokens():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25), 0.0]])
    out = fold_kl_into_rewards(torch.tensor([1.0]), logp, ref, torch.tensor([[1.0, 0.0]]), 0.1, "k1")
    close(out, [1.0 - 0.1 * math.log(2.0)])


def test_adaptive_kl_controller_clips_the_error():
    ctl = AdaptiveKLController(coef=0.1, target=6.0, horizon=10000)
    assert ctl.update(current_kl=12.0, num_steps=100) == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    ctl = AdaptiveKLController(coef=0.1, target=6.0, horizon=10000)
    assert ctl.update(current_kl=6.6, num_steps=100) == pytest.approx(0.1 * (1 + 0.1 * 100 / 10000))
    assert ctl.update(current_kl=0.0, num_steps=50) == pytest.approx(
        0.1 * (1 + 0.1 * 0.01) * (1 - 0.2 * 50 / 10000))
    assert rl_ops.FixedKLController(0.05).update(100.0, 10) == 0.05
    with pytest.raises(RLOpsError, match="target > 0"):
        AdaptiveKLController(coef=0.1, target=0.0, horizon=10)
    with pytest.raises(RLOpsError, match="kl estimator must be one of"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


# ------------------------------------------------------------------ policy loss

# Six tokens (old_logp = 0, so ratio r = exp(logp)), clip 0.2 / 0.28, dual clip 3:
#   A   r     pg1=-A r  pg2=-A clip(r)  pg      d pg / d logp          clipped by
#   1   1.5   -1.5      -1.28           -1.28   0                      high
#   1   0.5   -0.5      -0.8            -0.5    -A r = -0.5
#  -1   0.5    0.5       0.8             0.8    0                      low
#  -1   4.0    4.0       1.28            3.0    0                      dual (min with -A c = 3)
#  -1   2.0    2.0       1.28            2.0    -A r = 2.0
#   2   1.1   -2.2      -2.2            -2.2    -A r = -2.2
ADV = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, 2.0]])
RATIO = torch.tensor([[1.5, 0.5, 0.5], [4.0, 2.0, 1.1]])
PG = [[-1.28, -0.5, 0.8], [3.0, 2.0, -2.2]]
DPG = [[0.0, -0.5, 0.0], [0.0, 2.0, -2.2]]


def _logp():
    return RATIO.log().clone().requires_grad_(True)


def test_ppo_clip_higher_with_dual_clip_by_hand():
    logp, mask = _logp(), torch.ones(2, 3)
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), ADV, mask, PolicyLossConfig(), backend="torch")
    close(loss, sum(map(sum, PG)) / 6)
    loss.backward()
    close(logp.grad, torch.tensor(DPG) / 6)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 6)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 6)
    assert metrics["clip_frac_dual"] == pytest.approx(1 / 6)
    assert metrics["num_tokens"] == 6
    assert metrics["ratio_mean"] == pytest.approx(float(RATIO.mean()), rel=1e-5)
    assert metrics["advantage_mean"] == pytest.approx(float(ADV.mean()))
    assert metrics["advantage_min"] == -1.0 and metrics["advantage_max"] == 2.0


def test_without_dual_clip_the_negative_advantage_loss_is_unbounded():
    logp = _logp()
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), ADV, torch.ones(2, 3),
                                PolicyLossConfig(dual_clip=None), backend="torch")
    close(loss, (sum(map(sum, PG)) - 3.0 + 4.0) / 6)
    loss.backward()
    assert logp.grad[1, 0].item() == pytest.approx(4.0 / 6)  # -A r with r = 4
    assert metrics["clip_frac_dual"] == 0.0


def test_sequence_advantages_broadcast_over_tokens():
    logp = torch.zeros(2, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2, 2), torch.tensor([1.0, -3.0]), torch.ones(2, 2),
                          backend="torch")
    close(loss, (-1 - 1 + 3 + 3) / 4)


def test_decoupled_objective_caps_behaviour_weight():
    # token 2 (A = 1, r = 0.5): behaviour logp log 0.5 under old 0 -> w = exp(0 - log 0.5) = 2, cap 1.5
    logp = _logp()
    behavior = torch.zeros(2, 3)
    behavior[0, 1] = math.log(0.5)
    mask = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    cfg = PolicyLossConfig(behavior_weight_cap=1.5)
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), ADV, mask, cfg, behavior_logp=behavior,
                                backend="torch")
    close(loss, -0.5 * 1.5)
    loss.backward()
    close(logp.grad, [[0.0, -0.5 * 1.5, 0.0], [0.0, 0.0, 0.0]])
    assert metrics["behavior_weight_mean"] == pytest.approx(1.5)
    uncapped, _ = policy_loss(_logp(), torch.zeros(2, 3), ADV, mask, PolicyLossConfig(),
                              behavior_logp=behavior, backend="torch")
    close(uncapped, -0.5 * 2.0)


def test_kl_loss_term_adds_coef_times_estimate():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[-0.5, 0.25]])
    cfg = PolicyLossConfig(kl_coef=0.1, kl_kind="k3")
    loss, metrics = policy_loss(logp, torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), cfg,
                                ref_logp=ref, backend="torch")
    k3 = [math.exp(x) - x - 1 for x in (-0.5, 0.25)]
    close(loss, 0.1 * sum(k3) / 2)
    assert metrics["kl"] == pytest.approx(sum(k3) / 2, rel=1e-5)
    loss.backward()
    close(logp.grad, [[0.1 * (1 - math.exp(x)) / 2 for x in (-0.5, 0.25)]])


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 10 / 4),                 # sum over 4 tokens / 4
    ("seq-mean-token-sum", (6 + 4) / 2),    # two non-empty rows
    ("seq-mean-token-mean", (2 + 4) / 2),
    ("seq-mean-token-sum-norm", 10 / (3 * 3)),  # B * T, a constant
])
def test_aggregation_modes_by_hand(mode, expected):
    close(aggregate_loss(LOSS, MASK, mode), expected)


def test_aggregation_constant_and_global_counts():
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_norm_constant=5.0), 10 / 15)
    close(aggregate_loss(LOSS, MASK, "token-mean", global_num_tokens=8), 10 / 8)
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-mean", global_num_seqs=4), (2 + 4) / 4)


def test_aggregation_gradient_is_row_weight_times_mask():
    logp = torch.zeros(3, 3, requires_grad=True)
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-mean")
    loss, _ = policy_loss(logp, torch.zeros(3, 3), torch.ones(3), MASK, cfg, backend="torch")
    loss.backward()
    # d/dlogp of -A r at r = 1 is -1; row weights 1/(2*3) and 1/(2*1); the empty row gets 0
    close(logp.grad, [[-1 / 6] * 3, [-1 / 2, 0, 0], [0, 0, 0]])


def test_entropy_metric_and_grad_norm():
    logp = torch.zeros(1, 2, requires_grad=True)
    entropy = torch.tensor([[1.0, 3.0]])
    loss, metrics = policy_loss(logp, torch.zeros(1, 2), torch.ones(1), torch.tensor([[1.0, 0.0]]),
                                entropy=entropy, backend="torch")
    assert metrics["entropy"] == 1.0
    loss.backward()
    assert rl_ops.global_grad_norm([logp]) == pytest.approx(1.0)


def test_policy_loss_errors_name_the_rule():
    with pytest.raises(RLOpsError, match="agg_mode must be one of"):
        PolicyLossConfig(agg_mode="mean")
    with pytest.raises(RLOpsError, match="dual_clip must be > 1 \\+ clip_high"):
        PolicyLossConfig(dual_clip=1.1)
    with pytest.raises(RLOpsError, match="old_logp must have logp's shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(RLOpsError, match="advantages must be"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(RLOpsError, match="kl_coef=0.1 needs ref_logp"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3),
                    PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(RLOpsError, match="backend='cupy' needs CUDA tensors"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), backend="cupy")


def test_package_reexports_lazily():
    import postrain.ext as ext

    assert ext.policy_loss is policy_loss and ext.RLOpsError is RLOpsError


# ------------------------------------------------------------------ properties and gradcheck

@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
def test_policy_loss_gradcheck_every_term(agg_mode):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    logp = (old + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.5).requires_grad_(True)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 0.0]])
    behavior = old + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3
    ref = old + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3
    cfg = PolicyLossConfig(agg_mode=agg_mode, kl_coef=0.1, behavior_weight_cap=1.2)

    def f(lp):
        return rl_ops.policy_loss_reference(lp, old, adv, mask, cfg, behavior_logp=behavior,
                                            ref_logp=ref)[0]

    assert torch.autograd.gradcheck(f, (logp,))


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.lists(st.floats(-5, 5, width=32), min_size=2, max_size=36))
def test_group_advantage_properties(group_size, values):
    values = values[: len(values) - len(values) % group_size] or [0.0] * group_size
    rewards = torch.tensor(values)
    dr = group_advantages(rewards, group_size, "dr_grpo").view(-1, group_size)
    torch.testing.assert_close(dr.sum(1), torch.zeros(dr.shape[0]), atol=1e-4, rtol=0)
    # RLOO: r_i minus the mean of the other G - 1 rewards, computed the long way
    grouped = rewards.view(-1, group_size)
    others = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    torch.testing.assert_close(group_advantages(rewards, group_size, "rloo").view(-1, group_size),
                               grouped - others, atol=1e-4, rtol=1e-4)
    groups = filter_groups(rewards, group_size)
    assert groups.num_groups == groups.num_kept_groups + groups.num_dropped_groups
    flat = group_advantages(rewards, group_size, "grpo").view(-1, group_size)
    assert torch.all(flat[~groups.keep_groups] == 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000))
def test_equal_length_rows_make_token_and_sequence_means_agree(rows, length, seed):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, length + 2, generator=g)
    mask = torch.zeros(rows, length + 2)
    mask[:, :length] = 1.0
    a = aggregate_loss(loss, mask, "token-mean")
    torch.testing.assert_close(a, aggregate_loss(loss, mask, "seq-mean-token-mean"))
    torch.testing.assert_close(a * length, aggregate_loss(loss, mask, "seq-mean-token-sum"))
    torch.testing.assert_close(a * length / (length + 2),
                               aggregate_loss(loss, mask, "seq-mean-token-sum-norm"))


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(mode):
    # float32 mean of three copies of this value is not the value; GRPO used to divide that
    # rounding error by std + eps and hand every sample an advantage of 0.18
    rewards = torch.tensor([2.7507681846618652] * 3 + [0.0, 1.0, 2.0])
    advantages = group_advantages(rewards, 3, mode)
    assert torch.equal(advantages[:3], torch.zeros(3))
    assert advantages[3] < 0 < advantages[5]
