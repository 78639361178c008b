"""`rollout`: one prompt's episodes on an environment actor, and what they gave.

Segments (design note). An episode whose history changed under the model (a context policy
compacted it, actors/env/context.py; an agent harness rewrote it, actors/gateway) is several
*segments*: each is a prompt rendered from the history as it then was, followed by the ids
sampled in that context. A `Rollout`'s own per-token lists are its LAST segment (the one in
which the episode ended: its only one when nothing changed, so single-segment rollouts are
exactly what they always were); `earlier_segments` holds the others, oldest first. Every
segment is trained as its own sample with the episode's reward (the orchestrator's train step),
and no segment holds a token sampled in another context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from postrain.core.messages import MessageKind
from postrain.core.record import Record, codec

from .reward import Reward
from .generate import SAMPLING_CODEC, SamplingParams


@dataclass(frozen=True, slots=True)
class RolloutRequest(Record):
    """`rollout`: one episode of `task` (a task dict of the task's training or held-out stream);
    `task_name` names the mixture's task it is of ("": the run's first, or only, task)."""

    task: dict[str, Any]
    sampling: SamplingParams = field(default_factory=SamplingParams, metadata=SAMPLING_CODEC)
    sample_id: str | None = None   # the ledger's id, for the environment's logs (optional)
    task_name: str = ""


@dataclass(frozen=True, slots=True)
class RolloutSegment(Record):
    """One earlier segment of an episode (module docstring): a prompt, then per turn the sampled
    ids (loss_mask 1, their logprobs and policy versions) and the observation ids after them
    (loss_mask 0, logprob 0.0, version -1). Invariants as `Rollout`'s: the four per-token lists
    have one length; num_policy_tokens == sum(loss_mask)."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    policy_versions: list[int]
    num_policy_tokens: int
    routed_experts: bytes | None = None   # MoE: the routing record of its tokens (as Rollout's)
    images: list[bytes] | None = None     # a vision-language policy's image files of its prompt (as Rollout's)

    def _check(self) -> None:
        _check_tokens(self)


_SEGMENTS_CODEC = codec(lambda segments: [s.to_wire() for s in segments],
                        lambda items: [RolloutSegment.from_wire(item) for item in items])


@dataclass(frozen=True, slots=True)
class Rollout(Record):
    """One episode as tokens (actors/env/token_policy.py): the rendered prompt, then per turn exactly
    the sampled ids (loss_mask 1, with their logprobs and policy versions) and the observation's
    tokens (loss_mask 0, logprob 0.0, version -1); of its last segment when it has several (module
    docstring: `earlier_segments`, `segments()`). Invariants: the four per-token lists have one
    length; num_policy_tokens == sum(loss_mask) (of these lists; `episode_policy_tokens`: of every
    segment); num_turns counts the episode's turns in all its segments. `timeline`: the episode's
    hops (actors/env/timeline.py)."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    policy_versions: list[int]
    reward: Reward = field(metadata=codec(Reward.to_dict, Reward.from_dict))
    num_turns: int
    num_policy_tokens: int
    tool_statuses: list[Any] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    sample_id: str | None = None
    routed_experts: bytes | None = None   # MoE policies: the generator's routing record of every token
                                          # (GeneratedSample.routed_experts of the last action, padded)
    earlier_segments: list[RolloutSegment] | None = field(default=None, metadata=_SEGMENTS_CODEC)
    # the episode's segments before the last (module docstring), oldest first; None (or []) for most
    # episodes, so a single-segment rollout travels exactly as before segments existed
    images: list[bytes] | None = None     # a vision-language policy's image files, in order: they fill
                                          # the first image placeholders of token_ids (models/vision.py)
    cause: str | None = None              # why the episode ended as it did (Episode.cause: the last
                                          # info["cause"] its environment named), None when none did

    def _check(self) -> None:
        _check_tokens(self)

    @property
    def num_segments(self) -> int:
        return len(self.earlier_segments or ()) + 1

    def segments(self) -> list[RolloutSegment]:
        """Every segment of the episode, oldest first (the last: this rollout's own lists)."""
        last = RolloutSegment(token_ids=self.token_ids, loss_mask=self.loss_mask,
                              behavior_logprobs=self.behavior_logprobs, policy_versions=self.policy_versions,
                              num_policy_tokens=self.num_policy_tokens, routed_experts=self.routed_experts,
                              images=self.images)
        return [*(self.earlier_segments or ()), last]

    @property
    def episode_policy_tokens(self) -> int:
        """Sampled tokens of the whole episode, every segment's."""
        return self.num_policy_tokens + sum(s.num_policy_tokens for s in self.earlier_segments or ())

    def oldest_policy_version(self, default: int) -> int:
        """The oldest version that sampled a token of this episode, in any segment (`default`
        when none did)."""
        versions = [v for segment in self.earlier_segments or () for v in segment.policy_versions if v >= 0]
        return min((v for v in [*versions, *self.policy_versions] if v >= 0), default=default)


def _check_tokens(record: Rollout | RolloutSegment) -> None:
    """The per-token invariants shared by a rollout and its segments."""
    for name in ("loss_mask", "behavior_logprobs", "policy_versions"):
        if len(getattr(record, name)) != len(record.token_ids):
            record.fail_field(name, getattr(record, name), f"one entry per token ({len(record.token_ids)})")
    if record.num_policy_tokens != sum(record.loss_mask):
        record.fail_field("num_policy_tokens", record.num_policy_tokens, f"sum(loss_mask) = {sum(record.loss_mask)}")


# The environment actor's message (actors/env/actor.py).
ROLLOUT = MessageKind("rollout", RolloutRequest, Rollout)
