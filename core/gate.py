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

    gate = ConnectionGate(max_connections=16, max_connections_per_peer=4, what="the sealed channel")
    sock = gate.socket(zmq.PULL)         # bind it; gate.close() after closing it

Invariants (tests/core/test_sealed.py), in the gate's thread: _open maps each accepted connection
not yet disconnected to its peer; _num_open[peer] == its count there; the peer's admitted open
connections <= _num_admitted[peer] <= _num_open[peer] after each disconnect.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("postrain.core")

_POLL_S = 0.1          # the gate's thread checks for close this often
_NUM_PEERS_LOGGED = 1024


class RateLimitedLog:
    """Warnings keyed (by peer): at most one line per key per `interval_s`; the next line after a
    quiet spell says how many were suppressed. Keeps the last _NUM_PEERS_LOGGED keys."""

    def __init__(self, logger: logging.Logger, interval_s: float, clock=time.monotonic):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: collections.OrderedDict[str, list] = collections.OrderedDict()  # key: [time, suppressed]

    def warning(self, key: str, msg: str, *args) -> None:
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


class ConnectionGate:
    """The admission thread of one bound socket (see the module's note)."""

    def __init__(self, max_connections: int, max_connections_per_peer: int, what: str,
                 warning_interval_s: float = 10.0):
        if not 0 < max_connections_per_peer <= max_connections:
            raise ValueError(f"a connection gate needs 0 < max_connections_per_peer <= max_connections, "
                             f"got {max_connections_per_peer} and {max_connections}")
        self.max_connections, self.max_connections_per_peer = max_connections, max_connections_per_peer
        self.what = what
        self.num_refused = 0
        self.context = zmq.Context()
        self._open: dict[int, str] = {}            # fd -> peer address; the gate's thread only
        self._num_open: collections.Counter[str] = collections.Counter()
        self._num_admitted: collections.Counter[str] = collections.Counter()
        self.changed = threading.Condition()      # held while the counts change; notified after
        self._warn = RateLimitedLog(log, warning_interval_s)
        self._zap = self.context.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind("inproc://zeromq.zap.01")
        self._monitor = None
        self._thread = None
        self._closing = False

    def socket(self, kind: int) -> zmq.Socket:
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

    @property
    def num_admitted(self) -> int:
        """Admitted connections that may still be open (an upper bound; see the module's note).
        Wait for a value with `with gate.changed: gate.changed.wait_for(...)`."""
        with self.changed:
            return sum(self._num_admitted.values())

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._closing:
                ready = dict(poller.poll(int(_POLL_S * 1000)))
                with self.changed:
                    self._drain_monitor()
                    if ready.get(self._zap):
                        self._answer(self._zap.recv_multipart())
                    self.changed.notify_all()
        finally:
            self._zap.close(linger=0)
            self._monitor.close(linger=0)

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                peer = self._open[fd] = _peer_of(fd)
                self._num_open[peer] += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED and fd in self._open:
                peer = self._open.pop(fd)
                self._num_open[peer] -= 1
                self._num_admitted[peer] = min(self._num_admitted[peer], self._num_open[peer])
                for counter in (self._num_open, self._num_admitted):
                    if counter[peer] <= 0:
                        del counter[peer]

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) < 6:
            return                                   # not ZeroMQ's own request: nothing to answer
        version, request_id, _domain, peer = frames[:4]
        peer = peer.decode(errors="replace")
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


def _peer_of(fd: int) -> str:
    """The IP address of the peer of connected socket `fd` ("" once it is closed)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as dup:     # its own family (IPv4 or IPv6)
            return dup.getpeername()[0]
    except OSError:
        return ""
