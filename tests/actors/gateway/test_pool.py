"""The gateway's generator pool (actors/gateway/pool.py): requests spread to the generator with the
fewest in flight, past the bound a 429 with Retry-After, and no slot leaks when a request fails or is
cancelled. The pool's contract is any `.name` + `ask`; here each replica answers when the test lets it."""
from __future__ import annotations

import anyio
import pytest

from postrain.actors.gateway.pool import GeneratorPool
from postrain.actors.gateway.protocol import APIError
from postrain.actors.records import GenerateReply, GenerateRequest
from postrain.core.errors import ActorDiedError
from postrain.core.testing import async_test

REPLY = {"prompt_len": 1, "samples": [{"token_ids": [5], "logprobs": [-0.1], "policy_versions": [0],
                                       "finish_reason": "length", "text": "x"}]}


class Replica:
    def __init__(self, name: str):
        self.name, self.release, self.asked = name, anyio.Event(), 0

    async def call(self, kind, request, timeout_s):
        self.asked += 1
        await self.release.wait()
        if self.name == "dead":
            raise ActorDiedError("gone")
        return GenerateReply.from_wire(REPLY)


@async_test
async def test_requests_spread_by_load_and_past_the_bound_get_429():
    a, b = Replica("a"), Replica("b")
    pool = GeneratorPool([a, b], max_pending_requests=4)
    request = GenerateRequest(prompt_ids=[1])
    async with anyio.create_task_group() as group:
        for _ in range(4):
            group.start_soon(pool.generate, request)
        await anyio.wait_all_tasks_blocked()
        assert (a.asked, b.asked, pool.num_in_flight) == (2, 2, 4)
        with pytest.raises(APIError) as info:
            await pool.generate(request)
        assert info.value.status == 429 and info.value.retry_after_s == 1.0
        assert "max_pending_requests = 4" in info.value.message
        a.release.set()
        b.release.set()
    assert pool.num_in_flight == 0 and pool.in_flight == {"a": 0, "b": 0}


@async_test
async def test_a_dead_generator_is_a_503_and_a_cancelled_request_frees_its_slot():
    dead = Replica("dead")
    dead.release.set()
    pool = GeneratorPool([dead], max_pending_requests=2)
    with pytest.raises(APIError) as info:
        await pool.generate(GenerateRequest(prompt_ids=[1]))
    assert info.value.status == 503 and info.value.retry_after_s is not None
    slow = GeneratorPool([Replica("slow")], max_pending_requests=2)
    with anyio.move_on_after(0.05):
        await slow.generate(GenerateRequest(prompt_ids=[1]))
    assert slow.num_in_flight == 0
    with pytest.raises(ValueError, match="needs at least one generator"):
        GeneratorPool([], 1)
