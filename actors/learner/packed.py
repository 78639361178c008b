"""The tensor forms of a learner batch: `PackedBatch` (a batch padded on the right, cut into
micro-batches) and `PrefixPlan` (a micro-batch's shared-prefix layout).

batch.py makes a PackedBatch from a TrainBatch or SftBatch record; shared_prefix.py plans the
micro-batches and their PrefixPlans; learner.py runs them. Both import this module, and it
imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..models.llama import SharedPrefixBatch


@dataclass
class PrefixPlan:
    """A micro-batch's shared-prefix layout. The model returns the hidden states of the prefix
    rows (G*P) then the suffix rows (B*S), the rows `hidden_rows` indexes. Invariant: for every real token t of sample b, row hidden_rows[b, t]
    holds the hidden state the plain path computes at (b, t)."""

    batch: SharedPrefixBatch
    hidden_rows: torch.Tensor      # (B, T) int64 into cat(prefix rows (G*P), suffix rows (B*S)); 0 past the end

    @property
    def num_token_rows(self) -> int:
        """Token rows the forward pass computes: G * P + B * S."""
        return self.batch.prefix_ids.numel() + self.batch.suffix_ids.numel()

    def to(self, device) -> "PrefixPlan":
        b = self.batch
        prefix_ids, prefix_mask, suffix_ids, suffix_mask, group_of = (t.to(device) for t in (
            b.prefix_ids, b.prefix_mask, b.suffix_ids, b.suffix_mask, b.group_of))
        return PrefixPlan(SharedPrefixBatch(prefix_ids, prefix_mask, suffix_ids, suffix_mask, group_of),
                          self.hidden_rows.to(device))



@dataclass
class PackedBatch:
    """A batch padded on the right. Shapes: B samples, T the longest sample; per-token fields
    are aligned with targets = input_ids[:, 1:], so they are (B, T - 1).

    Invariants: loss_mask <= attention_mask[:, 1:]; advantages is (B,) or (B, T - 1); `shared`
    describes these rows (rows() and select() drop it: a plan belongs to one micro-batch); the
    teacher's rows (distillation) are all three or none, aligned with the targets like every
    per-token field (row t predicts input_ids[:, t + 1]).
    """

    input_ids: torch.Tensor          # (B, T) int64, 0 past each sample's end
    attention_mask: torch.Tensor     # (B, T) int64, 1 = real token
    loss_mask: torch.Tensor          # (B, T - 1) bool: target t+1 was produced by the policy
    behavior_logp: torch.Tensor      # (B, T - 1) float32 (0 where loss_mask is False)
    policy_versions: torch.Tensor    # (B, T - 1) int64, -1 where unknown
    advantages: torch.Tensor         # (B,) or (B, T - 1) float32
    shared: PrefixPlan | None = None   # shared-prefix layout of a micro-batch (actors/learner/shared_prefix.py)
    routed_experts: torch.Tensor | None = None   # (B, T, moe_layers, top_k) int64, -1 = none (routing.py)
    teacher_ids: torch.Tensor | None = None      # (B, T - 1, k) int64: the teacher's top-k ids (distillation)
    teacher_logp: torch.Tensor | None = None     # (B, T - 1, k) float32: their log-probs under the teacher
    teacher_tail: torch.Tensor | None = None     # (B, T - 1) float32: the teacher's log-mass outside them
    images: list[list[bytes]] | None = None      # per sample its image files (a vision-language policy)

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def rows(self, start: int, stop: int) -> "PackedBatch":
        """Samples [start, stop), trimmed to their own longest length (a micro-batch)."""
        width = max(int(self.attention_mask[start:stop].sum(-1).max()), 2)
        adv = self.advantages[start:stop]
        routed = None if self.routed_experts is None else self.routed_experts[start:stop, :width]
        return PackedBatch(
            self.input_ids[start:stop, :width], self.attention_mask[start:stop, :width],
            self.loss_mask[start:stop, :width - 1], self.behavior_logp[start:stop, :width - 1],
            self.policy_versions[start:stop, :width - 1], adv if adv.dim() == 1 else adv[:, :width - 1],
            routed_experts=routed, **self._teacher(lambda t: t[start:stop, :width - 1]),
            images=None if self.images is None else self.images[start:stop])

    def select(self, indices: torch.Tensor) -> "PackedBatch":
        """The samples at `indices` (B',) int64, in that order, at the same width."""
        return PackedBatch(
            self.input_ids[indices], self.attention_mask[indices], self.loss_mask[indices],
            self.behavior_logp[indices], self.policy_versions[indices], self.advantages[indices],
            routed_experts=None if self.routed_experts is None else self.routed_experts[indices],
            **self._teacher(lambda t: t[indices]),
            images=None if self.images is None else [self.images[i] for i in indices.tolist()])

    def to(self, device) -> "PackedBatch":
        return PackedBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
            self.behavior_logp.to(device), self.policy_versions.to(device), self.advantages.to(device),
            shared=None if self.shared is None else self.shared.to(device),
            routed_experts=None if self.routed_experts is None else self.routed_experts.to(device),
            **self._teacher(lambda t: t.to(device)), images=self.images)

    @property
    def has_teacher_rows(self) -> bool:
        return self.teacher_ids is not None

    def _teacher(self, op: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
        """The teacher fields as keyword arguments, `op` applied to each (None stays None)."""
        return {name: None if value is None else op(value)
                for name, value in (("teacher_ids", self.teacher_ids), ("teacher_logp", self.teacher_logp),
                                    ("teacher_tail", self.teacher_tail))}
