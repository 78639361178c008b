"""The message path under AsyncSocket: the C send/receive and pyzmq's, frame for frame."""
import gc
import sys
import time

import numpy as np
import pytest
import zmq

from postrain.core import transport, wire
from postrain.core.transport import AsyncSocket, _PyzmqPath

PATHS = {"pyzmq": _PyzmqPath}
if transport.NATIVE_MESSAGE_PATH:
    PATHS["native"] = transport._native


def test_the_c_message_path_loads_on_linux():
    # a build that silently fell back to pyzmq's calls would run several times slower
    if sys.platform == "linux":
        assert transport.NATIVE_MESSAGE_PATH


@pytest.fixture
def pair(tmp_path):
    context = zmq.Context.instance()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    address = f"ipc://{tmp_path}/t.sock"
    router.bind(address)
    dealer.connect(address)
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)


def _receive(path, sock, timeout_s: float = 5.0) -> list:
    deadline = time.monotonic() + timeout_s
    while (frames := path.recv_message(sock)) is None:
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.001)
    return frames


@pytest.mark.parametrize("name", sorted(PATHS))
def test_each_path_sends_and_receives_whole_messages_small_frames_as_bytes(pair, name):
    path, (router, dealer) = PATHS[name], pair
    assert path.recv_message(router) is None   # nothing waiting: None, not an error
    big = np.arange(100_000, dtype=np.float32)  # 400 kB: stays in ZeroMQ's memory
    sent = path.send_frames(dealer, [b"head", b"x" * 100])
    assert sent is True
    dealer.send_multipart([b"bulk", memoryview(big)], copy=False)
    identity, head, body = _receive(path, router)
    assert (type(head), head, body) == (bytes, b"head", b"x" * 100)
    identity_again, head, bulk = _receive(path, router)
    assert identity_again == identity and head == b"bulk"
    assert type(bulk) is not bytes and len(bulk) == big.nbytes
    view = np.frombuffer(memoryview(bulk), dtype=np.float32)
    assert np.array_equal(view, big)
    assert bytes(bulk) == big.tobytes()
    assert path.recv_message(router) is None


@pytest.mark.parametrize("name", sorted(PATHS))
def test_a_full_queue_refuses_a_message_whole_and_a_closed_socket_raises(name):
    path = PATHS[name]
    lonely = zmq.Context.instance().socket(zmq.DEALER)
    lonely.sndhwm = 1
    lonely.immediate = True   # no live peer: nothing can be queued
    assert path.send_frames(lonely, [b"a", b"b"]) is False
    lonely.close(linger=0)
    with pytest.raises(zmq.ZMQError):
        path.recv_message(lonely)
    with pytest.raises(zmq.ZMQError):
        path.send_frames(lonely, [b"a"])


def test_async_socket_sends_a_large_frame_through_pyzmq_and_it_decodes(pair):
    router, dealer = pair
    tensor = np.arange(1 << 18, dtype=np.float32)   # 1 MiB: a frame the C path leaves to pyzmq
    message = wire.Message("k", 1, 0, "me", None, {"t": tensor})
    assert AsyncSocket(dealer).send_nowait(wire.encode(message))
    receiver, deadline = AsyncSocket(router), time.monotonic() + 5
    while (frames := receiver.recv_multipart_nowait()) is None:
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.001)
    received = wire.decode(frames[1:]).body["t"]
    del frames
    gc.collect()   # the array alone keeps ZeroMQ's buffer alive
    assert np.array_equal(received, tensor)


def _first_handshake(monitor) -> int:
    """The first handshake outcome a client's monitor reports (success, a failure, or a drop)."""
    from zmq.utils.monitor import recv_monitor_message
    while monitor.poll(10_000):
        event = recv_monitor_message(monitor)["event"]
        if event != zmq.EVENT_CONNECTED and event != zmq.EVENT_CONNECT_DELAYED:
            return event
    raise AssertionError("no handshake outcome within 10 s")


def test_a_curve_server_admits_clients_only_through_a_zap_handler():
    """ZAP_ENFORCE_DOMAIN: without a ZAP handler a Curve server refuses every client (libzmq's
    default admits any key then); with one, a Curve connection works as before."""
    from zmq.auth.thread import ThreadAuthenticator

    from postrain.core.transport import CurveKeys, configure_client, configure_server

    keys, context = CurveKeys.generate(), zmq.Context()
    try:
        for with_handler in (False, True):
            auth = None
            if with_handler:
                auth = ThreadAuthenticator(context)
                auth.start()
                auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            server, client = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
            monitor = client.get_monitor_socket()
            try:
                configure_server(server, "tcp://192.0.2.1:0", keys)   # beyond loopback: Curve on
                assert server.getsockopt(zmq.ZAP_ENFORCE_DOMAIN) == 1
                port = server.bind_to_random_port("tcp://127.0.0.1")
                configure_client(client, "tcp://192.0.2.1:0", keys)
                client.connect(f"tcp://127.0.0.1:{port}")
                outcome = _first_handshake(monitor)
                if with_handler:
                    assert outcome == zmq.EVENT_HANDSHAKE_SUCCEEDED
                    client.send(b"hello")
                    assert server.poll(10_000) and server.recv() == b"hello"
                else:
                    assert outcome != zmq.EVENT_HANDSHAKE_SUCCEEDED, "admitted without a ZAP handler"
            finally:
                client.disable_monitor()
                for sock in (monitor, server, client):
                    sock.close(linger=0)
                if auth is not None:
                    auth.stop()
    finally:
        context.term()


def test_this_hosts_addresses_are_loopback_and_its_interfaces_only():
    """What an inbox beyond loopback asks of a caller's Peer-Address before it maps a /dev/shm
    handle from it (core/inbox.py)."""
    import psutil
    import socket

    ours = [nic.address for nics in psutil.net_if_addrs().values() for nic in nics
            if nic.family == socket.AF_INET]
    assert all(transport.is_this_hosts_address(ip) for ip in ["127.0.0.1", "127.0.0.2", "::1", *ours])
    assert transport.is_this_hosts_address("::ffff:127.0.0.1")
    strangers = [ip for ip in ("203.0.113.7", "198.51.100.9") if ip not in ours]
    assert strangers and not any(transport.is_this_hosts_address(ip) for ip in strangers)
    assert not transport.is_this_hosts_address("") and not transport.is_this_hosts_address("not an address")
