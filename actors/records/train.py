"""`train`, `sft`: the batches the learner steps on (actors/learner/batch.py has the per-token rules)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Record, Vector


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
