"""One round on SmolLM2-135M (the packaged GGUF) through the tinker SDK: a LoRA step, then
samples with a string stop whose logprobs are the trained adapter's (postrain.actors.tinker)."""
import numpy as np
import pytest
import tinker
from tinker import types

from postrain.actors.tinker import BaseModels
from tinker_server import API_KEY, tinker_served

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_smollm2_trains_and_samples_with_a_string_stop():
    bases = BaseModels.load([f"{NAME}=smollm2"])
    tokenizer = bases.get(NAME).tokenizer
    with tinker_served(bases) as (url, _):
        client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        tc = client.create_lora_training_client(NAME, rank=8, seed=0, train_unembed=False).result()
        prompt = tokenizer.encode("Question: what is 2 + 3?\nAnswer:")
        answer = tokenizer.encode(" 5\n")
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
        before = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert tc.forward([datum], "cross_entropy").result().metrics["loss:sum"] < before
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                             types.SamplingParams(max_tokens=12, temperature=1.0, stop="\n", seed=1)).result()
        for seq in out.sequences:
            text = tokenizer.decode(seq.tokens)
            assert "\n" not in text.rstrip("\n") and (seq.stop_reason == "length" or text.endswith("\n"))
            scored = tc.forward([types.Datum(model_input=types.ModelInput.from_ints((prompt + seq.tokens)[:-1]),
                                             loss_fn_inputs={"target_tokens": (prompt + seq.tokens)[1:]})],
                                "cross_entropy").result()
            trained = np.asarray(scored.loss_fn_outputs[0]["logprobs"].data[len(prompt) - 1:])
            np.testing.assert_allclose(seq.logprobs, trained, atol=1e-3)    # the engine ran the adapter
        client.close("success").result(timeout=30)
