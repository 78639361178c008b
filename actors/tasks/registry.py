"""The task registry: `TaskSpec` (what a task is), `register_task`, `get_task`, `list_tasks`.

    spec = get_task("arithmetic")                 # a registered name
    spec = get_task("reasoning_gym:chain_sum")    # a family of a registered prefix
    spec = get_task("my_pkg.tasks:SPEC")          # by import path: a TaskSpec, a function returning
                                                  # one, or an Environment subclass

This module imports no task: the package (`actors/tasks/__init__.py`) imports the built-in task
modules and registers them here, and a task module that makes specs itself (reasoning_gym's
families) imports this module, never the package, so no module of `actors/tasks` imports the
package that imports it.

Options: every `TaskSpec` method takes the task options as a dict (a config's `task_options`),
None (all defaults) or an already checked options instance, checks them with `options_model`
(`check_options`), and hands the task's functions and environment that validated instance.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from pydantic import BaseModel

from postrain.core import import_object
from postrain.core.errors import PostrainError

from ..env.api import Environment, check_options


class TaskError(PostrainError, ValueError):
    """An unknown task name, a bad import path or a bad registration."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """name; env_class (an Environment subclass); train(seed, options) -> endless iterator of task
    dicts; eval(options) -> the held-out list; demos(num, seed, options) -> demonstrations or None;
    options_model: the pydantic model of its task options (None: the env class's
    `options_model`; where that is None too, `AnyOptions`: unchecked). Every method checks
    `options` first and passes the functions the validated model instance."""

    name: str
    env_class: type[Environment]
    train: Callable[[int, Any], Iterator[dict]]   # (seed, an instance of options_model)
    eval: Callable[[Any], list[dict]]             # (an instance of options_model)
    demos: Callable[..., list[dict]] | None = None
    description: str = ""
    options_model: type[BaseModel] | None = None

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

    def needs_sandbox(self, options: dict | BaseModel | None = None) -> bool:
        """For an environment class with a classmethod `needs_sandbox(options)` (given the checked
        options), its answer (a dataset task scored by `code_tests` runs code; arithmetic with
        plain answers does not); else `uses_sandbox`."""
        by_options = getattr(self.env_class, "needs_sandbox", None)
        if by_options is None:
            return self.uses_sandbox
        return bool(by_options(self.check_options(options)))

    def check_options(self, options: dict | BaseModel | None) -> BaseModel:
        """`options` validated: an instance of `options_model` (`AnyOptions` where there is none);
        TaskOptionsError names a bad one."""
        return check_options(self.options_model, options, f"task {self.name!r}")

    def train_tasks(self, seed: int = 0, options: dict | BaseModel | None = None) -> Iterator[dict]:
        return self.train(seed, self.check_options(options))

    def eval_tasks(self, options: dict | BaseModel | None = None) -> list[dict]:
        return self.eval(self.check_options(options))

    def demonstrations(self, num: int, seed: int = 0, options: dict | BaseModel | None = None) -> list[dict]:
        if self.demos is None:
            raise TaskError(f"task {self.name!r} has no built-in demonstrations; fix: set the "
                            f"orchestrator's sft_steps = 0, or its sft_demonstrations = \"FILE.jsonl\" "
                            f"(chat demonstrations), or give the TaskSpec demos=")
        return self.demos(num, seed, self.check_options(options))

    def make_env(self, *, sandbox=None, scorers=None, options: dict | BaseModel | None = None) -> Environment:
        return self.env_class(sandbox=sandbox, scorers=scorers, options=self.check_options(options))

    @classmethod
    def from_environment(cls, env_class: type[Environment], name: str) -> "TaskSpec":
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


_REGISTRY: dict[str, TaskSpec] = {}                       # name -> spec
_FAMILIES: dict[str, Callable[[str], TaskSpec]] = {}     # "prefix:" -> make(rest of the name)


def register_task(spec: TaskSpec, *, replace: bool = False) -> TaskSpec:
    if not isinstance(spec, TaskSpec):
        raise TaskError(f"register_task takes a TaskSpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY and not replace:
        raise TaskError(f"task {spec.name!r} is already registered; fix: pick another name or pass "
                        f"replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def register_task_family(prefix: str, make: Callable[[str], TaskSpec]) -> None:
    """Names `PREFIX:REST` resolve to `make(REST)` (a TaskSpec; TaskError for an unknown REST):
    `reasoning_gym:FAMILY`. `prefix` ends in ':'."""
    if not prefix.endswith(":"):
        raise TaskError(f"a task family prefix ends in ':', got {prefix!r}; fix: e.g. 'reasoning_gym:'")
    _FAMILIES[prefix] = make


def get_task(name: str) -> TaskSpec:
    """A registered task by name, a family's task (`reasoning_gym:FAMILY`), or an import path
    'package.module:attr' (through `postrain.core.import_object`) of a TaskSpec, a function
    returning one, or an Environment subclass (`TaskSpec.from_environment`, named by the path)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    for prefix, make in _FAMILIES.items():
        if name.startswith(prefix):
            return make(name.removeprefix(prefix))
    if ":" not in name:
        raise TaskError(f"unknown task {name!r}; registered: {sorted(_REGISTRY)}; fix: use one of "
                        f"those or an import path 'package.module:SPEC' (or ':EnvClass')")
    try:
        obj = import_object(name)
    except ImportError as exc:
        fix = "" if "; fix:" in str(exc) else "; fix: check the import path"
        raise TaskError(f"cannot load task {name!r}: {exc}{fix}") from exc
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
