"""References to other actors: `ActorRef` talks to one actor over its own DEALER socket.

`call`, `send` and `call_stream` take a declared message (core/messages.py) and a record, and
return records; under them, `ask` (request/reply with a correlation id and a timeout), `tell`
(one-way), `stream` (a stream of replies) move raw bodies by name. A reference belongs to its process's `Node` (core/node.py), which makes it
(`Node.ref`), reaps its deadlines and closes it; the serving side is `postrain.core.inbox`.

Failure rule: every pending request ends in a reply, a `RemoteError`, an
`ActorTimeoutError`, or an `ActorDiedError` the moment the connection to the
actor drops (a socket monitor watches it), never in a hang.

Who reads replies (leader/follower): no task is dedicated to a reference's
socket. A caller waiting for its reply reads the socket itself when no other
task is reading it (it leads), and delivers the replies it reads for other
requests to their waiters (followers); when it has its own reply it hands
the socket to a waiting follower. A lone caller is thus woken by the socket
itself, not by a receive task one scheduler pass earlier. Between calls the
node's reaper drains what arrived (late replies, stream items) every tick.
"""
from __future__ import annotations

import collections
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine, Protocol

import anyio
import zmq
from zmq.utils.monitor import parse_monitor_message

from . import wire
from .errors import ActorDiedError, ActorTimeoutError, AuthenticationError, RemoteError
from .messages import UNTYPED, MessageKind, ReplyT
from .transport import HWM_MESSAGES, AsyncSocket, CurveKeys, configure_client, is_beyond_loopback, uses_curve

if TYPE_CHECKING:
    import trio

log = logging.getLogger("postrain.core")

_CONNECTED = zmq.EVENT_HANDSHAKE_SUCCEEDED
_LOST = zmq.EVENT_DISCONNECTED
_AUTH_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def reaches_same_host(address: str, same_node: bool) -> bool:
    """Whether an actor at `address` shares this process's host (and so its /dev/shm): the
    registry placed it on this node (`same_node`), or the address cannot leave the host (ipc,
    tcp on loopback). Never decided by comparing IP addresses: nodes may share one."""
    return same_node or not is_beyond_loopback(address)


class NodeSide(Protocol):
    """What a reference uses of its process's `Node` (core/node.py, which imports this module:
    named here by what it does, not imported)."""

    name: str
    keys: CurveKeys | None
    context: zmq.Context[zmq.Socket[bytes]]

    def next_msg_id(self) -> int: ...
    def shm_min_bytes_for(self, address: str, same_node: bool = False) -> int | None: ...
    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None: ...
    def new_event(self) -> anyio.Event | trio.Event: ...


@dataclass(slots=True)
class _Pending:
    """One request awaiting its reply. deadline: time.monotonic() by which the next
    reply must arrive (for a stream: the next item); the node's reaper enforces it."""
    kind: str
    stream: bool
    deadline: float
    timeout_s: float
    reply: wire.Message | None = None
    error: Exception | None = None
    items: Any = None      # stream: a deque of Message | Exception
    wake: Any = None       # an Event while its caller waits as a follower; set on news or hand-over
    sent: bool = False     # queued on a connection (False while it waits for one: see ActorRef.rebind)

    def has_news(self) -> bool:
        """A reply or an error is in (a stream: an item or an error waits to be taken)."""
        if self.stream:
            return bool(self.items)
        return self.reply is not None or self.error is not None


class ActorRef:
    """A handle to one actor at `address`. Cheap to keep; safe to use from many tasks.

    Invariant: `_pending` holds exactly the requests sent and not yet answered;
    each leaves it by its reply, its deadline (the node's reaper), or a disconnect.
    Timeouts are deadlines checked by one reaper task per node, not a cancel
    scope per request: scopes cost more than the rest of a round trip.

    Invariant: at most one task reads the socket at a time: `_reading` is True
    exactly while a caller leads (see the module docstring); the reaper reads
    only when it is False, and never waits. `_followers` holds the requests
    whose callers wait for the leader; when no task leads and one is waiting,
    one of them is woken to lead (`_hand_over`)."""

    def __init__(self, node: NodeSide, address: str, name: str, same_node: bool = False,
                 server_key: bytes | None = None):
        self.node = node    # the process's Node (core/node.py), which made this reference: `Node.ref`
        self.address = address
        self.name = name
        self.server_key = server_key   # the Curve key the actor serves with (None: the control plane's)
        # The actor runs on this process's host: bulk arrays go through /dev/shm. Decided by node
        # identity (`same_node`, from the registry) or by an address that proves it (ipc, loopback).
        self.same_host = reaches_same_host(address, same_node)
        sock = node.context.socket(zmq.DEALER)
        sock.linger = 0
        sock.immediate = True          # queue only on a live connection: nothing waits in a dead pipe
        sock.sndhwm = sock.rcvhwm = HWM_MESSAGES
        sock.reconnect_ivl = 20
        sock.reconnect_ivl_max = 500
        configure_client(sock, address, node.keys, server_key)
        self._uses_curve = uses_curve(address, node.keys)  # else a failed handshake means the peer went away
        self._monitor = AsyncSocket(_monitor_socket(node.context, sock))
        sock.connect(address)
        self._sock = AsyncSocket(sock)
        self._shm_min_bytes = node.shm_min_bytes_for(address, same_node)  # decided once, not per message
        # Its replies may name /dev/shm files only where its inbox sends them so (core/inbox.py): at
        # an address that cannot leave this host; from anywhere else such a reply is refused.
        self._shm_replies = not is_beyond_loopback(address)
        self._pending: dict[int, _Pending] = {}
        self._reading = False
        self._followers: dict[int, _Pending] = {}   # insertion-ordered: the oldest leads next
        self._connected = anyio.Event()
        self._auth_error: AuthenticationError | None = None
        self._accepted = False         # a Curve handshake with the actor at `address` succeeded once
        self._closed = False
        node.spawn(self._watch_connection)

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r}, {self.address!r})"

    # -- public API ---------------------------------------------------------

    async def call(self, kind: MessageKind[Any, ReplyT], request: Any = None, *, timeout_s: float = 30.0,
                   policy_version: int | None = None) -> ReplyT:
        """Send `request` (a record of kind.request, or None) and return the reply's record
        (core/messages.py). Raises as `ask`; TypeError for a request of the wrong record.
        Cancelled: the request may still run remotely."""
        reply = await self.ask_message(kind.name, kind.encode_request(request), timeout_s=timeout_s,
                                       policy_version=policy_version)
        return kind.decode_reply(reply.body)

    async def send(self, kind: MessageKind[Any, Any], request: Any = None, *, timeout_s: float = 30.0,
                   policy_version: int | None = None) -> None:
        """`tell` of a declared message: one-way, no reply. Cancelled: as `tell`."""
        # `tell`'s body, inlined: one-way messages are the message path's tightest loop
        body = request if kind.request is UNTYPED else kind.encode_request(request)
        frames = wire.encode(wire.Message(kind.name, 0, 0, self.node.name, policy_version, body), self._shm_min_bytes)
        if self._auth_error is None and not self._closed and self._sock.send_nowait(frames):
            return
        await self._send_waiting(frames, 0, kind.name, None, time.monotonic() + timeout_s, timeout_s)

    async def call_stream(self, kind: MessageKind[Any, ReplyT], request: Any = None, *, timeout_s: float = 30.0,
                          policy_version: int | None = None) -> AsyncIterator[ReplyT]:
        """A declared stream's items, each decoded into kind.reply. Cancelled: as `stream`."""
        async for body in self.stream(kind.name, kind.encode_request(request), timeout_s=timeout_s,
                                      policy_version=policy_version):
            yield kind.decode_reply(body)

    async def ask(self, kind: str, body: Any = None, *, timeout_s: float = 30.0,
                  policy_version: int | None = None) -> Any:
        """Send a request and return the reply's body. Raises RemoteError, ActorDiedError,
        ActorTimeoutError or AuthenticationError. Cancelled: the request may still run remotely."""
        return (await self.ask_message(kind, body, timeout_s=timeout_s,
                                       policy_version=policy_version)).body

    async def ask_message(self, kind: str, body: Any = None, *, timeout_s: float = 30.0,
                          policy_version: int | None = None) -> wire.Message:
        """Like `ask`, returning the whole reply Message (its policy_version too). Cancelled:
        the request may still run remotely; its reply, if any, is dropped on arrival."""
        msg_id = self.node.next_msg_id()
        pending = _Pending(kind, False, time.monotonic() + timeout_s, timeout_s)
        try:
            await self._send(msg_id, kind, body, policy_version, pending)
            await self._wait(msg_id, pending)
        finally:
            self._pending.pop(msg_id, None)
        if pending.error is not None:
            raise pending.error
        assert pending.reply is not None   # it has news and no error: its reply
        return pending.reply

    async def tell(self, kind: str, body: Any = None, *, timeout_s: float = 30.0,
                   policy_version: int | None = None) -> None:
        """Send one-way (msg_id 0: no reply). Returns once ZeroMQ has queued it on a live
        connection; a handler error is logged by the actor, not reported back.
        Does not yield when the message can be queued at once. Cancelled: the message is
        queued whole or not at all; an array it put in shared memory stays until the node closes."""
        frames = wire.encode(wire.Message(kind, 0, 0, self.node.name, policy_version, body),
                             self._shm_min_bytes)
        if self._auth_error is None and not self._closed and self._sock.send_nowait(frames):
            return
        await self._send_waiting(frames, 0, kind, None, time.monotonic() + timeout_s, timeout_s)

    async def stream(self, kind: str, body: Any = None, *, timeout_s: float = 30.0,
                     policy_version: int | None = None) -> AsyncIterator[Any]:
        """Send a request whose handler yields many replies; iterate their bodies.
        `timeout_s` bounds the wait for each item. Breaking out early abandons the rest.
        Cancelled: as breaking out; the remote handler runs on, its items are dropped."""
        async for msg in self.stream_messages(kind, body, timeout_s=timeout_s,
                                              policy_version=policy_version):
            yield msg.body

    async def stream_messages(self, kind: str, body: Any = None, *, timeout_s: float = 30.0,
                              policy_version: int | None = None) -> AsyncIterator[wire.Message]:
        """Like `stream`, yielding whole Messages. Cancelled: as `stream`."""
        msg_id = self.node.next_msg_id()
        pending = _Pending(kind, True, time.monotonic() + timeout_s, timeout_s,
                           items=collections.deque())
        try:
            await self._send(msg_id, kind, body, policy_version, pending)
            while True:
                if not pending.items:
                    await self._wait(msg_id, pending)
                item = pending.items.popleft()
                if isinstance(item, Exception):
                    raise item
                if item.kind == wire.END:
                    return
                yield item
        finally:
            self._pending.pop(msg_id, None)

    def rebind(self, address: str, same_node: bool = False) -> None:
        """Talk to the actor at `address` from now on (it was started again on another node;
        on this process's node when `same_node`).
        Every request sent fails with ActorDiedError (it went to the old process, which is gone),
        so its caller's retry rules apply; those still waiting for a connection (never sent) go
        to the new address, as do later ones."""
        old = self.address
        sent = {msg_id: pending for msg_id, pending in self._pending.items() if pending.sent}
        for msg_id, pending in sent.items():
            del self._pending[msg_id]
            self._deliver(pending, ActorDiedError(f"actor {self.name} moved from {old} to {address} with the "
                                                  "request in flight (its node was lost); retry"))
        self._sock.wake()  # a leading caller waits on the socket
        sock = self._sock.sock
        try:
            sock.disconnect(old)
        except zmq.ZMQError:
            pass  # never connected there
        configure_client(sock, address, self.node.keys, self.server_key)   # its name's: unchanged
        self.address = address
        self._uses_curve = uses_curve(address, self.node.keys)
        self.same_host = reaches_same_host(address, same_node)
        self._shm_min_bytes = self.node.shm_min_bytes_for(address, same_node)
        self._shm_replies = not is_beyond_loopback(address)
        if self._connected.is_set():
            self._connected = anyio.Event()
        self._auth_error = None
        self._accepted = False
        sock.connect(address)

    @property
    def closed(self) -> bool:
        """True once `close` has run: every request through this reference fails."""
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(ActorDiedError(f"reference to actor {self.name} was closed"))
        self._connected.set()  # a sender waiting for a connection wakes, finds it closed and fails
        try:
            self._sock.sock.disable_monitor()  # libzmq's io thread blocks on a monitor nobody reads
        except zmq.ZMQError:
            pass
        self._monitor.close()
        self._sock.close()

    # -- internals ----------------------------------------------------------

    def timeout_error(self, kind: str, timeout_s: float) -> ActorTimeoutError:
        state = "connected" if self._connected.is_set() else "never connected"
        return ActorTimeoutError(
            f"no reply from actor {self.name} ({self.address}, {state}) to {kind!r} within "
            f"{timeout_s} s; check that it is running (`postrain status`) or raise timeout_s")

    async def _send(self, msg_id: int, kind: str, body: Any, policy_version: int | None,
                    pending: _Pending) -> None:
        """Register `pending` and send the request. Cancelled: the request was queued whole or
        not at all; `pending` stays registered for the caller to remove (ask's finally does)."""
        frames = wire.encode(wire.Message(kind, msg_id, 0, self.node.name, policy_version, body),
                             self._shm_min_bytes)
        self._pending[msg_id] = pending
        if self._auth_error is None and not self._closed and self._sock.send_nowait(frames):
            pending.sent = True
            return  # the fast path: connected, room in the queue
        await self._send_waiting(frames, msg_id, kind, pending, pending.deadline, pending.timeout_s)

    async def _send_waiting(self, frames: list[Any], msg_id: int, kind: str, pending: _Pending | None,
                            deadline: float, timeout_s: float) -> None:
        """Send once connected and the peer's queue has room, or raise by `deadline`.
        Cancelled: nothing was sent (a send is atomic); the caller removes its pending entry."""
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
            while True:
                if self._auth_error is not None:
                    raise self._auth_error
                if self._closed:
                    raise ActorDiedError(f"reference to actor {self.name} is closed")
                if pending is not None and pending.error is not None:
                    raise pending.error   # failed while we waited (disconnect, reaper)
                if self._sock.send_nowait(frames):
                    if pending is not None:
                        pending.sent = True
                    return
                if self._connected.is_set():   # connected but full: wait for room
                    await anyio.sleep(0.0002)
                else:
                    await self._connected.wait()
        if pending is not None:
            self._pending.pop(msg_id, None)
        raise self.timeout_error(kind, timeout_s)

    def reap(self, now: float) -> None:
        """Fail every request whose deadline has passed (the node's reaper calls this)."""
        for msg_id, pending in list(self._pending.items()):
            if pending.deadline < now:
                del self._pending[msg_id]
                self._deliver(pending, self.timeout_error(pending.kind, pending.timeout_s))
                self._sock.wake()  # if its caller leads, it waits on the socket, not an event

    def drain(self) -> None:
        """Deliver every reply that has arrived, without waiting, when no caller is reading
        (the node's reaper calls this each tick): stream items reach their deque and late
        error replies get logged even while no caller waits."""
        if self._reading or self._closed:
            return
        try:
            while (frames := self._sock.recv_multipart_nowait()) is not None:
                self._on_reply(frames)
        except zmq.ZMQError:
            return
        self._hand_over()

    async def _wait(self, msg_id: int, pending: _Pending) -> None:
        """Return once `pending` has news. Leads (reads the socket) when no other task does;
        otherwise waits to be handed news or the lead. Cancelled: nothing is lost; a reply
        that arrives later is dropped, and the lead passes to another waiting caller."""
        try:
            while not pending.has_news():
                if not self._reading:
                    await self._lead(pending)
                    continue
                pending.wake = self.node.new_event()
                self._followers[msg_id] = pending
                try:
                    await pending.wake.wait()
                finally:
                    pending.wake = None
                    self._followers.pop(msg_id, None)
        finally:
            self._hand_over()

    async def _lead(self, pending: _Pending) -> None:
        """Read the socket, delivering every reply, until `pending` has news. Cancelled: the
        replies read so far are delivered; `_reading` is cleared so another caller may lead."""
        self._reading = True
        try:
            while not pending.has_news():
                frames = self._sock.recv_multipart_nowait()
                if frames is not None:
                    self._on_reply(frames)
                    continue
                try:
                    await self._sock.wait_readable()
                except anyio.ClosedResourceError:
                    if not pending.has_news():  # close() fails every request before closing
                        self._deliver(pending, ActorDiedError(
                            f"reference to actor {self.name} was closed"))
        except zmq.ZMQError as exc:  # the socket was closed under us
            if not pending.has_news():
                self._deliver(pending, ActorDiedError(f"reference to actor {self.name}: {exc}"))
        finally:
            self._reading = False

    def _hand_over(self) -> None:
        """If no task reads the socket, wake the oldest waiting caller to lead."""
        if not self._reading and self._followers:
            pending = next(iter(self._followers.values()))
            if pending.wake is not None:
                pending.wake.set()

    def _on_reply(self, frames: list[Any]) -> None:
        try:
            msg = wire.decode(frames, self._shm_replies)
        except wire.WireError as exc:
            log.error("actor %s sent a malformed reply: %s", self.name, exc)
            return
        pending = self._pending.get(msg.corr_id)
        if pending is None:
            if msg.kind == wire.ERROR:
                log.error("actor %s: %s", self.name, msg.body)
            return
        if not pending.stream or msg.kind in (wire.END, wire.ERROR):
            del self._pending[msg.corr_id]
        self._deliver(pending, _error_from(msg) if msg.kind == wire.ERROR else msg)

    @staticmethod
    def _deliver(pending: _Pending, item: wire.Message | Exception) -> None:
        if pending.stream:
            pending.items.append(item)
            pending.deadline = time.monotonic() + pending.timeout_s
        elif not isinstance(item, Exception):
            pending.reply = item
        if isinstance(item, Exception):
            pending.error = item
        if pending.wake is not None:
            pending.wake.set()

    async def _watch_connection(self) -> None:
        """Follow the socket's connection events: connected, lost (fail every pending request),
        refused key. Cancelled: events stop being read; pending requests keep their deadlines."""
        while not self._closed:
            try:
                frames = await self._monitor.recv_multipart()
            except (zmq.ZMQError, anyio.ClosedResourceError):
                return
            message = parse_monitor_message([bytes(f) for f in frames])
            if message["endpoint"] and message["endpoint"].decode(errors="replace") != self.address:
                continue  # the connection to an address this reference left (rebind)
            event = message["event"]
            if event == _CONNECTED:
                self._auth_error = None
                self._accepted = True
                self._connected.set()
            elif event == _LOST or (event & _AUTH_FAILED and not self._uses_curve):
                if self._connected.is_set():
                    self._connected = anyio.Event()
                self._fail_all(ActorDiedError(
                    f"actor {self.name} ({self.address}) disconnected with the request in flight "
                    "(it died or was stopped); the supervisor restarts crashed actors: retry"))
            elif event & _AUTH_FAILED and self._accepted:
                # Not our key: the actor that accepted it is gone, and something else answers at its
                # address (on one machine, a reconnect to a closed port can even meet itself). Keep
                # waiting, as for any lost actor, until it is back or moves (rebind).
                log.debug("actor %s (%s): handshake failed after it had accepted our key", self.name,
                          self.address)
            elif event & _AUTH_FAILED:
                self._auth_error = AuthenticationError(
                    f"actor {self.name} ({self.address}) refused our CurveZMQ key, or is not the actor "
                    "whose server key we expected; connect with the run's CurveKeys (the head makes "
                    "them per run and hands them out in memory, to node agents and actors; they are "
                    "never written to the run folder) and the actor's server key (the head's lookup "
                    "answers it; core/identity.py server_key_of), or add this client's public key "
                    "to the actor's allowed_client_keys")
                self._fail_all(self._auth_error)
                # wake senders waiting for a connection so they raise the auth error
                self._connected.set()
                self._connected = anyio.Event()

    def _fail_all(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for item in pending.values():
            self._deliver(item, error)
        self._sock.wake()  # a leading caller waits on the socket


def _monitor_socket(context: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    """A PAIR socket receiving `sock`'s connection events. pyzmq's get_monitor_socket names
    the endpoint after the descriptor number, which the OS reuses; a unique name cannot
    attach to a closing socket's monitor."""
    address = f"inproc://postrain-monitor-{uuid.uuid4().hex}"
    sock.monitor(address, _CONNECTED | _LOST | _AUTH_FAILED)
    monitor = context.socket(zmq.PAIR)
    monitor.linger = 0
    monitor.connect(address)
    return monitor


def _error_from(msg: wire.Message) -> RemoteError:
    body = msg.body if isinstance(msg.body, dict) else {}
    return RemoteError(str(body.get("type", "Error")), str(body.get("message", msg.body)),
                       str(body.get("traceback", "")))
