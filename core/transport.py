"""ZeroMQ at the edge: addresses, CurveZMQ keys, and async send/receive on any loop.

The rest of the runtime never calls a blocking socket method. `AsyncSocket`
receives with NOBLOCK and, when nothing is queued, waits for the socket's
file descriptor through anyio, so the same code runs on trio and on asyncio
(uvloop).

ZeroMQ's descriptor is edge-triggered: it signals when the socket's state
changes, and any call that processes the socket's command queue (a send,
reading EVENTS) can consume that signal. So after every send we check EVENTS
and, if a message is waiting while the receiver sleeps on the descriptor, we
wake the receiver (see `AsyncSocket`).
"""
from __future__ import annotations

import ipaddress
import os
import socket as _socket
import tempfile
from dataclasses import dataclass

import anyio
import zmq

_SEND_RETRY_S = 0.0002      # first wait when the peer's queue is full
_SEND_RETRY_MAX_S = 0.002   # waits double up to this
HWM_MESSAGES = 10000        # queue bound per peer, each direction


def ipc_address(socket_dir: str, name: str) -> str:
    """An ipc:// address for actor `name` under `socket_dir` (Unix socket paths max out at 107 bytes)."""
    path = os.path.join(socket_dir, f"{name}.sock")
    if len(path) > 100:
        raise ValueError(f"ipc socket path {path!r} is {len(path)} bytes, over the 100-byte limit "
                         "of Unix sockets; use a shorter run socket dir or actor name")
    return f"ipc://{path}"


def make_socket_dir() -> str:
    return tempfile.mkdtemp(prefix="pr-", dir="/tmp")


def is_beyond_loopback(address: str) -> bool:
    """True when a tcp address listens (or connects) beyond the loopback interface."""
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost",):
        return False
    if host in ("*", "0.0.0.0", "::"):
        return True
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return not ipaddress.ip_address(_socket.gethostbyname(host)).is_loopback
        except OSError:
            return True


@dataclass(frozen=True)
class CurveKeys:
    """A run's CurveZMQ identity: servers present server_*; clients present client_*.

    A listening socket beyond loopback accepts only clients whose public key
    is in `allowed_client_keys` (by default the run's own client key)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed_client_keys: tuple[bytes, ...] = ()

    @classmethod
    def generate(cls) -> "CurveKeys":
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret, (client_public,))

    def to_dict(self) -> dict:
        return {"server_public": self.server_public, "server_secret": self.server_secret,
                "client_public": self.client_public, "client_secret": self.client_secret,
                "allowed_client_keys": list(self.allowed_client_keys)}

    @classmethod
    def from_dict(cls, data: dict) -> "CurveKeys":
        return cls(data["server_public"], data["server_secret"], data["client_public"],
                   data["client_secret"], tuple(data["allowed_client_keys"]))


def configure_server(sock: zmq.Socket, address: str, keys: CurveKeys | None) -> None:
    """Make `sock` a CurveZMQ server when `address` listens beyond loopback."""
    if not is_beyond_loopback(address):
        return
    if keys is None:
        raise ValueError(f"{address} listens beyond loopback, which needs CurveZMQ keys; "
                         "pass the run's CurveKeys (CurveKeys.generate())")
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = b"postrain"


def configure_client(sock: zmq.Socket, address: str, keys: CurveKeys | None) -> None:
    if not is_beyond_loopback(address):
        return
    if keys is None:
        raise ValueError(f"{address} is beyond loopback, which needs CurveZMQ keys")
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class AsyncSocket:
    """A zmq socket used from one event loop: recv by one task, sends from any task.

    Invariant: at most one task waits in `recv_multipart` at a time (the
    runtime's receive task); `_waiting` says whether it is parked on the
    descriptor. The hot path uses no cancel scopes or timers (each costs tens
    of microseconds); a parked receiver is woken with `notify_closing`, which
    makes its wait raise ClosedResourceError, caught here."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.fd = sock.FD
        self._waiting = False
        self._closed = False

    async def recv_multipart(self) -> list:
        """The next message's frames (zmq.Frame). Cancel-safe: a cancelled call receives nothing.
        Raises anyio.ClosedResourceError once the socket is closed."""
        sock = self.sock
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                return sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                continue  # the edge was consumed (by a send); a message is waiting
            self._waiting = True
            try:
                await anyio.wait_readable(self.fd)
            except anyio.ClosedResourceError:
                pass  # woken by _wake_receiver, or closing (checked at the top)
            finally:
                self._waiting = False

    def send_nowait(self, frames: list) -> bool:
        """Send now if the socket can take it; False if it would block (high-water mark)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        if self._waiting and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            anyio.notify_closing(self.fd)  # wake the parked receiver: a message is waiting
        return True

    async def send_multipart(self, frames: list) -> None:
        """Send, waiting while the peer's queue is full. Cancel-safe: cancelled means not sent."""
        delay = _SEND_RETRY_S
        while not self.send_nowait(frames):
            await anyio.sleep(delay)
            delay = min(delay * 2, _SEND_RETRY_MAX_S)

    def close(self, linger_ms: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._waiting:
            try:
                anyio.notify_closing(self.fd)
            except Exception:  # no loop running
                pass
        self.sock.close(linger=linger_ms)
