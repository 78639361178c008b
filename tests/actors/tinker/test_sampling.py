"""Sampling through the tinker SDK against postrain's Tinker server: save_weights_for_sampler,
sampling sessions and asample on the generator's engine (postrain.actors.tinker.sampling)."""
import numpy as np
import pytest
import tinker
from tinker import types

from tinker_server import API_KEY

PROMPT = [1, 5, 9, 40, 77]


@pytest.fixture(scope="module")
def trained(served):
    """(service client, training client, its sampling client) after one SFT step on the tiny model."""
    client = tinker.ServiceClient(base_url=served[0], api_key=API_KEY)
    tc = client.create_lora_training_client("tiny", rank=4, seed=0, train_unembed=False).result()
    tokens = PROMPT + [100, 101, 102, 103]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    yield client, tc, sampler
    client.close("success").result(timeout=30)


def sample(sampler, num=1, prompt=PROMPT, **params):
    return sampler.sample(types.ModelInput.from_ints(prompt), num, types.SamplingParams(**params),
                          include_prompt_logprobs=True).result()


def test_sampled_and_prompt_logprobs_are_the_trained_adapters(trained):
    _, tc, sampler = trained
    out = sample(sampler, num=3, max_tokens=6, temperature=1.0, seed=7)
    assert len(out.sequences) == 3 and all(s.sequence_id for s in out.sequences)
    assert len({s.sequence_id for s in out.sequences}) == 3
    seq = out.sequences[0]
    tokens = PROMPT + list(seq.tokens)
    scored = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                     loss_fn_inputs={"target_tokens": tokens[1:]})], "cross_entropy").result()
    logprobs = scored.loss_fn_outputs[0]["logprobs"].data
    np.testing.assert_allclose(seq.logprobs, logprobs[len(PROMPT) - 1:], atol=1e-4)
    assert out.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], logprobs[:len(PROMPT) - 1], atol=1e-4)


def test_greedy_seeds_top_k_and_stops(trained):
    _, _, sampler = trained
    greedy = sample(sampler, max_tokens=8, temperature=0.0, stop=[]).sequences[0]
    assert greedy.stop_reason == "length" and len(greedy.tokens) == 8
    assert sample(sampler, max_tokens=8, temperature=1.0, top_k=1, stop=[]).sequences[0].tokens == greedy.tokens
    seeded = [sample(sampler, max_tokens=8, temperature=1.0, seed=3).sequences[0].tokens for _ in range(2)]
    assert seeded[0] == seeded[1]
    stopped = sample(sampler, max_tokens=8, temperature=0.0, stop=[greedy.tokens[2]]).sequences[0]
    assert stopped.stop_reason == "stop" and stopped.tokens == greedy.tokens[:3]


def test_named_sampler_weights_open_by_path_and_equal_the_ephemeral_ones(trained):
    client, tc, sampler = trained
    path = tc.save_weights_for_sampler("step1").result().path
    assert path.startswith(f"tinker://{tc.model_id}/sampler_weights/step1")
    by_path = client.create_sampling_client(model_path=path).result()
    assert sample(by_path, max_tokens=6, temperature=0.0).sequences[0].tokens == \
        sample(sampler, max_tokens=6, temperature=0.0).sequences[0].tokens
    with pytest.raises(tinker.NotFoundError, match="names no saved sampler weights"):
        client.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/nope").result()


def test_the_base_model_samples_without_an_adapter(trained):
    client, _, _ = trained
    base = client.create_sampling_client(base_model="tiny").result()
    out = sample(base, max_tokens=4, temperature=0.0, stop=[])
    assert len(out.sequences[0].tokens) == 4


def test_bad_sampling_input_is_refused_by_name(trained):
    _, _, sampler = trained
    with pytest.raises(tinker.BadRequestError, match="exceeds 'tiny'.s context of 1024 tokens"):
        sample(sampler, max_tokens=100_000)
    with pytest.raises(tinker.BadRequestError, match="token id 5000 is outside"):
        sample(sampler, prompt=[1, 5000], max_tokens=2)
    assert len(sample(sampler, max_tokens=2).sequences) == 1      # the session still serves


def test_concurrent_requests_on_one_sampler_decode_together_and_keep_their_samples(trained, monkeypatch):
    """Requests waiting on the same weights join the engine's running batch; each gets what it
    gets alone."""
    import threading
    import time

    from postrain.actors.tinker import service

    _, _, sampler = trained
    prompts = [PROMPT[:k] + [50 + k] for k in range(2, 6)]
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    alone = [sampler.sample(types.ModelInput.from_ints(p), 1, params).result().sequences[0] for p in prompts]
    admitted: list[int] = []
    real = service.step_engine

    def first_waits_for_the_rest(weights, admit, kv_cache_mb):
        deadline = time.monotonic() + 60              # a bound, not a timing: the requests are on their way
        while not admitted and len(admit) + len(weights.pending) < len(prompts) and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        admitted.append(len(admit))
        return real(weights, admit, kv_cache_mb)

    monkeypatch.setattr(service, "step_engine", first_waits_for_the_rest)
    futures = [sampler.sample(types.ModelInput.from_ints(p), 1, params) for p in prompts]
    together = [f.result().sequences[0] for f in futures]
    assert sum(admitted) == len(prompts) and len(admitted) >= 6      # one engine step per new token
    assert sum(1 for n in admitted if n) <= 2                         # four requests admitted in at most two steps
    for a, b in zip(alone, together):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_a_training_client_keeps_its_four_newest_unnamed_saves(trained):
    """A loop that saves for sampling every step holds 4 merged copies at most; a session on an
    older save is answered 410, naming why."""
    client = trained[0]
    tc = client.create_lora_training_client("tiny", rank=2, seed=1, train_unembed=False).result()   # its own
    samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(5)]
    with pytest.raises(tinker.APIStatusError, match="dropped when the training client saved 4 newer ones"):
        sample(samplers[0], max_tokens=2)
    assert len(sample(samplers[-1], max_tokens=2).sequences) == 1
