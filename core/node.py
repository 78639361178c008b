"""A process's messaging endpoint: `Node`.

`Node` owns the process's ZeroMQ context, its references to other actors (`ActorRef`,
core/actor_ref.py: `ask`, `tell`, `stream`) and the background tasks that serve them: the
reaper, which every tick delivers the replies that arrived while no caller read and fails the
requests past their deadline, and ZeroMQ's authentication handler for its Curve servers. The
serving side of an actor's inbox is `postrain.core.inbox`.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Coroutine

import anyio
import sniffio
import zmq
from zmq.utils import z85

from . import shm
from .actor_ref import ActorRef, reaches_same_host
from .identity import Identities
from .transport import AsyncSocket, CurveKeys

if TYPE_CHECKING:
    import trio

log = logging.getLogger("postrain.core")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"   # where libzmq asks a context's ZAP handler (RFC 27)
REAPER_TICK_S = 0.02    # request deadlines are enforced to within this


def native_event_class() -> type[anyio.Event] | type[trio.Event]:
    if sniffio.current_async_library() == "trio":
        import trio
        return trio.Event
    return anyio.Event


class Node:
    """Messaging endpoint of one process. Use as `async with Node(name) as node:`.

    Cancelling the `async with` body closes every socket; pending requests are
    abandoned (their callers are cancelled with it)."""

    def __init__(self, name: str, keys: CurveKeys | None = None,
                 shm_min_bytes: int | None = shm.DEFAULT_SHM_MIN_BYTES):
        self.name = name
        self.keys = keys
        self.shm_min_bytes = shm_min_bytes  # None disables shared memory (peers on other hosts)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._msg_ids = itertools.count(1)
        self._task_group: anyio.abc.TaskGroup | None = None
        self._refs: list[ActorRef] = []
        self._closers: list[Callable[[], None]] = []  # sockets to close after the tasks end
        self._zap_started = False
        # Who holds a client key (core/identity.py), for this process's Curve servers: set by the
        # runtime (asks the head) or the supervisor (its own table) before an inbox binds; else
        # made by `ensure_zap` from the keys it is given, each trusted to declare any sender.
        self.identities: Identities | None = None

    async def __aenter__(self) -> "Node":
        """Open the node's task group and start its reaper. Cancelled: nothing started."""
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._event_class = native_event_class()
        self._task_group.start_soon(self._reap_deadlines)
        return self

    def new_event(self) -> anyio.Event | trio.Event:
        """An Event of the running loop's own kind (trio.Event is 3x cheaper than anyio's)."""
        return self._event_class()

    async def _reap_deadlines(self) -> None:
        """Every tick: deliver arrived replies and fail overdue requests. Cancelled (the node
        closes): each tick is synchronous, so none is left half done."""
        while True:
            await anyio.sleep(REAPER_TICK_S)
            now = time.monotonic()
            for ref in self._refs:
                ref.drain()
                ref.reap(now)

    async def __aexit__(self, *exc_info: Any) -> bool:
        """Cancel the node's tasks, then close every socket and the shared memory left. Cancelled
        again while the tasks end: the sockets and shared memory are still closed (finally)."""
        assert self._task_group is not None   # made by __aenter__
        self._task_group.cancel_scope.cancel()
        try:
            return await self._task_group.__aexit__(*exc_info)
        finally:
            for close in self._closers:
                close()
            shm.cleanup_shm()

    def close_on_exit(self, close: Callable[[], None]) -> None:
        """Call `close` (a socket's) when the node ends, after its tasks are cancelled."""
        self._closers.append(close)

    def next_msg_id(self) -> int:
        return next(self._msg_ids)

    def shm_min_bytes_for(self, address: str, same_node: bool = False) -> int | None:
        """Shared memory only between processes on one host: `same_node` (the registry placed the
        actor on this process's node, whatever its address), or an address that proves it (ipc,
        tcp on loopback)."""
        return self.shm_min_bytes if reaches_same_host(address, same_node) else None

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        assert self._task_group is not None, "spawn inside `async with node`"
        self._task_group.start_soon(fn, *args)

    def ref(self, address: str, name: str | None = None, same_node: bool = False,
            server_key: bytes | None = None) -> ActorRef:
        """A reference to the actor at `address`; `same_node`: the registry says it runs on this
        process's node (its lookup's answer), so bulk arrays go through /dev/shm even over tcp.
        `server_key`: the Curve key it serves with (the lookup's answer; None: the control
        plane's, for the head and node agents)."""
        ref = ActorRef(self, address, name or address, same_node, server_key)
        self._refs.append(ref)
        self._closers.append(ref.close)
        return ref

    def rebind(self, name: str, address: str, same_node: bool = False) -> int:
        """Point every open reference to actor `name` at `address` (it was started again
        elsewhere: another node of a cluster, this one when `same_node`); returns how many moved.
        See ActorRef.rebind."""
        moved = [ref for ref in self._refs if ref.name == name and not ref.closed and ref.address != address]
        for ref in moved:
            ref.rebind(address, same_node)
        return len(moved)

    def close_refs(self, name: str) -> int:
        """Close every open reference to actor `name` (it is gone for good): requests in
        flight or waiting for a connection fail with ActorDiedError, as does every later one
        through them; returns how many were closed."""
        gone = [ref for ref in self._refs if ref.name == name and not ref.closed]
        for ref in gone:
            ref.close()
        return len(gone)

    def ensure_zap(self, allowed_keys: tuple[bytes, ...]) -> None:
        """Serve ZeroMQ's authentication requests for this process's Curve servers: a client key
        is let in when `self.identities` names it, `allowed_keys` (Z85) as CONTROL."""
        if self.identities is None:
            self.identities = Identities(allowed_keys)
        elif not set(allowed_keys) <= self.identities.trusted:
            self.identities.trusted = self.identities.trusted | set(allowed_keys)
        if self._zap_started:
            return
        self._zap_started = True
        sock = self.context.socket(zmq.REP)
        sock.linger = 0
        sock.bind(ZAP_ENDPOINT)
        self.spawn(_serve_zap, AsyncSocket(sock), self.identities)


async def _serve_zap(sock: AsyncSocket, identities: Identities) -> None:
    """ZAP (RFC 27): accept a CURVE client only if `identities` names its public key; the name
    becomes the connection's User-Id, which the inbox checks each message's sender against.
    Cancelled: the socket closes; a client whose request was unanswered fails its handshake."""
    try:
        while True:
            frames = [bytes(f) for f in await sock.recv_multipart()]
            if len(frames) < 6:
                log.warning("ignored a malformed ZAP request of %d frames", len(frames))
                continue
            version, request_id, _domain, peer_address, _identity, mechanism = frames[:6]
            key = frames[6] if len(frames) > 6 else b""
            name = None
            if mechanism == b"CURVE" and len(key) == 32:
                name = await identities.name_of(z85.encode(key))
            if name is None:
                log.warning("refused a %s connection from %s: client key not accepted",
                            mechanism.decode(errors="replace"), peer_address.decode(errors="replace"))
                status = [b"400", b"client key not accepted", b""]
            else:
                status = [b"200", b"OK", name.encode()]
            await sock.send_multipart([version, request_id, *status, b""])
    finally:
        # unbind first: it frees the endpoint at once, so the next Node of this process (one
        # context) can bind it; close alone frees it later, on libzmq's reaper thread
        with contextlib.suppress(zmq.ZMQError):
            sock.sock.unbind(ZAP_ENDPOINT)
        sock.close()
