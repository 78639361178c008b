"""Training clients through the tinker SDK against postrain's Tinker server: forward_backward,
optim_step and forward on LoRA tenants of the tiny model (postrain.actors.tinker.service,
tenants.py, ordering.py), held equal to postrain's own learner."""
import httpx
import numpy as np
import pytest
import tinker
import torch
import trio
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from postrain.actors.learner import Learner, LearnerConfig
from postrain.actors.records import SftBatch
from tinker_server import API_KEY

KEY = {"X-API-Key": API_KEY}
RANK, LR, BETAS, EPS = 4, 1e-3, (0.9, 0.95), 1e-8


def samples(num: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(token ids, loss masks) of `num` prompt + completion samples of the tiny vocabulary."""
    rng = np.random.default_rng(seed)
    tokens, masks = [], []
    for _ in range(num):
        prompt, completion = int(rng.integers(2, 6)), int(rng.integers(1, 5))
        tokens.append([int(t) for t in rng.integers(3, 250, prompt + completion)])
        masks.append([0] * prompt + [1] * completion)
    return tokens, masks


def datums(tokens, masks, num_trained: int) -> list[types.Datum]:
    """The Tinker datums of SFT samples: inputs t[:-1], targets t[1:], weights mask[1:] / num_trained
    (Tinker's cross_entropy is a sum, the learner's SFT loss a token mean)."""
    return [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                        loss_fn_inputs={"target_tokens": t[1:], "weights": [m / num_trained for m in mask[1:]]})
            for t, mask in zip(tokens, masks)]


def learner() -> Learner:
    return Learner(LearnerConfig(model="tiny", seed=0, lora={"rank": RANK, "alpha": 32.0}, lr=LR, betas=BETAS,
                                 adam_eps=EPS, max_grad_norm=None, micro_batch_size=2048))


def adam() -> types.AdamParams:
    return types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture
def client(served):
    service_client = tinker.ServiceClient(base_url=served[0], api_key=API_KEY)
    yield service_client
    service_client.close("success").result(timeout=30)


def train_client(client):
    return client.create_lora_training_client("tiny", rank=RANK, seed=0, train_unembed=False).result()


def test_cross_entropy_and_optim_step_equal_the_learners_sft_steps(served, client):
    tokens, masks = samples(6)
    n = sum(sum(m) for m in masks)
    reference = learner()
    first = reference.sft_step(SftBatch(token_ids=tokens, loss_mask=masks))
    reference.sft_step(SftBatch(token_ids=tokens, loss_mask=masks))
    tc = train_client(client)
    out = tc.forward_backward(datums(tokens, masks, n), "cross_entropy").result()
    tc.optim_step(adam()).result()
    tc.forward_backward(datums(tokens, masks, n), "cross_entropy").result()
    tc.optim_step(adam()).result()
    assert out.metrics["loss:sum"] == pytest.approx(first["loss"], abs=1e-5)
    assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [len(t) - 1 for t in tokens]
    tenant = served[1].tenants[tc.model_id]
    difference = max_difference(tenant.adapters(), reference.lora.adapters())
    assert difference < 1e-6, difference


def test_gradients_accumulate_over_calls_until_optim_step(served, client):
    tokens, masks = samples(6)
    whole, parts = train_client(client), train_client(client)
    whole.forward_backward(datums(tokens, masks, 10), "cross_entropy").result()
    for half in (slice(0, 3), slice(3, 6)):
        parts.forward_backward(datums(tokens[half], masks[half], 10), "cross_entropy").result()
    grads = [{k: p.grad for k, p in zip(served[1].tenants[c.model_id].adapters(),
                                        served[1].tenants[c.model_id].lora.parameters())} for c in (whole, parts)]
    for name in grads[0]:   # the same sum in another order: equal to float32 rounding
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)
    assert served[1].tenants[parts.model_id].num_accumulated == 2


def test_chunks_of_over_1024_datums_run_in_seq_id_order(served, client):
    """The SDK cuts 1,100 datums into chunks of 1,024 and 76 and sends the second first; the server
    runs them in seq_id order: the weights equal those of the same chunks posted in order."""
    tokens, masks = samples(1100, seed=1)
    n = sum(sum(m) for m in masks)
    data = datums(tokens, masks, n)
    reference = learner()
    loss = reference.sft_step(SftBatch(token_ids=tokens, loss_mask=masks))["loss"]
    tc = train_client(client)
    future = tc.forward_backward(data, "cross_entropy")
    tc.optim_step(adam()).result()
    out = future.result()
    assert len(out.loss_fn_outputs) == 1100 and out.metrics["loss:sum"] == pytest.approx(loss, abs=1e-5)
    in_order = train_client(client)
    proto = {**KEY, "Content-Type": "application/x-protobuf"}
    with httpx.Client(base_url=served[0], headers=KEY, timeout=120) as http:
        for seq_id, chunk in ((1, data[:1024]), (2, data[1024:])):
            http.post("/api/v1/forward_backward", content=raw_forward_backward(in_order.model_id, seq_id, chunk),
                      headers=proto)
        step = http.post("/api/v1/optim_step", json={"model_id": in_order.model_id, "seq_id": 3,
                                                     "adam_params": adam().model_dump()}).json()
        wait_result(http, step["request_id"])
    tenants = served[1].tenants
    assert max_difference(tenants[tc.model_id].adapters(), tenants[in_order.model_id].adapters()) == 0.0


def raw_forward_backward(model_id: str, seq_id: int, data: list[types.Datum]) -> bytes:
    request = types.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_backward_input=
                                           types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"))
    return forward_backward_request_to_proto(request).SerializeToString()


def wait_result(http: httpx.Client, request_id: str) -> httpx.Response:
    for _ in range(100):
        reply = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if reply.headers["content-type"].startswith("application/x-protobuf") or "try_again" not in reply.text:
            return reply
    raise AssertionError(f"{request_id} never finished")


def test_a_resent_request_is_applied_once_and_out_of_order_requests_run_in_order(served, client):
    tokens, masks = samples(4, seed=2)
    data = datums(tokens, masks, sum(sum(m) for m in masks))
    once = train_client(client)                    # the SDK's own order, each request once
    once.forward_backward(data, "cross_entropy").result()
    once.optim_step(adam()).result()
    raw = train_client(client)
    body = raw_forward_backward(raw.model_id, 1, data)
    proto = {**KEY, "Content-Type": "application/x-protobuf"}
    optim = {"model_id": raw.model_id, "seq_id": 2, "adam_params": adam().model_dump()}
    with httpx.Client(base_url=served[0], headers=KEY, timeout=60) as http:
        step = http.post("/api/v1/optim_step", json=optim).json()          # seq 2 first: it waits for 1
        first = http.post("/api/v1/forward_backward", content=body, headers=proto).json()
        again = http.post("/api/v1/forward_backward", content=body, headers=proto).json()   # a retry
        assert again["request_id"] == first["request_id"]
        assert http.post("/api/v1/optim_step", json=optim).json()["request_id"] == step["request_id"]
        assert wait_result(http, step["request_id"]).json()["metrics"]["learning_rate:mean"] == LR
        results = [wait_result(http, first["request_id"]).content for _ in range(2)]   # readable twice
        assert results[0] == results[1] and len(results[0]) > 0
    tenants = served[1].tenants
    assert max_difference(tenants[raw.model_id].adapters(), tenants[once.model_id].adapters()) == 0.0


def test_three_tenants_training_at_once_each_equal_training_alone(served, client):
    """Three adapters on one base, their requests interleaved: each ends as it would alone. Their
    forward_backwards may run batched (test_batching.py), which changes float32 rounding (about 1e-6
    of the gradients), and Adam's second step magnifies it where a gradient is near zero (3e-5
    measured here): the bound is a tenth of one step (lr 1e-3); a wrong gradient moves a whole step."""
    data = []
    for seed in range(3):
        tokens, masks = samples(3, seed=10 + seed)
        data.append(datums(tokens, masks, sum(sum(m) for m in masks)))
    together = [client.create_lora_training_client("tiny", rank=2 + i, seed=i, train_unembed=False).result()
                for i in range(3)]
    futures = []
    for _ in range(2):                       # every request sent before any result is read
        for tc, d in zip(together, data):
            futures += [tc.forward_backward(d, "cross_entropy"), tc.optim_step(adam())]
    for future in futures:
        future.result()
    tenants = served[1].tenants
    for i, d in enumerate(data):
        alone = client.create_lora_training_client("tiny", rank=2 + i, seed=i, train_unembed=False).result()
        for _ in range(2):
            alone.forward_backward(d, "cross_entropy").result()
            alone.optim_step(adam()).result()
        assert max_difference(tenants[together[i].model_id].adapters(), tenants[alone.model_id].adapters()) < 1e-4


def test_a_seq_id_gap_that_never_fills_fails_the_waiting_requests(served, client):
    tc = train_client(client)
    tokens, masks = samples(1)
    with httpx.Client(base_url=served[0], headers=KEY, timeout=60) as http:
        waiting = http.post("/api/v1/forward_backward", content=raw_forward_backward(tc.model_id, 3, datums(
            tokens, masks, 1)), headers={"Content-Type": "application/x-protobuf"}).json()
        failed = wait_result(http, waiting["request_id"]).json()   # seq_gap_timeout_s = 1 in the fixture
    assert failed["category"] == "user"
    assert "seq_id 1 of model" in failed["error"] and "never arrived within 1 s" in failed["error"]


def test_forward_only_leaves_the_weights_and_returns_the_logprobs(served, client):
    tokens, masks = samples(3, seed=3)
    tc = train_client(client)
    tenant = served[1].tenants[tc.model_id]
    before = tenant.adapters()
    out = tc.forward(datums(tokens, masks, 1), "cross_entropy").result()
    assert max_difference(before, tenant.adapters()) == 0.0 and tenant.num_accumulated == 0
    reference = learner().compute_logprobs(SftBatch(token_ids=tokens, loss_mask=masks))
    for o, expected in zip(out.loss_fn_outputs, reference):
        np.testing.assert_allclose(o["logprobs"].data, expected[1:].numpy(), atol=1e-5)


def test_bad_training_input_is_refused_by_name_and_other_tenants_go_on(served, client):
    tc, other = train_client(client), train_client(client)
    oov = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 999]),
                      loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match="token id 999 is outside 'tiny'.s vocabulary"):
        tc.forward_backward([oov], "cross_entropy").result()
    tokens, masks = samples(2)
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'orpo' is not supported"):
        other.forward_backward(datums(tokens, masks, 1), "orpo").result()
    fresh = train_client(client)
    assert fresh.forward(datums(tokens, masks, 1), "cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(tinker.BadRequestError, match="base_model 'Qwen/Qwen3-8B' is not held"):
        client.create_lora_training_client("Qwen/Qwen3-8B", rank=RANK, train_unembed=False).result()

