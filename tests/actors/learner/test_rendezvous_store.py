"""The learner group's rendezvous store (issue 32): a client without the group's secret can
neither join nor read it; ranks that hold it form a real gloo group through it."""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

from postrain.actors.learner.rendezvous_store import AuthenticatedStore, RendezvousRefused, StoreServer

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
