"""The learner's other requests and replies: checkpoints, export, publish, stats, and its group's
own messages (actors/learner/actor.py; `train`/`sft` take records/train.py, `get_weights` replies
a WeightSync and `publish` a PublishReport, records/weights.py).

The requests that train, save, export or publish the learner's weights (TrainBatch, SftBatch,
SaveCheckpoint, ExportHf, PublishRequest) may carry `expect_policy_version`: the version the
caller's LearnerKeeper predicts (actors/learner/recovery.py); a learner at another version
refuses them with PolicyVersionMismatch (it restarted) instead of acting on the wrong weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Self

from postrain.core.messages import MessageKind
from postrain.core.record import Record, RecordError, codec
from .train import SFT, TRAIN
from .weights import PublishReport, WeightSync

GROUP_STATES = ("alone", "waiting", "joining", "formed")


@dataclass(frozen=True, slots=True)
class SaveCheckpoint(Record):
    """`save_checkpoint`: the folder to write, and the caller's own JSON-able state to keep in it
    (the orchestrator's RunState wire dict: records/run.py)."""

    path: str
    extra: dict[str, Any] | None = None
    expect_policy_version: int | None = None


@dataclass(frozen=True, slots=True)
class CheckpointSaved(Record):
    """The `save_checkpoint` reply: where it was written, at which step and version."""

    path: str
    step: int
    policy_version: int


@dataclass(frozen=True, slots=True)
class LoadCheckpoint(Record):
    """`load_checkpoint`: the folder a `save_checkpoint` wrote."""

    path: str


@dataclass(frozen=True, slots=True)
class CheckpointLoaded(Record):
    """The `load_checkpoint` reply: the learner's step and version now, and the `extra` saved."""

    step: int
    policy_version: int
    extra: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ExportHf(Record):
    """`export_hf`: the folder to write the policy to, as Hugging Face files."""

    path: str
    expect_policy_version: int | None = None


@dataclass(frozen=True, slots=True)
class ExportedHf(Record):
    """The `export_hf` reply: the folder written."""

    path: str


@dataclass(frozen=True, slots=True)
class PublishRequest(Record):
    """`publish`: push the current weights to `targets` (actor names). timeout_s: per message;
    chunk_mb: the largest chunk to a target the sealed transport serves (None: one chunk)."""

    targets: list[str] = field(default_factory=list)
    timeout_s: float = 120.0
    chunk_mb: float | None = None
    expect_policy_version: int | None = None

    def _check(self) -> None:
        if self.timeout_s <= 0:
            self.fail_field("timeout_s", self.timeout_s, "> 0")
        if self.chunk_mb is not None and self.chunk_mb <= 0:
            self.fail_field("chunk_mb", self.chunk_mb, "> 0, or None for one chunk")


@dataclass(frozen=True, slots=True)
class LearnerStats(Record):
    """The `stats` reply: step, version, parameter count, the last publish (None before the
    first), and the pieces sealed for targets on other nodes so far."""

    step: int
    policy_version: int
    num_params: int
    num_pieces_sealed: int = 0
    last_publish: PublishReport | None = field(default=None,
                                               metadata=codec(PublishReport.to_wire, PublishReport.from_wire))


@dataclass(frozen=True, slots=True)
class JoinGroup(Record):
    """`join` (rank 0 to another rank of its learner group): join group `generation`, hosted at
    address:port (actors/learner/group.py)."""

    generation: str
    address: str
    port: int


@dataclass(frozen=True, slots=True)
class GroupState(Record):
    """The `group`, `join` and `rank_step` reply: a rank's generation (None before it joined one),
    its state (GROUP_STATES; "alone": not a rank of a group) and its rank. A None generation
    travels as no key (Record.to_wire), so it defaults to None: a rank restarted before it joined
    must read back, or rank 0's probe of it fails instead of counting it lost."""

    state: str
    rank: int
    generation: str | None = None

    def _check(self) -> None:
        if self.state not in GROUP_STATES:
            self.fail_field("state", self.state, f"one of {GROUP_STATES}")


@dataclass(frozen=True, slots=True)
class RankStep(Record):
    """`rank_step` (rank 0 to another rank): its part of a request, in group `generation`. kind:
    train, sft, save_checkpoint, load_checkpoint, and for a sharded group publish and export_hf;
    request: that message's request record (RANK_MESSAGES names each kind's), decoded by kind.

    Invariant: isinstance(request, RANK_MESSAGES[kind].request)."""

    generation: str
    kind: str
    request: Record = field(metadata={"encode": lambda request: request.to_wire()})

    def _check(self) -> None:
        request_type = RANK_MESSAGES[self.kind].request if self.kind in RANK_MESSAGES else None
        if request_type is None:
            self.fail_field("kind", self.kind, f"one of {sorted(RANK_MESSAGES)}")
        if not isinstance(self.request, request_type):
            self.fail_field("request", self.request, f"a {request_type.__name__} (the request of {self.kind})")

    @classmethod
    def of(cls, generation: str, kind: MessageKind[Any, Any], request: Record) -> "RankStep":
        return cls(generation=generation, kind=kind.name, request=request)

    @classmethod
    def from_wire(cls, data: Any) -> Self:
        """The step of a received dict, its request decoded as its kind's record."""
        if isinstance(data, dict) and isinstance(data.get("request"), dict):
            kind = RANK_MESSAGES.get(data.get("kind", ""))
            if kind is None or kind.request is None:
                raise RecordError(f"RankStep.kind must be one of {sorted(RANK_MESSAGES)}, got {data.get('kind')!r}")
            data = {**data, "request": kind.request.from_wire(data["request"])}
        return super(RankStep, cls).from_wire(data)    # (slots: no zero-argument super)

    @property
    def message(self) -> MessageKind[Any, Any]:
        """The learner message this step is a rank's part of."""
        return RANK_MESSAGES[self.kind]


# The learner's other messages (actors/learner/actor.py); its steps are TRAIN and SFT (train.py).
SAVE_CHECKPOINT = MessageKind("save_checkpoint", SaveCheckpoint, CheckpointSaved)
LOAD_CHECKPOINT = MessageKind("load_checkpoint", LoadCheckpoint, CheckpointLoaded)
EXPORT_HF = MessageKind("export_hf", ExportHf, ExportedHf)
GET_WEIGHTS = MessageKind("get_weights", None, WeightSync)
PUBLISH = MessageKind("publish", PublishRequest, PublishReport)
LEARNER_STATS = MessageKind("stats", None, LearnerStats)
JOIN_GROUP = MessageKind("join", JoinGroup, GroupState)            # rank 0 -> a follower rank
GROUP_STATE = MessageKind("group", None, GroupState)               # rank 0 probes its ranks
RANK_STEP = MessageKind("rank_step", RankStep, GroupState)         # rank 0 -> a follower: its part of a step

#: The learner messages a rank's step carries, by name. A sharded learner (strategy "fsdp")
#: gathers its weights on every rank, so its publishes (and get_weights) and exports are rank
#: steps too.
RANK_MESSAGES: dict[str, MessageKind[Any, Any]] = {kind.name: kind for kind in (
    TRAIN, SFT, SAVE_CHECKPOINT, LOAD_CHECKPOINT, PUBLISH, EXPORT_HF)}
