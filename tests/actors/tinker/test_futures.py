"""FutureStore (postrain.actors.tinker.futures): try_again, metadata first, results read twice."""
import json

import pytest
import trio

from postrain.actors.tinker.errors import TinkerAPIError
from postrain.actors.tinker.futures import FutureStore, Result


def test_pending_large_failed_and_unknown_futures_answer_in_the_sdks_shapes():
    async def main():
        store = FutureStore(poll_wait_s=0.01, inline_limit_bytes=8)
        request_id = store.open("s")
        kind, body = await store.retrieve(request_id, allow_metadata_only=True)
        assert json.loads(body) == {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        store.resolve(request_id, Result.proto(b"0123456789"))
        kind, body = await store.retrieve(request_id, allow_metadata_only=True)
        assert json.loads(body) == {"status": "complete_metadata", "response_payload_size": 10}
        for _ in range(2):      # readable more than once
            assert await store.retrieve(request_id, allow_metadata_only=False) == ("application/x-protobuf",
                                                                                   b"0123456789")
        failed = store.open("s")
        store.resolve(failed, Result.failed(TinkerAPIError(400, "bad datum")))
        assert json.loads((await store.retrieve(failed, False))[1]) == {"error": "bad datum", "category": "user"}
        store.forget("s")
        with pytest.raises(TinkerAPIError, match="unknown request_id"):
            await store.retrieve(request_id, False)
    trio.run(main)


def test_a_waiting_retrieve_returns_as_soon_as_the_result_is_in():
    async def main():
        store = FutureStore(poll_wait_s=30)
        request_id = store.open()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.lowlevel.checkpoint)
            store.resolve(request_id, Result.json({"model_id": "m"}))
        with trio.fail_after(5):
            assert json.loads((await store.retrieve(request_id, False))[1]) == {"model_id": "m"}
    trio.run(main)


def test_only_finished_results_past_max_kept_are_dropped_oldest_first():
    store = FutureStore(max_kept=2)
    pending = store.open()
    done = [store.open() for _ in range(2)]
    for request_id in done:
        store.resolve(request_id, Result.json({}))
    store.open()
    assert store.is_pending(pending)
    with pytest.raises(TinkerAPIError):
        trio.run(store.retrieve, done[0], False)
