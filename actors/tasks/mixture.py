"""Task mixtures: several tasks in one run, each with a weight, its own options, its own held-out
set and its own reward range (`[[tasks]]` in a run config).

    [[tasks]]
    task = "arithmetic"
    weight = 2
    options = { max_digits = 2 }

    [[tasks]]
    name = "chain_sum"
    task = "reasoning_gym:chain_sum"
    reward_range = [0, 1]
    num_eval_tasks = 20

A run of one task (`task` and `task_options`) is the mixture of that one task, so the
orchestrator and the environment actors have one code path: `TaskMixture.of(options)`.

The rules (each one tested in tests/actors/tasks/test_mixture.py):

- **Groups never mix tasks.** Each group (a prompt and its `samples_per_prompt` samples) is
  one task's: group g of batch b draws its task with a generator seeded by (seed, b, g), in
  proportion to the weights (or to the shares that follow the learning signal:
  actors/orchestrator/task_weights.py), then takes item b * P + g of that task's own training
  stream (P groups a batch; the items of the groups that drew another task are skipped). So
  the data order is a function of (seed, b) and the shares, never of the draws before, and a
  mixture of one task gives exactly that task's prompts in that task's order.
- **One reward scale.** Before the learner's group-relative advantages, each task's reward is
  mapped from its `reward_range` [low, high] onto [0, 1]: `(reward - low) / (high - low)`, not
  clipped. A 0/1 check and a 0-10 judge score then move the policy by the same units, whatever
  the advantage estimator (with a per-group standard deviation the units cancel anyway; with
  Dr. GRPO's mean-only baseline they would not). The ledger, samples.jsonl and the per-task
  metrics keep the environment's own reward; `reward_mean` of a train row is the scaled one.
- **Each task evaluates on its own held-out set**: its first `num_eval_tasks` (the entry's, else
  the orchestrator's), episode for episode as a run of that task alone would; the run's
  accuracy is the mean of the tasks' accuracies (each task counts once, whatever its size).
- **A KL target per task** (`kl_target`): the learner gives that task's samples an adaptive
  KL coefficient of their own (actors/learner/task_kl.py), for domains that drift at different
  speeds; the others keep the learner's.
- **Names.** A task's name labels its metrics (`reward_mean_<name>`), its samples
  (`postrain samples --task NAME`) and its evaluations; by default the task string with each
  character outside [a-z0-9_] replaced by "_".
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from postrain.core import Options
from postrain.core.errors import PostrainError

from .registry import TaskSpec, get_task

NAME_RULE = re.compile(r"^[a-z0-9_]{1,40}$")


class MixtureError(PostrainError, ValueError):
    """A mixture that cannot run: a duplicate name, a task stated twice, an unknown task name."""


def default_name(task: str) -> str:
    """A task string as a name: lower case, each character outside [a-z0-9_] replaced by "_"."""
    return re.sub(r"[^a-z0-9_]", "_", task.lower())[:40]


class TaskEntry(Options):
    """One task of a mixture: a `[[tasks]]` table of a run config."""

    task: str = Field(description="the task, as `task` names one: a registered name, 'reasoning_gym:FAMILY', "
                      "'pkg.mod:TASK' or 'pkg.mod:EnvClass'")
    name: str | None = Field(None, description="its label in metrics, samples and evaluations ([a-z0-9_], "
                             "at most 40); none: the task string with other characters replaced by '_'")
    options: dict[str, Any] = Field(default_factory=dict, description="the task's knobs, checked by its "
                                    "options model (as task_options for one task)")
    weight: float = Field(1.0, gt=0, description="its share of the groups: groups draw their task in "
                          "proportion to the weights")
    reward_range: tuple[float, float] = Field((0.0, 1.0), description="[low, high] of its rewards, mapped "
                                              "onto [0, 1] before advantages so that tasks weigh the same "
                                              "whatever their units")
    num_eval_tasks: int | None = Field(None, ge=0, description="its held-out tasks per evaluation; none: "
                                       "the orchestrator's num_eval_tasks")
    kl_target: float | None = Field(None, gt=0, description="its own KL-to-reference target per token: its "
                                    "samples get an adaptive KL coefficient of their own, starting at the "
                                    "learner's kl_coef (actors/learner/task_kl.py); none: the learner's")

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        get_task(value)   # TaskError (a ValueError) names the problem and the fix
        return value

    @field_validator("name")
    @classmethod
    def _name_rule(cls, value: str | None) -> str | None:
        if value is not None and not NAME_RULE.match(value):
            raise ValueError(f"task name {value!r} must be 1-40 characters of a-z, 0-9 and _ (it labels "
                             "metrics); fix: e.g. name = \"" + default_name(value) + "\"")
        return value

    @field_validator("reward_range")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not high > low:
            raise ValueError(f"reward_range = [{low}, {high}] must have high > low; fix: the lowest and the "
                             "highest reward the task gives, e.g. [0, 10] for a 0-10 judge score")
        return value

    @model_validator(mode="after")
    def _options_checked(self) -> "TaskEntry":
        get_task(self.task).check_options(self.options)
        return self

    @property
    def label(self) -> str:
        return self.name or default_name(self.task)


@dataclasses.dataclass(frozen=True)
class MixtureTask:
    """One task of a running mixture: its spec and checked options, weight, reward range."""

    name: str
    spec: TaskSpec
    options: BaseModel          # the spec's options model, checked
    weight: float
    reward_range: tuple[float, float]
    num_eval_tasks: int | None
    kl_target: float | None = None

    def scaled(self, reward: float) -> float:
        """`reward` mapped from `reward_range` onto [0, 1] (not clipped)."""
        low, high = self.reward_range
        return (reward - low) / (high - low)

    def eval_tasks(self, default_num: int) -> list[dict]:
        """Its held-out tasks of one evaluation: the first `num_eval_tasks` (else `default_num`)."""
        num = default_num if self.num_eval_tasks is None else self.num_eval_tasks
        return self.spec.eval_tasks(self.options)[:num]


class TaskMixture:
    """The tasks of a run (module docstring). Made by `of(options)` from a role's TaskOptions."""

    def __init__(self, tasks: list[MixtureTask]):
        assert tasks, "a mixture holds at least one task"
        names = [t.name for t in tasks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise MixtureError(f"task name(s) {duplicates} are used twice in [[tasks]]; fix: give each "
                               "entry its own name = \"...\"")
        self.tasks = tasks
        self._by_name = {t.name: t for t in tasks}
        total = sum(t.weight for t in tasks)
        self.shares = [t.weight / total for t in tasks]   # each task's share of the groups

    @classmethod
    def of(cls, options: Any) -> "TaskMixture":
        """The mixture a role's TaskOptions states: its `tasks` entries, or its one `task`."""
        if options.tasks:
            return cls([MixtureTask(e.label, get_task(e.task), get_task(e.task).check_options(e.options),
                                    e.weight, e.reward_range, e.num_eval_tasks, e.kl_target) for e in options.tasks])
        return cls.single(get_task(options.task), options.task_options)

    @classmethod
    def single(cls, spec: TaskSpec, options: dict | BaseModel | None = None) -> "TaskMixture":
        """The mixture of one task: named by its spec, weight 1, rewards as they are."""
        return cls([MixtureTask(spec.name, spec, spec.check_options(options), 1.0, (0.0, 1.0), None)])

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tasks]

    @property
    def is_single(self) -> bool:
        return len(self.tasks) == 1

    @property
    def kl_targets(self) -> dict[str, float] | None:
        """The tasks that set their own KL target (name -> target); None when none does."""
        targets = {t.name: t.kl_target for t in self.tasks if t.kl_target is not None}
        return targets or None

    def __getitem__(self, name: str) -> MixtureTask:
        """The task of that name; "" names the first (a request from before mixtures)."""
        if not name:
            return self.tasks[0]
        try:
            return self._by_name[name]
        except KeyError:
            raise MixtureError(f"no task named {name!r} in this run's mixture; its tasks: {self.names}") from None

    def draw(self, seed: int, batch: int, group: int, shares: list[float] | None = None) -> MixtureTask:
        """The task of group `group` of batch `batch`: a draw in proportion to `shares` (default:
        the weights' shares) seeded by (seed, batch, group) alone. A mixture of one task always
        draws it (and draws nothing at random)."""
        if self.is_single:
            return self.tasks[0]
        digest = hashlib.sha256(f"mixture:{seed}:{batch}:{group}".encode()).digest()
        return random.Random(digest).choices(self.tasks, weights=shares or self.shares)[0]
