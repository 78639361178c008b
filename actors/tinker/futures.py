"""Futures: every accepted Tinker request gets a `request_id` at once; its result is polled.

    store = FutureStore()
    request_id = store.open()                        # answered to the POST as {"request_id": ...}
    store.resolve(request_id, Result.json({...}))    # or Result.proto(bytes), Result.failed(error)
    content_type, body = await store.retrieve(request_id, allow_metadata_only=True)

What `retrieve` answers (POST /api/v1/retrieve_future), in the SDK 0.38's terms:
- pending after `poll_wait_s`: `{"type": "try_again", "request_id", "queue_state": "active"}`;
  the SDK asks again at once;
- done, `allow_metadata_only` and the payload over `inline_limit_bytes`: metadata first,
  `{"status": "complete_metadata", "response_payload_size": N}`; the SDK reserves N bytes of
  its in-flight budget and asks again without the flag;
- done: the payload (protobuf for ForwardBackwardOutput and SampleResponse, JSON otherwise);
- failed: `{"error", "category"}` (the SDK's RequestFailedResponse);
- unknown (never opened, or evicted): 404.

Invariant: a result stays readable, as many times as asked, until `max_kept` newer results
push it out (oldest first) or its session finishes (`forget`). `num_pending(owner)` == the
number of `owner`'s entries whose result is None (the service's queued-requests limit). `cancel` resolves a pending
future as failed (the work it stood for is not undone where it already ran).
"""
from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import trio

from .errors import TinkerAPIError

PROTO = "application/x-protobuf"
JSON = "application/json"


@dataclass(frozen=True)
class Result:
    content_type: str
    payload: bytes

    @classmethod
    def json(cls, body: dict) -> Result:
        return cls(JSON, json.dumps(body).encode())

    @classmethod
    def proto(cls, payload: bytes) -> Result:
        return cls(PROTO, payload)

    @classmethod
    def failed(cls, error: TinkerAPIError) -> Result:
        return cls(JSON, json.dumps(error.failed_future()).encode())


class _Entry:
    def __init__(self, owner: str | None):
        self.owner = owner                # the session whose request it is (None: none named)
        self.done = trio.Event()
        self.result: Result | None = None  # set exactly once, before `done` is set


class FutureStore:
    """Pending and finished futures by request id (the module's note)."""

    def __init__(self, max_kept: int = 4096, poll_wait_s: float = 10.0, inline_limit_bytes: int = 1 << 20):
        self.max_kept, self.poll_wait_s, self.inline_limit_bytes = max_kept, poll_wait_s, inline_limit_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._num_pending: dict[str, int] = {}     # owner -> its entries not yet resolved (never 0: removed)

    def open(self, owner: str | None = None) -> str:
        request_id = f"req-{uuid.uuid4().hex}"
        self._entries[request_id] = _Entry(owner)
        if owner is not None:
            self._num_pending[owner] = self._num_pending.get(owner, 0) + 1
        self._evict()
        return request_id

    def resolve(self, request_id: str, result: Result) -> None:
        """Set the result of a pending future (once; a later resolve is ignored: a cancel won)."""
        entry = self._entries.get(request_id)
        if entry is None or entry.result is not None:
            return
        entry.result = result
        entry.done.set()
        if entry.owner is not None:
            self._num_pending[entry.owner] -= 1
            if not self._num_pending[entry.owner]:
                del self._num_pending[entry.owner]

    def cancel(self, request_id: str) -> None:
        self.resolve(request_id, Result.failed(TinkerAPIError(400, f"request {request_id} was cancelled")))

    def forget(self, owner: str) -> None:
        """Drop every future of session `owner` (it finished)."""
        for request_id in [r for r, e in self._entries.items() if e.owner == owner]:
            del self._entries[request_id]
        self._num_pending.pop(owner, None)

    def num_pending(self, owner: str) -> int:
        """How many futures of session `owner` are open and not yet resolved."""
        return self._num_pending.get(owner, 0)

    def is_pending(self, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.result is None

    async def retrieve(self, request_id: str, allow_metadata_only: bool) -> tuple[str, bytes]:
        """(content type, body) of the reply (the module's note). Cancelled: nothing changes."""
        entry = self._entries.get(request_id)
        if entry is None:
            raise TinkerAPIError(404, f"unknown request_id {request_id!r}: never issued by this server, or its "
                                      f"result was dropped (the last {self.max_kept} are kept); resend the request")
        with trio.move_on_after(self.poll_wait_s):
            await entry.done.wait()
        result = entry.result
        if result is None:
            return JSON, json.dumps({"type": "try_again", "request_id": request_id, "queue_state": "active"}).encode()
        if allow_metadata_only and len(result.payload) > self.inline_limit_bytes:
            return JSON, json.dumps({"status": "complete_metadata",
                                     "response_payload_size": len(result.payload)}).encode()
        return result.content_type, result.payload

    def _evict(self) -> None:
        """Drop the oldest finished futures past max_kept (pending ones are never dropped)."""
        excess = len(self._entries) - self.max_kept
        for request_id in [r for r, e in self._entries.items() if e.result is not None][:max(excess, 0)]:
            del self._entries[request_id]
