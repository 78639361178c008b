"""verifiers tasks: a `verifiers` taskset (its prompts, its `@vf.reward` functions) run by postrain.

    task = "verifiers"
    task_options = { taskset = "my_pkg.envs:load_taskset", eval_fraction = 0.1 }

`taskset` names, by import path, a `verifiers.v1.Taskset` or a function with no arguments that
returns one. Its tasks' data (a
`vf.TaskData`: `prompt`, `system_prompt` and the task's own fields) become postrain task dicts;
the episode is single-turn: the system prompt and the prompt, one assistant turn, then the
task's own scoring (`Task.score`, without a runtime) on a trace of that conversation. Each
`@vf.reward` becomes a reward component with its weight; `@vf.metric`s are not rewards and are
left out.

Held-out split, disjoint by construction: a task is held out iff the first 8 bytes of
sha256(f"{split_seed}:" + its `Task.key`) fall below `eval_fraction` of their range (verifiers'
key is the content hash of the task's data unless the taskset defines a durable one). The
taskset must be finite (bound an infinite one with `.take(n)` in the function that returns it).

verifiers is asyncio code and postrain's actors run trio: scoring runs in a worker thread with its
own asyncio loop, bounded by `score_timeout_s`; a scorer that raises or hangs fails only its
sample (`RewardFailure`, dropped with the reason in the ledger). Importing `verifiers.v1` takes
seconds, so it happens only when a verifiers task is used.

Not covered: verifiers' multi-turn harnesses (user simulators, agents) and MCP toolsets, which
call a model over an OpenAI-compatible endpoint and run their tools in verifiers' own runtimes.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import random
from typing import Iterator

import trio
from pydantic import Field

from postrain.core import Options, import_object

from ..environment import Environment, Reward, StepResult, TaskOptionsError
from .rewards import RewardFailure


class VerifiersOptions(Options):
    """The task options of `verifiers`."""

    taskset: str = Field(description="import path 'pkg.mod:NAME' of a verifiers.v1 Taskset or a function "
                         "returning one")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="share of the tasks held out (by a hash of "
                                 "the task's key)")
    split_seed: int = Field(0, description="seed of the held-out hash")
    num_eval: int | None = Field(None, ge=0, description="held-out tasks per evaluation, at most (none: all)")
    score_timeout_s: float = Field(60.0, gt=0, description="a scoring call past this fails its sample, seconds")
    max_turns: int = Field(1, ge=1, le=1, description="single-turn: one assistant turn per episode")


@functools.lru_cache(maxsize=4)
def load_taskset(path: str):
    """The Taskset at `path` (made once per process)."""
    from verifiers.v1 import Taskset
    try:
        obj = import_object(path)
    except ImportError as exc:
        raise TaskOptionsError(f"cannot load the verifiers taskset {path!r}: {exc}; fix: check the "
                               f"import path") from None
    if callable(obj) and not isinstance(obj, (Taskset, type)):
        obj = obj()
    if not isinstance(obj, Taskset):
        raise TaskOptionsError(f"{path!r} is a {type(obj).__name__}, not a verifiers.v1.Taskset; fix: point "
                               f"at a Taskset or a function that returns one")
    if not obj.bounded:
        raise TaskOptionsError(f"the verifiers taskset {path!r} is infinite; fix: return taskset.take(n)")
    return obj


@functools.lru_cache(maxsize=4)
def _tasks(path: str) -> tuple:
    return tuple(load_taskset(path))


def _held_out(task, options: dict) -> bool:
    digest = hashlib.sha256(f"{options.get('split_seed', 0)}:{task.key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < options.get("eval_fraction", 0.1) * 2 ** 64


def _wire(task) -> dict:
    return task.data.model_dump(mode="json", exclude_none=True)


def train_tasks(seed: int = 0, options: dict | None = None) -> Iterator[dict]:
    """An endless, deterministic stream of the training tasks: epochs, each shuffled by (seed, epoch)."""
    options = options or {}
    tasks = [t for t in _tasks(options["taskset"]) if not _held_out(t, options)]
    if not tasks:
        raise TaskOptionsError(f"the verifiers taskset {options['taskset']!r} has no training tasks; fix: "
                               f"lower eval_fraction")
    for epoch in itertools.count():
        order = list(range(len(tasks)))
        random.Random(f"verifiers-{seed}-{epoch}").shuffle(order)
        for i in order:
            yield {"id": f"vf-train-{seed}-{epoch}-{i}", "data": _wire(tasks[i])}


def eval_tasks(options: dict | None = None) -> list[dict]:
    """The held-out tasks in the taskset's order, at most `num_eval`."""
    options = options or {}
    held = [t for t in _tasks(options["taskset"]) if _held_out(t, options)][:options.get("num_eval")]
    return [{"id": f"vf-eval-{i}", "data": _wire(t)} for i, t in enumerate(held)]


def _message_dict(message) -> dict:
    from verifiers.v1.types import content_text
    return {"role": message.role, "content": content_text(message.content)}


def score(taskset, wire: dict, messages: list[dict]) -> Reward:
    """The task's own rewards on the finished conversation (blocking: its own asyncio loop)."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    task_type = type(taskset).task_type()
    task = task_type(task_type.data_type().model_validate(wire), taskset.config.task)
    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    nodes = [MessageNode(parent=i - 1 if i else None, message=kinds[m["role"]](content=m["content"]),
                         sampled=m["role"] == "assistant") for i, m in enumerate(messages)]
    trace = Trace(task=TraceTask(type=task_type.__name__, data=task.data), agent=AgentInfo(config=AgentConfig()),
                  nodes=nodes)
    asyncio.run(task.score(trace))
    rewards = {name: r for name, r in trace.rewards.items() if r is not None}
    return Reward({name: r.score for name, r in rewards.items()}, {name: r.weight for name, r in rewards.items()})


class VerifiersEnv(Environment):
    """One verifiers task: its prompt, one answer, its rubric of `@vf.reward` functions."""

    max_turns = 1
    options_model = VerifiersOptions

    async def reset(self, task: dict) -> list[dict]:
        """The task's system prompt and prompt. Does not wait (cancel-safe)."""
        from verifiers.v1 import TaskData
        self.wire = task["data"]
        data = TaskData.model_validate({k: v for k, v in self.wire.items() if k in TaskData.model_fields})
        prompt = data.prompt if data.prompt is not None else ""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [_message_dict(m) for m in prompt]
        if data.system_prompt:
            messages.insert(0, {"role": "system", "content": data.system_prompt})
        self.messages = messages
        return messages

    async def step(self, action: str) -> StepResult:
        """Score the conversation with the task's rewards (a worker thread, within score_timeout_s).
        Raises RewardFailure. Cancellation: no reward; the thread runs on to its end."""
        taskset = load_taskset(self.options["taskset"])
        conversation = [*self.messages, {"role": "assistant", "content": action}]
        timeout_s = float(self.options.get("score_timeout_s", 60.0))
        try:
            with trio.fail_after(timeout_s):
                reward = await trio.to_thread.run_sync(score, taskset, self.wire, conversation,
                                                       abandon_on_cancel=True)
        except trio.TooSlowError:
            raise RewardFailure(f"verifiers scoring did not return within {timeout_s} s") from None
        except Exception as exc:  # noqa: BLE001 - a taskset's reward may raise anything
            raise RewardFailure(f"verifiers scoring raised {type(exc).__name__}: {exc}"[:300]) from exc
        return StepResult(None, True, reward)
