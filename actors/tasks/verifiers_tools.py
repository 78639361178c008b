"""The tools of a verifiers task, called by postrain: a task's `Task.toolsets(config)` (each a
`vf.Toolset` with `@vf.tool` methods) become named tools the model calls in postrain's format,
`<tool name="NAME">{json arguments}</tool>` (`postrain.actors.env.tools.parse_named_call`).

Where a tool runs:
- a tool named in the task option `sandbox_tools` (`{"run_python": "python"}`) runs code: its one
  string argument runs in postrain's sandbox, as Python (`"python"`) or as a shell command line
  (`"bash"`); the method's own body (what verifiers' runtimes would run) is not called;
- any other tool is its method, called in the environment actor in a worker thread (a coroutine
  method gets its own asyncio loop there) within `tool_timeout_s`.

Every outcome is the tool's output for the model, never an exception out of the episode: a result
(str as is, anything else as JSON), a tool that raised (`[error: tool 'x' raised ...]`), one past
its time (the thread is abandoned and ends when the tool does), arguments that do not fit the
tool's signature (pydantic's message), an unknown name (with the tools there are). A tool whose one
parameter is a str may also be called with the text itself as the body
(`<tool name="python">print(2 + 3)</tool>`): a body that is not a JSON object is that argument
(the call's `well_formed` stays False, for a format reward).
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from typing import Any, Callable, Coroutine, Mapping, cast

import trio
from pydantic import BaseModel, ValidationError, create_model

from ..env.api import TaskOptionsError
from ..env.tools import (NAMED_CALL_EXAMPLE, NamedCall, format_observation, format_shell_output,
                     format_tool_output, truncate_middle)

SANDBOX_KINDS = ("python", "bash")
_SHELL = "import subprocess, sys\nsys.exit(subprocess.run(['/bin/sh', '-c', sys.stdin.read()]).returncode)\n"


@dataclasses.dataclass(frozen=True)
class VerifiersTool:
    """One `@vf.tool` method. arguments_model validates a call's arguments against its signature;
    sandbox_kind: None (the method runs here) or "python"/"bash" (its one argument runs in the sandbox)."""

    name: str
    description: str
    fn: Callable[..., Any]
    arguments_model: type[BaseModel]
    sandbox_kind: str | None = None

    @property
    def text_argument(self) -> str | None:
        """The name of its one parameter when that is a str (such a tool may be called with the
        text itself as the body, not JSON); else None."""
        fields = self.arguments_model.model_fields
        if len(fields) == 1 and next(iter(fields.values())).annotation is str:
            return next(iter(fields))
        return None

    def signature_line(self) -> str:
        """`name(arg: type, ...): description` for the prompt."""
        schema = self.arguments_model.model_json_schema()
        required = set(schema.get("required", ()))
        args = [f"{arg}: {spec.get('type', 'any')}{'' if arg in required else ' (optional)'}"
                for arg, spec in schema.get("properties", {}).items()]
        return f"- {self.name}({', '.join(args)}): {self.description or 'no description'}"


def discover_tools(task_type: type[Any], config,
                   sandbox_tools: Mapping[str, str]) -> dict[str, VerifiersTool]:
    """The tools of a task by name: every `@vf.tool` of every toolset of `task_type.toolsets(config)`
    (new toolset objects each call).
    TaskOptionsError for a `sandbox_tools` entry that names no tool, an unknown kind, or a tool
    whose signature is not one string argument."""
    from verifiers.v1.utils.decorators import discover_decorated
    tools = {}
    for toolset in task_type.toolsets(config):
        for fn in discover_decorated(toolset, "tool"):
            name = getattr(fn, "tool_name", None) or fn.__name__
            tools[name] = VerifiersTool(name, (fn.__doc__ or "").strip(), fn, _arguments_model(name, fn),
                                        sandbox_tools.get(name))
    for name, kind in sandbox_tools.items():
        if name not in tools:
            raise TaskOptionsError(f"sandbox_tools names {name!r}, which is not a tool of "
                                   f"{task_type.__name__} (its tools: {sorted(tools)}); fix: name one of "
                                   f"those")
        if kind not in SANDBOX_KINDS:
            raise TaskOptionsError(f"sandbox_tools[{name!r}] is {kind!r}; fix: one of {SANDBOX_KINDS}")
        if tools[name].text_argument is None:
            raise TaskOptionsError(f"the sandbox tool {name!r} must take one str argument (the code), has "
                                   f"{list(tools[name].arguments_model.model_fields)}; fix: give it one "
                                   f"parameter such as `code: str`")
    return tools


def _arguments_model(name: str, fn) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for arg, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = Any if param.annotation is param.empty else param.annotation
        fields[arg] = (annotation, ... if param.default is param.empty else param.default)
    return create_model(f"{name}_arguments", __config__={"extra": "forbid"}, **fields)


def tools_prompt(tools: dict[str, VerifiersTool]) -> str:
    """How to call the tools, and what each one is (for the system prompt)."""
    lines = "\n".join(tool.signature_line() for tool in tools.values())
    return (f"You can call these tools:\n{lines}\n"
            f"To call one, write {NAMED_CALL_EXAMPLE} with its arguments as one JSON object; its result "
            f"comes back between <output> and </output>. When you are done, reply without a tool "
            f"call: that reply is your final answer.")


async def call_tool(tools: dict[str, VerifiersTool], call: NamedCall, *, sandbox, timeout_s: float,
                    max_output_chars: int) -> str:
    """The `<output>` the model reads for `call` (never raises but for cancellation). Cancellation:
    no output; a worker thread or sandbox run in flight ends within its own limits."""
    tool = tools.get(call.name) if call.name is not None else None
    if tool is not None and call.arguments is None and tool.text_argument is not None:
        kwargs = {tool.text_argument: call.raw_arguments}  # the body itself: its one str argument
    elif call.error:
        return format_observation(f"[error: {call.error}]")
    elif tool is None:
        return format_observation(f"[error: there is no tool {call.name!r}; the tools are {sorted(tools)}]")
    else:
        try:
            kwargs = tool.arguments_model.model_validate(call.arguments).model_dump()
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                                 for e in exc.errors())
            return format_observation(f"[error: bad arguments for tool {call.name!r}: {problems}]")
    if tool.sandbox_kind is not None:
        return await _run_in_sandbox(tool, next(iter(kwargs.values())), sandbox, timeout_s, max_output_chars)
    try:
        with trio.fail_after(timeout_s):
            result = await trio.to_thread.run_sync(_call_blocking, tool.fn, kwargs, abandon_on_cancel=True)
    except trio.TooSlowError:
        return format_observation(f"[error: tool {call.name!r} did not return within {timeout_s} s]")
    except Exception as exc:  # noqa: BLE001 - a task's tool may raise anything: the model reads it
        return format_observation(truncate_middle(f"[error: tool {call.name!r} raised {type(exc).__name__}: "
                                                  f"{exc}]", max_output_chars))
    text = result.rstrip("\n") if isinstance(result, str) else json.dumps(result, default=str)
    return format_observation(truncate_middle(text, max_output_chars))


def _call_blocking(fn, kwargs: dict):
    result = fn(**kwargs)
    # a coroutine method's result (an awaitable that asyncio.run takes: a coroutine)
    return asyncio.run(cast(Coroutine[Any, Any, Any], result)) if inspect.isawaitable(result) else result


async def _run_in_sandbox(tool: VerifiersTool, code: str, sandbox, timeout_s: float,
                          max_output_chars: int) -> str:
    if tool.sandbox_kind == "python":
        result = await sandbox.exec(code, timeout_s=timeout_s)
        return format_tool_output(result, max_chars=max_output_chars)
    result = await sandbox.exec(_SHELL, stdin=code, timeout_s=timeout_s)
    return format_shell_output(result, max_chars=max_output_chars)
