"""`generate`: a prompt and how to sample it, in; samples with their token ids and logprobs, out."""
from __future__ import annotations

import dataclasses
from typing import Any
from dataclasses import dataclass, field

from postrain.core.messages import MessageKind
from postrain.core.record import Record, RecordError, codec


class SamplingParamsError(RecordError):
    """A sampling parameter outside its range."""


@dataclass(frozen=True, slots=True)
class SamplingParams(Record):
    """How to sample one request. Applies per request; n samples share the prompt. The
    logprobs this yields are defined in actors/generator/sampling.py.

    The one table of sampling defaults: a role that needs a default takes it from here
    (`SamplingParams().max_new_tokens`), never a literal of its own. Frozen: derive a
    variant with `dataclasses.replace(params, max_new_tokens=8)`."""

    n: int = 1                                   # samples per prompt (GRPO group size)
    temperature: float = 1.0                     # 0 = greedy (argmax)
    top_p: float = 1.0                           # nucleus mass kept, in (0, 1]; 1 = off
    top_k: int = 0                               # keep the k most likely tokens; 0 = off
    seed: int | None = None                      # per-request seed; sample i uses seed + i
    max_new_tokens: int = 64                     # generated tokens at most, per sample
    stop: tuple[str, ...] = ()                   # stop strings (text is cut before them); a str: one
    stop_token_ids: tuple[int, ...] = ()         # extra stop ids (kept in token_ids)
    ignore_eos: bool = False                     # True = do not stop on the tokenizer's EOS ids

    def __post_init__(self) -> None:
        # The wire and configs bring lists (and a lone stop string): normalise before the type checks.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        Record.__post_init__(self)

    def _check(self) -> None:
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

    def to_wire(self) -> dict[str, Any]:
        """Every field (seed too when None), stop lists as lists: what the handlers always received."""
        return {f.name: list(v) if isinstance(v, tuple) else v
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_wire(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """SamplingParams of a dict of its fields (None or {}: the defaults); an unknown field is a
        SamplingParamsError naming it."""
        if isinstance(data, cls):
            return data
        data = dict(data or {})
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise SamplingParamsError(f"unknown sampling field(s) {unknown}; the fields are "
                                      f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**data)


SAMPLING_CODEC = codec(SamplingParams.to_wire, SamplingParams.from_wire)


@dataclass(frozen=True, slots=True)
class GenerateRequest(Record):
    """`generate`: a prompt as token ids (or, for a person at a terminal, as text) and how to sample it."""

    prompt_ids: list[int] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams, metadata=SAMPLING_CODEC)
    images: list[bytes] | None = None   # a vision-language policy's image files, one per image run of
                                        # prompt_ids, in order (models/vision.py render_prompt)

    def _check(self) -> None:
        if (self.prompt_ids is None) == (self.prompt is None):
            self.fail_field("prompt_ids", self.prompt_ids, "given, or prompt instead (exactly one of the two)")
        if self.images and self.prompt_ids is None:
            self.fail_field("images", f"{len(self.images)} image(s)", "sent with prompt_ids (a prompt laid out "
                            "with the images' token runs), not with text")


@dataclass(frozen=True, slots=True)
class GeneratedSample(Record):
    """One sample of a `generate` reply: the EXACT sampled ids, their logprobs (actors/generator/sampling.py)
    and the policy version that sampled each token; all three of one length."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str | None      # "stop" | "length" | "abort"
    text: str
    routed_experts: bytes | None = None   # MoE policies: the experts each token of prompt + sample went
                                          # to in each MoE layer (routing replay; models.moe.encode_routing)

    def _check(self) -> None:
        for name in ("logprobs", "policy_versions"):
            if len(getattr(self, name)) != len(self.token_ids):
                self.fail_field(name, getattr(self, name), f"one entry per token ({len(self.token_ids)})")

    def to_wire(self) -> dict[str, Any]:  # finish_reason travels even when None
        wire = {"token_ids": self.token_ids, "logprobs": self.logprobs,
                "policy_versions": self.policy_versions, "finish_reason": self.finish_reason,
                "text": self.text}
        if self.routed_experts is not None:
            wire["routed_experts"] = self.routed_experts
        return wire


@dataclass(frozen=True, slots=True)
class GenerateReply(Record):
    """The `generate` reply: the prompt's length in tokens and `sampling.n` samples."""

    prompt_len: int
    samples: list[GeneratedSample] = field(metadata=codec(
        lambda samples: [s.to_wire() for s in samples],
        lambda samples: [GeneratedSample.from_wire(s) for s in samples]))


@dataclass(frozen=True, slots=True)
class GeneratorStats(Record):
    """The generator's `stats` reply (no body): the engine's batch and queue, its KV cache, the policy
    version, throughput and counters since start; the speculation figures with speculative decoding."""

    num_running: int
    num_waiting: int
    kv_num_used_blocks: int
    kv_num_blocks: int
    kv_utilization: float
    prefix_hit_rate: float
    policy_version: int
    tokens_per_s: float
    num_steps: int
    num_generated_tokens: int
    num_prefill_tokens: int
    num_cached_prompt_tokens: int
    num_preemptions: int
    busy_s: float
    num_verify_steps: int
    num_drafted_tokens: int
    num_accepted_tokens: int
    draft_s: float
    num_image_encodes: int = 0                     # images the vision tower read (those not in its cache)
    num_recomputed_on_swap: int = 0                # sequences a weight swap sent back to be read again (exact)
    acceptance_rate: float | None = None           # with speculative decoding only
    tokens_per_verify_step: float | None = None    # with speculative decoding only
    draft_time_share: float | None = None          # with speculative decoding only


# The generator's messages (actors/generator/actor.py).
GENERATE = MessageKind("generate", GenerateRequest, GenerateReply)
GENERATOR_STATS = MessageKind("stats", None, GeneratorStats)
