"""The `tinker` role (actors/tinker/actor.py): the Tinker API served by a supervised actor in its own
process, driven by the real SDK (a LoRA step and a sample), and its options refused where unsafe."""
from __future__ import annotations

import pytest
import tinker
import trio
from pydantic import ValidationError
from tinker import types

from postrain.actors.records import TINKER_ADDRESS
from postrain.actors.tinker.actor import TinkerActorOptions
from postrain.core import ActorSpec, Supervisor

KEY = "tml-role-test"


def drive(url: str) -> tuple[float, int]:
    """One LoRA SFT step and one sample through the SDK: (the step's loss, the sampled tokens)."""
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = client.create_lora_training_client("tiny", rank=2, seed=0, train_unembed=False).result()
    tokens = [1, 5, 9, 40, 77, 100, 101]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    loss = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=4, stop=[])).result()
    client.close("success").result(timeout=30)
    return loss, len(out.sequences[0].tokens)


@pytest.mark.slow
def test_the_tinker_role_serves_the_sdk_from_a_supervised_actor():
    async def main():
        async with Supervisor.open() as supervisor:
            ref = await supervisor.start(ActorSpec(
                name="tinker", cls="postrain.actors.tinker:TinkerActor", cpus=0.5, memory_mb=0, start_timeout_s=300,
                options={"models": ["tiny"], "api_key": KEY, "service": {"enable_sandbox": False}}))
            address = await ref.call(TINKER_ADDRESS)
            assert address.model == "tiny"
            return await trio.to_thread.run_sync(drive, address.url)

    loss, num_sampled = trio.run(main)
    assert loss > 0 and num_sampled == 4


def test_the_roles_options_refuse_an_exposed_server_without_a_key_and_a_key_the_sdk_cannot_send():
    with pytest.raises(ValidationError, match="needs an API key"):
        TinkerActorOptions(host="0.0.0.0")
    with pytest.raises(ValidationError, match="tml-"):
        TinkerActorOptions(api_key="secret")
    assert TinkerActorOptions(host="0.0.0.0", api_key=KEY).read_api_key() == KEY
