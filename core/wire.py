"""The wire codec: one message = a msgpack envelope frame + bulk-array frames.

Frame 0 is a msgpack array, the envelope:

    [kind, msg_id, corr_id, sender, policy_version, body]

- kind: str, the message kind (a handler name, or a reserved kind below);
- msg_id: int, unique per sender; 0 marks a tell (one-way: no reply is sent,
  errors are only logged); corr_id: int, the msg_id this replies to (0 for a
  request or a tell);
- sender: str, the sending actor's name;
- policy_version: int or None: a version stamp the application may set on what it
  sends (the kernel carries it and never reads it);
- body: any msgpack value (None, bool, int, float, str, bytes, list, dict).

Bulk arrays anywhere inside the body (numpy arrays, CPU torch tensors) do not
go through msgpack: each becomes an ext value `ARRAY_EXT` holding
`[frame_index, dtype, shape, is_torch]`, and its bytes travel as frame
`frame_index` (>= 1), sent without copying. An array larger than
`FRAME_MAX_BYTES` travels as several frames instead, in order, each a slice of
it (still no copy): `ARRAY_FRAMES_EXT` holds `[first_frame, num_frames, dtype,
shape, is_torch]`. An array of at least
`shm_min_bytes` (when the caller allows shared memory, i.e. both ends on one
host) is written once to a file in /dev/shm and the envelope carries only
`SHM_EXT` = `[path, dtype, shape, is_torch]`; the receiver maps the file and
unlinks it, so the tensor crosses without a socket copy. The files' names, pool
and removal (also of what a killed process left) are core/shm.py's. A receiver
takes such a handle only from a sender on its host (`decode(frames, allow_shm=True)`,
which the receiving end decides by its transport: core/inbox.py): from anywhere
else it is refused with a WireError and no file is touched.

Decoding is zero-copy too: a received array is a read-only view of the
frame's memory (numpy) or a tensor over it (torch; treat it as read-only and
`.clone()` before writing in place). An array of several frames is joined into
one new, writable buffer: one copy. No pickle anywhere: an unsupported type
raises `WireError` at encode time, and any malformed frame raises `WireError`
at decode time, which the actor answers with a typed error reply.
"""
from __future__ import annotations

import functools
import mmap
import sys
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np

from . import shm
from .errors import WireError as WireError   # re-exported: callers catch wire.WireError

ARRAY_EXT = 1
SHM_EXT = 2
ARRAY_FRAMES_EXT = 3
# The largest frame of an array. CurveZMQ (every tcp link beyond loopback) encrypts and
# decrypts each frame into freshly allocated buffers of its size: a 113 MB frame (SmolLM2's
# embedding) pays that in new pages each time, and a 538 MB state went over raw pyzmq with
# Curve at 0.05-0.07 GB/s in one frame against 0.15-0.2 GB/s in frames of 0.25-4 MiB (2-core
# VM, 2026-12-01, loaded). Frames of this size are reused by the allocator.
FRAME_MAX_BYTES = 4 << 20

# Reserved kinds. User handlers may not use names starting with "_".
REPLY = "_reply"        # the final answer to a request
ITEM = "_item"          # one item of a stream of replies
END = "_end"            # the end of a stream
ERROR = "_error"        # a typed error in place of a reply; body: {"type", "message", "traceback"}
PING = "_ping"          # answered with a REPLY by the runtime itself
# The kernel's control messages (_stop, _cores, _peers_moved, ...) are declared in core/control.py.

_NUMPY_DTYPES = {
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
}
# torch dtype name -> numpy dtype name used to hold its bytes (None: torch-only dtype).
_TORCH_DTYPES = {
    "bool": "bool", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "float16": "float16", "float32": "float32", "float64": "float64",
    "bfloat16": None,
}


@dataclass(slots=True)
class Message:
    kind: str
    msg_id: int
    corr_id: int
    sender: str
    policy_version: int | None
    body: Any


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


class _Encoder:
    """One msgpack Packer per thread (`_encoder_of_thread`), reused for every envelope
    (a fresh Packer per message costs more than the packing). `buffers` collects the
    bulk arrays of the message being encoded and `shm_min_bytes` is its setting;
    `encode` never re-enters itself (bulk-array headers are packed with
    `msgpack.packb`). Invariant: `buffers` is empty between messages."""

    __slots__ = ("buffers", "shm_min_bytes", "pack")

    def __init__(self) -> None:
        self.buffers: list[memoryview | bytes] = []
        self.shm_min_bytes: int | None = None
        self.pack = msgpack.Packer(default=self.default, use_bin_type=True, strict_types=False).pack

    def default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return _encode_numpy(obj, self.buffers, self.shm_min_bytes)
        if _is_torch_tensor(obj):
            return _encode_torch(obj, self.buffers, self.shm_min_bytes)
        if isinstance(obj, (np.integer, np.floating, np.bool_)):
            return obj.item()
        if isinstance(obj, tuple):
            return list(obj)
        raise WireError(f"cannot send a value of type {type(obj).__name__} on the wire; "
                        "send msgpack types (dict, list, str, bytes, int, float, bool, None), "
                        "numpy arrays or CPU torch tensors")


_encoder_of_thread = threading.local()  # .encoder: that thread's _Encoder


def encode(msg: Message, shm_min_bytes: int | None = None) -> list[Any]:
    """Message -> frames (frame 0 bytes, then one buffer per bulk array).

    shm_min_bytes: arrays at least this large go through /dev/shm (None: never;
    use only when sender and receiver share a host).
    """
    try:
        encoder: _Encoder = _encoder_of_thread.encoder
    except AttributeError:
        encoder = _encoder_of_thread.encoder = _Encoder()
    encoder.shm_min_bytes = shm_min_bytes
    try:  # on error the packer discards what it packed
        head = encoder.pack([msg.kind, msg.msg_id, msg.corr_id, msg.sender, msg.policy_version,
                             msg.body])
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"cannot encode message {msg.kind!r}: {exc}") from exc
    finally:
        buffers = encoder.buffers
        if buffers:   # hand them over (or, on error, drop the caller's arrays)
            encoder.buffers = []
    return [head, *buffers] if buffers else [head]


def _encode_numpy(array: np.ndarray, buffers: list[memoryview | bytes],
                  shm_min_bytes: int | None) -> Any:
    dtype = array.dtype.name
    if dtype not in _NUMPY_DTYPES:
        raise WireError(f"numpy dtype {dtype} is not supported on the wire; "
                        f"use one of {sorted(_NUMPY_DTYPES)}")
    shape = array.shape  # before ascontiguousarray, which makes 0-d arrays 1-d
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # the ignore: numpy's stubs declare ndarray.__buffer__ for Python >= 3.12 only (a buffer on 3.11 too)
    return _place(memoryview(array).cast("B") if array.size else b"",  # type: ignore[arg-type]
                  dtype, shape, False, buffers, shm_min_bytes)


def _encode_torch(tensor: Any, buffers: list[memoryview | bytes],   # tensor: a torch.Tensor
                  shm_min_bytes: int | None) -> Any:
    if tensor.device.type != "cpu":
        raise WireError(f"only CPU tensors go on the wire, got one on {tensor.device}; "
                        "call .cpu() first (weights for a GPU peer are staged on the host)")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise WireError(f"torch dtype {dtype} is not supported on the wire; "
                        f"use one of {sorted(_TORCH_DTYPES)}")
    tensor = tensor.detach().contiguous()
    torch = sys.modules["torch"]  # a tensor exists, so torch is imported
    raw = tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else b""
    return _place(memoryview(raw).cast("B") if len(raw) else b"", dtype, tuple(tensor.shape),
                  True, buffers, shm_min_bytes)


def _place(raw: memoryview | bytes, dtype: str, shape: tuple[int, ...], is_torch: bool,
           buffers: list[memoryview | bytes], shm_min_bytes: int | None) -> Any:
    nbytes = len(raw)
    if shm_min_bytes is not None and shm.SHM_DIR and nbytes >= shm_min_bytes:
        path = shm.write_segment(raw)
        return msgpack.ExtType(SHM_EXT, msgpack.packb([path, dtype, list(shape), is_torch]))
    if nbytes <= FRAME_MAX_BYTES:
        buffers.append(raw)
        return msgpack.ExtType(ARRAY_EXT, msgpack.packb([len(buffers), dtype, list(shape), is_torch]))
    first = len(buffers) + 1
    buffers.extend(raw[start:start + FRAME_MAX_BYTES] for start in range(0, nbytes, FRAME_MAX_BYTES))
    return msgpack.ExtType(ARRAY_FRAMES_EXT, msgpack.packb([first, len(buffers) - first + 1, dtype,
                                                            list(shape), is_torch]))


def decode(frames: list[Any], allow_shm: bool = False) -> Message:
    """Frames (bytes or zmq.Frame) -> Message. Raises WireError on anything malformed.

    allow_shm: the sender shares this host, so the message may name a /dev/shm file (SHM_EXT);
    False (a sender that may be on another host): such a message is refused, no file opened."""
    if not frames:
        raise WireError("empty message: expected an envelope frame")
    try:  # msgpack reads a zmq.Frame through the buffer protocol, without a memoryview
        if len(frames) == 1:  # no bulk frames: a shared hook needs no closure
            envelope = msgpack.unpackb(frames[0], ext_hook=_EXT_HOOKS_WITHOUT_FRAMES[allow_shm],
                                       raw=False, strict_map_key=False)
        else:
            envelope = msgpack.unpackb(frames[0], ext_hook=lambda code, data: _ext_hook(
                code, data, frames, allow_shm), raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several types for bad bytes
        raise WireError(f"envelope is not valid msgpack: {exc}") from exc
    if type(envelope) is not list or len(envelope) != 6:
        raise WireError("envelope must be [kind, msg_id, corr_id, sender, policy_version, body], "
                        f"got {type(envelope).__name__}")
    kind, msg_id, corr_id, sender, policy_version, body = envelope
    if type(kind) is not str or type(msg_id) is not int or type(corr_id) is not int \
            or type(sender) is not str or not (policy_version is None or type(policy_version) is int):
        raise WireError("envelope fields have wrong types: kind:str, msg_id:int, corr_id:int, "
                        f"sender:str, policy_version:int|None; got {envelope[:5]!r}")
    return Message(kind, msg_id, corr_id, sender, policy_version, body)


def _ext_hook(code: int, data: bytes, frames: Sequence[Any], allow_shm: bool) -> Any:
    if code == ARRAY_EXT:
        index, dtype, shape, is_torch = _unpack_ext(data, "array")
        if not isinstance(index, int) or not 1 <= index < len(frames):
            raise WireError(f"array refers to frame {index!r}, but the message has "
                            f"{len(frames)} frames")
        frame = frames[index]
        buffer = memoryview(frame)
        return _make_array(buffer, dtype, shape, is_torch)
    if code == ARRAY_FRAMES_EXT:
        first, count, dtype, shape, is_torch = _unpack_ext(data, "array of frames", num_fields=5)
        if not (isinstance(first, int) and isinstance(count, int) and first >= 1 and count >= 1
                and first + count <= len(frames)):
            raise WireError(f"array refers to {count!r} frames from frame {first!r}, but the message "
                            f"has {len(frames)} frames")
        return _make_array(_join(frames[first:first + count], _expected_nbytes(dtype, shape, is_torch)),
                           dtype, shape, is_torch)
    if code == SHM_EXT:
        if not allow_shm:
            raise WireError("refused a shared-memory array (a /dev/shm file handle) from a sender that may "
                            "be on another host: only a sender on this host may name one (ipc, loopback, "
                            "or a tcp connection from one of this host's own addresses)")
        path, dtype, shape, is_torch = _unpack_ext(data, "shared-memory array")
        return _make_array(shm.map_segment(path, _expected_nbytes(dtype, shape, is_torch), dtype, shape),
                           dtype, shape, is_torch)
    raise WireError(f"unknown msgpack ext type {code}")


def _join(frames: Sequence[Any], nbytes: int) -> memoryview:
    """The frames' bytes in one new writable buffer of `nbytes` (WireError if they differ)."""
    total = sum(len(memoryview(frame)) for frame in frames)
    if total != nbytes:
        raise WireError(f"array frames hold {total} bytes, but its dtype and shape need {nbytes}: "
                        "truncated or corrupt")
    joined = np.empty(nbytes, dtype=np.uint8)
    pos = 0
    for frame in frames:
        part = np.frombuffer(memoryview(frame), dtype=np.uint8)
        joined[pos:pos + len(part)] = part
        pos += len(part)
    return memoryview(joined)  # type: ignore[arg-type]   # numpy declares __buffer__ for Python >= 3.12 only


# allow_shm -> the ext hook of a message of one frame
_EXT_HOOKS_WITHOUT_FRAMES = {allow: functools.partial(_ext_hook, frames=(), allow_shm=allow)
                             for allow in (False, True)}


def peek_msg_id(frames: list[Any]) -> int | None:
    """The msg_id of a message that failed to decode, if its envelope still shows one,
    so the error reply can reach the caller's pending request."""
    try:
        envelope = msgpack.unpackb(frames[0], ext_hook=lambda code, data: None, raw=False)
        msg_id = envelope[1]
        return msg_id if isinstance(msg_id, int) and msg_id > 0 else None
    except Exception:
        return None


def _unpack_ext(data: bytes, what: str, num_fields: int = 4) -> list[Any]:
    """The header's fields: where the bytes are (1 or 2 fields), then dtype, shape, is_torch."""
    try:
        fields = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise WireError(f"malformed {what} header: {exc}") from exc
    if not isinstance(fields, list) or len(fields) != num_fields:
        raise WireError(f"malformed {what} header: expected {num_fields} fields, got {fields!r}")
    dtype, shape = fields[-3], fields[-2]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WireError(f"malformed {what} shape {shape!r}")
    if not isinstance(dtype, str):
        raise WireError(f"malformed {what} dtype {dtype!r}")
    return fields


def _expected_nbytes(dtype: str, shape: list[int], is_torch: bool) -> int:
    if is_torch:
        if dtype not in _TORCH_DTYPES:
            raise WireError(f"unsupported torch dtype {dtype!r}")
        itemsize = 2 if dtype == "bfloat16" else np.dtype(_TORCH_DTYPES[dtype]).itemsize
    else:
        if dtype not in _NUMPY_DTYPES:
            raise WireError(f"unsupported numpy dtype {dtype!r}")
        itemsize = np.dtype(dtype).itemsize
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _make_array(buffer: memoryview | mmap.mmap | bytes, dtype: str, shape: list[int],
                is_torch: bool) -> Any:
    nbytes = _expected_nbytes(dtype, shape, is_torch)
    if len(buffer) != nbytes:
        raise WireError(f"array frame holds {len(buffer)} bytes, but dtype {dtype} and shape "
                        f"{shape} need {nbytes}: truncated or corrupt")
    if not is_torch:
        return np.frombuffer(buffer, dtype=dtype).reshape(shape)
    import torch
    import warnings
    if nbytes == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    with warnings.catch_warnings():  # frame memory is read-only to Python; see module docstring
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=getattr(torch, dtype))
    return flat.view(shape)
