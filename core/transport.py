"""ZeroMQ at the edge: addresses, CurveZMQ keys, and async send/receive on any loop.

The rest of the runtime never calls a blocking socket method. `AsyncSocket`
receives with NOBLOCK and, when nothing is queued, waits for the socket's
file descriptor through anyio, so the same code runs on trio and on asyncio
(uvloop).

ZeroMQ's descriptor is edge-triggered: it signals when the socket's state
changes, and any call that processes the socket's command queue (a send,
reading EVENTS) can consume that signal. Reading EVENTS, or a non-blocking
receive that finds nothing, drains that queue, so the next arrival signals
again: a receiver may park on the descriptor right after either says that
nothing is waiting. A send made while a receiver is parked may consume the
signal meant for it, so after such a send we check EVENTS and wake the
receiver if a message is waiting (see `AsyncSocket`).
"""
from __future__ import annotations

import ipaddress
import os
import socket as _socket
import tempfile
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Awaitable, Callable, cast

import anyio
import sniffio
import zmq

_SEND_RETRY_S = 0.0002      # first wait when the peer's queue is full
_SEND_RETRY_MAX_S = 0.002   # waits double up to this
HWM_MESSAGES = 10000        # queue bound per peer, each direction
_COPY_BELOW_BYTES = 1 << 16  # smaller bytes frames are copied on send: cheaper than tracking them


def ipc_address(socket_dir: str, name: str) -> str:
    """An ipc:// address for actor `name` under `socket_dir` (Unix socket paths max out at 107 bytes)."""
    path = os.path.join(socket_dir, f"{name}.sock")
    if len(path) > 100:
        raise ValueError(f"ipc socket path {path!r} is {len(path)} bytes, over the 100-byte limit "
                         "of Unix sockets; use a shorter run socket dir or actor name")
    return f"ipc://{path}"


def make_socket_dir() -> str:
    return tempfile.mkdtemp(prefix="pr-", dir="/tmp")


def free_tcp_port(host: str) -> int:
    """A tcp port free on `host` (an address of this machine) now: the OS picks it. Another
    process may take it before its user binds it; the user's bind then fails loudly."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


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


def is_this_hosts_address(ip: str) -> bool:
    """Whether `ip` (a tcp connection's Peer-Address) is loopback or an address of one of this
    host's interfaces, as they are now. A connection from another host cannot carry one: Linux
    drops a packet that arrives from outside with a local source address (`accept_local`, off
    by default), so no tcp handshake with such a source completes."""
    import psutil
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    address = getattr(address, "ipv4_mapped", None) or address
    if address.is_loopback:
        return True
    return any(nic.family in (_socket.AF_INET, _socket.AF_INET6)
               and ipaddress.ip_address(nic.address.split("%", 1)[0]) == address
               for nics in psutil.net_if_addrs().values() for nic in nics)


@dataclass(frozen=True)
class CurveKeys:
    """A run's keys: its CurveZMQ identity (servers present server_*; clients present client_*)
    and `bulk_key`, the AES-256 key that seals bulk bytes between nodes (core/sealed.py).

    A listening tcp socket accepts only clients whose public key is in `allowed_client_keys` (the
    run's control key: trusted to declare any sender) or that its supervisor names as an actor's
    (core/identity.py: each actor holds its own client pair, derived from `identity_seed`, which
    only the head and the node agents hold; an actor's own keys carry its name in `identity` and
    the bulk key only where its role needs it). The head makes them per run (`generate`) and
    hands them out sealed to node agents (core/enrol.py) and in each actor's start; the secrets
    never appear in a repr, a log or a config.

    Server pairs: the run's (`server_*` of the control plane's keys) serves the head and the node
    agents; each actor's inbox serves with its own pair, derived from the seed like its client
    pair, so an actor's keys hold neither the run's server secret nor another actor's.
    `control_server_public` is the control plane's server key, which an actor connects to its
    head with (`control_server_key`: `server_public` where it is empty, as in the run's keys)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)
    allowed_client_keys: tuple[bytes, ...] = ()
    bulk_key: bytes = field(default=b"", repr=False)
    identity_seed: bytes = field(default=b"", repr=False)   # the control plane's only (core/identity.py)
    identity: str = ""   # whose client pair this is: "" the run's control key, else an actor's name
    control_server_public: bytes = b""   # the head's and node agents' server key ("": server_public)

    @property
    def control_server_key(self) -> bytes:
        """The server key of the control plane (the head, the node agents)."""
        return self.control_server_public or self.server_public

    @classmethod
    def generate(cls) -> "CurveKeys":
        """A run's keys: the client pair is the control key (head, node agents, the operator's
        `status`/`down`); each actor gets its own pair from `identity_seed` (core/identity.py)."""
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret, (client_public,),
                   os.urandom(32), os.urandom(32))

    def to_dict(self) -> dict[str, Any]:
        return {"server_public": self.server_public, "server_secret": self.server_secret,
                "client_public": self.client_public, "client_secret": self.client_secret,
                "allowed_client_keys": list(self.allowed_client_keys), "bulk_key": self.bulk_key,
                "identity_seed": self.identity_seed, "identity": self.identity,
                "control_server_public": self.control_server_public}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CurveKeys":
        return cls(data["server_public"], data["server_secret"], data["client_public"],
                   data["client_secret"], tuple(data["allowed_client_keys"]), data["bulk_key"],
                   data.get("identity_seed", b""), data.get("identity", ""),
                   data.get("control_server_public", b""))


def uses_curve(address: str, keys: CurveKeys | None) -> bool:
    """Whether a socket at `address` speaks CurveZMQ: every tcp address when the run has keys
    (so that another local user cannot call an actor on 127.0.0.1 either); never ipc, whose
    socket lives in the run's private folder. A tcp address beyond loopback without keys is an
    error (ValueError), never a plain socket."""
    if not address.startswith("tcp://"):
        return False
    if keys is None:
        if is_beyond_loopback(address):
            raise ValueError(f"{address} is beyond loopback, which needs CurveZMQ keys; "
                             "pass the run's CurveKeys (CurveKeys.generate())")
        return False
    return True


def configure_server(sock: zmq.Socket[bytes], address: str, keys: CurveKeys | None) -> None:
    """Make `sock` a CurveZMQ server when `uses_curve(address, keys)`."""
    if not uses_curve(address, keys):
        return
    assert keys is not None   # uses_curve is False without keys
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = b"postrain"
    if hasattr(zmq, "ZAP_ENFORCE_DOMAIN"):   # libzmq >= 4.2.2: no ZAP handler, no connection (else
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)   # Curve without a handler admits any client key)


def configure_client(sock: zmq.Socket[bytes], address: str, keys: CurveKeys | None,
                     server_key: bytes | None = None) -> None:
    """Make `sock` a CurveZMQ client when `uses_curve(address, keys)`, of the server whose public
    key is `server_key` (an actor's, core/identity.py `server_key_of`; None: the control plane's)."""
    if not uses_curve(address, keys):
        return
    assert keys is not None   # uses_curve is False without keys
    sock.curve_serverkey = server_key or keys.control_server_key
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class AsyncSocket:
    """A zmq socket used from one event loop: received by one task at a time, sent from any.

    Invariant: at most one task is parked in `wait_readable` at a time;
    `_waiting` says whether one is. The hot path uses no cancel scopes or
    timers (each costs tens of microseconds); a parked receiver is woken with
    `notify_closing` (see `wake`), which makes its wait raise
    ClosedResourceError, caught here.

    Frames are sent and received by the C message path (`_zmqio`) where it
    loads, else by pyzmq's calls (`_PyzmqPath`); both give the same frames:
    `bytes` below 64 KiB, larger ones as zero-copy buffer objects (read them
    with `memoryview` or `bytes`)."""

    def __init__(self, sock: zmq.Socket[bytes]):
        self.sock = sock
        self.fd = sock.FD
        self._waiting = False
        self._closed = False
        self._wait_fd, self._notify_closing, self._woken_errors = _fd_primitives()

    def recv_multipart_nowait(self) -> list[Any] | None:
        """The next message's frames (a ROUTER's identity first), or None if none is
        waiting. Never yields. After None, `wait_readable` may park: this call drained the
        command queue."""
        return _recv_message(self.sock)

    async def wait_readable(self) -> None:
        """Park until a message may be waiting or `wake()` is called; call after
        `recv_multipart_nowait` returned None. May return with nothing to receive.
        Cancel-safe (receives nothing). Raises anyio.ClosedResourceError once closed."""
        if self._closed:
            raise anyio.ClosedResourceError
        self._waiting = True
        try:
            await self._wait_fd(self.fd)
        except self._woken_errors:
            if self._closed:
                raise anyio.ClosedResourceError from None
            # woken by wake() or by a send that found a message waiting
        finally:
            self._waiting = False

    def recv_authenticated_nowait(self) -> tuple[list[Any], str, str] | None:
        """Like `recv_multipart_nowait`, with the User-Id the authentication handler gave the
        sender's connection (core/node.py: its actor name, or CONTROL; "" where none) and the
        connection's Peer-Address (the sender's IP; "" where none). For Curve servers only:
        pyzmq's path, which keeps each frame's connection metadata."""
        return _PyzmqPath.recv_message_with_user(self.sock)

    def wake(self) -> None:
        """Make the task parked in `wait_readable`, if any, return now."""
        if self._waiting:
            self._notify_closing(self.fd)

    async def recv_multipart(self) -> list[Any]:
        """The next message's frames, as `recv_multipart_nowait` gives them. Cancel-safe: a cancelled call receives nothing.
        Raises anyio.ClosedResourceError once the socket is closed."""
        while True:
            frames = self.recv_multipart_nowait()
            if frames is not None:
                return frames
            await self.wait_readable()

    def send_nowait(self, frames: list[Any]) -> bool:
        """Send now if the socket can take it; False if it would block (high-water mark).
        A multipart message is all or nothing: ZeroMQ checks the limit at its first frame."""
        sock = self.sock
        sent = _send_frames(sock, frames)
        if sent is None:   # the C path sends only small bytes frames
            sent = _PyzmqPath.send_frames(sock, frames)
        if sent and self._waiting and _events(sock) & zmq.POLLIN:
            self._notify_closing(self.fd)  # wake the parked receiver: a message is waiting
        return sent

    async def send_multipart(self, frames: list[Any]) -> None:
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
                self._notify_closing(self.fd)
            except Exception:  # no loop running
                pass
        self.sock.close(linger=linger_ms)


class _PyzmqPath:
    """The message path through pyzmq's own calls, where the C one does not load.
    Costs that shape it (pyzmq, per call): a receive that finds nothing raises, which
    costs more than reading EVENTS first; a frame received without copying says
    whether another follows (`zmq.Frame.more`), which reading RCVMORE would cost
    as much to learn; pyzmq's multipart helpers read RCVMORE per frame.

    Either path's receive that finds nothing has drained the socket's command queue,
    so ZeroMQ's edge-triggered descriptor signals the next arrival."""

    @staticmethod
    def recv_message(sock: zmq.Socket[bytes]) -> list[Any] | None:
        received = _PyzmqPath.recv_message_with_user(sock, read_user=False)
        return None if received is None else received[0]

    @staticmethod
    def recv_message_with_user(sock: zmq.Socket[bytes], read_user: bool = True) -> tuple[list[Any], str, str] | None:
        if not cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:   # EVENTS is an int option
            return None
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        user = peer = ""
        frames: list[Any] = [frame.bytes if len(frame) < _COPY_BELOW_BYTES else frame]
        while frame.more:  # the rest of a multipart message is already here
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            if read_user and not user:   # every frame of a message carries its connection's metadata
                try:
                    user = cast(str, frame.get("User-Id")) or ""   # metadata properties are str
                    peer = cast(str, frame.get("Peer-Address")) or ""
                except zmq.ZMQError:   # no metadata: a connection without a ZAP answer
                    user = ""
            frames.append(frame.bytes if len(frame) < _COPY_BELOW_BYTES else frame)
        return frames, user, peer

    @staticmethod
    def send_frames(sock: zmq.Socket[bytes], frames: list[Any]) -> bool:
        last = len(frames) - 1
        try:
            for index, frame in enumerate(frames):
                sock.send(frame, zmq.NOBLOCK | zmq.SNDMORE if index < last else zmq.NOBLOCK,
                          copy=type(frame) is bytes and len(frame) < _COPY_BELOW_BYTES)
        except zmq.Again:
            assert index == 0, "ZeroMQ refused a later frame of a message it had begun"
            return False
        return True

    @staticmethod
    def events(sock: zmq.Socket[bytes]) -> int:
        return cast(int, sock.get(zmq.EVENTS))   # EVENTS is an int option


def _native_message_path() -> ModuleType | None:
    """The C message path bound to the libzmq that pyzmq loaded, or None where it was not
    built or that libzmq is not among this process's mappings (then pyzmq's calls serve)."""
    try:
        from . import _zmqio
    except ImportError:
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libzmq" in line}
    except OSError:
        return None
    for path in paths:
        try:
            _zmqio.bind(path)
            return cast(ModuleType, _zmqio)   # a compiled module: mypy sees no types in it
        except ImportError:
            continue
    return None


_native = _native_message_path()
_recv_message: Callable[[zmq.Socket[bytes]], list[Any] | None]
_send_frames: Callable[[zmq.Socket[bytes], list[Any]], bool | None]   # None: the C path declines the frames
_events: Callable[[zmq.Socket[bytes]], int]
if _native is not None:
    _recv_message, _send_frames, _events = _native.recv_message, _native.send_frames, _native.events
else:
    _recv_message, _send_frames, _events = (_PyzmqPath.recv_message, _PyzmqPath.send_frames,
                                            _PyzmqPath.events)
NATIVE_MESSAGE_PATH = _native is not None


def _fd_primitives() -> tuple[Callable[[int], Awaitable[None]], Callable[[int], None],
                            tuple[type[BaseException], ...]]:
    """(wait_readable, notify_closing, errors a woken wait raises) for the running loop:
    trio's own functions on trio (anyio's wrappers look the backend up on every call,
    which costs more than the wait), anyio's elsewhere."""
    try:
        on_trio = sniffio.current_async_library() == "trio"
    except sniffio.AsyncLibraryNotFoundError:
        on_trio = False
    if on_trio:
        import trio
        return (trio.lowlevel.wait_readable, trio.lowlevel.notify_closing,
                (trio.ClosedResourceError, anyio.ClosedResourceError))
    return anyio.wait_readable, anyio.notify_closing, (anyio.ClosedResourceError,)
