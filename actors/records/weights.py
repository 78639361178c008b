"""`load_weights`, `publish`: a weight sync (whole, in chunks, or sealed) and its reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrain.core.messages import MessageKind
from postrain.core.record import Record, codec


@dataclass(frozen=True, slots=True)
class SealedChunk(Record):
    """Where a chunk's tensors travel when the learner runs on another node: not in the
    `load_weights` message but on the receiver's sealed channel (core/sealed.py), as pieces
    sealed for (sender, the chunk's version, sync_id, chunk). layout: [name, torch dtype name,
    shape] of each tensor, in the order of its bytes; piece_bytes: the pieces' size; timeout_s:
    the longest wait for one piece."""

    sender: str
    sync_id: bytes
    layout: list[list[Any]]
    piece_bytes: int
    timeout_s: float

    def _check(self) -> None:
        if len(self.sync_id) != 16:
            self.fail_field("sync_id", self.sync_id, "16 bytes")
        if self.piece_bytes <= 0 or self.timeout_s <= 0:
            self.fail_field("piece_bytes", self.piece_bytes, "> 0, with timeout_s > 0")
        if not all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str)
                   and isinstance(e[2], list) and all(isinstance(d, int) and d >= 0 for d in e[2])
                   for e in self.layout):
            self.fail_field("layout", self.layout, "a list of [name, dtype, shape]")


@dataclass(frozen=True, slots=True)
class WeightPatch(Record):
    """A sync that is not the whole weights (actors/weights/patch.py): kind "lora" (the adapters,
    scaled by lora_scale; with base_version None the base tensors too) or "delta" (the elements
    changed since base_version). digest: weights_digest of the whole weights after applying it;
    a receiver refuses a patch it cannot apply or whose result has another digest."""

    kind: str
    digest: str
    base_version: int | None = None
    lora_scale: float | None = None
    dtype: str | None = None      # the weights' travel (rollout) dtype: the receiver's are cast to it first

    def _check(self) -> None:
        if self.kind not in ("lora", "delta"):
            self.fail_field("kind", self.kind, "'lora' or 'delta'")
        if (self.kind == "lora") != (self.lora_scale is not None):
            self.fail_field("lora_scale", self.lora_scale, "given for kind 'lora' only")
        if self.kind == "delta" and self.base_version is None:
            self.fail_field("base_version", self.base_version, "the version a delta applies to")


@dataclass(frozen=True, slots=True)
class WeightSync(Record):
    """`load_weights`: the learner's weights at `version` ({Hugging Face name: CPU tensor}, no tied
    lm_head duplicate). Chunked (links across hosts): one sync is `num_chunks` messages of whole
    tensors sent in order; the receiver applies the version when chunk num_chunks - 1 arrives.
    From a learner on another node each chunk's tensors come on the sealed channel (`sealed`;
    `weights` is then empty until the receiver fills it)."""

    version: int
    weights: dict[str, Any]
    chunk: int | None = None
    num_chunks: int | None = None
    sealed: SealedChunk | None = field(default=None,
                                       metadata=codec(SealedChunk.to_wire, SealedChunk.from_wire))
    patch: WeightPatch | None = field(default=None,     # None: `weights` are the whole weights
                                      metadata=codec(WeightPatch.to_wire, WeightPatch.from_wire))

    def _check(self) -> None:
        if (self.chunk is None) != (self.num_chunks is None):
            self.fail_field("chunk", self.chunk, "given together with num_chunks (both or neither)")
        if self.chunk is not None and self.num_chunks is not None and not 0 <= self.chunk < self.num_chunks:
            self.fail_field("chunk", self.chunk, f"in 0..num_chunks - 1 ({self.num_chunks - 1})")
        if self.sealed is not None and (self.chunk is None or self.weights):
            self.fail_field("sealed", self.sealed, "given only with a chunk whose weights are empty")

    @property
    def completes_version(self) -> bool:
        """True when this message is the whole sync or its last chunk."""
        return self.chunk is None or self.chunk + 1 == self.num_chunks


@dataclass(frozen=True, slots=True)
class WeightSyncReply(Record):
    """The `load_weights` reply: the version the receiver holds (and, for a chunk, whether the
    sync is complete)."""

    version: int
    complete: bool | None = None


@dataclass(frozen=True, slots=True)
class PublishReport(Record):
    """The learner's `publish` reply: the version pushed, its size, the `load_weights` messages
    sent to all targets together, and seconds per target."""

    version: int
    num_bytes: int
    num_messages: int
    sync_s: dict[str, float]
    total_s: float
    num_bytes_sent: int | None = None   # tensor bytes sent to all targets together (patches are smaller)


@dataclass(frozen=True, slots=True)
class WeightsChannel(Record):
    """The `weights_channel` reply (no body): where a learner on another node sends this
    receiver's sealed weight pieces (core/sealed.py)."""

    address: str


@dataclass(frozen=True, slots=True)
class WeightsDigest(Record):
    """The weight receiver's `digest` reply (no body): the version held and a sha256 of its weights
    (actors/weights/messages.py, weights_digest)."""

    version: int
    digest: str


# A weight receiver's messages (the generator, the reference receiver: actors/weights/).
LOAD_WEIGHTS = MessageKind("load_weights", WeightSync, WeightSyncReply)
WEIGHTS_DIGEST = MessageKind("digest", None, WeightsDigest)
WEIGHTS_CHANNEL = MessageKind("weights_channel", None, WeightsChannel)
