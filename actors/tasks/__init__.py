"""Built-in tasks and the task registry.

A task is a `TaskSpec`: an environment class, an endless seeded stream of training tasks, a fixed
held-out evaluation set, and (optionally) supervised demonstrations. Configs name a task:

    spec = get_task("arithmetic")                 # built-in: "arithmetic", "arithmetic_judged", "cad", "charts", "code", "dataset",
                                                  # "finance_docs", "reasoning_gym" (a mixture of families),
                                                  # "verifiers"
    spec = get_task("reasoning_gym:chain_sum")    # one reasoning-gym family
    spec = get_task("my_pkg.tasks:SPEC")          # yours, by import path (a TaskSpec, or a
                                                  # function with no arguments that returns one)
    spec = get_task("my_pkg.reverse:ReverseEnv")  # an Environment subclass: its classmethods
                                                  # train_tasks(seed, options), eval_tasks(options)
                                                  # (and demonstrations(num, seed, options)) if any
    for task in itertools.islice(spec.train_tasks(seed=0, options={"max_digits": 4}), 8): ...
    env = spec.make_env(sandbox=handle, options={"max_tool_calls": 2})

`register_task(spec)` adds one under its name. Task dicts are plain data (they travel over the
wire); the same options (a config's `task_options`) feed the task generator (difficulty knobs)
and the environment: the task's `options_model` (by default its environment class's) checks
them wherever the spec uses them (a misspelt option is a `TaskOptionsError` naming it), and the
generator and the environment read the validated model's attributes, whose fields hold every
default.

Modules: `registry.py` holds TaskSpec and the registry (re-exported here); this package imports
the built-in task modules and registers them; no task module imports this package.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from postrain.core import Options

from . import (arithmetic, arithmetic_judged, cad, charts, code, dataset, demonstrations, finance, long_context,
               reasoning_gym, terminal, verifiers_env)
from .mixture import MixtureError, MixtureTask, TaskEntry, TaskMixture
from .registry import TaskError, TaskSpec, get_task, list_tasks, register_task, register_task_family

ARITHMETIC = register_task(TaskSpec(
    "arithmetic", arithmetic.ArithmeticEnv, arithmetic.train_tasks, arithmetic.eval_tasks,
    demonstrations.arithmetic_demonstrations, "integer + - * questions with a Python tool"))
ARITHMETIC_JUDGED = register_task(TaskSpec(
    "arithmetic_judged", arithmetic_judged.ArithmeticJudgedEnv, arithmetic.train_tasks, arithmetic.eval_tasks,
    demonstrations.arithmetic_demonstrations, "arithmetic whose reward is a judge model's rubric verdict "
    "(the programmatic check kept as a zero-weight component)"))
CODE = register_task(TaskSpec(
    "code", code.CodeEnv, code.train_tasks, code.eval_tasks, demonstrations.code_demonstration_cycle,
    "write a function; run the visible tests, revise; graded on hidden tests"))
DATASET = register_task(TaskSpec(
    "dataset", dataset.DatasetEnv, dataset.train_tasks, dataset.eval_tasks, dataset.demonstrations,
    description="prompts and answers from a local JSONL/Parquet/Arrow file, scored by a reward function"))
VERIFIERS = register_task(TaskSpec(
    "verifiers", verifiers_env.VerifiersEnv, verifiers_env.train_tasks, verifiers_env.eval_tasks,
    description="a verifiers taskset's prompts and tools, scored by its own @vf.reward functions"))
REASONING_GYM = register_task(TaskSpec(
    "reasoning_gym", reasoning_gym.ReasoningGymEnv, reasoning_gym.mixture_train_tasks,
    reasoning_gym.mixture_eval_tasks, reasoning_gym.mixture_demonstrations,
    description="a weighted mixture of reasoning-gym families, each scored by its own verifier"))
TERMINAL = register_task(TaskSpec(
    "terminal", terminal.TerminalEnv, terminal.train_tasks, terminal.eval_tasks, terminal.demonstrations,
    "shell work in one sandbox session per episode (files, repositories to fix); graded by a test script"))
LONG_CONTEXT = register_task(TaskSpec(
    "long_context", long_context.LongContextEnv, long_context.train_tasks, long_context.eval_tasks,
    description="find a setting in a generated repository read file by file: long tool outputs"))
FINANCE_DOCS = register_task(TaskSpec(
    "finance_docs", finance.FinanceDocsEnv, finance.train_tasks, finance.eval_tasks, finance.demonstrations,
    "questions about generated company reports (statements, notes, restatements, mixed units); graded "
    "numerically with a unit and a tolerance"))
CAD = register_task(TaskSpec(
    "cad", cad.CadEnv, cad.train_tasks, cad.eval_tasks, cad.demonstrations,
    "build a part from its spec with a build123d script in a sandbox session; the STL export is measured "
    "in a jail of its own and judged on the host (solid, volume, bounding box, through-holes, features)"))
CHARTS = register_task(TaskSpec(
    "charts", charts.ChartsEnv, charts.train_tasks, charts.eval_tasks, charts.demonstrations,
    description="read a company chart (a PNG as an image content part) and answer a question that needs "
    "arithmetic; graded on the last number with an absolute tolerance (needs a vision-language policy)"))
register_task_family(reasoning_gym.PREFIX, reasoning_gym.family_task)

__all__ = ["ARITHMETIC", "ARITHMETIC_JUDGED", "CAD", "CHARTS", "CODE", "DATASET", "FINANCE_DOCS", "LONG_CONTEXT", "REASONING_GYM", "TERMINAL", "VERIFIERS", "TaskError",
           "MixtureError", "MixtureTask", "TaskEntry", "TaskMixture", "TaskOptions", "TaskSpec", "get_task", "list_tasks", "register_task", "register_task_family"]


class TaskOptions(Options):
    """The task fields of a role's options (the orchestrator's and the environment actor's), shared
    through a run config's `[shared]`: both roles must read the same task with the same knobs."""

    task: str = Field("arithmetic", description="the task: a registered name ('arithmetic', 'arithmetic_judged', 'cad', 'charts', 'code', "
                      "'dataset', 'finance_docs', 'reasoning_gym', 'verifiers'), 'reasoning_gym:FAMILY', 'pkg.mod:TASK' (a TaskSpec or a function returning one) or 'pkg.mod:EnvClass' "
                      "(an Environment subclass)")
    task_options: dict[str, Any] = Field(default_factory=dict, description="the task's knobs (part of the "
                                         "data order: a resume must keep them); checked by its options model")

    tasks: list[TaskEntry] = Field(default_factory=list, description="a mixture of tasks (a run config's "
                                   "[[tasks]] tables: task, name, options, weight, reward_range, "
                                   "num_eval_tasks; actors/tasks/mixture.py); empty: the one `task`")

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        get_task(value)  # TaskError (a ValueError) names the problem and the fix
        return value

    @model_validator(mode="after")
    def _one_way_to_name_the_tasks(self) -> "TaskOptions":
        stated = {"task", "task_options"} & self.model_fields_set
        if self.tasks and stated:
            raise ValueError(f"both {' and '.join(sorted(stated))} and [[tasks]] are set; fix: state the run's "
                             "tasks once: one task with task (and task_options), or a mixture with [[tasks]] "
                             "tables (a mixture of one is fine)")
        if self.tasks:
            TaskMixture.of(self)   # MixtureError (a ValueError) on a name used twice
        return self

    @field_validator("task_options")
    @classmethod
    def _task_options(cls, value: dict, info: ValidationInfo) -> dict:
        if "task" in info.data:  # else the task itself is the error
            get_task(info.data["task"]).check_options(value)
        return value
