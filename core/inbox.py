"""An actor's inbox: the serving side of the message layer.

`Inbox` serves one ROUTER socket: one task receives and decodes into a
bounded queue, one task dispatches to the handlers; a reply is sent by the
task that produced it (ZeroMQ sends are atomic on the loop's thread), waiting
while the caller's queue is full. A malformed frame, an unknown kind or a
handler that raises gets a typed ERROR reply and a log line; the inbox keeps
serving.
"""
from __future__ import annotations

import collections
import logging
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import anyio
import zmq

from . import wire
from .node import Node, native_event_class
from .transport import HWM_MESSAGES, AsyncSocket, configure_server, is_beyond_loopback

log = logging.getLogger("postrain.core")

UNKNOWN_REQUEST = -1    # corr_id of an error reply to a message too broken to show its msg_id
REPLY_TIMEOUT_S = 10.0  # how long a reply waits for a caller whose queue is full
INBOX_QUEUE_MESSAGES = 1024  # decoded messages waiting for the dispatcher before receive pauses


@dataclass(frozen=True)
class Handler:
    """How the inbox runs one message kind.

    stream: the function is an async generator; each item is sent as ITEM, then END.
    concurrent: run each message in its own task (default: one at a time, in order)."""

    fn: Callable
    stream: bool = False
    concurrent: bool = False
    wants_message: bool = False


@dataclass
class Reply:
    """Return this from a handler to set the reply's policy_version."""
    body: Any
    policy_version: int | None = None


class Inbox:
    """Serves one ROUTER socket: receive task -> channel -> dispatcher -> outbox.

    A malformed frame, an unknown kind or a handler that raises gets an ERROR
    reply (type MalformedMessage, UnknownKind, or the exception's class) and a
    log line; the inbox keeps serving."""

    def __init__(self, node: Node, address: str, handlers: dict[str, Handler],
                 allowed_client_keys: tuple[bytes, ...] = ()):
        self.node = node
        self.address = address
        self.handlers = handlers
        sock = node.context.socket(zmq.ROUTER)
        sock.linger = 1000
        sock.router_mandatory = True   # a full peer queue makes send wait, not drop
        sock.sndhwm = sock.rcvhwm = HWM_MESSAGES
        configure_server(sock, address, node.keys)
        if is_beyond_loopback(address):
            node.ensure_zap(allowed_client_keys or node.keys.allowed_client_keys)
        sock.bind(address)
        self.bound_address = sock.last_endpoint.decode()
        self._sock = AsyncSocket(sock)
        self._shm_min_bytes = node.shm_min_bytes_for(address)  # decided once, not per reply
        node._closers.append(self.close)
        self.num_queued = 0       # decoded, waiting for the dispatcher
        self.num_in_flight = 0    # handlers running
        self.num_served = 0
        self.num_rejected = 0

    async def serve(self) -> None:
        """Run until cancelled. Cancellation stops receiving; queued messages are dropped
        (their callers see a disconnect once the socket closes)."""
        queue = MessageQueue(INBOX_QUEUE_MESSAGES)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._receive, queue)
            await self._dispatch(queue, tg)

    def close(self) -> None:
        self._sock.close(linger_ms=1000)

    async def _receive(self, queue: "MessageQueue") -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except (zmq.ZMQError, anyio.ClosedResourceError):
                return
            identity, frames = frames[0], frames[1:]
            try:
                msg = wire.decode(frames)
            except wire.WireError as exc:
                self.num_rejected += 1
                log.warning("inbox %s: malformed message: %s", self.address, exc)
                corr_id = wire.peek_msg_id(frames) or UNKNOWN_REQUEST
                await self.post_error(identity, corr_id, "MalformedMessage", str(exc))
                continue
            await queue.put((identity, msg))
            self.num_queued = len(queue)

    async def _dispatch(self, queue: "MessageQueue", tg) -> None:
        while True:
            identity, msg = await queue.get()
            self.num_queued = len(queue)
            if msg.kind == wire.PING:
                await self.post(identity, wire.REPLY, msg.msg_id, "pong")
                continue
            handler = self.handlers.get(msg.kind)
            if handler is None:
                self.num_rejected += 1
                log.warning("inbox %s: unknown message kind %r from %s", self.address, msg.kind,
                            msg.sender)
                await self.post_error(identity, msg.msg_id, "UnknownKind",
                                      f"no handler for message kind {msg.kind!r}; this actor "
                                      f"handles {sorted(self.handlers)}")
                continue
            if handler.concurrent:
                tg.start_soon(self._run, handler, identity, msg)
            else:
                await self._run(handler, identity, msg)

    async def _run(self, handler: Handler, identity, msg: wire.Message) -> None:
        self.num_in_flight += 1
        try:
            args = (msg.body, msg) if handler.wants_message else (msg.body,)
            if handler.stream:
                async for item in handler.fn(*args):
                    await self._post_result(identity, wire.ITEM, msg.msg_id, item)
                await self.post(identity, wire.END, msg.msg_id, None)
            else:
                await self._post_result(identity, wire.REPLY, msg.msg_id, await handler.fn(*args))
            self.num_served += 1
        except Exception as exc:  # the handler's failure goes back to the caller, not up
            log.warning("inbox %s: handler for %r raised %s: %s", self.address, msg.kind,
                        type(exc).__name__, exc)
            await self.post_error(identity, msg.msg_id, type(exc).__name__, str(exc),
                                  traceback.format_exc())
        finally:
            self.num_in_flight -= 1

    async def _post_result(self, identity, kind, corr_id, result) -> None:
        if isinstance(result, Reply):
            await self.post(identity, kind, corr_id, result.body, result.policy_version)
        else:
            await self.post(identity, kind, corr_id, result)

    async def post(self, identity, kind: str, corr_id: int, body: Any,
                   policy_version: int | None = None) -> None:
        """Send a reply. A tell (corr_id 0) gets none: errors are logged instead.
        A caller that is gone or does not read for REPLY_TIMEOUT_S loses the reply (logged)."""
        if corr_id == 0:
            if kind == wire.ERROR:
                log.warning("inbox %s: error on a one-way message: %s", self.address, body)
            return
        msg = wire.Message(kind, self.node.next_msg_id(), corr_id, self.node.name, policy_version, body)
        try:
            frames = wire.encode(msg, self._shm_min_bytes)
        except wire.WireError as exc:
            await self.post_error(identity, corr_id, "WireError", f"cannot encode the reply: {exc}")
            return
        try:
            if not self._sock.send_nowait([identity, *frames]):
                with anyio.fail_after(REPLY_TIMEOUT_S):
                    await self._sock.send_multipart([identity, *frames])
        except (zmq.ZMQError, TimeoutError) as exc:
            log.warning("inbox %s: reply %s to %r lost: %s", self.address, kind, identity.bytes, exc)

    async def post_error(self, identity, corr_id: int, error_type: str, message: str,
                         remote_traceback: str = "") -> None:
        await self.post(identity, wire.ERROR, corr_id,
                        {"type": error_type, "message": message, "traceback": remote_traceback})


class MessageQueue:
    """The bounded channel between an inbox's receive task and its dispatcher.

    A deque and two events instead of a memory stream: `put` and `get` yield
    to the loop only when they must wait (full or empty), which saves two
    scheduler passes per message on the request path.
    Invariant: 0 <= len(self) <= max_items (put waits while full)."""

    def __init__(self, max_items: int):
        self.max_items = max_items
        self._items: collections.deque = collections.deque()
        self._not_empty: anyio.Event | None = None   # set by put; awaited by get when empty
        self._not_full: anyio.Event | None = None    # set by get; awaited by put when full
        self._new_event = native_event_class()

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item) -> None:
        """Cancel-safe: a cancelled put has not enqueued."""
        while len(self._items) >= self.max_items:
            self._not_full = self._not_full or self._new_event()
            await self._not_full.wait()
        self._items.append(item)
        if self._not_empty is not None:
            self._not_empty.set()
            self._not_empty = None

    async def get(self):
        """Cancel-safe: a cancelled get has not dequeued."""
        while not self._items:
            self._not_empty = self._not_empty or self._new_event()
            await self._not_empty.wait()
        item = self._items.popleft()
        if self._not_full is not None:
            self._not_full.set()
            self._not_full = None
        return item
