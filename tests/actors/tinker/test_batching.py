"""Several tenants' forward_backward batched into one forward of their shared base
(actors/learner/lora.py `batched_adapters`, tenants.py `forward_backward_together`, the
service's "Batching tenants"): each adapter on its own rows equals that adapter alone, and three
tenants trained at once, batched or in turn (batch_tenants=False), each end as trained alone."""
import sys
from pathlib import Path

import pytest
import tinker
import torch
import trio

from postrain.actors.learner.lora import ALL_LINEAR, LearnerLora, batched_adapters
from postrain.actors.tinker import TinkerOptions
from tinker_server import API_KEY, tinker_served

sys.path.insert(0, str(Path(__file__).parent))
from test_training import LR, adam, datums, max_difference, samples  # noqa: E402  (the training tests' data)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# (rank, seed, train_mlp, train_unembed) of the three tenants: two of rank 4, one of them adapting the
# unembedding too (its own LM head weight in the batch), one of rank 8 on attention alone
TENANTS = [(4, 0, True, False), (4, 1, True, True), (8, 2, False, False)]


def test_adapters_on_their_own_rows_equal_each_alone_in_value_and_gradient(tiny_bases):
    model = tiny_bases.get("tiny").model
    loras = [LearnerLora(model, {"rank": rank, "alpha": 32.0, "targets": targets}, seed)
             for rank, seed, targets in ((2, 0, ALL_LINEAR), (3, 1, ALL_LINEAR), (4, 2, ATTENTION))]
    try:
        generator = torch.Generator().manual_seed(0)
        for lora in loras:
            lora.enabled = False
            with torch.no_grad():
                for b in lora.lora_B.values():     # B = 0 would make every adapter the base
                    b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
        ids = torch.randint(3, 250, (7, 6), generator=generator)
        rows = [[0, 4], [1, 2, 5], [6]]            # row 3 takes no adapter: the base alone
        probe = torch.randn(7, 6, model.config.hidden_size, generator=generator)
        alone, alone_grads = [], []
        for lora, mine in zip(loras, rows):
            lora.enabled = True
            out = model.hidden_states(ids[mine])
            (out * probe[mine]).sum().backward()
            alone.append(out.detach())
            alone_grads.append([p.grad.clone() for p in lora.parameters()])
            lora.enabled = False
            for p in lora.parameters():
                p.grad = None
        base = model.hidden_states(ids[[3]]).detach()
        with batched_adapters(list(zip(loras, rows))):
            out = model.hidden_states(ids)
            (out * probe).sum().backward()
        for lora, mine, expected, grads in zip(loras, rows, alone, alone_grads):
            torch.testing.assert_close(out[mine].detach(), expected, rtol=0, atol=1e-5)
            for p, g in zip(lora.parameters(), grads):   # float32 rounding (float64: 1e-15 of the largest)
                assert float((p.grad - g).abs().max()) <= 1e-5 * float(g.abs().max())
            assert lora.enabled is False and lora.rows is None          # as before the block
        torch.testing.assert_close(out[[3]].detach(), base, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="rows overlap"):
            with batched_adapters([(loras[0], [0, 1]), (loras[1], [1])]):
                pass
        assert all(lora.enabled is False and lora.rows is None for lora in loras)
    finally:
        for lora in loras:
            lora.detach()


@pytest.fixture(scope="module")
def batching(tiny_bases):
    """(base URL, TinkerService) of a server batching its tenants (the default)."""
    with tinker_served(tiny_bases, TinkerOptions(seq_gap_timeout_s=5.0, poll_wait_s=2.0, evict_after_s=None)) as out:
        yield out


@pytest.fixture
def client(batching):
    service_client = tinker.ServiceClient(base_url=batching[0], api_key=API_KEY)
    yield service_client
    service_client.close("success").result(timeout=30)


def hold_compute(service):
    """Take the server's compute limiter from this thread: requests queue, none runs; the
    function that gives it back."""
    token, borrower = service.trio_token, object()
    trio.from_thread.run(service.compute.acquire_on_behalf_of, borrower, trio_token=token)
    return lambda: trio.from_thread.run_sync(service.compute.release_on_behalf_of, borrower, trio_token=token)


@pytest.mark.parametrize("batch_tenants", [True, False])
def test_three_tenants_training_at_once_each_equal_training_alone(tiny_bases, batch_tenants):
    """Three tenants (different seeds, one of another rank and targets) send two rounds of
    forward_backward + optim_step at once: each ends as trained alone, and the forwards ran
    batched exactly when batch_tenants is set."""
    data = []
    for i in range(len(TENANTS)):
        tokens, masks = samples(3, seed=10 + i)
        data.append(datums(tokens, masks, sum(sum(m) for m in masks)))
    options = TinkerOptions(batch_tenants=batch_tenants, seq_gap_timeout_s=5.0, poll_wait_s=2.0, evict_after_s=None)
    with tinker_served(tiny_bases, options) as (url, service):
        client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        try:
            def create():
                return [client.create_lora_training_client("tiny", rank=rank, seed=seed, train_mlp=mlp,
                                                           train_unembed=unembed).result()
                        for rank, seed, mlp, unembed in TENANTS]
            together = create()
            session = together[0].model_id.rsplit(":train:", 1)[0]
            done = at_once(service, session, lambda: [f for _ in range(2) for tc, d in zip(together, data)
                                                      for f in (tc.forward_backward(d, "cross_entropy"),
                                                                tc.optim_step(adam()))])
            first_losses = [done[2 * i].metrics["loss:sum"] for i in range(len(TENANTS))]
            first_outputs = [done[2 * i].loss_fn_outputs for i in range(len(TENANTS))]
            batched, batched_ops = service.num_batched_forwards, service.num_batched_ops
            alone = create()
            alone_losses = []
            for tc, d in zip(alone, data):
                for step in range(2):
                    out = tc.forward_backward(d, "cross_entropy").result()
                    tc.optim_step(adam()).result()
                    if step == 0:
                        alone_losses.append(out.metrics["loss:sum"])
            assert (service.num_batched_forwards, service.num_batched_ops) == (batched, batched_ops)
            for i in range(len(TENANTS)):
                ours, theirs = (service.tenants[tc.model_id].adapters() for tc in (together[i], alone[i]))
                difference = max_difference(ours, theirs)
                # Adam divides each gradient element by its own size: where one is near eps, the
                # batched forward's rounding moves its update by up to a few percent of the step
                # (1.2e-5 seen). A tenant trained on another's rows would differ by whole steps.
                assert difference < LR / 20 if batch_tenants else difference == 0.0, difference
                # each tenant's own outputs, in its own datums' order
                assert first_losses[i] == pytest.approx(alone_losses[i], rel=1e-5)
                assert [len(o["logprobs"].data) for o in first_outputs[i]] == [len(d.model_input.to_ints())
                                                                                for d in data[i]]
        finally:
            client.close("success").result(timeout=30)
    if batch_tenants:   # round one: the three forwards in one; round two as they came
        assert batched >= 1 and batched_ops >= 3, (batched, batched_ops)
    else:
        assert (batched, batched_ops) == (0, 0)


def at_once(service, session: str, send):
    """The futures `send()` returns, its requests all accepted while the compute is held: they
    run as one batch when it is given back."""
    give_back = hold_compute(service)
    try:
        before = service.futures.num_pending(session)
        futures = send()
        for _ in range(500):
            if service.futures.num_pending(session) == before + len(futures):
                break
            trio.from_thread.run(trio.sleep, 0.01, trio_token=service.trio_token)
        assert service.futures.num_pending(session) == before + len(futures), "the SDK sent them all"
    finally:
        give_back()
    return [f.result() for f in futures]


def gradients(service, tc) -> dict:
    tenant = service.tenants[tc.model_id]
    return {k: p.grad for k, p in tenant.named_parameters().items()}


def test_a_forward_batched_with_a_forward_backward_leaves_its_weights_and_equals_each_alone(batching, client):
    service = batching[1]
    trains, reads, train_alone = (client.create_lora_training_client("tiny", rank=4, seed=seed, train_unembed=False)
                                  .result() for seed in (0, 1, 0))
    session = trains.model_id.rsplit(":train:", 1)[0]
    (tokens, masks), (other_tokens, other_masks) = samples(3, seed=20), samples(4, seed=21)
    train_data, read_data = datums(tokens, masks, 9), datums(other_tokens, other_masks, 1)
    before, weights = service.num_batched_forwards, service.tenants[reads.model_id].adapters()
    trained, read = at_once(service, session, lambda: [trains.forward_backward(train_data, "cross_entropy"),
                                                        reads.forward(read_data, "cross_entropy")])
    assert service.num_batched_forwards == before + 1
    assert max_difference(weights, service.tenants[reads.model_id].adapters()) == 0.0
    assert [service.tenants[tc.model_id].num_accumulated for tc in (reads, trains)] == [0, 1]
    read_alone = reads.forward(read_data, "cross_entropy").result()
    for o, expected in zip(read.loss_fn_outputs, read_alone.loss_fn_outputs):
        assert max(abs(a - b) for a, b in zip(o["logprobs"].data, expected["logprobs"].data)) < 1e-5
    alone = train_alone.forward_backward(train_data, "cross_entropy").result()
    assert trained.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5)
    ours, theirs = gradients(service, trains), gradients(service, train_alone)
    for name, grad in theirs.items():       # lora_A's are 0 (B starts at zero): equal too
        assert float((ours[name] - grad).abs().max()) <= 1e-5 * max(float(grad.abs().max()), 1e-12), name


def test_a_batch_whose_forward_fails_runs_its_requests_one_by_one(batching, client, monkeypatch):
    import postrain.actors.tinker.batching as batching_module

    def broken(jobs):
        raise RuntimeError("a batched forward that fails")
    monkeypatch.setattr(batching_module, "forward_backward_together", broken)
    service = batching[1]
    tcs = [client.create_lora_training_client("tiny", rank=2, seed=seed, train_unembed=False).result()
           for seed in (0, 1)]
    session = tcs[0].model_id.rsplit(":train:", 1)[0]
    tokens, masks = samples(2, seed=22)
    data = datums(tokens, masks, 4)
    before = (service.num_batched_forwards, service.num_batched_ops)
    results = at_once(service, session, lambda: [tc.forward_backward(data, "cross_entropy") for tc in tcs])
    assert (service.num_batched_forwards, service.num_batched_ops) == before     # nothing ran batched
    assert [service.tenants[tc.model_id].num_accumulated for tc in tcs] == [1, 1]
    assert all(r.metrics["loss:sum"] > 0 for r in results)
