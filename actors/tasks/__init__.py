"""Built-in tasks and the task registry.

A task is a `TaskSpec`: an environment class, an endless seeded stream of training tasks, a fixed
held-out evaluation set, and (optionally) supervised demonstrations. Configs name a task:

    spec = get_task("arithmetic")                 # built-in: "arithmetic", "code"
    spec = get_task("my_pkg.tasks:SPEC")          # yours, by import path (a TaskSpec, or a
                                                  # function with no arguments that returns one)
    for task in itertools.islice(spec.train_tasks(seed=0, options={"max_digits": 4}), 8): ...
    env = spec.make_env(sandbox=handle, options={"max_tool_calls": 2})

`register_task(spec)` adds one under its name. Task dicts are plain data (they travel over the
wire); the same `options` dict feeds the task generator (difficulty knobs) and the environment.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Iterator

from ..environment import Environment
from . import arithmetic, code, demonstrations


class TaskError(ValueError):
    """An unknown task name or a bad registration."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """name; env_class (an Environment subclass); train(seed, options) -> endless iterator of task
    dicts; eval(options) -> the held-out list; demos(num, seed, options) -> demonstrations or None."""

    name: str
    env_class: type
    train: Callable[[int, dict | None], Iterator[dict]]
    eval: Callable[[dict | None], list[dict]]
    demos: Callable[..., list[dict]] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.env_class, type) and issubclass(self.env_class, Environment)):
            raise TaskError(f"TaskSpec({self.name!r}).env_class must be an Environment subclass, got "
                            f"{self.env_class!r}; fix: subclass postrain.actors.Environment")

    def train_tasks(self, seed: int = 0, options: dict | None = None) -> Iterator[dict]:
        return self.train(seed, options)

    def eval_tasks(self, options: dict | None = None) -> list[dict]:
        return self.eval(options)

    def demonstrations(self, num: int, seed: int = 0, options: dict | None = None) -> list[dict]:
        if self.demos is None:
            raise TaskError(f"task {self.name!r} has no built-in demonstrations; fix: give the SFT "
                            f"stage a JSONL file of chat demonstrations")
        return self.demos(num, seed, options)

    def make_env(self, *, sandbox=None, generator=None, options: dict | None = None) -> Environment:
        return self.env_class(sandbox=sandbox, generator=generator, options=options)


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
    """A registered task by name, or 'package.module:attr' (a TaskSpec or a factory of one)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        raise TaskError(f"unknown task {name!r}; registered: {sorted(_REGISTRY)}; fix: use one of "
                        f"those or an import path 'package.module:SPEC'")
    module_name, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise TaskError(f"cannot load task {name!r}: {exc}; fix: check the import path") from exc
    if callable(obj) and not isinstance(obj, TaskSpec):
        obj = obj()
    if not isinstance(obj, TaskSpec):
        raise TaskError(f"task {name!r} is a {type(obj).__name__}, not a TaskSpec; fix: point at a "
                        f"TaskSpec or a function that returns one")
    return obj


def list_tasks() -> list[str]:
    return sorted(_REGISTRY)


ARITHMETIC = register_task(TaskSpec(
    "arithmetic", arithmetic.ArithmeticEnv, arithmetic.train_tasks, arithmetic.eval_tasks,
    demonstrations.arithmetic_demonstrations, "integer + - * questions with a Python tool"))
CODE = register_task(TaskSpec(
    "code", code.CodeEnv, code.train_tasks, code.eval_tasks, _code_demos,
    "write a function; run the visible tests, revise; graded on hidden tests"))

__all__ = ["ARITHMETIC", "CODE", "TaskError", "TaskSpec", "get_task", "list_tasks", "register_task"]
