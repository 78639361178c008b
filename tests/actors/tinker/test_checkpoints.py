"""save_weights and load_weights through the tinker SDK (save_state, load_state,
create_training_client_from_state[_with_optimizer]): postrain.actors.tinker.tenants checkpoints."""
import pytest
import tinker
from tinker import types

from tinker_server import API_KEY

TOKENS = [1, 5, 9, 40, 77, 100, 101]
DATUM = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                    loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [0.2] * 6})


def step(tc) -> None:
    tc.forward_backward([DATUM], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2, eps=1e-8)).result()


def weights(served, tc) -> dict:
    """A copy of the training client's adapter as the server holds it."""
    return {k: v.clone() for k, v in served[1].tenants[tc.model_id].adapters().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_a_saved_state_restores_the_adapter_and_its_optimizer(served):
    client = tinker.ServiceClient(base_url=served[0], api_key=API_KEY)
    tc = client.create_lora_training_client("tiny", rank=4, seed=0, train_unembed=False).result()
    assert tc.model_id == f"{client.holder.get_session_id()}:train:0"     # the id the SDK derives itself
    step(tc)
    path = tc.save_state("after-one").result().path
    assert path == f"tinker://{tc.model_id}/weights/after-one"
    saved = weights(served, tc)
    step(tc)
    continued = weights(served, tc)
    with pytest.warns(FutureWarning, match="load_state"):      # deprecated in the SDK, still served
        tc.load_state(path).result()
    assert same(weights(served, tc), saved)
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 4 and same(weights(served, resumed), saved)
    step(resumed)                 # the same second step as the original's, Adam moments included
    assert same(weights(served, resumed), continued)
    fresh_moments = client.create_training_client_from_state(path).result()
    step(fresh_moments)
    assert not same(weights(served, fresh_moments), continued)
    with pytest.raises(tinker.NotFoundError, match="names no weights saved on this server"):
        client.create_training_client_from_state(f"tinker://{tc.model_id}/weights/nope").result()
    client.close("success").result(timeout=30)
