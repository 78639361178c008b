"""`stable_reinforce` (postrain.actors.tinker.losses, stability.py): the loss against a float64
reference; the server's records of sampled sequences (kept per session, a day after last use, the
least recently used dropped past the cap); and through the SDK as tinker-cookbook's rl_loop
uses it: sampled with record_stability_info, datums with provenance, the ratio taken against
the recorded sampler logprobs whatever the client sends, and each bad datum refused by name."""
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from postrain.actors.tinker.errors import TinkerAPIError
from postrain.actors.tinker.losses import loss_config, token_loss
from postrain.actors.tinker.stability import RECORD_OVERHEAD_TOKENS, SAMPLED, SAMPLER_LOGPROBS, StabilityRecords
from postrain.actors.tinker.wire import Span, WireDatum
from tinker_server import API_KEY


def reference(logp, recorded, sampled, advantages, config) -> tuple[float, np.ndarray]:
    """(the loss, its gradient in logp), float64, from the definition in losses.py's table."""
    logp, recorded, sampled, adv = (np.asarray(x, dtype=np.float64) for x in (logp, recorded, sampled, advantages))
    log_ratio = np.where(sampled != 0, logp - recorded, 0.0)
    rho = np.exp(log_ratio)
    kept = (sampled != 0) & (rho >= config["mask_low_threshold"]) & (rho <= config["mask_high_threshold"])
    k = config["kl_coeff"]
    value = np.where(kept, -rho * adv, 0.0) + np.where(sampled != 0, k * (np.exp(-log_ratio) - 1 + log_ratio), 0.0)
    grad = np.where(kept, -rho * adv, 0.0) + np.where(sampled != 0, k * (1 - np.exp(-log_ratio)), 0.0)
    return float(value.sum()), grad


@pytest.mark.parametrize("config", [{}, {"kl_coeff": 0.1}, {"mask_low_threshold": 0.9, "mask_high_threshold": 1.1}])
def test_stable_reinforce_equals_its_float64_reference(config):
    rng = np.random.default_rng(0)
    num, prompt = 64, 10
    logp64 = -rng.uniform(0.1, 4.0, num)
    recorded = logp64 + rng.normal(0, 0.5, num)          # ratios inside and outside the mask
    recorded[:prompt] = 0.0
    sampled = np.r_[np.zeros(prompt), np.ones(num - prompt)]
    advantages = np.r_[np.zeros(prompt), rng.normal(0, 1, num - prompt)]
    full = loss_config("stable_reinforce", config)
    logp = torch.tensor(logp64, dtype=torch.float32, requires_grad=True)
    inputs = {SAMPLER_LOGPROBS: torch.tensor(recorded, dtype=torch.float32),
              SAMPLED: torch.tensor(sampled, dtype=torch.float32),
              "advantages": torch.tensor(advantages, dtype=torch.float32)}
    loss, term = token_loss("stable_reinforce", logp, inputs, full)
    loss.backward()
    value, grad = reference(logp.detach().double().numpy(), inputs[SAMPLER_LOGPROBS].double().numpy(), sampled,
                            inputs["advantages"].double().numpy(), full)
    ratio = np.exp(logp64[prompt:] - recorded[prompt:])
    assert ((ratio < full["mask_low_threshold"]) | (ratio > full["mask_high_threshold"])).any()   # some masked
    assert float(loss.detach()) == pytest.approx(value, rel=1e-5, abs=1e-5)
    np.testing.assert_array_equal(term.detach().numpy()[:prompt], 0.0)      # the prompt moves nothing
    np.testing.assert_allclose(logp.grad.double().numpy(), grad, rtol=1e-5, atol=1e-6)


def test_stable_reinforce_settings_are_checked():
    assert loss_config("stable_reinforce", {}) == {"kl_coeff": 0.0, "mask_low_threshold": 0.5,
                                                   "mask_high_threshold": 2.0}
    with pytest.raises(TinkerAPIError, match="needs 0 <= mask_low_threshold <= 1 <= mask_high_threshold"):
        loss_config("stable_reinforce", {"mask_low_threshold": 1.5})
    with pytest.raises(TinkerAPIError, match="kl_coeff >= 0"):
        loss_config("stable_reinforce", {"kl_coeff": -1.0})


def datum_of(prompt: list[int], tokens: list[int], sequence_id: str, advantage: float = 1.0) -> WireDatum:
    """rl_loop's datum of one sampled sequence: input prompt + tokens[:-1], targets shifted by one."""
    inputs = np.asarray(prompt + tokens[:-1], dtype=np.int64)
    targets = np.asarray(prompt[1:] + tokens, dtype=np.float32)
    advantages = np.r_[np.zeros(len(prompt) - 1), np.full(len(tokens), advantage)].astype(np.float32)
    return WireDatum(inputs, {"target_tokens": targets, "advantages": advantages},
                     [Span("prompt", sequence_id, 0, len(prompt)), Span("sampled", sequence_id, 0, len(tokens) - 1)],
                     [Span("prompt", sequence_id, 1, len(prompt) - 1), Span("sampled", sequence_id, 0, len(tokens))])


def test_records_resolve_a_datum_to_the_recorded_sampler_logprobs():
    records = StabilityRecords(max_tokens_per_session=1000)
    prompt = np.array([1, 2, 3, 4])
    records.record("s", "r-0", prompt, [7, 8, 9], [-0.5, -1.5, -2.5], now_s=0.0)
    resolved = records.resolve("s", datum_of([1, 2, 3, 4], [7, 8, 9], "r-0"), "data[0]", now_s=1.0)
    np.testing.assert_array_equal(resolved.inputs[SAMPLER_LOGPROBS], [0, 0, 0, -0.5, -1.5, -2.5])
    np.testing.assert_array_equal(resolved.inputs[SAMPLED], [0, 0, 0, 1, 1, 1])
    with pytest.raises(TinkerAPIError, match="not recorded in this session"):
        records.resolve("other session", datum_of([1, 2, 3, 4], [7, 8, 9], "r-0"), "data[0]", now_s=1.0)


def test_a_datum_whose_tokens_differ_from_the_record_is_refused_naming_the_position():
    records = StabilityRecords(max_tokens_per_session=1000)
    records.record("s", "r-0", np.array([1, 2, 3, 4]), [7, 8, 9], [-0.5, -1.5, -2.5], now_s=0.0)
    with pytest.raises(TinkerAPIError, match=r"data\[0\]\.model_input: position 5 holds token 99, but its "
                                             r"provenance names token 8"):
        records.resolve("s", datum_of([1, 2, 3, 4], [7, 99, 9], "r-0"), "data[0]", now_s=1.0)
    bad = datum_of([1, 2, 3, 4], [7, 8, 9], "r-0")
    bad.inputs["advantages"][0] = 1.0                  # a prompt target with an advantage
    with pytest.raises(TinkerAPIError, match="advantages are nonzero at position 0"):
        records.resolve("s", bad, "data[0]", now_s=1.0)
    too_long = WireDatum(bad.tokens, bad.inputs, [Span("prompt", "r-0", 0, 9)], bad.target_spans)
    with pytest.raises(TinkerAPIError, match="spans cover 9 positions, it has 6"):
        records.resolve("s", too_long, "data[0]", now_s=1.0)
    no_provenance = WireDatum(bad.tokens, bad.inputs)
    with pytest.raises(TinkerAPIError, match="needs provenance on every datum"):
        records.resolve("s", no_provenance, "data[0]", now_s=1.0)


def test_a_target_read_in_another_context_than_it_was_sampled_in_is_refused():
    """Spans that each match the record, but targets not shifted by one (the target is its own
    input): the ratio would compare the learner and the sampler on different contexts."""
    records = StabilityRecords(max_tokens_per_session=1000)
    records.record("s", "r-0", np.array([1, 2, 3, 4]), [7, 8, 9], [-0.5, -1.5, -2.5], now_s=0.0)
    inputs = np.asarray([1, 2, 3, 4, 7, 8], dtype=np.int64)
    unshifted = WireDatum(inputs, {"target_tokens": np.asarray([0, 0, 0, 0, 7, 8], dtype=np.float32),
                                   "advantages": np.asarray([0, 0, 0, 0, 1, 1], dtype=np.float32)},
                          [Span("prompt", "r-0", 0, 4), Span("sampled", "r-0", 0, 2)],
                          [Span("prompt", "r-0", 0, 4), Span("sampled", "r-0", 0, 2)])
    with pytest.raises(TinkerAPIError, match="targets 4 to 5 are sampled tokens of 'r-0', but the model_input "
                                             "before them is not that sequence's prompt"):
        records.resolve("s", unshifted, "data[0]", now_s=1.0)


def test_records_are_kept_a_day_after_last_use_and_the_least_recently_used_go_past_the_cap():
    prompt = np.array([1, 2, 3, 4])
    size = 7 + RECORD_OVERHEAD_TOKENS
    records = StabilityRecords(max_tokens_per_session=2 * size + 6, keep_s=100.0)
    for i in range(3):                                 # 3 records pass the cap: the oldest goes
        records.record("s", f"r-{i}", prompt, [7, 8, 9], [-1.0] * 3, now_s=float(i))
    assert records.num_tokens("s") == 2 * size
    with pytest.raises(TinkerAPIError, match="'r-0' is not recorded"):
        records.resolve("s", datum_of([1, 2, 3, 4], [7, 8, 9], "r-0"), "data[0]", now_s=3.0)
    records.resolve("s", datum_of([1, 2, 3, 4], [7, 8, 9], "r-1"), "data[0]", now_s=90.0)   # restarts r-1's day
    records.resolve("s", datum_of([1, 2, 3, 4], [7, 8, 9], "r-1"), "data[0]", now_s=150.0)  # 60 s after its use
    with pytest.raises(TinkerAPIError, match="'r-2' is not recorded"):                      # 148 s unused
        records.resolve("s", datum_of([1, 2, 3, 4], [7, 8, 9], "r-2"), "data[0]", now_s=150.0)
    records.expire(now_s=500.0)                        # the sweep: r-1 unused for 350 s
    assert records.num_tokens("s") == 0
    records.record("s", "r-3", prompt, [7], [-1.0], now_s=500.0)
    records.drop_session("s")
    assert records.num_tokens("s") == 0
    with pytest.raises(TinkerAPIError, match="keeps up to 148 tokens for this request .2 samples"):
        StabilityRecords(max_tokens_per_session=100).check_fits(2, 4, 6)


def rl_loop_datum(prompt: types.ModelInput, seq, advantage: float, client_logprobs=None) -> types.Datum:
    """The datum tinker-cookbook's rl_loop builds for `stable_reinforce` (its with_sampled_provenance)."""
    ob_len = prompt.length - 1
    tokens = seq.tokens
    model_input = prompt.append(types.EncodedTextChunk(tokens=tokens[:-1]))
    logprobs = client_logprobs if client_logprobs is not None else seq.logprobs
    datum = types.Datum(model_input=model_input, loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(torch.tensor([0] * ob_len + tokens)),
        "logprobs": types.TensorData.from_torch(torch.tensor([0.0] * ob_len + list(logprobs))),
        "advantages": types.TensorData.from_torch(torch.tensor([0.0] * ob_len + [advantage] * len(tokens)))})
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=prompt.length),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=ob_len),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(tokens))])


def test_stable_reinforce_through_the_sdk_as_the_cookbooks_rl_loop_uses_it(served):
    client = tinker.ServiceClient(base_url=served[0], api_key=API_KEY)
    tc = client.create_lora_training_client("tiny", rank=4, seed=0, train_unembed=False).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = types.ModelInput.from_ints([1, 5, 9, 40, 77])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    result = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    seq = result.sequences[0]
    assert len(seq.tokens) >= 2

    honest = rl_loop_datum(prompt, seq, 0.8)
    lying = rl_loop_datum(prompt, seq, 0.8, client_logprobs=[0.0] * len(seq.tokens))   # ratios it does not have
    current = tc.forward([honest], "stable_reinforce").result()
    logp = np.asarray(current.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)
    ob_len = prompt.length - 1
    recorded = np.r_[np.zeros(ob_len), seq.logprobs]
    sampled = np.r_[np.zeros(ob_len), np.ones(len(seq.tokens))]
    advantages = np.r_[np.zeros(ob_len), np.full(len(seq.tokens), 0.8)]
    value, _ = reference(logp, recorded, sampled, advantages, loss_config("stable_reinforce", {}))
    for datum in (honest, lying):
        out = tc.forward_backward([datum], "stable_reinforce").result()
        assert out.metrics["loss:sum"] == pytest.approx(value, abs=1e-4)
    assert value == pytest.approx(-0.8 * len(seq.tokens), rel=0.05)    # the same weights: ratios near 1
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result() is not None

    with pytest.raises(tinker.BadRequestError, match="record_stability_info with temperature 0.7"):
        sampler.sample(prompt=prompt, num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=4, temperature=0.7)).result()
    unrecorded = tc.save_weights_and_get_sampling_client().result()     # record_stability_info False
    plain = unrecorded.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]
    with pytest.raises(tinker.BadRequestError, match="is not recorded in this session"):
        tc.forward_backward([rl_loop_datum(prompt, plain, 0.8)], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="needs provenance on every datum"):
        tc.forward_backward([types.Datum(model_input=honest.model_input, loss_fn_inputs=honest.loss_fn_inputs)],
                            "stable_reinforce").result()
    tampered = rl_loop_datum(prompt, seq, 0.8)
    ids = tampered.model_input.to_ints()
    ids[-1] = (ids[-1] + 1) % 256
    forged = types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=tampered.loss_fn_inputs,
                         model_input_spans=tampered.model_input_spans,
                         loss_fn_input_spans=tampered.loss_fn_input_spans)
    with pytest.raises(tinker.BadRequestError, match=r"position \d+ holds token \d+, but its provenance names"):
        tc.forward_backward([forged], "stable_reinforce").result()
    service = served[1]
    session_id = tc.holder.get_session_id()
    assert service.stability.num_tokens(session_id) > 0
    client.close("success").result(timeout=30)
    assert service.stability.num_tokens(session_id) == 0               # the session's records go with it


def test_a_negative_span_is_refused_as_bad_input():
    from tinker.proto import tinker_public_pb2 as pb

    from postrain.actors.tinker.wire import decode_forward_backward
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="stable_reinforce")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1, 2], dtype=np.int32).tobytes()
    span = datum.model_input_spans.add().sampled_tokens
    span.sequence_id, span.offset, span.length = "r-0", -3, 2
    datum.loss_fn_input_spans.add().sampled_tokens.sequence_id = "r-0"
    with pytest.raises(TinkerAPIError, match="offset -3 and length 2; both must be >= 0"):
        decode_forward_backward(msg.SerializeToString())
