"""The sealed channel (core/sealed.py) over real ZeroMQ tcp sockets: bytes arrive bit for bit
across piece and buffer boundaries; junk, a replayed piece, a reordered one, a tampered one
and a stranger's forgery are refused, logged naming the peer, and accepted never; a stranger's
junk neither holds a receive past its deadline nor floods the log, and its connections are capped
and, until one brings a piece that opens, expire."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import zmq

from postrain.core.sealed import (
    SealedReceiver, SealedSender, SealedStreamError, Stream, new_run_key, new_sync_id, piece_plan,
)

PIECE = 1000                          # small pieces: every buffer below spans several, or none
SIZES = [2500, 0, 1000, 7, 3001]


def buffers(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in SIZES]


def stream(version: int = 1, chunk: int = 0, sync_id: bytes | None = None) -> Stream:
    return Stream("learner", version, sync_id or new_sync_id(), chunk)


class Receiving:
    """receiver.receive(...) in a thread (it blocks): `.join()` returns the filled buffers or raises."""

    def __init__(self, receiver: SealedReceiver, s: Stream, timeout_s: float = 10.0):
        self.out = [np.full(size, 0xAB, dtype=np.uint8) for size in SIZES]
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(receiver, s, timeout_s))
        self._thread.start()

    def _run(self, receiver, s, timeout_s):
        try:
            receiver.receive(s, [memoryview(b) for b in self.out], timeout_s)
        except BaseException as exc:
            self.error = exc

    def join(self) -> list[np.ndarray]:
        self._thread.join(30)
        if self.error is not None:
            raise self.error
        return self.out


@pytest.fixture
def channel():
    key = new_run_key()
    receiver = SealedReceiver(key, "127.0.0.1", piece_bytes=PIECE, warning_interval_s=0)  # every line
    sender = SealedSender(key, piece_bytes=PIECE)
    tap = zmq.Context.instance().socket(zmq.PULL)     # a wire tap: captures valid pieces to replay
    tap_address = f"tcp://127.0.0.1:{tap.bind_to_random_port('tcp://127.0.0.1')}"
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.linger = 0
    stranger.connect(receiver.address)
    yield key, receiver, sender, (tap, tap_address), stranger
    for sock in (tap, stranger):
        sock.close(linger=0)
    sender.close()
    receiver.close()


def captured_pieces(key: bytes, tap, tap_address: str, s: Stream, data: list) -> list[list[bytes]]:
    """Every piece of `data` as sealed for `s` with the run's key, as an eavesdropper records them."""
    recorder = SealedSender(key, piece_bytes=PIECE)
    send(recorder, tap_address, s, data)
    pieces = [tap.recv_multipart() for _ in range(recorder.num_pieces_sealed)]
    recorder.close()
    return pieces


def send(sender: SealedSender, address: str, s: Stream, data: list, timeout_s: float = 10) -> None:
    """`data` sealed for `s` to the receiver at `address`, which must take every piece."""
    assert sender.send(s, [memoryview(b) for b in data], {address: None}, timeout_s) == {}


def send_raw(stranger, pieces: list[list[bytes]]) -> None:
    for frames in pieces:
        stranger.send_multipart(frames)


def test_a_stream_arrives_bit_for_bit_across_piece_and_buffer_boundaries(channel):
    _, receiver, sender, _, _ = channel
    assert piece_plan([2500, 0, 7], 1000) == [(0, 0, 1000), (0, 1000, 2000), (0, 2000, 2500), (2, 0, 7)]
    for version in (1, 2):                         # the channel is reused, sync after sync
        s, data = stream(version), buffers(version)
        receiving = Receiving(receiver, s)
        send(sender, receiver.address, s, data)
        assert sender.num_pieces_sealed == version * len(piece_plan(SIZES, PIECE))
        assert all(np.array_equal(got, want) for got, want in zip(receiving.join(), data))


def test_junk_and_a_piece_replayed_from_another_sync_are_refused_and_skipped(channel, caplog):
    key, receiver, sender, (tap, tap_address), stranger = channel
    old = captured_pieces(key, tap, tap_address, stream(1), buffers(1))
    s, data = stream(2), buffers(2)
    receiving = Receiving(receiver, s)
    with caplog.at_level(logging.WARNING, logger="postrain.core"):
        stranger.send(b"junk")                                    # one frame, not a piece
        stranger.send_multipart([b"PRS1" + bytes(40), b"x" * 50])  # a header of no sync
        send_raw(stranger, old[:2])                               # valid pieces of an earlier sync
        send(sender, receiver.address, s, data)
        got = receiving.join()
    assert all(np.array_equal(g, w) for g, w in zip(got, data))   # the real stream went through
    refusals = [r.getMessage() for r in caplog.records if "refused a piece" in r.getMessage()]
    assert len(refusals) == 4 and all("from 127.0.0.1" in line for line in refusals), refusals
    assert "not a sealed piece" in refusals[0] and "names no sync in progress" in refusals[-1]


@pytest.mark.parametrize("attack", ["forged", "tampered", "replayed", "reordered", "relabelled"])
def test_a_bad_piece_of_the_stream_in_progress_fails_it_and_is_logged(channel, caplog, attack):
    key, receiver, sender, (tap, tap_address), stranger = channel
    s, data = stream(3), buffers(3)
    valid = captured_pieces(key, tap, tap_address, s, data)       # what the eavesdropper saw of s
    header, sealed = valid[0]
    if attack == "forged":          # the right header, bytes sealed with another key
        bad = captured_pieces(new_run_key(), tap, tap_address, s, data)[0]
    elif attack == "tampered":      # one bit flipped
        bad = [header, bytes([sealed[0] ^ 1]) + sealed[1:]]
    elif attack == "replayed":      # piece 0 delivered, then delivered again
        send_raw(stranger, [valid[0]])
        bad = valid[0]
    elif attack == "reordered":     # piece 1 first
        bad = valid[1]
    else:                           # piece 1's bytes under piece 0's header
        bad = [header, valid[1][1]]
    receiving = Receiving(receiver, s)
    with caplog.at_level(logging.WARNING, logger="postrain.core"):
        send_raw(stranger, [bad])
        with pytest.raises(SealedStreamError, match="refused: .*the sync is dropped"):
            receiving.join()
    line = [r.getMessage() for r in caplog.records if "refused a piece" in r.getMessage()][-1]
    assert "from 127.0.0.1" in line and ("does not authenticate" in line or "is next" in line), line
    assert s.sync_id in receiver.dropped
    # what is left of the dropped stream is skipped quietly; the next stream goes through
    caplog.clear()
    send_raw(stranger, valid[1:3])
    nxt, nxt_data = stream(4), buffers(4)
    receiving = Receiving(receiver, nxt)
    send(sender, receiver.address, nxt, nxt_data)
    assert all(np.array_equal(g, w) for g, w in zip(receiving.join(), nxt_data))
    assert not [r for r in caplog.records if "refused a piece" in r.getMessage()]


def test_a_receive_without_pieces_ends_at_its_timeout_and_a_sender_without_receiver_at_its(channel):
    key, receiver, _, _, _ = channel
    with pytest.raises(SealedStreamError, match="no piece 0 of 9 of chunk 0 of version 1 from learner with"):
        Receiving(receiver, stream(1), timeout_s=0.3).join()
    nowhere = SealedSender(key, piece_bytes=PIECE)
    failed = nowhere.send(stream(1), [memoryview(b) for b in buffers(1)], {"tcp://127.0.0.1:9": None}, 0.3)
    assert list(failed) == ["tcp://127.0.0.1:9"]
    assert isinstance(failed["tcp://127.0.0.1:9"], SealedStreamError)
    assert "took over 0.3 s (the receiver took nothing" in str(failed["tcp://127.0.0.1:9"])
    nowhere.close()
    with pytest.raises(ValueError, match="needs the run's 32-byte key"):
        SealedReceiver(b"short", "127.0.0.1")


def test_one_send_seals_each_piece_once_for_all_receivers_and_one_that_fails_costs_the_others_nothing(
        channel):
    key, receiver, sender, _, _ = channel
    other = SealedReceiver(key, "127.0.0.1", piece_bytes=PIECE)
    gave_up = threading.Event()
    gave_up.set()
    s, data = stream(5), buffers(5)
    receivings = [Receiving(receiver, s), Receiving(other, s)]
    failed = sender.send(s, [memoryview(b) for b in data], {receiver.address: None, other.address: None,
                                                            "tcp://127.0.0.1:9": None,    # nobody there
                                                            "tcp://127.0.0.1:7": gave_up}, 0.5)
    assert sorted(failed) == ["tcp://127.0.0.1:7", "tcp://127.0.0.1:9"]
    assert "abandoned" in str(failed["tcp://127.0.0.1:7"])
    assert "took nothing" in str(failed["tcp://127.0.0.1:9"])
    for receiving in receivings:                                   # both bit for bit
        assert all(np.array_equal(got, want) for got, want in zip(receiving.join(), data))
    assert sender.num_pieces_sealed == len(piece_plan(SIZES, PIECE))       # sealed once for all
    other.close()


class Junk:
    """A stranger sending junk frames without pause, in a thread, until `stop` (or 20 s at most:
    the loop ends by itself); `finished` is set when it has stopped."""

    def __init__(self, address: str):
        self.stop, self.flowing, self.finished = threading.Event(), threading.Event(), threading.Event()
        self.num_sent = 0
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.linger = 0
        self.sock.connect(address)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        end = time.monotonic() + 20
        try:
            while not self.stop.is_set() and time.monotonic() < end:
                try:
                    self.sock.send(b"junk", zmq.NOBLOCK)
                    self.num_sent += 1
                    if self.num_sent == 100:
                        self.flowing.set()
                except zmq.Again:
                    self.stop.wait(0.001)
        finally:
            self.finished.set()

    def close(self):
        self.stop.set()
        self.finished.wait(30)
        self.sock.close(linger=0)


@pytest.fixture
def pair():
    """A receiver with the default caps and warning interval, and a sender, of one run."""
    key = new_run_key()
    receiver, sender = SealedReceiver(key, "127.0.0.1", piece_bytes=PIECE), SealedSender(key, piece_bytes=PIECE)
    yield key, receiver, sender
    sender.close()
    receiver.close()


def test_junk_without_pause_neither_holds_a_receive_past_its_deadline_nor_stalls_the_next_sync(pair):
    _, receiver, sender = pair
    junk = Junk(receiver.address)
    try:
        assert junk.flowing.wait(10)
        with pytest.raises(SealedStreamError, match="no piece 0 of 9 of chunk 0 of version 1 .* within 0.5 s"):
            Receiving(receiver, stream(1), timeout_s=0.5).join()
        assert not junk.finished.is_set()      # the receive ended while the junk still came
        s, data = stream(2), buffers(2)
        receiving = Receiving(receiver, s)
        send(sender, receiver.address, s, data)      # the next genuine sync, through the junk
        assert all(np.array_equal(got, want) for got, want in zip(receiving.join(), data))
        assert not junk.finished.is_set()
    finally:
        junk.close()


def test_a_strangers_junk_is_logged_once_per_peer_and_interval(pair, caplog):
    key, receiver, _ = pair
    tap = zmq.Context.instance().socket(zmq.PULL)
    tap_address = f"tcp://127.0.0.1:{tap.bind_to_random_port('tcp://127.0.0.1')}"
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.linger = 0
    stranger.connect(receiver.address)
    s, data = stream(3), buffers(3)
    pieces = captured_pieces(key, tap, tap_address, s, data)
    try:
        receiving = Receiving(receiver, s)
        with caplog.at_level(logging.WARNING, logger="postrain.core"):
            for _ in range(50):
                stranger.send(b"junk")
                stranger.send_multipart([b"PRS1" + bytes(40), b"x" * 50])
            send_raw(stranger, pieces)            # on the same connection: after all 100 junk frames
            got = receiving.join()
        assert all(np.array_equal(g, w) for g, w in zip(got, data))
        refusals = [r.getMessage() for r in caplog.records if "refused a piece" in r.getMessage()]
        assert refusals == ["refused a piece on the sealed channel from 127.0.0.1: not a sealed piece"]
    finally:
        tap.close(linger=0)
        stranger.close(linger=0)


def test_a_peer_gets_at_most_its_share_of_connections_and_the_rest_are_refused(pair, caplog):
    from zmq.utils.monitor import recv_monitor_message
    _, receiver, sender = pair
    strangers, monitors = [], []
    for _ in range(6):
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.linger = 0
        monitors.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH))
        sock.connect(receiver.address)
        strangers.append(sock)
    try:
        with caplog.at_level(logging.WARNING, logger="postrain.core"):
            outcomes = []
            for monitor in monitors:
                assert monitor.poll(10_000), "no handshake within 10 s"
                outcomes.append(recv_monitor_message(monitor)["event"])
        assert outcomes.count(zmq.EVENT_HANDSHAKE_SUCCEEDED) == 4        # max_connections_per_peer
        assert outcomes.count(zmq.EVENT_HANDSHAKE_FAILED_AUTH) == 2
        assert receiver.gate.num_refused >= 2
        lines = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert lines and "to the sealed channel from 127.0.0.1" in lines[0] and "at most 4 a peer" in lines[0]
        assert len(lines) == 1                                  # once per peer and interval
    finally:
        for sock, monitor in zip(strangers, monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
    with receiver.gate.changed:                                 # the strangers gone, a sender gets in
        assert receiver.gate.changed.wait_for(lambda: receiver.gate.num_admitted == 0, 10)
    s, data = stream(4), buffers(4)
    receiving = Receiving(receiver, s)
    send(sender, receiver.address, s, data)
    assert all(np.array_equal(got, want) for got, want in zip(receiving.join(), data))


class Idle:
    """A stranger's connection that does not connect again once closed; `event()`: its next
    handshake or disconnect event, within 10 s."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.linger = 0
        self.sock.reconnect_ivl = -1
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)

    def event(self) -> int:
        from zmq.utils.monitor import recv_monitor_message
        assert self.monitor.poll(10_000), "no event within 10 s"
        return recv_monitor_message(self.monitor)["event"]

    def close(self):
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def num_expired(receiver: SealedReceiver) -> int:
    """The gate's count of expired connections, read under its lock: the gate counts each in the
    step that shuts it down, so every one whose peer saw it closed is counted."""
    with receiver.gate.changed:
        return receiver.gate.num_expired


def test_connections_that_prove_nothing_expire_and_free_the_gate_and_a_senders_stays(caplog):
    key = new_run_key()
    receiver = SealedReceiver(key, "127.0.0.1", piece_bytes=PIECE, max_connections=4, proof_timeout_s=1.0)
    sender = SealedSender(key, piece_bytes=PIECE)
    strangers = [Idle(receiver.address) for _ in range(4)]
    turned_away = late = None
    try:
        with caplog.at_level(logging.WARNING, logger="postrain.core"):
            assert [stranger.event() for stranger in strangers] == [zmq.EVENT_HANDSHAKE_SUCCEEDED] * 4
            turned_away = Idle(receiver.address)                   # idle strangers fill the gate
            assert turned_away.event() == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            assert [stranger.event() for stranger in strangers] == [zmq.EVENT_DISCONNECTED] * 4
            assert num_expired(receiver) == 4
            s, data = stream(1), buffers(1)                        # until they expire
            receiving = Receiving(receiver, s)
            send(sender, receiver.address, s, data)
            assert all(np.array_equal(got, want) for got, want in zip(receiving.join(), data))
            late = Idle(receiver.address)                          # accepted after the sender's connection:
            assert late.event() == zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert late.event() == zmq.EVENT_DISCONNECTED          # it expires; the proven one stays
        assert num_expired(receiver) == 5
        with receiver.gate.changed:
            assert receiver.gate.changed.wait_for(lambda: receiver.gate.num_admitted == 1, 10)
        lines = [r.getMessage() for r in caplog.records if "closed a connection" in r.getMessage()]
        assert lines == ["closed a connection to the sealed channel from 127.0.0.1: nothing it sent "
                         "proved it within 1 s"]                   # once per peer and interval
    finally:
        for stranger in [*strangers, turned_away, late]:
            if stranger is not None:
                stranger.close()
        sender.close()
        receiver.close()
