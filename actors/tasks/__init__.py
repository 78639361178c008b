"""Built-in tasks and the task registry.

A task is a `TaskSpec`: an environment class, an endless seeded stream of training tasks, a fixed
held-out evaluation set, and (optionally) supervised demonstrations. Configs name a task:

    spec = get_task("arithmetic")                 # built-in: "arithmetic", "code", "dataset",
                                                  # "reasoning_gym" (a mixture of families), "verifiers"
    spec = get_task("reasoning_gym:chain_sum")    # one reasoning-gym family
    spec = get_task("my_pkg.tasks:SPEC")          # yours, by import path (a TaskSpec, or a
                                                  # function with no arguments that returns one)
    spec = get_task("my_pkg.reverse:ReverseEnv")  # an Environment subclass: its classmethods
                                                  # train_tasks(seed, options), eval_tasks(options)
                                                  # (and demonstrations(num, seed, options)) if any
    for task in itertools.islice(spec.train_tasks(seed=0, options={"max_digits": 4}), 8): ...
    env = spec.make_env(sandbox=handle, options={"max_tool_calls": 2})

`register_task(spec)` adds one under its name. Task dicts are plain data (they travel over the
wire); the same `options` dict (a config's `task_options`) feeds the task generator (difficulty
knobs) and the environment, and the task's `options_model` (by default its environment class's)
checks it wherever the spec uses it: a misspelt option is a `TaskOptionsError` naming it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from pydantic import Field, ValidationInfo, field_validator

from postrain.core import Options, import_object
from postrain.core.errors import PostrainError

from ..env.api import Environment, check_options
from . import arithmetic, code, dataset, demonstrations, reasoning_gym, terminal, verifiers_env


class TaskError(PostrainError, ValueError):
    """An unknown task name, a bad import path or a bad registration."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """name; env_class (an Environment subclass); train(seed, options) -> endless iterator of task
    dicts; eval(options) -> the held-out list; demos(num, seed, options) -> demonstrations or None;
    options_model: the pydantic model of its task options (None: the env class's
    `options_model`, which may be None too: unchecked). Every method checks `options` first."""

    name: str
    env_class: type
    train: Callable[[int, dict | None], Iterator[dict]]
    eval: Callable[[dict | None], list[dict]]
    demos: Callable[..., list[dict]] | None = None
    description: str = ""
    options_model: type | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.env_class, type) and issubclass(self.env_class, Environment)):
            raise TaskError(f"TaskSpec({self.name!r}).env_class must be an Environment subclass, got "
                            f"{self.env_class!r}; fix: subclass postrain.actors.Environment")
        if self.options_model is None:
            object.__setattr__(self, "options_model", self.env_class.options_model)

    @property
    def uses_sandbox(self) -> bool:
        """Its environment runs code (`Environment.uses_sandbox`): a run needs a sandbox actor."""
        return bool(self.env_class.uses_sandbox)

    def needs_sandbox(self, options: dict | None = None) -> bool:
        """For an environment class with a classmethod `needs_sandbox(options)`, its answer for these
        options (a dataset task scored by `code_tests` runs code; arithmetic with plain answers does
        not); else `uses_sandbox`."""
        by_options = getattr(self.env_class, "needs_sandbox", None)
        if by_options is None:
            return self.uses_sandbox
        return bool(by_options(self.check_options(options)))

    def check_options(self, options: dict | None) -> dict:
        """A copy of `options`, checked by `options_model`; TaskOptionsError names a bad one."""
        return check_options(self.options_model, options, f"task {self.name!r}")

    def train_tasks(self, seed: int = 0, options: dict | None = None) -> Iterator[dict]:
        return self.train(seed, self.check_options(options))

    def eval_tasks(self, options: dict | None = None) -> list[dict]:
        return self.eval(self.check_options(options))

    def demonstrations(self, num: int, seed: int = 0, options: dict | None = None) -> list[dict]:
        if self.demos is None:
            raise TaskError(f"task {self.name!r} has no built-in demonstrations; fix: give the SFT "
                            f"stage a JSONL file of chat demonstrations")
        return self.demos(num, seed, self.check_options(options))

    def make_env(self, *, sandbox=None, generator=None, options: dict | None = None) -> Environment:
        return self.env_class(sandbox=sandbox, generator=generator, options=self.check_options(options))

    @classmethod
    def from_environment(cls, env_class: type, name: str) -> "TaskSpec":
        """The task of an Environment subclass named alone (`task = "pkg.mod:EnvClass"`): its
        classmethods `train_tasks(seed, options)` and `eval_tasks(options)` (and
        `demonstrations(num, seed, options)`) where it defines them. An environment actor needs
        none of them (the orchestrator sends the tasks); a missing one fails when it is used."""
        def missing(method: str, signature: str):
            def fail(*args, **kwargs):
                raise TaskError(f"task {name!r} is the environment class {env_class.__name__}, which "
                                f"defines no {method}; fix: add a classmethod {method}{signature} to "
                                f"it, or name a TaskSpec as the task")
            return fail
        return cls(name, env_class,
                   train=getattr(env_class, "train_tasks", None) or missing("train_tasks", "(seed, options)"),
                   eval=getattr(env_class, "eval_tasks", None) or missing("eval_tasks", "(options)"),
                   demos=getattr(env_class, "demonstrations", None),
                   description=(env_class.__doc__ or "").strip().split("\n")[0])


def _code_demos(num: int, seed: int = 0, options: dict | None = None) -> list[dict]:
    demos = demonstrations.code_demonstrations(seed, options)
    return [demos[i % len(demos)] for i in range(num)]


_REGISTRY: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec, *, replace: bool = False) -> TaskSpec:
    if not isinstance(spec, TaskSpec):
        raise TaskError(f"register_task takes a TaskSpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY and not replace:
        raise TaskError(f"task {spec.name!r} is already registered; fix: pick another name or pass "
                        f"replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def get_task(name: str) -> TaskSpec:
    """A registered task by name, or an import path 'package.module:attr' (through
    `postrain.core.import_object`) of a TaskSpec, a function returning one, or an Environment
    subclass (`TaskSpec.from_environment`, named by the path)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name.startswith(reasoning_gym.PREFIX):
        return reasoning_gym.family_task(name.removeprefix(reasoning_gym.PREFIX))
    if ":" not in name:
        raise TaskError(f"unknown task {name!r}; registered: {sorted(_REGISTRY)}; fix: use one of "
                        f"those or an import path 'package.module:SPEC' (or ':EnvClass')")
    try:
        obj = import_object(name)
    except ImportError as exc:
        raise TaskError(f"cannot load task {name!r}: {exc}; fix: check the import path") from exc
    if isinstance(obj, type) and issubclass(obj, Environment):
        return TaskSpec.from_environment(obj, name)
    if callable(obj) and not isinstance(obj, TaskSpec):
        obj = obj()
    if not isinstance(obj, TaskSpec):
        raise TaskError(f"task {name!r} is a {type(obj).__name__}, not a TaskSpec or an Environment "
                        f"subclass; fix: point at a TaskSpec, a function that returns one, or an "
                        f"Environment subclass")
    return obj


def list_tasks() -> list[str]:
    return sorted(_REGISTRY)


ARITHMETIC = register_task(TaskSpec(
    "arithmetic", arithmetic.ArithmeticEnv, arithmetic.train_tasks, arithmetic.eval_tasks,
    demonstrations.arithmetic_demonstrations, "integer + - * questions with a Python tool"))
CODE = register_task(TaskSpec(
    "code", code.CodeEnv, code.train_tasks, code.eval_tasks, _code_demos,
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

__all__ = ["ARITHMETIC", "CODE", "DATASET", "REASONING_GYM", "TERMINAL", "VERIFIERS", "TaskError", "TaskSpec", "get_task", "list_tasks", "register_task"]


class TaskOptions(Options):
    """The task fields of a role's options (the orchestrator's and the environment actor's), shared
    through a run config's `[shared]`: both roles must read the same task with the same knobs."""

    task: str = Field("arithmetic", description="the task: a registered name ('arithmetic', 'code', "
                      "'dataset', 'reasoning_gym', 'verifiers'), 'reasoning_gym:FAMILY', 'pkg.mod:TASK' (a TaskSpec or a function returning one) or 'pkg.mod:EnvClass' "
                      "(an Environment subclass)")
    task_options: dict[str, Any] = Field(default_factory=dict, description="the task's knobs (part of the "
                                         "data order: a resume must keep them); checked by its options model")

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        get_task(value)  # TaskError (a ValueError) names the problem and the fix
        return value

    @field_validator("task_options")
    @classmethod
    def _task_options(cls, value: dict, info: ValidationInfo) -> dict:
        if "task" in info.data:  # else the task itself is the error
            get_task(info.data["task"]).check_options(value)
        return value
