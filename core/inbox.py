"""An actor's inbox: the serving side of the message layer.

`Inbox` serves one ROUTER socket with one task that receives, decodes and
runs each message's handler itself: a handler that runs one message at a
time (the default) runs inline, in arrival order, and a `concurrent=True`
handler in a task of its own. A reply is sent by the task that produced it
(ZeroMQ sends are atomic on the loop's thread), waiting while the caller's
queue is full. Running inline saves the scheduler pass a hand-off between a
receive task and a dispatcher would cost on every request; while a handler
runs, the next messages wait in ZeroMQ's queue (bounded by its high-water
mark), which is where a dispatcher's queue would have held them.
A malformed frame, an unknown kind or a handler that raises gets a typed
ERROR reply and a log line; the inbox keeps serving.
"""
from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from typing import Any, Callable, cast

import anyio
import zmq

from . import wire
from .identity import CONTROL, may_send_as
from .node import Node
from .transport import (HWM_MESSAGES, AsyncSocket, configure_server, is_beyond_loopback,
                        is_this_hosts_address, uses_curve)

log = logging.getLogger("postrain.core")

UNKNOWN_REQUEST = -1    # corr_id of an error reply to a message too broken to show its msg_id
REPLY_TIMEOUT_S = 10.0  # how long a reply waits for a caller whose queue is full
MAX_MESSAGES_PER_PASS = 64  # messages served back to back before the loop lets other tasks run


@dataclass(frozen=True)
class Handler:
    """How the inbox runs one message kind.

    stream: the function is an async generator; each item is sent as ITEM, then END.
    concurrent: run each message in its own task (default: one at a time, in order).
    control_only: on a socket that authenticates callers, served only for the run's control key
    (the supervisors and the operator, core/identity.py): the kernel's STOP, PEERS_MOVED,
    PEERS_GONE and CORES to an actor, `shutdown` to the head.
    senders: on such a socket, served for the control key and for the actors whose
    authenticated name it accepts (`senders(name)`), e.g. the head's `work` for the actors
    that hand out work."""

    fn: Callable[..., Any]   # async (a coroutine function), or an async generator when `stream`
    stream: bool = False
    concurrent: bool = False
    wants_message: bool = False
    control_only: bool = False
    senders: Callable[[str], bool] | None = None


@dataclass
class Reply:
    """Return this from a handler to set the reply's policy_version."""
    body: Any
    policy_version: int | None = None


class Inbox:
    """Serves one ROUTER socket: one task receives, decodes and runs handlers.

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
        if uses_curve(address, node.keys):
            assert node.keys is not None   # uses_curve is False without keys
            node.ensure_zap(allowed_client_keys or node.keys.allowed_client_keys)
        sock.bind(address)
        self.bound_address = cast(bytes, sock.last_endpoint).decode()   # LAST_ENDPOINT is a bytes option
        self._sock = AsyncSocket(sock)
        self._shm_min_bytes = node.shm_min_bytes_for(address)  # decided once, not per reply
        # A Curve server knows who calls (the ZAP User-Id, core/identity.py): a message whose
        # declared sender is not the caller's authenticated name is refused (SenderMismatch).
        self._authenticates = uses_curve(address, node.keys)
        # A /dev/shm handle is taken from a sender on this host only (core/wire.py): from any caller
        # of an address that cannot leave the host (ipc, inproc, loopback); beyond loopback, from a
        # connection whose Peer-Address is this host's (`_local_peers` keeps each peer's answer).
        self._shm_from_anyone = not is_beyond_loopback(address)
        self._local_peers: dict[str, bool] = {}
        node.close_on_exit(self.close)
        self.num_in_flight = 0    # handlers running
        self.num_served = 0
        self.num_rejected = 0

    async def serve(self) -> None:
        """Run until cancelled. Cancellation stops receiving; messages not yet received are
        dropped (their callers see a disconnect once the socket closes)."""
        async with anyio.create_task_group() as tg:
            await self._serve_messages(tg)

    def close(self) -> None:
        self._sock.close(linger_ms=1000)

    async def _serve_messages(self, tg: anyio.abc.TaskGroup) -> None:
        """Receive and handle messages until the socket closes. Messages already queued are
        taken without waiting on the socket; after MAX_MESSAGES_PER_PASS of them in a row
        the loop yields once, so a flood of tells cannot starve the actor's other tasks.
        Decoding and dispatch are inline here: every await saved is saved per message.
        Cancelled: as `serve`; a handler running inline is cancelled with it (see `_run`)."""
        sock, handlers, authenticates = self._sock, self.handlers, self._authenticates
        shm_from_anyone = self._shm_from_anyone
        num_in_row = 0
        user = peer = None
        while True:
            if authenticates:
                received = sock.recv_authenticated_nowait()
                frames, user, peer = received if received is not None else (None, None, None)
            else:
                frames = sock.recv_multipart_nowait()
            if frames is None:
                num_in_row = 0
                try:
                    await sock.wait_readable()
                except anyio.ClosedResourceError:
                    return
                continue
            identity, frames = frames[0], frames[1:]
            try:   # a socket beyond loopback authenticates (uses_curve), so `peer` is set there
                msg = wire.decode(frames, shm_from_anyone or self._is_local_peer(cast(str, peer)))
            except wire.WireError as exc:
                await self._reject_malformed(identity, frames, exc)
            else:
                handler = handlers.get(msg.kind)
                if user is not None and not may_send_as(user, msg.sender):
                    await self._reject_sender(identity, msg, user)
                elif user is not None and handler is not None and handler.control_only and user != CONTROL:
                    await self._reject_sender(identity, msg, user, "only the run's supervisors may send it")
                elif (user is not None and handler is not None and handler.senders is not None
                      and user != CONTROL and not handler.senders(user)):
                    await self._reject_sender(identity, msg, user, "this actor's role may not send it")
                elif handler is None:
                    await self._reject_unknown(identity, msg)
                elif handler.concurrent:
                    tg.start_soon(self._run, handler, identity, msg)
                else:
                    await self._run(handler, identity, msg)
            num_in_row += 1
            if num_in_row >= MAX_MESSAGES_PER_PASS:
                num_in_row = 0
                await anyio.lowlevel.checkpoint()

    def _is_local_peer(self, peer: str) -> bool:
        """Whether a connection from `peer` (its IP) comes from this host; asked once per peer."""
        local = self._local_peers.get(peer)
        if local is None:
            local = self._local_peers[peer] = is_this_hosts_address(peer)
        return local

    async def _reject_malformed(self, identity: bytes, frames: list[Any], exc: wire.WireError) -> None:
        """Count, log and answer a frame that does not decode. Cancelled: counted and logged;
        the error reply may not be sent (`post`)."""
        self.num_rejected += 1
        log.warning("inbox %s: malformed message: %s", self.address, exc)
        corr_id = wire.peek_msg_id(frames) or UNKNOWN_REQUEST
        await self.post_error(identity, corr_id, "MalformedMessage", str(exc))

    async def _reject_sender(self, identity: bytes, msg: wire.Message, user: str, why: str = "") -> None:
        """Count, log and refuse a message whose declared sender is not its caller's authenticated
        name, or (`why`) a kernel message from an actor. Cancelled: the reply may not be sent
        (`post`); the count and log line stay."""
        self.num_rejected += 1
        log.warning("inbox %s: refused %r declaring sender %r from a connection authenticated as %r%s",
                    self.address, msg.kind, msg.sender, user or "nobody", f": {why}" if why else "")
        if why:
            await self.post_error(identity, msg.msg_id, "SenderMismatch",
                                  f"message kind {msg.kind!r} from actor {user!r} refused: {why}")
            return
        await self.post_error(identity, msg.msg_id, "SenderMismatch",
                              f"this message declares sender {msg.sender!r}, but its connection's key "
                              f"authenticates {user or 'no one'!r}; an actor sends under its own name "
                              "and key only")

    async def _reject_unknown(self, identity: bytes, msg: wire.Message) -> None:
        """Answer a PING, or count, log and refuse a kind with no handler. Cancelled: the
        reply may not be sent (`post`); the count and log line stay."""
        if msg.kind == wire.PING:
            await self.post(identity, wire.REPLY, msg.msg_id, "pong")
            return
        self.num_rejected += 1
        log.warning("inbox %s: unknown message kind %r from %s", self.address, msg.kind,
                    msg.sender)
        await self.post_error(identity, msg.msg_id, "UnknownKind",
                              f"no handler for message kind {msg.kind!r}; this actor "
                              f"handles {sorted(self.handlers)}")

    async def _run(self, handler: Handler, identity: bytes, msg: wire.Message) -> None:
        """Run one message's handler and send its reply (a tell, msg_id 0, gets none).
        Cancelled: the handler is cancelled where it is (what it leaves is its own docstring's
        to say), no reply is sent, and num_in_flight is restored; num_served is not counted."""
        self.num_in_flight += 1
        try:
            args = (msg.body, msg) if handler.wants_message else (msg.body,)
            if handler.stream:
                async for item in handler.fn(*args):
                    await self.post(identity, wire.ITEM, msg.msg_id, item)
                await self.post(identity, wire.END, msg.msg_id, None)
            else:
                body = await handler.fn(*args)
                if msg.msg_id:
                    await self.post(identity, wire.REPLY, msg.msg_id, body)
            self.num_served += 1
        except Exception as exc:  # the handler's failure goes back to the caller, not up
            log.warning("inbox %s: handler for %r raised %s: %s", self.address, msg.kind,
                        type(exc).__name__, exc)
            await self.post_error(identity, msg.msg_id, type(exc).__name__, str(exc),
                                  traceback.format_exc())
        finally:
            self.num_in_flight -= 1

    async def post(self, identity: bytes, kind: str, corr_id: int, body: Any,
                   policy_version: int | None = None) -> None:
        """Send a reply (`body` may be a `Reply`, which sets policy_version). A tell
        (corr_id 0) gets none: errors are logged instead. Does not yield when the caller's
        queue has room; a caller that is gone or does not read for REPLY_TIMEOUT_S loses
        the reply (logged). Cancelled: the reply is not sent."""
        if corr_id == 0:
            if kind == wire.ERROR:
                log.warning("inbox %s: error on a one-way message: %s", self.address, body)
            return
        if isinstance(body, Reply):
            body, policy_version = body.body, body.policy_version
        msg = wire.Message(kind, self.node.next_msg_id(), corr_id, self.node.name, policy_version, body)
        try:
            frames = wire.encode(msg, self._shm_min_bytes)
        except wire.WireError as exc:
            await self.post_error(identity, corr_id, "WireError", f"cannot encode the reply: {exc}")
            return
        frames.insert(0, identity)
        try:
            if not self._sock.send_nowait(frames):
                with anyio.fail_after(REPLY_TIMEOUT_S):
                    await self._sock.send_multipart(frames)
        except (zmq.ZMQError, TimeoutError) as exc:
            log.warning("inbox %s: reply %s to %r lost: %s", self.address, kind, identity, exc)

    async def post_error(self, identity: bytes, corr_id: int, error_type: str, message: str,
                         remote_traceback: str = "") -> None:
        """Send an ERROR reply (`post`). Cancelled: the reply is not sent."""
        await self.post(identity, wire.ERROR, corr_id,
                        {"type": error_type, "message": message, "traceback": remote_traceback})
