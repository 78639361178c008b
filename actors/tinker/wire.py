"""The Tinker API's protobuf bodies, decoded into arrays and encoded from them (SDK 0.38).

    call = decode_forward_backward(body)             # POST /api/v1/forward_backward (x-protobuf)
    call.datums[0].tokens, call.datums[0].inputs["target_tokens"], call.loss_fn, call.forward_only
    call.datums[0].input_spans, call.datums[0].target_spans   # provenance (Span lists) or None
    encode_forward_backward_output(outputs, metrics)  # the future's ForwardBackwardOutput
    encode_sample_response(sequences, prompt_logprobs)

The messages are the SDK's own (`tinker.proto.tinker_public_pb2`), so the server reads exactly
what `tinker==0.38.0` writes; tests round-trip through the SDK's `request_conv` and
`response_conv`. A body that does not parse, a chunk that is not text (images, audio), a tensor
whose bytes do not fill its shape: TinkerAPIError 400 naming what is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import TinkerAPIError

_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.float32), 2: np.dtype(np.int64), 3: np.dtype(np.int32)}  # DType -> numpy


@dataclass(frozen=True)
class Span:
    """One provenance claim of a datum (the SDK's Prompt/SampledProvenanceSpan): its next `length`
    positions are positions [offset, offset + length) of the named sampled sequence's prompt
    (`kind` "prompt") or of its sampled tokens ("sampled")."""

    kind: str
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class WireDatum:
    """One datum: its input tokens (L,), its loss inputs, each a dense numpy array, and its
    provenance (spans tiling the input tokens and the target tokens; None when not sent)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    input_spans: list[Span] | None = None
    target_spans: list[Span] | None = None


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    datums: list[WireDatum]


def _pb():
    from tinker.proto import tinker_public_pb2
    return tinker_public_pb2


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """The call a forward_backward body carries; TinkerAPIError 400 for a body that is not one."""
    from google.protobuf.message import DecodeError
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise TinkerAPIError(400, f"the forward_backward body is not a ForwardBackwardRequest protobuf ({exc}); "
                                  "send it with the tinker SDK (Content-Type: application/x-protobuf)") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    datums = [_datum(d, i) for i, d in enumerate(msg.data)]
    return ForwardBackwardCall(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), datums)


def _datum(msg, index: int) -> WireDatum:
    pieces = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise TinkerAPIError(400, f"data[{index}].model_input: a {kind or 'empty'} chunk is not supported; "
                                      "this server trains on text tokens (EncodedTextChunk) only")
        pieces.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    inputs = {name: decode_tensor(t, f"data[{index}].loss_fn_inputs[{name!r}]") for name, t in msg.loss_fn_inputs.items()}
    if len(msg.model_input_spans) == 0 and len(msg.loss_fn_input_spans) == 0:
        return WireDatum(tokens, inputs)
    return WireDatum(tokens, inputs, [_span(s) for s in msg.model_input_spans],
                     [_span(s) for s in msg.loss_fn_input_spans])


def _span(msg) -> Span:
    kind = msg.WhichOneof("span")
    if kind is None:
        raise TinkerAPIError(400, "a provenance span sets neither prompt_tokens nor sampled_tokens; build "
                                  "provenance with Datum.with_provenance")
    arm = msg.sampled_tokens if kind == "sampled_tokens" else msg.prompt_tokens
    if arm.offset < 0 or arm.length < 0:
        raise TinkerAPIError(400, f"a provenance span of {arm.sequence_id!r} has offset {arm.offset} and length "
                                  f"{arm.length}; both must be >= 0")
    return Span("sampled" if kind == "sampled_tokens" else "prompt", arm.sequence_id, int(arm.offset), int(arm.length))


def decode_tensor(msg, where: str) -> np.ndarray:
    """A proto Tensor (dense or sparse CSR) as a dense numpy array of its shape."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise TinkerAPIError(400, f"{where}: tensor dtype {msg.dtype} is not supported; send float32 or int64")
    shape = [int(s) for s in msg.shape]
    try:
        if msg.HasField("sparse_csr"):
            csr = msg.sparse_csr
            values = np.frombuffer(csr.values, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            rows = len(crow) - 1
            width = int(np.prod(shape[1:])) if len(shape) > 1 else (shape[0] if shape else 0)
            dense = np.zeros((max(rows, 0), width) if len(shape) > 1 else (width,), dtype=dtype)
            if len(shape) > 1:
                for r in range(rows):
                    dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
            else:
                dense[col] = values
            return dense.reshape(shape)
        data = np.frombuffer(msg.dense, dtype=dtype)
        return data.reshape(shape) if shape else data
    except (ValueError, IndexError) as exc:
        raise TinkerAPIError(400, f"{where}: its bytes do not fill shape {shape} ({exc})") from None


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput of per-datum outputs (each field a float32 (L,) array) and metrics."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    if outputs:
        record = msg.loss_fn_outputs.add()
        record.num_datums = len(outputs)
        for name in outputs[0]:
            arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
            batched = record.fields[name]
            batched.data = b"".join(a.tobytes() for a in arrays)
            batched.offsets = offsets.tobytes()
            batched.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


@dataclass(frozen=True)
class WireSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str        # "stop" | "length"


def encode_sample_response(sequences: list[WireSequence], prompt_logprobs: np.ndarray | None,
                           num_cached_prompt_tokens: int = 0) -> bytes:
    """A SampleResponse: the sequences, and the prompt's logprobs (NaN where none) when asked for."""
    pb = _pb()
    msg = pb.SampleResponse()
    for seq in sequences:
        out = msg.sequences.add()
        out.stop_reason = pb.STOP_REASON_LENGTH if seq.stop_reason == "length" else pb.STOP_REASON_STOP
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    msg.prompt_cache_hit_tokens = num_cached_prompt_tokens
    return msg.SerializeToString()
