"""Tenants and limits of the Tinker server (postrain.actors.tinker.service, tenants.py, futures.py):
the 429s of max_training_clients_per_base and max_queued_requests_per_session, as raw HTTP and as
the tinker SDK meets them, and idle eviction to disk with an exact resume."""
import asyncio
import logging
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker._client import AsyncTinker
import torch
import trio
from tinker import types

from postrain.actors.tinker import TinkerOptions
from tinker_server import API_KEY, tinker_served

sys.path.insert(0, str(Path(__file__).parent))
from test_training import adam, datums, raw_forward_backward, samples  # noqa: E402  (the training tests' data)

KEY = {"X-API-Key": API_KEY}
PROTO = {"Content-Type": "application/x-protobuf"}


def open_session(http: httpx.Client) -> str:
    return http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {},
                                                     "sdk_version": "0.38.0"}).json()["session_id"]


def create_model(http: httpx.Client, session_id: str, model_seq_id: int) -> httpx.Response:
    return http.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": model_seq_id,
                                                   "base_model": "tiny",
                                                   "lora_config": {"rank": 2, "train_unembed": False}})


def in_server(service, fn, *args):
    """`await fn(*args)` on the server's trio loop, from this (the test's) thread."""
    return trio.from_thread.run(fn, *args, trio_token=service.trio_token)


def test_a_base_past_its_training_clients_gets_429_naming_the_limit(tiny_bases):
    with tinker_served(tiny_bases, TinkerOptions(max_training_clients_per_base=1)) as (url, service):
        with httpx.Client(base_url=url, headers=KEY) as http:
            sid = open_session(http)
            assert create_model(http, sid, 0).status_code == 200
            refused = create_model(http, sid, 1)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            assert refused.headers["content-type"] == "application/json"
            detail = refused.json()["detail"]
            assert "base model 'tiny' holds 1 training clients" in detail
            assert "max_training_clients_per_base=1" in detail and "--max-training-clients-per-base N" in detail
            http.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}})
            assert service.tenants == {} and service.num_resident("tiny") == 0   # finishing freed its adapter
            other = open_session(http)
            assert create_model(http, other, 0).status_code == 200                 # and a new one fits


def test_the_sdks_client_raises_rate_limit_error_with_the_servers_message(tiny_bases):
    """Without retries left, the SDK raises tinker.RateLimitError carrying the 429's detail."""
    with tinker_served(tiny_bases, TinkerOptions(max_training_clients_per_base=1)) as (url, _):
        with httpx.Client(base_url=url, headers=KEY) as http:
            sid = open_session(http)
            assert create_model(http, sid, 0).status_code == 200

        async def create_with_no_retries():
            async with AsyncTinker(base_url=url, api_key=API_KEY, max_retries=0) as client:
                await client.models.create(request=types.CreateModelRequest(
                    session_id=sid, model_seq_id=1, base_model="tiny",
                    lora_config=types.LoraConfig(rank=2, train_unembed=False)))
        with pytest.raises(tinker.RateLimitError, match="max_training_clients_per_base=1"):
            asyncio.run(create_with_no_retries())


class _Seen429(logging.Handler):
    """Sets `event` when the SDK logs that it retries a 429 (tinker._base_client, debug)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.event = threading.Event()

    def emit(self, record):
        if "Retrying due to status code 429" in record.getMessage():
            self.event.set()


def test_the_sdk_retries_a_429_and_the_fourth_tenant_starts_once_a_session_frees_a_slot(tiny_bases):
    """tinker 0.38's create_lora_training_client retries a 429 itself (10 times, waiting Retry-After
    each, then RateLimitError): the fourth tenant waits, and starts when the first session finishes."""
    sdk_log = logging.getLogger("tinker._base_client")
    seen, level = _Seen429(), sdk_log.level
    sdk_log.addHandler(seen)
    sdk_log.setLevel(logging.DEBUG)
    try:
        options = TinkerOptions(max_training_clients_per_base=3, retry_after_s=1)
        with tinker_served(tiny_bases, options) as (url, service):
            first = tinker.ServiceClient(base_url=url, api_key=API_KEY)
            held = [first.create_lora_training_client("tiny", rank=2, seed=i, train_unembed=False).result(timeout=60)
                    for i in range(3)]
            second = tinker.ServiceClient(base_url=url, api_key=API_KEY)
            fourth = second.create_lora_training_client("tiny", rank=2, seed=3, train_unembed=False)
            assert seen.event.wait(60), "the SDK never met the 429"
            assert service.num_resident("tiny") == 3 and len(service.tenants) == 3       # it waits
            first.close("success").result(timeout=60)             # frees the three adapters
            tc = fourth.result(timeout=60)                        # the SDK's next retry fits
            assert service.tenants[tc.model_id].is_resident and len(held) == 3
            second.close("success").result(timeout=60)
    finally:
        sdk_log.removeHandler(seen)
        sdk_log.setLevel(level)


def test_a_session_past_its_queued_requests_gets_429_and_a_resent_request_does_not(tiny_bases):
    options = TinkerOptions(max_queued_requests_per_session=1, seq_gap_timeout_s=600)
    with tinker_served(tiny_bases, options) as (url, service):
        with httpx.Client(base_url=url, headers=KEY) as http:
            sid = open_session(http)
            model_id = create_model(http, sid, 0).json()["model_id"]
            tokens, masks = samples(1)
            waiting = raw_forward_backward(model_id, 2, datums(tokens, masks, 1))       # waits for seq_id 1
            first = http.post("/api/v1/forward_backward", content=waiting, headers=PROTO)
            assert first.status_code == 200 and service.futures.num_pending(sid) == 1
            again = http.post("/api/v1/forward_backward", content=waiting, headers=PROTO)
            assert again.json()["request_id"] == first.json()["request_id"]        # a retry is answered
            refused = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3,
                                                            "adam_params": adam().model_dump()})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            detail = refused.json()["detail"]
            assert f"session {sid!r} has 1 requests queued" in detail
            assert "max_queued_requests_per_session=1" in detail
            assert "--max-queued-requests-per-session N" in detail
            assert not in_server(service, service.evict, model_id)      # nothing queued may be evicted


def optimizer_state(tenant) -> dict:
    return {(i, k): v.clone() for i, s in tenant.optimizer.state_dict()["state"].items() for k, v in s.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool(torch.equal(a[k], b[k])) for k in a)


def test_an_evicted_tenant_resumes_on_its_next_request_bit_for_bit(tiny_bases):
    """Two tenants train alike; one is evicted after two steps and again between a forward_backward
    and its optim_step (pending gradients), each time resumed by its next request. After two more
    steps both hold the same adapter (the unembedding's too: the SDK's default) and AdamW state,
    exactly."""
    tokens, masks = samples(4, seed=5)
    data = datums(tokens, masks, sum(sum(m) for m in masks))
    options = TinkerOptions(max_training_clients_per_base=2, evict_after_s=3600)
    with tinker_served(tiny_bases, options) as (url, service):
        client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        evicted, kept = [client.create_lora_training_client("tiny", rank=4, seed=0).result() for _ in range(2)]
        for tc in (evicted, kept):
            for _ in range(2):
                tc.forward_backward(data, "cross_entropy").result()
                tc.optim_step(adam()).result()
        tenant = service.tenants[evicted.model_id]
        assert in_server(service, service.evict, evicted.model_id)
        path = tenant.evicted_to
        assert not tenant.is_resident and path.parent == service.state_dir and path.exists()
        assert service.num_resident("tiny") == 1                          # evicted: not counted
        third = client.create_lora_training_client("tiny", rank=2, seed=1, train_unembed=False).result()
        assert service.num_resident("tiny") == 2
        for tc in (evicted, kept):
            tc.forward_backward(data, "cross_entropy").result()            # resumes the evicted one
            assert tenant.is_resident and not path.exists()
            if tc is evicted:                                               # again, gradients pending
                assert in_server(service, service.evict, evicted.model_id) and not tenant.is_resident
            tc.optim_step(adam()).result()
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(adam()).result()
        assert service.num_resident("tiny") == 3     # a resume is never refused: the limit admits new ones
        other = service.tenants[kept.model_id]
        assert tenant.num_steps == other.num_steps == 4
        assert same(tenant.adapters(), other.adapters())
        assert same(optimizer_state(tenant), optimizer_state(other))
        idle = in_server(service, service.evict_idle, time.monotonic() + 3600)    # the sweep, an hour later
        assert sorted(idle) == sorted([evicted.model_id, kept.model_id, third.model_id])
        assert service.num_resident("tiny") == 0 and len(list(service.state_dir.iterdir())) == 3
        client.close("success").result(timeout=60)
        assert list(service.state_dir.iterdir()) == []                     # freed: their files deleted
    assert not service.state_dir.exists()                                  # the server's own folder, removed


def test_a_session_without_heartbeats_is_finished_and_its_training_clients_freed(tiny_bases):
    """A client that died without closing: past session_timeout_s of silence its session is finished
    (reason timeout) and its adapter leaves the base; a heartbeating session stays."""
    options = TinkerOptions(max_training_clients_per_base=1, session_timeout_s=300.0)
    with tinker_served(tiny_bases, options) as (url, service):
        with httpx.Client(base_url=url, headers=KEY) as http:
            silent = open_session(http)
            assert create_model(http, silent, 0).status_code == 200
            assert in_server(service, service.finish_silent_sessions, time.monotonic()) == []   # not yet
            later = time.monotonic() + 3600
            assert in_server(service, service.finish_silent_sessions, later) == [silent]
            assert service.tenants == {} and service.num_resident("tiny") == 0
            gone = http.post("/api/v1/session_heartbeat", json={"session_id": silent})
            assert gone.status_code == 410 and "timeout" in gone.json()["detail"]
            alive = open_session(http)
            assert create_model(http, alive, 0).status_code == 200             # the freed slot is taken


def test_a_base_past_its_training_memory_gets_429_and_a_tenant_larger_than_the_budget_400(tiny_bases):
    """tiny's rank-2 adapter over every linear layer: 16 bytes per weight of A and B (weights, gradients,
    AdamW's two moments) fill 0.45 MiB; a budget of 1.5 tenants holds one, not two."""
    from postrain.actors.tinker.tenants import lora_targets, training_state_bytes

    per_tenant = training_state_bytes(tiny_bases.get("tiny").model, 2, lora_targets(True, True, False))
    budget_mb = 1.5 * per_tenant / 2**20
    with tinker_served(tiny_bases, TinkerOptions(max_training_memory_mb_per_base=budget_mb)) as (url, service):
        with httpx.Client(base_url=url, headers=KEY) as http:
            sid = open_session(http)
            assert create_model(http, sid, 0).status_code == 200
            assert service.resident_bytes("tiny") == per_tenant
            refused = create_model(http, sid, 1)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            assert "max_training_memory_mb_per_base" in refused.json()["detail"]
            big = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 2, "base_model": "tiny",
                                                          "lora_config": {"rank": 8, "train_unembed": False}})
            assert big.status_code == 400 and "lower lora_config.rank" in big.json()["detail"]
            http.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}})
            assert service.resident_bytes("tiny") == 0
            assert create_model(http, open_session(http), 0).status_code == 200     # the freed budget takes one
