"""Bulk bytes between nodes on a plain ZeroMQ tcp channel, each piece sealed with AES-256-GCM.

CurveZMQ (every actor socket beyond loopback) encrypts each frame into a fresh buffer in one
I/O thread, which held a weight sync across nodes to 0.2-0.3 of plain tcp. Large buffers
(a weight sync's tensors) travel instead on a second channel: the receiver binds a PULL
socket on its node's address, without Curve; the sender connects a PUSH socket; the sender
seals every piece and the receiver opens it, each in a Python thread beside ZeroMQ's I/O
threads, so sealing piece i + 1 overlaps sending piece i, and opening overlaps receipt.
Control (what to expect, in which order, the final reply) stays on the actors' Curve
messages; this channel carries only the sealed bytes.

    receiver = SealedReceiver(run_key, host="10.0.0.2")        # receiver.address: tcp://10.0.0.2:PORT
    sender = SealedSender(run_key)                              # to any number of receivers
    stream = Stream(sender="learner", version=3, sync_id=new_sync_id(), chunk=0)
    failed = sender.send(stream, [memoryview(...), ...], {receiver.address: None}, 60)
                                                  # a thread: returns once all are queued; {} if all took them
    receiver.receive(stream, [writable memoryview, ...], 60)   # a thread: SealedStreamError if refused

Both ends learn the run's key (`CurveKeys.bulk_key`: made by the head per run, handed out with
the Curve keys) and agree on the stream and its buffers' sizes over the Curve channel first.

Invariants (tests/core/test_sealed.py):
- Keys: a stream's key is HKDF-SHA256(run key; sender, version, sync id), the sync id 16
  random bytes fresh for every sync (and every retry of one), so no two syncs share a key.
- Nonce of piece p of chunk c: version mod 2**32, c, p (4 bytes each): within one key no
  nonce repeats. Associated data: the piece's header (magic, sync id, version, chunk, piece,
  sender), so a piece opens only as the very piece of the very stream it was sealed for.
- One sealing for all receivers: none of key, nonce or associated data names the receiver, so
  a sync's pieces are sealed once and the same ciphertext goes to every receiver of the sync
  (`SealedSender.send`); no (key, nonce) ever seals two different plaintexts.
- Pieces: each buffer is cut into pieces of at most `piece_bytes` (a piece never spans two
  buffers), numbered in buffer order; the receiver computes the same plan from the sizes.
- The receiver takes exactly the pieces of its stream, in order. A piece that names the stream
  but is not its next one, has the wrong size or does not authenticate (forged, tampered,
  replayed from another position) is refused, logged in one line naming the peer's address,
  and the receive fails (SealedStreamError): the caller discards the buffers, and the later
  pieces of its sync (any chunk) are skipped quietly (`dropped`: sync ids). A piece that names another stream
  (a stranger's junk, a piece replayed from another sync) is refused, logged and skipped: it
  is no piece of this one. A stranger without the key gets nothing accepted.
- A sender that stops mid-stream (it died) leaves its receiver waiting for the next piece
  until `timeout_s`; pieces of a newer stream that arrive meanwhile are refused, so that
  stream fails too and the one after goes through.
- A receive's deadline is set when it starts and moves only when a piece of its stream is
  taken (then: that moment + timeout_s): frames that are no piece of it (a stranger's junk)
  never move it, and the deadline is checked before every frame, so junk arriving without
  pause cannot hold a receive (nor the lock) past it.
- What a stranger costs: its connections pass a gate (core/gate.py): at most
  `max_connections_per_peer` per address and `max_connections` in all, each queueing at most
  RCVHWM (2 * _RING) frames of at most MAXMSGSIZE (piece_bytes + TAG_BYTES + 4096) bytes; so
  one address queues at most max_connections_per_peer * 2 * _RING pieces. Its junk is logged
  at most once per peer address per `warning_interval_s`, with a count of what was not.
- Its connections expire: one that has brought no piece that opened within `proof_timeout_s`
  of its acceptance is closed by the gate, so idle or junk-only connections cannot hold the
  caps; one that brought such a piece (a sender's) stays until it ends.
- One thread at a time uses each end (a lock); `close` waits for it.
"""
from __future__ import annotations

import collections
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, cast

import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import PostrainError
from .gate import ConnectionGate, RateLimitedLog

log = logging.getLogger("postrain.core")
_T = TypeVar("_T")

KEY_BYTES = 32                 # AES-256
TAG_BYTES = 16                 # the GCM tag after each piece's ciphertext
PIECE_BYTES = 4 << 20          # measured: docs/performance.md, Cluster
_MAGIC = b"PRS1"
_HEADER = struct.Struct(">4s16sQII")   # magic, sync id, version, chunk, piece; then the sender's name
_RING = 4                      # the sender's sealed buffers in flight (ZeroMQ sends them without copying)
_POLL_S = 0.1                  # a waiting receiver checks for close this often
_NUM_DROPPED_KEPT = 64


class SealedStreamError(PostrainError):
    """A sealed stream that could not be received whole: a piece refused, or none in time."""


def new_run_key() -> bytes:
    return os.urandom(KEY_BYTES)


def new_sync_id() -> bytes:
    return os.urandom(16)


@dataclass(frozen=True, slots=True)
class Stream:
    """One chunk of one sync: what its pieces are sealed for."""

    sender: str
    version: int
    sync_id: bytes
    chunk: int

    def header(self, piece: int) -> bytes:
        return _HEADER.pack(_MAGIC, self.sync_id, self.version, self.chunk, piece) + self.sender.encode()

    def nonce(self, piece: int) -> bytes:
        return struct.pack(">III", self.version & 0xFFFFFFFF, self.chunk, piece)

    def cipher(self, run_key: bytes) -> AESGCM:
        """AES-256-GCM under this sync's own key (HKDF of the run's key)."""
        sender = self.sender.encode()
        info = b"postrain sealed bulk v1" + struct.pack(">H", len(sender)) + sender \
            + struct.pack(">Q", self.version) + self.sync_id
        return AESGCM(HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(run_key))


def piece_plan(sizes: list[int], piece_bytes: int) -> list[tuple[int, int, int]]:
    """(buffer index, start, stop) of every piece, in order: each buffer cut into pieces of at
    most piece_bytes (an empty buffer has none)."""
    return [(index, start, min(start + piece_bytes, size))
            for index, size in enumerate(sizes) for start in range(0, size, piece_bytes)]


def _check_key(run_key: bytes) -> None:
    if not isinstance(run_key, bytes) or len(run_key) != KEY_BYTES:
        raise ValueError(f"a sealed channel needs the run's {KEY_BYTES}-byte key (CurveKeys.bulk_key), "
                         f"got {type(run_key).__name__} of {len(run_key) if run_key else 0} bytes")


class SealedSender:
    """This process's end of sealed channels to any number of receivers (blocking calls, made
    from a worker thread): a PUSH socket per receiver address, made on first use, and one ring
    of sealed buffers for all of them.

    Invariants: `send` seals each piece of a stream once (`num_pieces_sealed`) and queues the
    very same sealed bytes to every receiver it names. That is safe because a stream's key,
    nonce and associated data name the sender, version, sync id, chunk and piece, never the
    receiver: every receiver of a sync gets identical ciphertext of identical plaintext under
    one (key, nonce), so no nonce ever seals two different plaintexts, and a piece replayed
    from one receiver's link to another's is the piece that receiver expects anyway. A ring
    buffer is sealed into only once ZeroMQ has let go of its previous piece on every live
    socket (`_trackers`); a receiver that fails has its socket closed and the ring is replaced
    (its old buffers stay with ZeroMQ's messages until they are freed)."""

    def __init__(self, run_key: bytes, piece_bytes: int = PIECE_BYTES):
        _check_key(run_key)
        self.piece_bytes = piece_bytes
        self.num_pieces_sealed = 0
        self._run_key = run_key
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._new_ring()
        self._lock = threading.Lock()

    def send(self, stream: Stream, buffers: list[memoryview], receivers: dict[str, threading.Event | None],
             timeout_s: float) -> dict[str, SealedStreamError]:
        """Seal every piece of `buffers` (byte views) for `stream` once and queue it to every
        receiver (address: its abandon flag, or None). The receivers that failed, each with its
        error: a piece it did not take within timeout_s (no receiver), or its flag set (its caller
        gave up; seen within _POLL_S). A receiver that fails costs the others nothing but the
        wait; the others get every piece, at the pace of the slowest."""
        with self._lock:
            cipher = stream.cipher(self._run_key)
            plan = piece_plan([len(b) for b in buffers], self.piece_bytes)
            failed: dict[str, SealedStreamError]
            live, failed = dict(receivers), {}
            for piece, (index, start, stop) in enumerate(plan):
                what = f"piece {piece} of {len(plan)} of chunk {stream.chunk} of version {stream.version} to "
                waits = {address: _Wait(timeout_s, abandon, what + address)
                         for address, abandon in live.items()}
                for address, wait in waits.items():
                    self._try(address, live, failed, wait.check, "before it was sealed")
                slot = piece % _RING
                for address, tracker in self._trackers[slot]:
                    if address in live:
                        self._try(address, live, failed, _wait_sent, tracker, waits[address])
                if not live:
                    break
                sealed = memoryview(self._ring[slot])[:stop - start + TAG_BYTES]
                header = stream.header(piece)
                cipher.encrypt_into(stream.nonce(piece), buffers[index][start:stop], header, sealed)
                self.num_pieces_sealed += 1
                trackers = []
                for address in list(live):
                    queued = self._try(address, live, failed, self._queue, address, [header, sealed],
                                       waits[address])
                    if queued is not None:
                        trackers.append((address, queued))
                self._trackers[slot] = trackers
            return failed

    def _try(self, address: str, live: dict[str, threading.Event | None], failed: dict[str, SealedStreamError],
             call: Callable[..., _T], *args: Any) -> _T | None:
        """call(*args); on SealedStreamError the receiver at `address` is failed with it (None)."""
        try:
            return call(*args)
        except SealedStreamError as exc:
            failed[address] = exc
            del live[address]
            self._close(address)
            return None

    def _queue(self, address: str, frames: list[Any], wait: "_Wait") -> zmq.MessageTracker | None:
        sock = self._socks.get(address)
        if sock is None:
            context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()   # pyzmq types it Context[Never]
            sock = self._socks[address] = context.socket(zmq.PUSH)
            sock.linger = 0
            sock.sndhwm = 2 * _RING
            sock.immediate = True    # queue only on a live connection
            sock.sndtimeo = int(_POLL_S * 1000)
            sock.connect(address)
        while True:
            try:
                return sock.send_multipart(frames, copy=False, track=True)
            except zmq.Again:
                wait.check("the receiver took nothing: is it alive?")

    def _new_ring(self) -> None:
        self._ring = [bytearray(self.piece_bytes + TAG_BYTES) for _ in range(_RING)]
        self._trackers: list[list[tuple[str, zmq.MessageTracker]]] = [[] for _ in range(_RING)]

    def forget(self, address: str) -> None:
        """Close the socket to `address` (its receiver moved away), if open."""
        with self._lock:
            self._close(address)

    def _close(self, address: str) -> None:
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close(linger=0)
            self._new_ring()     # ZeroMQ may still hold the old ring's buffers

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close(linger=0)
            self._socks.clear()


def _wait_sent(tracker: zmq.MessageTracker, wait: "_Wait") -> None:
    """Until ZeroMQ has let go of a queued piece."""
    while True:
        try:
            tracker.wait(_POLL_S)
            return
        except zmq.NotDone:
            wait.check("ZeroMQ sent nothing")


class _Wait:
    """The deadline and the abandon flag of one piece's send."""

    def __init__(self, timeout_s: float, abandon: threading.Event | None, what: str):
        self.deadline, self.timeout_s = time.monotonic() + timeout_s, timeout_s
        self.abandon, self.what = abandon, what

    def check(self, why: str) -> None:
        """SealedStreamError when the caller gave up or the piece's time is out."""
        if self.abandon is not None and self.abandon.is_set():
            raise SealedStreamError(f"sending {self.what} was abandoned")
        if time.monotonic() > self.deadline:
            raise SealedStreamError(f"sending {self.what} took over {self.timeout_s:g} s ({why})")


class SealedReceiver:
    """This process's end of sealed channels: a PULL socket bound on `host` (plain tcp, any free
    port: `address`) that senders connect to (blocking calls, made from a worker thread).
    max_connections_per_peer (default 4: a sender needs one) and max_connections (default 16):
    open connections admitted per peer address and in all (more are refused at the handshake);
    warning_interval_s (default 10 s): at most one warning line per peer address this often;
    proof_timeout_s (default 60 s): a connection that brings no piece that opens within this of
    its acceptance is closed (a sender whose connection was closed connects again by itself).
    Invariant: `dropped` holds the sync ids of the last receives that failed."""

    def __init__(self, run_key: bytes, host: str, piece_bytes: int = PIECE_BYTES,
                 max_connections: int = 16, max_connections_per_peer: int = 4,
                 warning_interval_s: float = 10.0, proof_timeout_s: float = 60.0):
        _check_key(run_key)
        self.piece_bytes = piece_bytes
        self._run_key = run_key
        self.gate = ConnectionGate(max_connections, max_connections_per_peer, "the sealed channel",
                                   warning_interval_s, proof_timeout_s)
        self._warn = RateLimitedLog(log, warning_interval_s)
        self._sock = self.gate.socket(zmq.PULL)
        self._sock.linger = 0
        self._sock.rcvhwm = 2 * _RING            # per connection: a stranger queues little
        self._sock.maxmsgsize = piece_bytes + TAG_BYTES + 4096   # a larger frame drops its connection
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.dropped: collections.deque[bytes] = collections.deque(maxlen=_NUM_DROPPED_KEPT)
        self._closing = False
        self._lock = threading.Lock()

    def receive(self, stream: Stream, buffers: list[memoryview], timeout_s: float) -> None:
        """Fill `buffers` (writable byte views, the sizes the sender sends) with the opened pieces of
        `stream`, in order; waits at most timeout_s for each piece. SealedStreamError on a piece
        refused or none in time (the stream is then `dropped`; discard the buffers)."""
        with self._lock:
            try:
                self._receive(stream, buffers, timeout_s)
            except SealedStreamError:
                self.dropped.append(stream.sync_id)
                raise

    def _receive(self, stream: Stream, buffers: list[memoryview], timeout_s: float) -> None:
        cipher = stream.cipher(self._run_key)
        plan = piece_plan([len(b) for b in buffers], self.piece_bytes)
        piece = 0
        deadline = time.monotonic() + timeout_s     # moved by pieces of this stream only
        while piece < len(plan):
            frames = self._next(deadline, timeout_s, stream, piece, len(plan))
            peer = cast(str, frames[-1].get("Peer-Address")) or "an unknown peer"   # a str property
            header = frames[0].bytes if len(frames) == 2 else b""
            expected = stream.header(piece)
            if header != expected:
                self._refuse_other(header, stream, piece, peer)
                continue
            index, start, stop = plan[piece]
            sealed = frames[1].buffer
            try:
                if len(sealed) != stop - start + TAG_BYTES:
                    raise InvalidTag
                cipher.decrypt_into(stream.nonce(piece), sealed, header, buffers[index][start:stop])
            except InvalidTag:
                self._refuse(peer, f"piece {piece} of chunk {stream.chunk} of version {stream.version} from "
                             f"{stream.sender} does not authenticate (forged, tampered or not sealed with "
                             "the run's key)")
            self.gate.vouch(frames[0].get(zmq.SRCFD))       # its connection proved the sender
            piece += 1
            deadline = time.monotonic() + timeout_s

    def _next(self, deadline: float, timeout_s: float, stream: Stream, piece: int,
              num_pieces: int) -> list[zmq.Frame]:
        """The next frames on the socket, if they come before `deadline` (checked before every
        frame, so a flood of frames cannot outlast it)."""
        while True:
            if self._closing:
                raise SealedStreamError("the sealed channel closed during a receive")
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise SealedStreamError(f"no piece {piece} of {num_pieces} of chunk {stream.chunk} of "
                                        f"version {stream.version} from {stream.sender} within "
                                        f"{timeout_s:g} s")
            if self._sock.poll(max(1, int(min(left_s, _POLL_S) * 1000))):
                return self._sock.recv_multipart(copy=False)

    def _refuse_other(self, header: bytes, stream: Stream, piece: int, peer: str) -> None:
        """A piece that is not the next one of `stream`: skipped when it names another sync
        (refused and logged, unless it is a leftover of a dropped one), fatal when it names this."""
        fields = _HEADER.unpack_from(header) if len(header) >= _HEADER.size else None
        if fields is None or fields[0] != _MAGIC:
            self._warn.warning(peer, "refused a piece on the sealed channel from %s: not a sealed piece", peer)
        elif fields[1] == stream.sync_id:
            self._refuse(peer, f"it claims piece {fields[4]} of chunk {fields[3]} where piece {piece} of "
                         f"chunk {stream.chunk} of version {stream.version} from {stream.sender} is next "
                         "(replayed or reordered)")
        elif fields[1] not in self.dropped:
            self._warn.warning(peer, "refused a piece on the sealed channel from %s: it names no sync in "
                               "progress", peer)

    def _refuse(self, peer: str, why: str) -> None:
        log.warning("refused a piece on the sealed channel from %s: %s", peer, why)
        raise SealedStreamError(f"a piece from {peer} was refused: {why}; the sync is dropped "
                                "(publish again)")

    def close(self) -> None:
        self._closing = True
        with self._lock:
            self._sock.close(linger=0)
            self.gate.close()
