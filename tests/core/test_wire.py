"""The wire codec: round trips of nested values and arrays, and typed errors for bad frames."""
import os

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from postrain.core import shm, wire
from postrain.core.wire import Message, WireError, decode, encode

NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                torch.float16, torch.float32, torch.float64, torch.bfloat16]

scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) \
    | st.text(max_size=20) | st.binary(max_size=20)
values = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                      | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=20)
arrays = st.sampled_from(NUMPY_DTYPES).flatmap(
    lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))


def round_trip(body, shm_min_bytes=None):
    frames = encode(Message("k", 7, 3, "sender", 5, body), shm_min_bytes)
    msg = decode([bytes(f) if isinstance(f, memoryview) else f for f in frames])
    assert (msg.kind, msg.msg_id, msg.corr_id, msg.sender, msg.policy_version) == ("k", 7, 3, "sender", 5)
    return msg.body


@given(values)
def test_nested_values_round_trip(body):
    assert round_trip(body) == body


@settings(max_examples=60)
@given(st.lists(arrays, max_size=3), values)
def test_arrays_of_every_dtype_round_trip_inside_nested_values(array_list, other):
    out = round_trip({"arrays": array_list, "other": other})
    assert out["other"] == other
    for sent, got in zip(array_list, out["arrays"], strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        np.testing.assert_array_equal(got, sent)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_tensors_round_trip_with_their_dtype(dtype):
    tensor = (torch.arange(24) % 7).reshape(2, 3, 4).to(dtype)
    got = round_trip({"t": tensor, "empty": torch.zeros(0, 3, dtype=dtype)})
    assert got["t"].dtype == dtype and torch.equal(got["t"], tensor)
    assert got["empty"].shape == (0, 3)


def test_non_contiguous_and_big_endian_arrays_are_sent_as_values():
    matrix = np.arange(12, dtype=np.int32).reshape(3, 4)
    np.testing.assert_array_equal(round_trip(matrix.T), matrix.T)
    big_endian = np.arange(5, dtype=">f8")
    np.testing.assert_array_equal(round_trip(big_endian), big_endian)
    assert round_trip(torch.arange(6).reshape(2, 3).t()).tolist() == [[0, 3], [1, 4], [2, 5]]


def test_bulk_arrays_travel_as_separate_frames_without_copy():
    array = np.arange(1000, dtype=np.float32)
    frames = encode(Message("k", 1, 0, "s", None, {"a": array}))
    assert len(frames) == 2 and len(frames[0]) < 100
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), array)


def test_an_array_over_the_frame_limit_travels_as_slices_and_arrives_whole_and_writable(monkeypatch):
    monkeypatch.setattr(wire, "FRAME_MAX_BYTES", 1000)
    weights = {"small": torch.arange(10, dtype=torch.float32), "big": torch.randn(7, 301),
               "array": np.arange(2600, dtype=np.int16)}
    frames = encode(Message("k", 1, 0, "s", None, weights))
    assert len(frames) == 1 + 1 + 9 + 6 and all(len(f) <= 1000 for f in frames[1:])
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.float32), weights["big"].numpy())
    got = decode([bytes(f) for f in frames]).body
    assert torch.equal(got["small"], weights["small"]) and torch.equal(got["big"], weights["big"])
    np.testing.assert_array_equal(got["array"], weights["array"])
    got["big"][0, 0] = 1.0      # joined into its own buffer: the receiver may write it
    with pytest.raises(WireError, match="refers to 9 frames from frame 2, but the message has 10 frames"):
        decode([bytes(f) for f in frames[:10]])
    frames[5] = b"x"
    with pytest.raises(WireError, match="array frames hold 7429 bytes, but its dtype and shape need 8428"):
        decode([bytes(f) for f in frames])


def test_a_tensor_of_many_frames_crosses_a_curve_tcp_link_whole():
    import zmq

    from postrain.core.transport import CurveKeys, configure_client, configure_server

    from zmq.auth.thread import ThreadAuthenticator

    keys, context = CurveKeys.generate(), zmq.Context()
    auth = ThreadAuthenticator(context)      # a Curve server admits clients only through a ZAP handler
    auth.start()
    auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    server, client = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        configure_server(server, "tcp://192.0.2.1:0", keys)   # any address beyond loopback: Curve on
        port = server.bind_to_random_port("tcp://127.0.0.1")
        configure_client(client, "tcp://192.0.2.1:0", keys)
        client.connect(f"tcp://127.0.0.1:{port}")
        tensor = torch.randn(3 * wire.FRAME_MAX_BYTES // 4 + 5)
        frames = encode(Message("load_weights", 1, 0, "s", None, {"w": tensor}))
        assert len(frames) == 5
        client.send_multipart(frames, copy=False)
        assert torch.equal(decode(server.recv_multipart(copy=False)).body["w"], tensor)
    finally:
        server.close(linger=0)
        client.close(linger=0)
        auth.stop()
        context.term()


def test_large_tensors_go_through_shared_memory_and_leave_no_file_behind(tmp_path):
    tensor = torch.randn(512, 1024)
    frames = encode(Message("k", 1, 0, "s", None, tensor), shm_min_bytes=1 << 20)
    assert len(frames) == 1, "only a handle is on the wire"
    header = msgpack.unpackb(frames[0], ext_hook=lambda code, data: msgpack.unpackb(data))
    path = header[5][0]
    got = decode(frames, allow_shm=True).body
    assert torch.equal(got, tensor)
    got[0, 0] = 1.0  # the receiver may write its private copy
    assert not os.path.exists(path), "the receiver unlinks the file it maps"


def test_unsupported_values_are_refused_with_a_clear_error():
    with pytest.raises(WireError, match="cannot send a value of type object"):
        encode(Message("k", 1, 0, "s", None, {"x": object()}))
    with pytest.raises(WireError, match="dtype"):
        encode(Message("k", 1, 0, "s", None, np.array(["a"], dtype=object)))


@pytest.mark.parametrize("frames, rule", [
    ([], "empty message"),
    ([b"\xc1"], "not valid msgpack"),
    ([msgpack.packb({"kind": "x"})], "envelope must be"),
    ([msgpack.packb(["k", "1", 0, "s", None, None])], "wrong types"),
    ([msgpack.packb(["k", 1, 0, "s", None, msgpack.ExtType(1, msgpack.packb([1, "float32", [4], False]))]),
      b"\x00" * 15], "truncated"),
    ([msgpack.packb(["k", 1, 0, "s", None, msgpack.ExtType(1, msgpack.packb([3, "float32", [1], False]))])],
     "refers to frame"),
    ([msgpack.packb(["k", 1, 0, "s", None, msgpack.ExtType(9, b"")])], "unknown msgpack ext"),
])
def test_malformed_frames_raise_wire_error_naming_the_problem(frames, rule):
    with pytest.raises(WireError, match=rule):
        decode(frames)


def test_a_shared_memory_handle_is_refused_unless_the_sender_shares_this_host():
    """A message from another host must not name a file in this host's /dev/shm: the receiving end
    says whether its sender shares the host (allow_shm, from its transport: core/inbox.py)."""
    frames = encode(Message("k", 1, 0, "s", None, torch.ones(1024)), shm_min_bytes=1024)
    path = msgpack.unpackb(frames[0], ext_hook=lambda code, data: msgpack.unpackb(data))[5][0]
    try:
        with pytest.raises(WireError, match="refused a shared-memory array .* may be on another host"):
            decode(frames)
        assert os.path.exists(path), "a refused handle's file is not touched"
        assert torch.equal(decode(frames, allow_shm=True).body, torch.ones(1024))
    finally:
        shm.cleanup_shm()
    handle = msgpack.ExtType(2, msgpack.packb(["/etc/passwd", "uint8", [1], False]))
    passwd = [msgpack.packb(["k", 1, 0, "s", None, handle])]
    with pytest.raises(WireError, match="not a postrain file"):
        decode(passwd, allow_shm=True)


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_arbitrary_bytes_decode_or_raise_wire_error_never_anything_else(frames):
    try:
        decode(frames)
    except WireError:
        pass


def test_peek_msg_id_recovers_the_id_of_a_broken_request():
    frames = [msgpack.packb(["k", 42, 0, "s", None, msgpack.ExtType(1, msgpack.packb([1, "float32", [4], False]))])]
    with pytest.raises(WireError):
        decode(frames)
    assert wire.peek_msg_id(frames) == 42
    assert wire.peek_msg_id([b"garbage"]) is None
