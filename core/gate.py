"""Admission for a bound ZeroMQ socket without Curve: caps on open connections, per peer and in all.

Design note. ZeroMQ has no option that caps the connections a bound socket accepts, and a PULL
socket queues up to RCVHWM messages of up to MAXMSGSIZE bytes on every one of them, so a stranger
who opens connections without end would cost memory without end. The one place ZeroMQ lets a
socket's owner refuse a connection is the ZAP handshake (RFC 27), which it runs for every
connection of a socket that names a ZAP domain, under the NULL mechanism too. So a gate gives its
socket a ZeroMQ context of its own (ZAP is served per context, at inproc://zeromq.zap.01), names a
domain, enforces it (ZAP_ENFORCE_DOMAIN: no handler, no connection) and answers each request from
one thread that also reads the socket's monitor: EVENT_ACCEPTED (file descriptor -> the peer's
address, by getpeername) and EVENT_DISCONNECTED keep the table of open connections. A ZAP request
names the peer's address but not its connection, so the gate counts admissions per peer and,
whenever one of the peer's connections ends, lowers that count to the peer's open connections:
an upper bound of the peer's admitted open connections, exact once its refused ones are gone. A
request is admitted while its peer holds fewer than `max_connections_per_peer` admissions and all
peers fewer than `max_connections`.

An admission is not a proof: the NULL mechanism names no one. With `proof_timeout_s`, a connection
that its owner has not vouched for (`vouch(fd)`, once a frame read from it proved the sender, as
ZeroMQ's SRCFD property names it) within that long of its acceptance is shut down from the gate's
thread (a shutdown of its file descriptor: ZeroMQ then ends it and the monitor reports it gone).
So a stranger's idle connections hold the caps for at most proof_timeout_s each; a vouched one
stays until it ends. A stranger that connects again at once takes a freed slot again: the caps,
not the expiry, bound what it holds at any moment.

    gate = ConnectionGate(max_connections=16, max_connections_per_peer=4, what="the sealed channel",
                          proof_timeout_s=60)
    sock = gate.socket(zmq.PULL)         # bind it; gate.close() after closing it
    gate.vouch(frame.get(zmq.SRCFD))     # a frame read from sock proved its sender

Invariants (tests/core/test_sealed.py), under `changed`: _open maps each accepted connection not
yet disconnected to its record (peer, deadline); _num_open[peer] == its count there; the peer's
admitted open connections <= _num_admitted[peer] <= _num_open[peer] after each disconnect; a
connection's deadline is inf once vouched for or shut down, or without a proof_timeout_s.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import socket
import threading
import time
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("postrain.core")

_POLL_S = 0.1          # the gate's thread checks for close this often
_NUM_PEERS_LOGGED = 1024


class RateLimitedLog:
    """Warnings keyed (by peer): at most one line per key per `interval_s`; the next line after a
    quiet spell says how many were suppressed. Keeps the last _NUM_PEERS_LOGGED keys."""

    def __init__(self, logger: logging.Logger, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: collections.OrderedDict[str, list[float]] = collections.OrderedDict()  # key: [time, suppressed]

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = self.clock()
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self.interval_s:
            entry[1] += 1
            return
        suppressed = entry[1] if entry is not None else 0
        self._last[key] = [now, 0]
        self._last.move_to_end(key)
        while len(self._last) > _NUM_PEERS_LOGGED:
            self._last.popitem(last=False)
        if suppressed:
            msg += f" (and {suppressed} more like it from there in the last {self.interval_s:g} s, not logged)"
        self.logger.warning(msg, *args)


@dataclasses.dataclass(slots=True)
class _Connection:
    """An accepted connection: its peer's address and port ("" and 0 if it was gone before the
    gate saw it) and when the gate shuts it down (time.monotonic(); inf: never)."""

    address: str
    port: int
    deadline: float


class ConnectionGate:
    """The admission thread of one bound socket (see the module's note). proof_timeout_s (default
    None: none): how long an accepted connection may stay without being vouched for."""

    def __init__(self, max_connections: int, max_connections_per_peer: int, what: str,
                 warning_interval_s: float = 10.0, proof_timeout_s: float | None = None):
        if not 0 < max_connections_per_peer <= max_connections:
            raise ValueError(f"a connection gate needs 0 < max_connections_per_peer <= max_connections, "
                             f"got {max_connections_per_peer} and {max_connections}")
        self.max_connections, self.max_connections_per_peer = max_connections, max_connections_per_peer
        self.what, self.proof_timeout_s = what, proof_timeout_s
        self.num_refused = 0
        self.num_expired = 0                        # connections shut down unvouched for
        self.context = zmq.Context()
        self._open: dict[int, _Connection] = {}    # fd -> its connection; under `changed`
        self._num_open: collections.Counter[str] = collections.Counter()
        self._num_admitted: collections.Counter[str] = collections.Counter()
        self.changed = threading.Condition()      # held while the counts change; notified after
        self._warn = RateLimitedLog(log, warning_interval_s)
        self._zap = self.context.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind("inproc://zeromq.zap.01")
        self._monitor: zmq.Socket[bytes] | None = None   # set by `socket`
        self._thread: threading.Thread | None = None
        self._closing = False

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        """A socket of this gate's context whose every connection asks the gate (one per gate)."""
        assert self._monitor is None, "one socket per gate"
        sock = self.context.socket(kind)
        sock.zap_domain = b"postrain-gate"
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="connection-gate")
        self._thread.start()
        return sock

    def close(self) -> None:
        """End the thread and the context; close the gate's socket first. Idempotent."""
        if self.context.closed:
            return
        self._closing = True
        if self._thread is not None:
            self._thread.join()
        else:
            self._zap.close(linger=0)
        self.context.term()

    def vouch(self, fd: int) -> None:
        """The connection on `fd` proved its sender: it is never shut down for want of a proof."""
        with self.changed:
            connection = self._open.get(fd)
            if connection is not None:
                connection.deadline = math.inf

    @property
    def num_admitted(self) -> int:
        """Admitted connections that may still be open (an upper bound; see the module's note).
        Wait for a value with `with gate.changed: gate.changed.wait_for(...)`."""
        with self.changed:
            return sum(self._num_admitted.values())

    def _serve(self) -> None:
        assert self._monitor is not None   # `socket` made it before it started this thread
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._closing:
                ready = dict(poller.poll(int(_POLL_S * 1000)))
                with self.changed:
                    self._drain_monitor()
                    self._expire()
                    if ready.get(self._zap):
                        self._answer(self._zap.recv_multipart())
                    self.changed.notify_all()
        finally:
            self._zap.close(linger=0)
            self._monitor.close(linger=0)

    def _drain_monitor(self) -> None:
        assert self._monitor is not None   # as in _serve, whose thread this is
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                timeout_s = math.inf if self.proof_timeout_s is None else self.proof_timeout_s
                connection = self._open[fd] = _Connection(*_peer_of(fd), time.monotonic() + timeout_s)
                self._num_open[connection.address] += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED and fd in self._open:
                peer = self._open.pop(fd).address
                self._num_open[peer] -= 1
                self._num_admitted[peer] = min(self._num_admitted[peer], self._num_open[peer])
                for counter in (self._num_open, self._num_admitted):
                    if counter[peer] <= 0:
                        del counter[peer]

    def _expire(self) -> None:
        """Shut down each connection past its deadline; its disconnect then frees its admission."""
        now = time.monotonic()
        for fd, connection in self._open.items():
            if connection.deadline <= now:
                connection.deadline = math.inf
                if _shut_down(fd, (connection.address, connection.port)):
                    self.num_expired += 1
                    self._warn.warning(f"expired {connection.address}", "closed a connection to %s from %s: "
                                       "nothing it sent proved it within %g s", self.what,
                                       connection.address, self.proof_timeout_s)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) < 6:
            return                                   # not ZeroMQ's own request: nothing to answer
        version, request_id, _domain, peer_address = frames[:4]
        peer = peer_address.decode(errors="replace")
        num_peer, num_all = self._num_admitted[peer], sum(self._num_admitted.values())
        ok = num_peer < self.max_connections_per_peer and num_all < self.max_connections
        if ok:
            self._num_admitted[peer] += 1
        else:
            self.num_refused += 1
            self._warn.warning(peer, "refused a connection to %s from %s: it holds %d admitted connections "
                               "(at most %d a peer), all peers %d (at most %d)", self.what, peer,
                               num_peer, self.max_connections_per_peer, num_all,
                               self.max_connections)
        status = [b"200", b"OK"] if ok else [b"400", b"too many connections"]
        self._zap.send_multipart([version, request_id, *status, b"", b""])


def _peer_of(fd: int) -> tuple[str, int]:
    """The IP address and port of the peer of connected socket `fd` (("", 0) once it is closed)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as dup:     # its own family (IPv4 or IPv6)
            address: tuple[str, int] = dup.getpeername()[:2]
            return address
    except OSError:
        return "", 0


def _shut_down(fd: int, peer: tuple[str, int]) -> bool:
    """Shut down connected socket `fd` if its peer is still `peer` (a file descriptor's number is
    reused once ZeroMQ closes it); whether it did."""
    try:
        with socket.socket(fileno=os.dup(fd)) as dup:
            if dup.getpeername()[:2] != peer:
                return False
            dup.shutdown(socket.SHUT_RDWR)
            return True
    except OSError:
        return False
