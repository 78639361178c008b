"""The learner group's rendezvous store (issue 32): a client without the group's secret can
neither join nor read it, nor hold the server with slow or large handshakes (security review,
round 2); ranks that hold it form a real gloo group through it."""
from __future__ import annotations

import logging
import os
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest

from postrain.actors.learner.rendezvous_store import (
    MAX_FRAME_BYTES, AuthenticatedStore, RendezvousRefused, StoreServer,
)

SECRET = b"s" * 32
SHORT = timedelta(seconds=5)


@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0, SECRET)
    client = AuthenticatedStore(*server.address, SECRET, is_server=False, timeout=SHORT)
    yield server, client
    client.close()
    server.close()


def test_a_client_with_the_secret_uses_the_store_as_torch_does(store):
    _, client = store
    client.set("addr/0", b"10.0.0.1:1234")
    assert client.get("addr/0") == b"10.0.0.1:1234"
    assert client.add("count", 2) == 2 and client.add("count", 1) == 3 and client.get("count") == b"3"
    assert client.compare_set("flag", b"", b"a") == b"a" and client.compare_set("flag", b"x", b"b") == b"a"
    assert client.check(["addr/0", "flag"]) and not client.check(["nope"])
    client.wait(["addr/0"], timedelta(seconds=1))
    with pytest.raises(TimeoutError, match="not set in time"):
        client.wait(["never"], timedelta(seconds=0.2))
    assert client.num_keys() == 3 and client.delete_key("flag") and client.num_keys() == 2


def test_a_client_without_the_secret_cannot_join_or_read(store):
    server, client = store
    client.set("addr/0", b"10.0.0.1:1234")
    with pytest.raises(RendezvousRefused):
        AuthenticatedStore(*server.address, b"w" * 32, is_server=False, timeout=SHORT)
    # a raw client: it gets the greeting (a nonce) and, for any answer but the proof, a closed socket
    with socket.create_connection(server.address, timeout=5) as raw:
        hello = _frame(raw)
        assert hello.startswith(b"PRS1") and b"10.0.0.1" not in hello
        answer = hello[4:] + os.urandom(32)
        raw.sendall(struct.pack(">I", len(answer)) + answer)
        raw.sendall(struct.pack(">I", 3) + b"get")
        assert _read_all(raw) == b""                      # closed, nothing of the table
    assert server.num_refused >= 2
    assert client.get("addr/0") == b"10.0.0.1:1234"      # the ranks' store is untouched


def test_a_rank_is_not_fooled_by_a_server_without_the_secret():
    impostor = StoreServer("127.0.0.1", 0, b"i" * 32)
    try:
        with pytest.raises(RendezvousRefused):
            AuthenticatedStore(*impostor.address, SECRET, is_server=False, timeout=SHORT)
    finally:
        impostor.close()


def _trickle(sock, data: bytes, interval_s: float) -> str:
    """Send `data` a byte at a time, waiting up to interval_s after each for the server to close:
    "closed" once it has, "open" if every byte went and it still had not."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i:i + 1])
            if select.select([sock], [], [], interval_s)[0] and not sock.recv(1):
                return "closed"
        except (ConnectionResetError, BrokenPipeError):
            return "closed"
    return "open"


def _greeting(sock) -> bytes:
    """The server's greeting frame, or b"" where it closed the connection instead."""
    header = _read_exact(sock, 4)
    return _read_exact(sock, struct.unpack(">I", header)[0]) if header else b""


def _read_exact(sock, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := sock.recv(size - len(data))):
        data += chunk
    return data


def _is_open(sock) -> bool:
    """Whether the server still holds `sock` (nothing to read: no close, no reset)."""
    return not select.select([sock], [], [], 0)[0]


def test_a_client_that_trickles_its_answer_is_dropped_at_the_handshakes_deadline(caplog):
    server = StoreServer("127.0.0.1", 0, SECRET, handshake_timeout_s=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="postrain.learner"), \
                socket.create_connection(server.address, timeout=5) as raw:
            hello = _greeting(raw)
            answer = struct.pack(">I", 64) + hello[4:] + os.urandom(32)
            # a byte every 50 ms never leaves a single recv waiting 0.3 s; the deadline holds anyway
            assert _trickle(raw, answer[:-1], interval_s=0.05) == "closed"
        assert server.num_refused == 1
        assert "did not prove the group's secret within 0.3 s" in caplog.text
    finally:
        server.close()


def test_connections_held_in_handshake_from_one_address_leave_room_for_a_rank():
    server = StoreServer("127.0.0.1", 0, SECRET, handshake_timeout_s=60, max_connections=8,
                         max_handshakes_per_peer=4)
    holders = [socket.create_connection(server.address, timeout=5, source_address=("127.0.0.2", 0))
               for _ in range(12)]
    try:
        greeted = [sock for sock in holders if _greeting(sock)]
        assert len(greeted) == 4 and server.num_refused == 8     # the rest closed before the greeting
        for sock in greeted:
            sock.sendall(b"\x00")                                # trickling their answers' lengths
        client = AuthenticatedStore(*server.address, SECRET, is_server=False, timeout=SHORT)
        client.set("addr/0", b"10.0.0.1:1234")
        assert client.get("addr/0") == b"10.0.0.1:1234"
        assert all(_is_open(sock) for sock in greeted)           # the rank got in while they held
        client.close()
    finally:
        for sock in holders:
            sock.close()
        server.close()


def test_a_rank_turned_away_at_a_cap_tries_again_until_it_gets_in():
    server = StoreServer("127.0.0.1", 0, SECRET, handshake_timeout_s=60, max_handshakes_per_peer=1)
    holder = socket.create_connection(server.address, timeout=5)
    joined: list = []
    try:
        assert _greeting(holder)
        joining = threading.Thread(target=lambda: joined.append(AuthenticatedStore(
            *server.address, SECRET, is_server=False, timeout=timedelta(seconds=30))))
        joining.start()
        end = time.monotonic() + 10
        while server.num_refused == 0 and time.monotonic() < end:   # turned away at least once
            time.sleep(0.01)
        assert server.num_refused >= 1 and not joined
        holder.close()                                                # the slot comes free
        joining.join(30)
        joined[0].set("rank", b"1")
        assert joined[0].get("rank") == b"1"
        joined[0].close()
    finally:
        holder.close()
        server.close()


def test_an_oversized_frame_before_the_proof_is_refused_unread_and_a_proven_one_may_be_large(store, caplog):
    server, client = store
    with caplog.at_level(logging.WARNING, logger="postrain.learner"), \
            socket.create_connection(server.address, timeout=5) as raw:
        _greeting(raw)
        raw.sendall(struct.pack(">I", MAX_FRAME_BYTES))       # 16 MiB announced, none of it sent
        assert _read_all(raw) == b""                           # closed at once, not waited for
    assert server.num_refused == 1
    assert "a rendezvous frame of 16777216 bytes is over the 256-byte limit" in caplog.text
    client.set("big", b"x" * (1 << 20))                       # after the proof: up to 16 MiB
    assert client.get("big") == b"x" * (1 << 20)


def _read_all(sock) -> bytes:
    """What the server sends before it closes (a reset counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(1024):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _frame(sock) -> bytes:
    size = struct.unpack(">I", sock.recv(4))[0]
    return sock.recv(size)


RANK = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from postrain.actors.learner.rendezvous_store import AuthenticatedStore
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = AuthenticatedStore("127.0.0.1", port, b"s" * 32, is_server=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    store.close()
    print("sum", value.item())
""")


def test_two_gloo_ranks_form_a_group_through_the_store():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-2000:]
        assert "sum 3.0" in out
