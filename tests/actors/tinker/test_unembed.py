"""`lora_config.train_unembed` (the SDK's default): a LoRA on the unembedding, trained through the
tenant's logprob head and merged into its samplers (postrain.actors.tinker.unembed); the tiny
base ties its head to its embedding, so the sampler unties them and the embedding stays the base's."""
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from postrain.actors.tinker.errors import TinkerAPIError
from postrain.actors.tinker.tenants import lora_targets, training_state_bytes
from postrain.actors.tinker.unembed import KEY_A, KEY_B
from tinker_server import API_KEY

PROMPT = [1, 5, 9, 40, 77]


def sft_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


@pytest.fixture
def client(served):
    service_client = tinker.ServiceClient(base_url=served[0], api_key=API_KEY)
    yield service_client
    service_client.close("success").result(timeout=30)


@pytest.mark.parametrize("body", [True, False])
def test_the_unembedding_trains_and_its_sampler_runs_the_trained_head(served, client, body):
    service = served[1]
    tc = client.create_lora_training_client("tiny", rank=4, seed=0, train_attn=body, train_mlp=body).result()
    tenant = service.tenants[tc.model_id]
    assert tenant.targets[-1] == "lm_head" and (len(tenant.targets) > 1) == body
    tokens = PROMPT + [100, 101, 102, 103]
    before = tc.forward([sft_datum(tokens)], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        tc.forward_backward([sft_datum(tokens)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    adapters = tenant.adapters()
    assert float(adapters[KEY_B].abs().max()) > 0                      # the head's adapter moved
    assert tc.forward([sft_datum(tokens)], "cross_entropy").result().metrics["loss:sum"] < before

    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=6, seed=3),
                         include_prompt_logprobs=True).result()
    seq = out.sequences[0]
    full = PROMPT + list(seq.tokens)
    scored = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                     loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()
    logprobs = scored.loss_fn_outputs[0]["logprobs"].data
    np.testing.assert_allclose(seq.logprobs, logprobs[len(PROMPT) - 1:], atol=1e-4)    # the trained head
    engine_model = next(w for w in service.samplers._weights.values()
                        if w.path and w.path.startswith(f"tinker://{tc.model_id}/")).engine.model
    base = tenant.held.model
    assert not engine_model.config.tie_word_embeddings                 # untied: the head is its own
    assert torch.equal(engine_model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert not torch.equal(engine_model.lm_head.weight, base.lm_head.weight)


def test_a_saved_state_keeps_the_head_and_loads_only_into_a_client_that_trains_it(served, client):
    tc = client.create_lora_training_client("tiny", rank=4, seed=0).result()
    tc.forward_backward([sft_datum(PROMPT + [100, 101])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("with-head").result().path
    restored = client.create_training_client_from_state_with_optimizer(path).result()
    mine, theirs = (served[1].tenants[c.model_id].adapters() for c in (tc, restored))
    assert mine.keys() == theirs.keys() and KEY_A in mine
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    plain = client.create_lora_training_client("tiny", rank=4, seed=0, train_unembed=False).result()
    with pytest.raises(tinker.RequestFailedError, match=r"on \[.*'lm_head'\], this training client"):
        plain.load_state(path).result()


def test_the_targets_and_the_training_memory_count_the_heads_adapter(tiny_bases):
    model = tiny_bases.get("tiny").model
    vocab, hidden = model.lm_head.weight.shape
    body = lora_targets(True, True, False)
    assert lora_targets(True, True, True) == body + ("lm_head",)
    assert lora_targets(False, False, True) == ("lm_head",)
    with pytest.raises(TinkerAPIError, match="lora_config trains nothing"):     # the SDK asserts it too
        lora_targets(False, False, False)
    extra = training_state_bytes(model, 4, body + ("lm_head",)) - training_state_bytes(model, 4, body)
    assert extra == 16 * 4 * (vocab + hidden)            # A (4, H) and B (V, 4), grads and two moments, float32
