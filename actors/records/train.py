"""`train`, `sft`: the batches the learner steps on (actors/learner/batch.py has the per-token
rules), and the step's reply.

Both batches may carry `expect_policy_version`: the learner version the caller's LearnerKeeper
predicts (actors/learner/recovery.py); a learner at another version refuses the step
(PolicyVersionMismatch) instead of training the wrong weights. It is a guard on the request,
not part of the data: the learner ignores it once checked."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from postrain.core.messages import MessageKind
from postrain.core.record import Record, RecordError, Vector

#: The fields of the batches below that are not per-sample (a shard keeps them whole).
NOT_PER_SAMPLE = ("expect_policy_version", "kl_targets")
#: TrainBatch's per-sample teacher rows for on-policy distillation (all three or none).
TEACHER_FIELDS = ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_tail_logmass")


@dataclass(frozen=True, slots=True)
class SftBatch(Record):
    """`sft`: supervised samples; loss on the tokens where loss_mask is 1 (loss_mask[i][0] == 0)."""

    token_ids: list[Vector]
    loss_mask: list[Vector]
    expect_policy_version: int | None = None
    images: list[list[bytes]] | None = None   # a vision-language policy: per sample its image files (TrainBatch's)

    def _check(self) -> None:
        _one_per_sample(self, ("loss_mask", "images"))


@dataclass(frozen=True, slots=True)
class TrainBatch(Record):
    """`train`: one RL batch (actors/learner/batch.py). Per sample: token_ids, loss_mask,
    behavior_logprobs (and policy_versions: per token, or one int per sample), all aligned with
    token_ids; then either `advantages` (per sample, or per token) or `rewards` /
    `reward_components` for the learner's group-relative advantages, over `group_ids`
    (contiguous groups of equal size; without them the batch is one group).

    On-policy distillation (docs/scorers.md): `teacher_topk_ids` (T, k) int, `teacher_topk_logprobs`
    (T, k) float and `teacher_tail_logmass` (T,) float per sample, all three or none, row t the
    teacher's next-token distribution that predicts token_ids[t] (row 0 and the rows before the
    scored span are unused zeros): its k most likely ids, their log-probabilities and the log of
    its mass outside them. A batch with them needs no rewards or advantages (`learner.loss =
    "opd"` trains on the KL alone).

    A KL target per task (a mixture's `kl_target`s: actors/learner/task_kl.py): `row_tasks` names
    each sample's task, and `kl_targets` maps the tasks that have a target to it; each such task's
    samples get its own adaptive KL coefficient, the others the learner's."""

    token_ids: list[Vector]
    loss_mask: list[Vector]
    behavior_logprobs: list[Vector]
    policy_versions: list[Vector | int] | None = None
    advantages: Vector | None = None
    rewards: Vector | None = None
    reward_components: dict[str, Vector] | None = None
    group_ids: Vector | None = None
    expect_policy_version: int | None = None
    routed_experts: list[bytes | None] | None = None   # MoE: per sample the generator's routing record,
                                                       # aligned with token_ids (routing replay, learner/routing.py)
    teacher_topk_ids: list[Vector] | None = None         # distillation: per sample (T, k) int32 ids
    teacher_topk_logprobs: list[Vector] | None = None    # per sample (T, k) float32, those ids' log-probs
    teacher_tail_logmass: list[Vector] | None = None     # per sample (T,) float32, log of the mass outside
    row_tasks: list[str] | None = None                   # per sample its task's name (with kl_targets)
    kl_targets: dict[str, float] | None = None           # task -> its KL target (per token, the learner's kl_kind)
    images: list[list[bytes]] | None = None   # a vision-language policy: per sample its image files, in order;
                                              # they fill its first image placeholders (models/vision.py)

    def _check(self) -> None:
        _one_per_sample(self, ("loss_mask", "behavior_logprobs", "policy_versions", "advantages", "rewards",
                               "group_ids", "routed_experts", "row_tasks", "images") + TEACHER_FIELDS)
        if (self.row_tasks is None) != (self.kl_targets is None):
            self.fail_field("kl_targets", self.kl_targets, "given with row_tasks (both or neither)")
        for task, target in (self.kl_targets or {}).items():
            if not target > 0:
                self.fail_field(f"kl_targets[{task!r}]", target, "> 0")
        for name, values in (self.reward_components or {}).items():
            if len(values) != len(self.token_ids):
                self.fail_field(f"reward_components[{name!r}]", values,
                           f"one value per sample ({len(self.token_ids)})")
        self._check_teacher()
        if (self.advantages is None and self.rewards is None and self.reward_components is None
                and not self.has_teacher_rows):
            self.fail_field("advantages", None, "given, or rewards / reward_components (with group_ids), or "
                                                "the teacher_* rows of a distillation batch")

    def _check_teacher(self) -> None:
        """All three teacher fields or none; per sample (T, k), (T, k), (T,) with T = len(token_ids[i])."""
        given = [name for name in TEACHER_FIELDS if getattr(self, name) is not None]
        if not given:
            return
        if len(given) != len(TEACHER_FIELDS):
            missing = sorted(set(TEACHER_FIELDS) - set(given))
            self.fail_field(missing[0], None, f"given with {given} (the teacher's rows travel as all three)")
        ids, logprobs, tails = self.teacher_topk_ids, self.teacher_topk_logprobs, self.teacher_tail_logmass
        assert ids is not None and logprobs is not None and tails is not None   # all three given (above)
        for i, tokens in enumerate(self.token_ids):
            length = len(tokens)
            shape_ids, shape_lp, shape_tail = _shape(ids[i]), _shape(logprobs[i]), _shape(tails[i])
            if len(shape_ids) != 2 or shape_ids[0] != length or shape_ids[1] < 1:
                self.fail_field(f"teacher_topk_ids[{i}]", ids[i],
                                f"(T, k) with T = len(token_ids[{i}]) = {length} and k >= 1 (shape {shape_ids})")
            if tuple(shape_lp) != tuple(shape_ids):
                self.fail_field(f"teacher_topk_logprobs[{i}]", logprobs[i],
                                f"the shape of teacher_topk_ids[{i}], {tuple(shape_ids)} (got {tuple(shape_lp)})")
            if tuple(shape_tail) != (length,):
                self.fail_field(f"teacher_tail_logmass[{i}]", tails[i],
                                f"({length},), one per token of token_ids[{i}] (got {tuple(shape_tail)})")

    @property
    def has_teacher_rows(self) -> bool:
        """True when the batch carries the teacher's top-k rows (distillation)."""
        return self.teacher_topk_ids is not None

    @property
    def num_samples(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepMetrics(Record):
    """The `train` / `sft` reply: the step's float metrics by name, always with "policy_version"
    (the version after the step), "loss" and "step"; the rest vary with the objective
    (actors/learner/learner.py). It travels flat, as the dict {name: value}."""

    values: dict[str, float]

    REQUIRED = ("policy_version", "loss", "step")

    def _check(self) -> None:
        missing = [name for name in self.REQUIRED if name not in self.values]
        if missing:
            self.fail_field("values", self.values, f"a dict with {list(self.REQUIRED)} (missing {missing})")

    @property
    def policy_version(self) -> int:
        return int(self.values["policy_version"])

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def to_wire(self) -> dict[str, Any]:
        return dict(self.values)

    @classmethod
    def from_wire(cls, data: Any) -> "StepMetrics":
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise RecordError(f"a StepMetrics travels as a dict of metrics, got {type(data).__name__}")
        return cls(values=dict(data))


def _shape(value: Any) -> tuple[int, ...]:
    """The shape of an array-like (a numpy array, a tensor, nested lists)."""
    return tuple(int(d) for d in np.shape(value))


def _one_per_sample(record: SftBatch | TrainBatch, names: tuple[str, ...]) -> None:
    num = len(record.token_ids)
    for name in names:
        value = getattr(record, name)
        if value is not None and len(value) != num:
            record.fail_field(name, value, f"one entry per sample ({num}, as token_ids)")


# The learner's steps (actors/learner/actor.py).
TRAIN = MessageKind("train", TrainBatch, StepMetrics)
SFT = MessageKind("sft", SftBatch, StepMetrics)
