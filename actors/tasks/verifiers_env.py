"""verifiers tasks: a `verifiers` taskset (its prompts, its tools, its `@vf.reward` functions) run by
postrain.

    task = "verifiers"
    task_options = { taskset = "my_pkg.envs:load_taskset", eval_fraction = 0.1,
                     sandbox_tools = { run_python = "python" }, max_turns = 8 }

`taskset` names, by import path, a `verifiers.v1.Taskset` or a function with no arguments that
returns one. Its tasks' data (a `vf.TaskData`: `prompt`, `system_prompt` and the task's own
fields) become postrain task dicts. postrain plays the model's turns itself (no OpenAI endpoint):

- a task without tools is single-turn: the system prompt and the prompt, one assistant turn;
- a task whose `Task.toolsets(config)` offers `@vf.tool`s is the tool loop: the tools' signatures
  and descriptions join the system prompt, each turn may call one tool as
  `<tool name="NAME">{json arguments}</tool>` (`postrain.actors.env.tools.parse_named_call`), its
  output comes back as the next turn (`verifiers_tools.call_tool`: code tools named in
  `sandbox_tools` run in postrain's sandbox, the others in a worker thread within
  `tool_timeout_s`; an error is the tool's output, the episode goes on). The episode ends at a
  turn without a tool call (the final reply), when a `@vf.stop` of the task (one taking the
  `Trace`) says so after a turn, or after `max_turns` turns;
- with the option `env`, a `vf.Env` subclass whose `run(task, agents)` writes the other side's
  turns itself (`verifiers_relay`): each `turn(message)` it makes for the model is the next
  observation; the episode ends when its run returns (or by a stop hook, or `max_turns`). A
  turn of the model that calls a tool gets the tool's output first; its reply goes to the run.

At the end the task's own scoring (`Task.score`, without a runtime) runs on the whole trace: every
turn, each tool call (a `ToolCall` with the arguments as the model wrote them) and its output (a
`ToolMessage`), the stop condition (`max_turns` when turns ran out). Each `@vf.reward` becomes a
reward component with its weight; `@vf.metric`s are not rewards and are left out.

Held-out split, disjoint by construction: a task is held out iff the first 8 bytes of
sha256(f"{split_seed}:" + its `Task.key`) fall below `eval_fraction` of their range (verifiers'
key is the content hash of the task's data unless the taskset defines a durable one). The
taskset must be finite (bound an infinite one with `.take(n)` in the function that returns it).

verifiers is asyncio code and postrain's actors run trio: scoring and stop hooks run in a worker
thread with their own asyncio loop, bounded by `score_timeout_s`; a scorer that raises or hangs
fails only its sample (`RewardFailure`, dropped with the reason in the ledger). Importing
`verifiers.v1` takes seconds, so it happens only when a verifiers task is used.

Not covered: a `vf.Env` whose run needs another model (a simulated user is a model behind
verifiers' harness and endpoint: refused by the agent's name), `Env.setup`/`finalize`,
`@vf.stop` hooks on a `Request` or `Response` (postrain's turns are text, not provider
requests: such a task is refused at reset),
toolsets' server hooks (`setup`, `setup_task`) and state channel, and verifiers' own runtimes
(`Task.setup`/`finalize`, runtime-dependent rewards, which `Task.score` skips without a runtime).
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import random
from typing import Any, Iterator, Literal

import trio
from pydantic import Field

from postrain.core import Options, import_object

from ..env.api import (Environment, EnvironmentContractError, Reward, StepResult, TaskOptionsError,
                       check_options)
from ..env.tools import OUTPUT_CLOSE, OUTPUT_OPEN, parse_named_call
from .rewards import RewardFailure
from .verifiers_relay import Relay, load_env_class
from .verifiers_tools import call_tool, discover_tools, tools_prompt


class VerifiersOptions(Options):
    """The task options of `verifiers`."""

    taskset: str = Field(description="import path 'pkg.mod:NAME' of a verifiers.v1 Taskset or a function "
                         "returning one")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="share of the tasks held out (by a hash of "
                                 "the task's key)")
    split_seed: int = Field(0, description="seed of the held-out hash")
    num_eval: int | None = Field(None, ge=0, description="held-out tasks per evaluation, at most (none: all)")
    score_timeout_s: float = Field(60.0, gt=0, description="a scoring call past this fails its sample, seconds")
    max_turns: int = Field(8, ge=1, description="assistant turns per episode, at most (a task without tools "
                           "takes one)")
    sandbox_tools: dict[str, Literal["python", "bash"]] = Field(
        default_factory=dict, description="tools that run code: tool name -> 'python' or 'bash'; the tool's "
        "one str argument runs in postrain's sandbox (a run then needs a sandbox actor)")
    tool_timeout_s: float = Field(10.0, gt=0, description="a tool call (or its sandbox run) past this "
                                  "returns an error to the model, seconds")
    env: str | None = Field(None, description="import path 'pkg.mod:EnvClass' of a verifiers.v1 Env subclass "
                            "whose run(task, agents) writes the other side's turns (none: the task alone)")
    policy_agent: str = Field("assistant", description="the agent of `env` that postrain's model plays")
    env_timeout_s: float = Field(30.0, gt=0, description="the env's run past this between two turns fails "
                                 "the sample, seconds")
    max_output_chars: int = Field(1200, ge=100, description="a tool's output longer than this is cut in the "
                                  "middle, characters")


def verifiers_options(options: dict | VerifiersOptions | None) -> VerifiersOptions:
    """`options` checked (a dict, None or a `VerifiersOptions`); TaskOptionsError names a bad one."""
    return check_options(VerifiersOptions, options, "task 'verifiers'")


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


def _held_out(task, options: VerifiersOptions) -> bool:
    digest = hashlib.sha256(f"{options.split_seed}:{task.key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < options.eval_fraction * 2 ** 64


def _wire(task) -> dict:
    return task.data.model_dump(mode="json", exclude_none=True)


def train_tasks(seed: int = 0, options: dict | VerifiersOptions | None = None) -> Iterator[dict]:
    """An endless, deterministic stream of the training tasks: epochs, each shuffled by (seed, epoch)."""
    options = verifiers_options(options)
    tasks = [t for t in _tasks(options.taskset) if not _held_out(t, options)]
    if not tasks:
        raise TaskOptionsError(f"the verifiers taskset {options.taskset!r} has no training tasks; fix: "
                               f"lower eval_fraction")
    for epoch in itertools.count():
        order = list(range(len(tasks)))
        random.Random(f"verifiers-{seed}-{epoch}").shuffle(order)
        for i in order:
            yield {"id": f"vf-train-{seed}-{epoch}-{i}", "data": _wire(tasks[i])}


def eval_tasks(options: dict | VerifiersOptions | None = None) -> list[dict]:
    """The held-out tasks in the taskset's order, at most `num_eval`."""
    options = verifiers_options(options)
    held = [t for t in _tasks(options.taskset) if _held_out(t, options)][:options.num_eval]
    return [{"id": f"vf-eval-{i}", "data": _wire(t)} for i, t in enumerate(held)]


def _message_dict(message) -> dict:
    from verifiers.v1.types import content_text
    return {"role": message.role, "content": content_text(message.content)}


def make_task(taskset, wire: dict):
    """The taskset's Task object for a task dict's data."""
    task_type = type(taskset).task_type()
    return task_type(task_type.data_type().model_validate(wire), taskset.config.task)


def build_trace(task, messages: list[dict], stop_condition: str | None = None):
    """A verifiers Trace of the conversation: `messages` are verifiers message dicts (role,
    content; an assistant's `tool_calls`, a tool message's `tool_call_id` and `name`)."""
    from pydantic import TypeAdapter
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import Message
    adapter = TypeAdapter(Message)
    nodes = [MessageNode(parent=i - 1 if i else None, message=adapter.validate_python(m),
                         sampled=m["role"] == "assistant") for i, m in enumerate(messages)]
    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data),
                  agent=AgentInfo(config=AgentConfig()), nodes=nodes)
    if stop_condition is not None:
        trace.stop(stop_condition)
    return trace


def score(task, messages: list[dict], stop_condition: str | None = None) -> Reward:
    """The task's own rewards on the finished conversation (blocking: its own asyncio loop)."""
    trace = build_trace(task, messages, stop_condition)
    asyncio.run(task.score(trace))
    rewards = {name: r for name, r in trace.rewards.items() if r is not None}
    return Reward({name: r.score for name, r in rewards.items()},
                  {name: r.weight for name, r in rewards.items()})


def fired_stop(task, stops: list, messages: list[dict]) -> str | None:
    """The name of the first of the task's `@vf.stop(trace)` hooks that says stop (blocking)."""
    from verifiers.v1.trace import Trace
    from verifiers.v1.utils.decorators import invoke

    async def check(trace):
        for stop in stops:
            result = invoke(stop, {Trace: trace, "trace": trace})
            result = await result if asyncio.iscoroutine(result) else result
            if not isinstance(result, bool):
                raise TypeError(f"@vf.stop {stop.__name__} must return a bool, got {type(result).__name__}")
            if result:
                return stop.__name__
        return None
    return asyncio.run(check(build_trace(task, messages)))


def trace_stops(task) -> list:
    """The task's `@vf.stop` hooks, each taking the Trace. EnvironmentContractError for one on a
    Request or Response, which postrain cannot give (its turns are text)."""
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.trace import Trace
    stops = task.hooks("stop")
    others = [fn.__name__ for fn in stops if hook_boundary(fn, allow_trace=True) is not Trace]
    if others:
        raise EnvironmentContractError(
            f"{type(task).__name__} has @vf.stop hooks on a Request or Response ({others}); postrain's "
            f"turns are text, so it can only run stop hooks that take the Trace; fix: make them take "
            f"`trace: vf.Trace`")
    return stops


class VerifiersEnv(Environment):
    """One verifiers task: its prompt, its tools (the tool loop) or one answer, its rubric of
    `@vf.reward` functions on the whole trace.

    State of an episode (set by `reset`): `task` the verifiers Task; `vf_tools` its tools by name
    (fresh toolset objects per episode; {}: single-turn); `messages` the verifiers trace's
    messages so far (system and prompt, then each assistant turn, each tool output); invariant:
    it ends in an assistant turn only when the episode is over."""

    options_model = VerifiersOptions
    options: VerifiersOptions

    @classmethod
    def needs_sandbox(cls, options: VerifiersOptions) -> bool:
        """Tools named in `sandbox_tools` run code in the sandbox."""
        return bool(options.sandbox_tools)

    def __init__(self, **kwargs) -> None:
        """TaskOptionsError for a taskset or env that does not load, or a bad `sandbox_tools`."""
        super().__init__(**kwargs)
        taskset = load_taskset(self.options.taskset)
        discover_tools(type(taskset).task_type(), taskset.config.task, self.options.sandbox_tools)
        if self.options.env:
            load_env_class(self.options.env)

    async def reset(self, task: dict) -> list[dict]:
        """The task's system prompt (with its tools' descriptions) and prompt; with an `env`, what
        its run opens the model's interaction with. Cancel-safe without an `env`; with one, the
        run is left waiting until `close`. EnvironmentContractError for stop hooks it cannot run."""
        self.task = make_task(load_taskset(self.options.taskset), task["data"])
        self.relay, opening = None, None
        if self.options.env:
            self.relay = Relay(load_env_class(self.options.env), self.task, self.options.policy_agent)
            self.relay.start(self.task)
            kind, opening = await self.relay.next_event(self.options.env_timeout_s)
            if kind == "end":
                raise EnvironmentContractError("the verifiers env's run ended before any turn of the model; "
                                               "fix: open an interaction and call turn()")
            self.task = self.relay.task
        self.vf_tools = discover_tools(type(self.task), self.task.config, self.options.sandbox_tools)
        self.stops = trace_stops(self.task)
        data = self.task.data
        prompt = data.prompt if data.prompt is not None else ""
        messages: list[dict[str, Any]]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [_message_dict(m) for m in prompt]
        if opening:  # the env's run opened with a message: it follows what the task prompts
            messages = [m for m in messages if m["content"]] + [{"role": "user", "content": opening}]
        system = "\n\n".join(filter(None, [data.system_prompt,
                                           tools_prompt(self.vf_tools) if self.vf_tools else None]))
        if system:
            messages.insert(0, {"role": "system", "content": system})
        self.messages = messages
        self.num_calls = 0
        return [dict(m) for m in messages]

    async def step(self, action: str) -> StepResult:
        """A tool call's output (the episode goes on), or, at a final reply or a stop hook that
        fires, the task's rewards. Raises RewardFailure (scoring or a stop hook raised or hung).
        Cancellation: no result; a tool or scoring thread in flight ends when it does."""
        call = parse_named_call(action) if self.vf_tools else None
        if call is None or (call.name is None and not call.error):
            self.messages.append({"role": "assistant", "content": action})
            if self.relay is None:
                return StepResult(None, True, await self._score(None))
            return await self._env_turn(action)
        output = await call_tool(self.vf_tools, call, sandbox=self.sandbox, timeout_s=self.options.tool_timeout_s,
                                 max_output_chars=self.options.max_output_chars)
        text = output.removeprefix(OUTPUT_OPEN + "\n").removesuffix("\n" + OUTPUT_CLOSE)
        if call.name is None:  # a <tool> tag without a name: the error is the next user turn
            self.messages += [{"role": "assistant", "content": action}, {"role": "user", "content": text}]
        else:
            self.num_calls += 1
            call_id = f"call_{self.num_calls}"
            self.messages += [{"role": "assistant", "content": action, "tool_calls": [
                {"id": call_id, "name": call.name, "arguments": call.raw_arguments}]},
                {"role": "tool", "tool_call_id": call_id, "name": call.name, "content": text}]
        return await self._go_on(output, {"tool": call.name, "well_formed": call.well_formed})

    async def _env_turn(self, reply: str) -> StepResult:
        """Hand the model's final reply to the env's run; its next message, or the rewards when it ended."""
        assert self.relay is not None, "step takes this path only with an env's relay"
        self.relay.reply(reply)
        kind, message = await self.relay.next_event(self.options.env_timeout_s)
        if kind == "end":
            return StepResult(None, True, await self._score(None))
        if not message:
            raise EnvironmentContractError("the verifiers env's run called turn() without a message after "
                                           "the first turn; fix: pass the next user message to turn(message)")
        self.messages.append({"role": "user", "content": message})
        return await self._go_on(message, {"env_turn": True})

    async def _go_on(self, observation: str, info: dict) -> StepResult:
        """The next observation, unless a stop hook of the task fires on the trace so far."""
        if self.stops:
            stopped = await self._blocking("stop hook", fired_stop, self.task, self.stops, self.messages)
            if stopped is not None:
                return StepResult(None, True, await self._score(stopped), {**info, "stop": stopped})
        return StepResult(observation, False, info=info)

    async def truncated(self) -> Reward:
        """Turns ran out: the task's rewards on the trace so far, stopped by `max_turns`."""
        return await self._score("max_turns")

    async def close(self) -> None:
        """An env's run still waiting for a turn sees the exchange terminated. Does not wait."""
        relay = getattr(self, "relay", None)   # None before reset, or without an env
        if relay is not None:
            relay.close()

    async def _score(self, stop_condition: str | None) -> Reward:
        return await self._blocking("scoring", score, self.task, self.messages, stop_condition)

    async def _blocking(self, what: str, fn, *args):
        """`fn(*args)` in a worker thread within score_timeout_s; RewardFailure if it raises or hangs."""
        timeout_s = self.options.score_timeout_s
        try:
            with trio.fail_after(timeout_s):
                return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except trio.TooSlowError:
            raise RewardFailure(f"verifiers {what} did not return within {timeout_s} s") from None
        except Exception as exc:  # noqa: BLE001 - a taskset's reward may raise anything
            raise RewardFailure(f"verifiers {what} raised {type(exc).__name__}: {exc}"[:300]) from exc
