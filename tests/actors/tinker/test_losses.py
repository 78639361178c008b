"""The Tinker losses (postrain.actors.tinker.losses) against float64 references written from
their definitions, value and gradient; and through the SDK, a loss's `loss:sum`."""
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from postrain.actors.tinker.errors import TinkerAPIError
from postrain.actors.tinker.losses import loss_config, token_loss
from tinker_server import API_KEY


def reference(loss_fn: str, logp, old, advantages, weights, config,
              sequence_ratio_mask=None) -> tuple[float, np.ndarray]:
    """(the loss, its gradient in logp), float64, from each loss's definition (losses.py's table)."""
    logp, old, adv, w = (np.asarray(x, dtype=np.float64) for x in (logp, old, advantages, weights))
    ratio = np.exp(logp - old)
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if loss_fn == "gspo":          # one sequence ratio s on every token, d s_t / d logp_t = s
        in_ratio = (np.asarray(sequence_ratio_mask) if sequence_ratio_mask is not None else adv) != 0
        s = np.exp((logp - old)[in_ratio].mean()) if in_ratio.any() else 1.0
        ratio = np.full_like(logp, s)
        loss_fn = "ppo"            # ppo's formula on s_t; its gradient -s_t * A where unclipped wins
    if loss_fn == "cross_entropy":
        return float(-(logp * w).sum()), -w
    if loss_fn == "importance_sampling":
        return float(-(ratio * adv).sum()), -ratio * adv
    if loss_fn == "ppo":
        clipped = np.clip(ratio, low, high)
        unclipped_wins = ratio * adv <= clipped * adv
        value = -np.minimum(ratio * adv, clipped * adv)
        inside = (ratio > low) & (ratio < high)
        grad = np.where(unclipped_wins | inside, -ratio * adv, 0.0)
        return float(value.sum()), grad
    if loss_fn == "cispo":
        clipped = np.clip(ratio, low, high)
        return float(-(clipped * logp * adv).sum()), -clipped * adv
    beta = config["beta"]          # dro
    return float(-(logp * adv - 0.5 * beta * (logp - old) ** 2).sum()), -(adv - beta * (logp - old))


@pytest.mark.parametrize("loss_fn, config", [
    ("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("cispo", {}), ("dro", {"beta": 0.5}),
    ("gspo", {}), ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})])
def test_each_loss_equals_its_float64_reference(loss_fn, config):
    rng = np.random.default_rng(0)
    num = 64
    logp64 = -rng.uniform(0.1, 4.0, num)
    old = logp64 + rng.normal(0, 0.3, num)            # ratios on both sides of the clips
    advantages, weights = rng.normal(0, 1, num), rng.uniform(0, 1, num)
    full = loss_config(loss_fn, config)
    logp = torch.tensor(logp64, dtype=torch.float32, requires_grad=True)
    inputs = {"logprobs": torch.tensor(old, dtype=torch.float32),
              "advantages": torch.tensor(advantages, dtype=torch.float32),
              "weights": torch.tensor(weights, dtype=torch.float32)}
    loss, term = token_loss(loss_fn, logp, inputs, full)
    loss.backward()
    value, grad = reference(loss_fn, logp.detach().double().numpy(), inputs["logprobs"].double().numpy(),
                            inputs["advantages"].double().numpy(), inputs["weights"].double().numpy(), full)
    assert float(loss.detach()) == pytest.approx(value, rel=1e-5, abs=1e-5)
    assert float(term.sum()) == pytest.approx(value, rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(logp.grad.double().numpy(), grad, rtol=1e-5, atol=1e-6)


def test_an_unknown_loss_or_setting_is_refused_by_name():
    with pytest.raises(TinkerAPIError, match="loss_fn 'orpo' is not supported by this server"):
        loss_config("orpo", {})
    with pytest.raises(TinkerAPIError, match=r"loss_fn_config \['beta'\] is not a setting of 'ppo'"):
        loss_config("ppo", {"beta": 1.0})
    with pytest.raises(TinkerAPIError, match="loss_fn_config\\['beta'\\] of 'dro' must be a number, got None"):
        loss_config("dro", {})


def test_ppo_through_the_sdk_sums_its_reference_on_the_servers_logprobs(served):
    client = tinker.ServiceClient(base_url=served[0], api_key=API_KEY)
    tc = client.create_lora_training_client("tiny", rank=4, seed=0, train_unembed=False).result()
    tokens = [1, 5, 9, 40, 77, 100, 101]
    rng = np.random.default_rng(1)
    current = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                      loss_fn_inputs={"target_tokens": tokens[1:]})], "cross_entropy").result()
    logp = np.asarray(current.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)
    old = (logp + rng.normal(0, 0.3, len(logp))).astype(np.float32)
    advantages = rng.normal(0, 1, len(logp)).astype(np.float32)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "logprobs": old, "advantages": advantages})
    out = tc.forward_backward([datum], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result()
    value, _ = reference("ppo", logp, old, advantages, np.ones(len(logp)),
                         {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    assert out.metrics["loss:sum"] == pytest.approx(value, abs=1e-4)
    client.close("success").result(timeout=30)


def test_gspo_defaults_are_the_learners_preset_as_ratio_bounds():
    from postrain.ext.loss_presets import loss_preset
    preset = loss_preset("gspo").loss
    assert loss_config("gspo", {}) == {"clip_low_threshold": 1 - preset["clip_low"],
                                       "clip_high_threshold": 1 + preset["clip_high"]}
    assert loss_config("gspo", {}) == pytest.approx({"clip_low_threshold": 0.9997, "clip_high_threshold": 1.0004})


@pytest.mark.parametrize("masked", [False, True])
def test_gspo_uses_one_ratio_per_sequence_over_its_masked_tokens(masked):
    """Prompt positions (A = 0, sampling logprob 0) stay out of s; with sequence_ratio_mask, exactly
    the marked tokens count; a sequence is clipped or kept whole."""
    rng = np.random.default_rng(2)
    num, prompt = 12, 4
    logp64 = -rng.uniform(0.1, 3.0, num)
    old = logp64 + rng.normal(0, 0.05, num)
    old[:prompt] = 0.0
    advantages = np.full(num, 0.7)
    advantages[:prompt] = 0.0
    mask = np.r_[np.zeros(prompt + 2), np.ones(num - prompt - 2)] if masked else None
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    logp = torch.tensor(logp64, dtype=torch.float32, requires_grad=True)
    inputs = {"logprobs": torch.tensor(old, dtype=torch.float32),
              "advantages": torch.tensor(advantages, dtype=torch.float32)}
    if masked:
        inputs["sequence_ratio_mask"] = torch.tensor(mask, dtype=torch.float32)
    loss, term = token_loss("gspo", logp, inputs, loss_config("gspo", config))
    loss.backward()
    value, grad = reference("gspo", logp.detach().double().numpy(), inputs["logprobs"].double().numpy(),
                            advantages, np.ones(num), config, mask)
    in_ratio = mask != 0 if masked else advantages != 0
    s = np.exp((logp.detach().double().numpy() - inputs["logprobs"].double().numpy())[in_ratio].mean())
    assert 0.8 < s < 1.2                                                  # the prompt would have pushed it far out
    np.testing.assert_allclose(term.detach().double().numpy()[prompt:], -s * 0.7, rtol=1e-5)
    assert float(loss.detach()) == pytest.approx(value, rel=1e-5)
    np.testing.assert_allclose(logp.grad.double().numpy(), grad, rtol=1e-5, atol=1e-6)


def test_gspo_through_the_sdk_sums_its_reference_on_the_servers_logprobs(served):
    """The SDK names `gspo` (tinker 0.38.0's LossFnType) and sends sequence_ratio_mask as float32."""
    client = tinker.ServiceClient(base_url=served[0], api_key=API_KEY)
    tc = client.create_lora_training_client("tiny", rank=4, seed=0, train_unembed=False).result()
    tokens = [1, 5, 9, 40, 77, 100, 101]
    current = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                      loss_fn_inputs={"target_tokens": tokens[1:]})], "cross_entropy").result()
    logp = np.asarray(current.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)
    rng = np.random.default_rng(3)
    old = (logp + rng.normal(0, 0.01, len(logp))).astype(np.float32)
    advantages = np.array([0, 0, 1.5, 1.5, 1.5, 1.5], dtype=np.float32)
    mask = np.array([0, 0, 1, 1, 1, 0], dtype=np.float32)
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "logprobs": old, "advantages": advantages, "sequence_ratio_mask": mask})
    out = tc.forward_backward([datum], "gspo", config).result()
    value, _ = reference("gspo", logp, old, advantages, np.ones(len(logp)), config, mask)
    assert out.metrics["loss:sum"] == pytest.approx(value, abs=1e-4)
    client.close("success").result(timeout=30)


def test_forward_backward_custom_equals_the_same_loss_as_cross_entropy(served):
    """The SDK runs a custom loss as a forward, then cross_entropy with weights -dC/dlogp."""
    client = tinker.ServiceClient(base_url=served[0], api_key=API_KEY)
    custom, plain = (client.create_lora_training_client("tiny", rank=4, seed=0, train_unembed=False).result()
                     for _ in range(2))
    tokens = [1, 5, 9, 40, 77, 100, 101]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.25] * 6})

    def quarter_nll(data, logprobs):
        loss = sum(-0.25 * lp.sum() for lp in logprobs)
        return loss, {"custom:sum": float(loss.detach())}
    out = custom.forward_backward_custom([datum], quarter_nll).result()
    reference = plain.forward_backward([datum], "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-6)
    grads = [[p.grad for p in served[1].tenants[c.model_id].lora.parameters()] for c in (custom, plain)]
    for mine, expected in zip(*grads):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-7)
    client.close("success").result(timeout=30)
