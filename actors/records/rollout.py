"""`rollout`: one prompt's episodes on an environment actor, and what they gave."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..env.api import Reward
from .base import Record, codec
from .generate import SAMPLING_CODEC, SamplingParams


@dataclass(frozen=True, slots=True)
class RolloutRequest(Record):
    """`rollout`: one episode of `task` (a task dict of the task's training or held-out stream)."""

    task: dict[str, Any]
    sampling: SamplingParams = field(default_factory=SamplingParams, metadata=SAMPLING_CODEC)
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
    reward: Reward = field(metadata=codec(Reward.to_dict, Reward.from_dict))
    num_turns: int
    num_policy_tokens: int
    tool_statuses: list[Any] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    sample_id: str | None = None
    routed_experts: bytes | None = None   # MoE policies: the generator's routing record of every token
                                          # (GeneratedSample.routed_experts of the last action, padded)

    def _check(self) -> None:
        for name in ("loss_mask", "behavior_logprobs", "policy_versions"):
            if len(getattr(self, name)) != len(self.token_ids):
                self._fail(name, getattr(self, name), f"one entry per token ({len(self.token_ids)})")
        if self.num_policy_tokens != sum(self.loss_mask):
            self._fail("num_policy_tokens", self.num_policy_tokens, f"sum(loss_mask) = {sum(self.loss_mask)}")

    def oldest_policy_version(self, default: int) -> int:
        """The oldest version that sampled a token of this episode (`default` when none did)."""
        return min((v for v in self.policy_versions if v >= 0), default=default)
