"""DAPO's batch rules (Yu et al. 2025, arXiv:2503.14476): dynamic sampling and overlong shaping.

Dynamic sampling (`dynamic_sampling = true`): a group whose rewards are all equal has advantage 0
for every sample and teaches nothing; it is dropped before training, each of its samples
"dropped" in the ledger with ZERO_VARIANCE. To keep the batch full, each batch generates
`dynamic_sampling_extra_prompts` prompts beyond `prompts_per_step` (over-provisioning, part of
the data order); the groups left after the drop are trained, at most `prompts_per_step` of
them, in order, and any beyond are dropped with BATCH_FULL. Invariant: every sample of a
generated batch ends trained or dropped with a reason (the ledger balances).

Overlong shaping (`overlong_max_tokens`): a sample of L policy tokens gets DAPO's soft overlong
penalty added to its reward before its group's baseline (ext/advantages.py, OverlongPenalty,
factor 1): 0 up to overlong_max_tokens - overlong_buffer_tokens, then down linearly to -1 at
overlong_max_tokens, -1 beyond. The ledger and samples.jsonl keep the environment's reward;
the train row reports `overlong_penalty_mean`.
"""
from __future__ import annotations

import dataclasses

from ..tasks import TaskMixture
from .scored_sample import ScoredSample

ZERO_VARIANCE = "zero reward variance (dynamic sampling)"
BATCH_FULL = "batch already full (dynamic sampling)"


@dataclasses.dataclass(frozen=True)
class BatchRules:
    """The orchestrator's DAPO options, applied by the train step to a batch's groups."""

    dynamic_sampling: bool = False
    max_groups: int | None = None               # prompts_per_step: groups trained at most
    overlong_max_tokens: int | None = None      # None: no overlong shaping
    overlong_buffer_tokens: int = 16
    mixture: TaskMixture | None = None          # each task's reward range (None: rewards as they are)

    @classmethod
    def from_options(cls, options, mixture: TaskMixture | None = None) -> "BatchRules":
        return cls(dynamic_sampling=options.dynamic_sampling, max_groups=options.prompts_per_step,
                   overlong_max_tokens=options.overlong_max_tokens,
                   overlong_buffer_tokens=options.overlong_buffer_tokens, mixture=mixture)

    def penalty(self, sample: ScoredSample) -> float:
        """The overlong penalty of one sample (module docstring); 0 without overlong shaping."""
        if self.overlong_max_tokens is None:
            return 0.0
        length = sample.rollout.episode_policy_tokens   # every segment's sampled tokens
        soft = self.overlong_max_tokens - self.overlong_buffer_tokens
        if length <= soft:
            return 0.0
        if length > self.overlong_max_tokens:
            return -1.0
        return (soft - length) / self.overlong_buffer_tokens

    def reward(self, sample: ScoredSample) -> float:
        """The reward the learner trains on: the environment's total on its task's scale (mapped
        from the task's reward_range onto [0, 1]: actors/tasks/mixture.py) plus the overlong penalty."""
        total = sample.rollout.reward.total
        if self.mixture is not None:
            total = self.mixture[sample.task].scaled(total)
        return total + self.penalty(sample)

    def select(self, groups: list[list[ScoredSample]], ledger) -> tuple[list[list[ScoredSample]], int]:
        """(the groups to train, the number dropped for zero reward variance); unchanged without
        dynamic sampling. Dropped samples are "dropped" in the ledger with the reason."""
        if not self.dynamic_sampling:
            return groups, 0
        kept: list[list[ScoredSample]] = []
        num_zero = 0
        for group in groups:
            rewards = [self.reward(s) for s in group]
            reason = (ZERO_VARIANCE if max(rewards) == min(rewards)
                      else BATCH_FULL if self.max_groups is not None and len(kept) >= self.max_groups else None)
            if reason is None:
                kept.append(group)
                continue
            num_zero += reason == ZERO_VARIANCE
            for sample in group:
                for sid in sample.segment_ids:   # an episode's segments go with it
                    ledger.drop(sid, reason)
        return kept, num_zero
