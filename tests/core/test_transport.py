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
