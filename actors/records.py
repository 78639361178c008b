"""Every message that crosses between roles, on one page: typed records that encode to plain msgpack dicts.

    orchestrator --RolloutRequest--> env --GenerateRequest--> generator
    orchestrator <-------Rollout---- env <----GenerateReply--- generator
    orchestrator --TrainBatch / SftBatch--> learner (through LearnerKeeper, actors/learner/recovery.py)
    learner --WeightSync--> generator (`load_weights`), replies WeightSyncReply
    learner --PublishReport--> orchestrator (the `publish` reply)
    head --RunRequest--> orchestrator (`run`)

Each record is a frozen dataclass. Construction checks every field's type (and the
record's own rules, such as per-token lists of one length), so a wrong key or value
fails where the message is made, with an error naming the record, the field, the
value and the rule. `to_wire()` gives the dict that travels (what the handlers
received before these records existed, so the wire format is unchanged: a field that
is None is left out); `from_wire(dict)` is its inverse, refusing unknown keys by name.
Tensors and arrays pass through untouched (the wire moves them as extra frames).

`SamplingParams` lives here too (re-exported by actors/generator/sampling.py, which holds the
sampler): it is part of two messages, and this module must not import torch, so that
the orchestrator and environment processes stay light.
"""
from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from postrain.core.errors import PostrainError

from .env.api import Reward


class RecordError(PostrainError, ValueError):
    """A message that breaks its record's rules; the message names the record, the field and the fix."""


class SamplingParamsError(RecordError):
    """A sampling parameter outside its range."""


class Vector:
    """Annotation marker: a 1-D sequence (a list or tuple of numbers, a numpy array, a 1-D
    tensor), checked shallowly here (its elements are the learner's to check, by name)."""


def _is_vector(value: Any) -> bool:
    return hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict))


def _conforms(value: Any, tp: Any) -> bool:
    """Whether `value` is of the annotated type `tp` (the forms the records below use)."""
    if tp is Any:
        return True
    if tp is Vector:
        return _is_vector(value)
    if tp is type(None):
        return value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arm) for arm in args)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            return False
        # Per-token lists of numbers are checked by length only (`_check`): checking each element
        # cost ~0.4 us a token, 6.6 ms a 16-sample generate reply, on the message path.
        return not args or args[0] in (int, float) or all(_conforms(v, args[0]) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict) and (not args or all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()))
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    return text or str(tp).replace("typing.", "").replace(f"{__name__}.", "")


class Record:
    """Base of the records: type checks from the annotations, `to_wire` and `from_wire`.

    A subclass is a `@dataclass(frozen=True, slots=True)`; it may add `_check()` for rules
    across fields. A field may name its wire codec in metadata (`encode`, `decode`) when its
    value is a nested record or class rather than plain data."""

    __slots__ = ()
    _hints: ClassVar[dict[type, dict[str, Any]]] = {}

    def __post_init__(self) -> None:
        hints = Record._hints.get(type(self))
        if hints is None:
            hints = Record._hints[type(self)] = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _conforms(value, hints[f.name]):
                self._fail(f.name, value, f"of type {_describe(hints[f.name])}")
        self._check()

    def _check(self) -> None:
        """Rules across fields (subclasses); raise with `_fail`."""

    def _fail(self, name: str, value: Any, rule: str) -> typing.NoReturn:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise RecordError(f"{type(self).__name__}.{name} must be {rule}, got {type(value).__name__} {shown}")

    def to_wire(self) -> dict:
        """The dict that travels; fields that are None are left out."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            encode = f.metadata.get("encode")
            out[f.name] = encode(value) if encode else value
        return out

    @classmethod
    def from_wire(cls, data: Any):
        """The record of a received dict; RecordError naming an unknown or missing key."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise RecordError(f"a {cls.__name__} travels as a dict, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise RecordError(f"{cls.__name__} has no field(s) {unknown}; its fields are {sorted(fields)}")
        missing = [name for name, f in fields.items() if name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise RecordError(f"{cls.__name__} needs field(s) {missing}; got {sorted(data)}")
        values = {}
        for name, value in data.items():
            decode = fields[name].metadata.get("decode")
            values[name] = decode(value) if decode and value is not None else value
        return cls(**values)


def _codec(encode, decode) -> dict:
    return {"encode": encode, "decode": decode}


# -- sampling ---------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """How to sample one request. Applies per request; n samples share the prompt. The
    logprobs this yields are defined in actors/generator/sampling.py."""

    n: int = 1                                   # samples per prompt (GRPO group size)
    temperature: float = 1.0                     # 0 = greedy (argmax)
    top_p: float = 1.0                           # nucleus mass kept, in (0, 1]; 1 = off
    top_k: int = 0                               # keep the k most likely tokens; 0 = off
    seed: int | None = None                      # per-request seed; sample i uses seed + i
    max_new_tokens: int = 64                     # generated tokens at most, per sample
    stop: list[str] = field(default_factory=list)             # stop strings (text is cut before them)
    stop_token_ids: list[int] = field(default_factory=list)   # extra stop ids (kept in token_ids)
    ignore_eos: bool = False                     # True = do not stop on the tokenizer's EOS ids

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            (self.n >= 1, "n", self.n, ">= 1"),
            (self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 = off)"),
            (self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise SamplingParamsError(f"{name} must be {rule}, got {value!r}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty, got ''")

    @property
    def logprob_temperature(self) -> float:
        """The T of the reported logprobs: the sampling temperature, 1 for greedy."""
        return self.temperature if self.temperature > 0 else 1.0

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict | None) -> "SamplingParams":
        """SamplingParams of a dict of its fields; an unknown field is a SamplingParamsError naming it."""
        if isinstance(data, cls):
            return data
        data = dict(data or {})
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise SamplingParamsError(f"unknown sampling field(s) {unknown}; the fields are "
                                      f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**data)


_SAMPLING = _codec(SamplingParams.to_wire, SamplingParams.from_wire)


# -- generator: `generate` --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GenerateRequest(Record):
    """`generate`: a prompt as token ids (or, for a person at a terminal, as text) and how to sample it."""

    prompt_ids: list[int] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams, metadata=_SAMPLING)

    def _check(self) -> None:
        if (self.prompt_ids is None) == (self.prompt is None):
            self._fail("prompt_ids", self.prompt_ids, "given, or prompt instead (exactly one of the two)")


@dataclass(frozen=True, slots=True)
class GeneratedSample(Record):
    """One sample of a `generate` reply: the EXACT sampled ids, their logprobs (actors/generator/sampling.py)
    and the policy version that sampled each token; all three of one length."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str | None      # "stop" | "length" | "abort"
    text: str

    def _check(self) -> None:
        for name in ("logprobs", "policy_versions"):
            if len(getattr(self, name)) != len(self.token_ids):
                self._fail(name, getattr(self, name), f"one entry per token ({len(self.token_ids)})")

    def to_wire(self) -> dict:  # finish_reason travels even when None
        return {"token_ids": self.token_ids, "logprobs": self.logprobs,
                "policy_versions": self.policy_versions, "finish_reason": self.finish_reason,
                "text": self.text}


@dataclass(frozen=True, slots=True)
class GenerateReply(Record):
    """The `generate` reply: the prompt's length in tokens and `sampling.n` samples."""

    prompt_len: int
    samples: list[GeneratedSample] = field(metadata=_codec(
        lambda samples: [s.to_wire() for s in samples],
        lambda samples: [GeneratedSample.from_wire(s) for s in samples]))


# -- environment: `rollout` -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RolloutRequest(Record):
    """`rollout`: one episode of `task` (a task dict of the task's training or held-out stream)."""

    task: dict[str, Any]
    sampling: SamplingParams = field(default_factory=SamplingParams, metadata=_SAMPLING)
    sample_id: str | None = None   # the ledger's id, for the environment's logs (optional)


@dataclass(frozen=True, slots=True)
class Rollout(Record):
    """One episode as tokens (actors/env/actor.py): the rendered prompt, then per turn exactly the
    sampled ids (loss_mask 1, with their logprobs and policy versions) and the observation's tokens
    (loss_mask 0, logprob 0.0, version -1). Invariants: the four per-token lists have one length;
    num_policy_tokens == sum(loss_mask). `timeline`: the episode's hops (actors/timeline.py)."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    policy_versions: list[int]
    reward: Reward = field(metadata=_codec(Reward.to_dict, Reward.from_dict))
    num_turns: int
    num_policy_tokens: int
    tool_statuses: list[Any] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    sample_id: str | None = None

    def _check(self) -> None:
        for name in ("loss_mask", "behavior_logprobs", "policy_versions"):
            if len(getattr(self, name)) != len(self.token_ids):
                self._fail(name, getattr(self, name), f"one entry per token ({len(self.token_ids)})")
        if self.num_policy_tokens != sum(self.loss_mask):
            self._fail("num_policy_tokens", self.num_policy_tokens, f"sum(loss_mask) = {sum(self.loss_mask)}")

    def oldest_policy_version(self, default: int) -> int:
        """The oldest version that sampled a token of this episode (`default` when none did)."""
        return min((v for v in self.policy_versions if v >= 0), default=default)


# -- learner: `train`, `sft` (actors/learner/batch.py has the per-token rules) ------------

@dataclass(frozen=True, slots=True)
class SftBatch(Record):
    """`sft`: supervised samples; loss on the tokens where loss_mask is 1 (loss_mask[i][0] == 0)."""

    token_ids: list[Vector]
    loss_mask: list[Vector]

    def _check(self) -> None:
        _one_per_sample(self, ("loss_mask",))


@dataclass(frozen=True, slots=True)
class TrainBatch(Record):
    """`train`: one RL batch (actors/learner/batch.py). Per sample: token_ids, loss_mask,
    behavior_logprobs (and policy_versions: per token, or one int per sample), all aligned with
    token_ids; then either `advantages` (per sample, or per token) or `rewards` /
    `reward_components` for the learner's group-relative advantages, over `group_ids`
    (contiguous groups of equal size; without them the batch is one group)."""

    token_ids: list[Vector]
    loss_mask: list[Vector]
    behavior_logprobs: list[Vector]
    policy_versions: list[Vector | int] | None = None
    advantages: Vector | None = None
    rewards: Vector | None = None
    reward_components: dict[str, Vector] | None = None
    group_ids: Vector | None = None

    def _check(self) -> None:
        _one_per_sample(self, ("loss_mask", "behavior_logprobs", "policy_versions", "advantages", "rewards",
                               "group_ids"))
        for name, values in (self.reward_components or {}).items():
            if len(values) != len(self.token_ids):
                self._fail(f"reward_components[{name!r}]", values,
                           f"one value per sample ({len(self.token_ids)})")
        if self.advantages is None and self.rewards is None and self.reward_components is None:
            self._fail("advantages", None, "given, or rewards / reward_components (with group_ids)")

    @property
    def num_samples(self) -> int:
        return len(self.token_ids)


def _one_per_sample(record: Record, names: tuple[str, ...]) -> None:
    num = len(record.token_ids)
    for name in names:
        value = getattr(record, name)
        if value is not None and len(value) != num:
            record._fail(name, value, f"one entry per sample ({num}, as token_ids)")


# -- weights: `load_weights`, `publish` ---------------------------------------------------

@dataclass(frozen=True, slots=True)
class SealedChunk(Record):
    """Where a chunk's tensors travel when the learner runs on another node: not in the
    `load_weights` message but on the receiver's sealed channel (core/sealed.py), as pieces
    sealed for (sender, the chunk's version, sync_id, chunk). layout: [name, torch dtype name,
    shape] of each tensor, in the order of its bytes; piece_bytes: the pieces' size; timeout_s:
    the longest wait for one piece."""

    sender: str
    sync_id: bytes
    layout: list[list]
    piece_bytes: int
    timeout_s: float

    def _check(self) -> None:
        if len(self.sync_id) != 16:
            self._fail("sync_id", self.sync_id, "16 bytes")
        if self.piece_bytes <= 0 or self.timeout_s <= 0:
            self._fail("piece_bytes", self.piece_bytes, "> 0, with timeout_s > 0")
        if not all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str)
                   and isinstance(e[2], list) and all(isinstance(d, int) and d >= 0 for d in e[2])
                   for e in self.layout):
            self._fail("layout", self.layout, "a list of [name, dtype, shape]")


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
                                       metadata=_codec(SealedChunk.to_wire, SealedChunk.from_wire))

    def _check(self) -> None:
        if (self.chunk is None) != (self.num_chunks is None):
            self._fail("chunk", self.chunk, "given together with num_chunks (both or neither)")
        if self.chunk is not None and not 0 <= self.chunk < self.num_chunks:
            self._fail("chunk", self.chunk, f"in 0..num_chunks - 1 ({self.num_chunks - 1})")
        if self.sealed is not None and (self.chunk is None or self.weights):
            self._fail("sealed", self.sealed, "given only with a chunk whose weights are empty")

    @property
    def completes_version(self) -> bool:
        """True when this message is the whole sync or its last chunk."""
        return self.chunk is None or self.chunk == self.num_chunks - 1


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


# -- the run: `run` ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RunRequest(Record):
    """The orchestrator's `run`: the run folder, and whether to resume from its checkpoint."""

    run_folder: str
    resume: bool = False


#: A learner step's reply (`train`, `sft`): float metrics, always with "policy_version" (the
#: version after the step), "loss" and "step"; the rest vary with the objective (see learner.py).
StepMetrics = dict[str, float]
