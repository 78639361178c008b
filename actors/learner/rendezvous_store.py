"""An authenticated, encrypted key-value store for the learner group's rendezvous.

torch's `TCPStore` (what `init_process_group("tcp://...")` uses) answers anyone who reaches its
port: a stranger can read the addresses the ranks publish, write its own, or join as a rank.
`AuthenticatedStore` is a `torch.distributed.Store` that gloo and NCCL use the same way, served
by rank 0 on its node's address only (never 0.0.0.0), whose clients must prove the group's
secret (`Actor.group_secret`, made per run and group by the supervisors, core/identity.py):

    store = AuthenticatedStore(host, port, secret, is_server=(rank == 0), timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    ...
    store.close()          # rank 0: stop serving (after destroy_process_group)

Protocol (TCP, each frame a 4-byte big-endian length and its bytes). The server sends b"PRS1" and
a fresh 32-byte nonce; the client answers its own nonce and HMAC-SHA256(secret, "client" + both
nonces); the server checks it (a wrong or late answer: the connection is closed, nothing was
read) and proves itself with HMAC(secret, "server" + both nonces). Every later frame is
AES-256-GCM under a key of that connection and direction (derived from the secret and both
nonces), its nonce the frame's counter, so a frame cannot be read, changed, replayed or moved
to another connection. Requests and replies are msgpack lists.

What a stranger costs (it cannot prove the secret): a connection, one thread and at most
MAX_HANDSHAKE_FRAME_BYTES of frame, for at most `handshake_timeout_s`: one deadline holds the
whole handshake, however slowly its bytes trickle, and only a proven connection may send frames
of up to MAX_FRAME_BYTES. One address holds at most `max_handshakes_per_peer` connections in
handshake at once, so one host cannot take every one of the `max_connections` slots; a rank
turned away at a cap (its connection closed before the greeting) tries again until its timeout.

Invariants (tests/actors/learner/test_rendezvous_store.py): the table is read or changed only by
a connection that proved the secret (probed in both directions); under `_lock`,
`_num_handshaking[address]` counts the connections from `address` admitted and not yet past
their handshake, each <= max_handshakes_per_peer, and len(_connections) <= max_connections.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta

import msgpack
import torch.distributed as dist
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from postrain.core.gate import RateLimitedLog

log = logging.getLogger("postrain.learner")

_MAGIC = b"PRS1"
_NONCE_BYTES = 32
MAX_HANDSHAKE_FRAME_BYTES = 256  # a frame before the proof (the handshake's are 36, 64 and 32 bytes)
MAX_FRAME_BYTES = 16 << 20       # a frame of a proven connection (stores hold small values); over: closed
HANDSHAKE_TIMEOUT_S = 10.0       # the whole handshake: a client without its proof by then is dropped
MAX_CONNECTIONS = 256            # open connections the server holds at once (the excess is closed)
MAX_HANDSHAKES_PER_PEER = 8      # in handshake from one address at once (a node's ranks join at once)
WARNING_INTERVAL_S = 10.0        # at most one refusal line per address this often


class RendezvousRefused(ConnectionError):
    """The other side did not prove the group's secret (or broke the protocol)."""


class _Closed(ConnectionError):
    """The other side closed the connection."""


def _mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


class _Channel:
    """One proven connection: AES-GCM frames, a counter per direction (client to server, back)."""

    def __init__(self, sock: socket.socket, secret: bytes, server_nonce: bytes, client_nonce: bytes,
                 is_server: bool):
        base = _mac(secret, b"keys", server_nonce, client_nonce)
        to_server = AESGCM(hmac.new(base, b"to server", hashlib.sha256).digest())
        to_client = AESGCM(hmac.new(base, b"to client", hashlib.sha256).digest())
        self.sock = sock
        self._seal, self._open = (to_client, to_server) if is_server else (to_server, to_client)
        self._sent = self._received = 0

    def send(self, value) -> None:
        nonce = struct.pack(">Q4x", self._sent)
        self._sent += 1
        _send_frame(self.sock, self._seal.encrypt(nonce, msgpack.packb(value, use_bin_type=True), None))

    def receive(self):
        nonce = struct.pack(">Q4x", self._received)
        self._received += 1
        frame = _recv_frame(self.sock)
        try:
            return msgpack.unpackb(self._open.decrypt(nonce, frame, None), raw=False)
        except Exception as exc:   # InvalidTag: changed, replayed or not ours
            raise RendezvousRefused(f"a rendezvous frame did not open ({type(exc).__name__})") from None


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """`size` bytes. With a `deadline` (time.monotonic()): TimeoutError once it passes, however
    slowly the bytes come (the socket's timeout is set to the time left before each recv)."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            time_left_s = deadline - time.monotonic()
            if time_left_s <= 0:
                raise TimeoutError("the handshake's deadline passed")
            sock.settimeout(time_left_s)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise _Closed("the rendezvous connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, deadline: float | None = None) -> bytes:
    """One frame of at most `max_bytes` (a larger one is refused from its length, unread)."""
    (size,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if size > max_bytes:
        raise RendezvousRefused(f"a rendezvous frame of {size} bytes is over the {max_bytes}-byte limit")
    return _recv_exact(sock, size, deadline)


def _client_handshake(sock: socket.socket, secret: bytes) -> _Channel:
    """Prove the secret and check the server's proof, all within HANDSHAKE_TIMEOUT_S. _Closed
    where the server closes before its greeting (it is at a cap): the caller may try again."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    hello = _recv_frame(sock, MAX_HANDSHAKE_FRAME_BYTES, deadline)
    if len(hello) != len(_MAGIC) + _NONCE_BYTES or not hello.startswith(_MAGIC):
        raise RendezvousRefused("the rendezvous server did not speak the group's protocol")
    server_nonce, client_nonce = hello[len(_MAGIC):], os.urandom(_NONCE_BYTES)
    _send_frame(sock, client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
    try:
        proof = _recv_frame(sock, MAX_HANDSHAKE_FRAME_BYTES, deadline)
    except ConnectionError:
        raise RendezvousRefused("the rendezvous server closed the connection: it did not accept this "
                                "rank's proof of the group's secret (a rank of another run or group?)") from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", server_nonce, client_nonce)):
        raise RendezvousRefused("the rendezvous server did not prove the group's secret")
    return _Channel(sock, secret, server_nonce, client_nonce, is_server=False)


class StoreServer:
    """Rank 0's side: the table, served to proven clients on (host, port), one thread each.
    handshake_timeout_s (default HANDSHAKE_TIMEOUT_S): the whole handshake's deadline;
    max_connections (default MAX_CONNECTIONS): open connections in all;
    max_handshakes_per_peer (default MAX_HANDSHAKES_PER_PEER): connections from one address
    that have not yet proved the secret. A connection over a cap is closed before the greeting.
    Invariant: `_table` changes only under `_changed` (a Condition), which waiters wait on."""

    def __init__(self, host: str, port: int, secret: bytes, *,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 max_handshakes_per_peer: int = MAX_HANDSHAKES_PER_PEER):
        if not 0 < max_handshakes_per_peer <= max_connections:
            raise ValueError(f"a rendezvous server needs 0 < max_handshakes_per_peer <= max_connections, "
                             f"got {max_handshakes_per_peer} and {max_connections}")
        self._secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections, self.max_handshakes_per_peer = max_connections, max_handshakes_per_peer
        self._table: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.address = self._listener.getsockname()[:2]
        self._closed = False
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()                            # under _lock
        self._num_handshaking: collections.Counter[str] = collections.Counter()  # under _lock
        self._warn = RateLimitedLog(log, WARNING_INTERVAL_S)
        self.num_refused = 0                                                     # under _lock
        threading.Thread(target=self._accept, name="postrain-rendezvous", daemon=True).start()

    def close(self) -> None:
        """Stop serving: the listener and every connection close; waiting requests end."""
        self._closed = True
        with self._lock:
            sockets = [self._listener, *self._connections]
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        with self._changed:
            self._changed.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            if self._admit(sock, peer[0]):
                threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()
            else:
                sock.close()

    def _admit(self, sock: socket.socket, address: str) -> bool:
        """Whether `sock`, from `address`, may start a handshake: under max_connections in all and
        max_handshakes_per_peer from its address (else it is counted refused and logged)."""
        with self._lock:
            num_open, num_handshaking = len(self._connections), self._num_handshaking[address]
            if num_open < self.max_connections and num_handshaking < self.max_handshakes_per_peer:
                self._connections.add(sock)
                self._num_handshaking[address] += 1
                return True
            self.num_refused += 1
        self._warn.warning(address, "rendezvous: refused a connection from %s: %d open (at most %d), %d of them "
                           "in handshake from there (at most %d)", address, num_open, self.max_connections,
                           num_handshaking, self.max_handshakes_per_peer)
        return False

    def _serve(self, sock: socket.socket, peer) -> None:
        try:
            channel = self._handshake(sock, peer[0])
            while True:
                request = channel.receive()
                channel.send(self._answer(request))
        except (OSError, ConnectionError, ValueError, TypeError, IndexError) as exc:
            if isinstance(exc, RendezvousRefused):
                with self._lock:
                    self.num_refused += 1
                self._warn.warning(peer[0], "rendezvous: refused %s:%s: %s", peer[0], peer[1], exc)
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()

    def _handshake(self, sock: socket.socket, address: str) -> _Channel:
        """The client's proof and ours, within one deadline (handshake_timeout_s from now, however
        its bytes trickle), on frames of at most MAX_HANDSHAKE_FRAME_BYTES; then the connection
        no longer counts against its address's handshakes."""
        deadline = time.monotonic() + self.handshake_timeout_s
        try:
            sock.settimeout(self.handshake_timeout_s)
            server_nonce = os.urandom(_NONCE_BYTES)
            _send_frame(sock, _MAGIC + server_nonce)
            answer = _recv_frame(sock, MAX_HANDSHAKE_FRAME_BYTES, deadline)
            client_nonce, proof = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
            if len(client_nonce) != _NONCE_BYTES or not hmac.compare_digest(
                    proof, _mac(self._secret, b"client", server_nonce, client_nonce)):
                raise RendezvousRefused("the client did not prove the group's secret")
            _send_frame(sock, _mac(self._secret, b"server", server_nonce, client_nonce))
        except TimeoutError:
            raise RendezvousRefused(f"the client did not prove the group's secret within "
                                    f"{self.handshake_timeout_s:g} s") from None
        finally:
            with self._lock:
                self._num_handshaking[address] -= 1
                if not self._num_handshaking[address]:
                    del self._num_handshaking[address]
        sock.settimeout(None)
        return _Channel(sock, self._secret, server_nonce, client_nonce, is_server=True)

    def _answer(self, request: list) -> list:
        """[True, value] or [False, why] for one request [op, *args]."""
        op, *args = request
        table, changed = self._table, self._changed
        with changed:
            if op == "set":
                table[args[0]] = bytes(args[1])
                changed.notify_all()
                return [True, None]
            if op == "add":
                value = int(table.get(args[0], b"0")) + int(args[1])
                table[args[0]] = str(value).encode()
                changed.notify_all()
                return [True, value]
            if op == "compare_set":
                key, expected, desired = args[0], bytes(args[1]), bytes(args[2])
                current = table.get(key)
                if (current is None and not expected) or current == expected:
                    table[key] = desired
                    changed.notify_all()
                    return [True, desired]
                return [True, expected if current is None else current]
            if op == "wait":     # [keys, timeout_s]: every key present, or False
                keys, deadline = args[0], time.monotonic() + float(args[1])
                while not all(key in table for key in keys):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        return [False, f"keys {sorted(k for k in keys if k not in table)} not set in time"]
                    changed.wait(min(left, 1.0))
                return [True, [table[key] for key in keys]]
            if op == "check":
                return [True, all(key in table for key in args[0])]
            if op == "delete":
                changed.notify_all()
                return [True, table.pop(args[0], None) is not None]
            if op == "num_keys":
                return [True, len(table)]
        return [False, f"unknown rendezvous request {op!r}"]


class AuthenticatedStore(dist.Store):
    """A torch.distributed.Store over `StoreServer` (started here when `is_server`), reached at
    (host, port) by proving `secret`. Thread-safe: one request at a time on its connection."""

    def __init__(self, host: str, port: int, secret: bytes, *, is_server: bool,
                 timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        if not secret:
            raise ValueError("the learner group's rendezvous needs the group's secret (Actor.group_secret, "
                             "given by the supervisor to each rank); start the ranks through a supervisor")
        self._timeout_s = timeout.total_seconds()
        self.server = StoreServer(host, port, secret) if is_server else None
        self._lock = threading.Lock()
        self._channel = self._connect(host, port, secret)

    def _connect(self, host: str, port: int, secret: bytes) -> _Channel:
        """Connect and prove the secret, trying again while the connection is refused (rank 0 not
        listening yet) or closed before the greeting (the server at a cap), until the timeout;
        RendezvousRefused at once where the server does not prove it back."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
            except OSError as exc:
                error = exc
            else:
                try:
                    channel = _client_handshake(sock, secret)
                except _Closed as exc:
                    sock.close()
                    error = exc
                except Exception:
                    sock.close()
                    raise
                else:
                    sock.settimeout(None)
                    return channel
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the learner group's rendezvous at {host}:{port} did not answer "
                                   f"within {self._timeout_s:g} s ({error})") from None
            time.sleep(0.1)

    def close(self) -> None:
        """Close the connection, and on rank 0 stop serving."""
        self._channel.sock.close()
        if self.server is not None:
            self.server.close()

    def _ask(self, *request):
        with self._lock:
            self._channel.send(list(request))
            ok, value = self._channel.receive()
        if not ok:
            raise (TimeoutError if "in time" in value else RuntimeError)(f"learner rendezvous: {value}")
        return value

    # -- the torch.distributed.Store interface ------------------------------------------------

    def set(self, key: str, value) -> None:
        self._ask("set", key, bytes(value) if not isinstance(value, str) else value.encode())

    def get(self, key: str) -> bytes:
        return self._ask("wait", [key], self._timeout_s)[0]

    def add(self, key: str, value: int) -> int:
        return self._ask("add", key, int(value))

    def compare_set(self, key: str, expected, desired) -> bytes:
        as_bytes = (lambda v: v.encode() if isinstance(v, str) else bytes(v))
        return self._ask("compare_set", key, as_bytes(expected), as_bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._ask("wait", list(keys), (timeout.total_seconds() if timeout else self._timeout_s))

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._ask("delete", key)

    def num_keys(self) -> int:
        return self._ask("num_keys")
