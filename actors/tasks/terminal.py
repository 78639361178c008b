"""Terminal work, multi-turn: shell commands in one sandbox session, graded by a test script.

An episode (`TerminalEnv`): the environment opens a sandbox session (a jail that lives for the
episode), lays the task's files into its work dir /work and runs the task's setup. The model
sees the task and works in a shell: each `<bash>` block it writes runs in the session (files,
working directory and exported variables persist between commands) and comes back as
`<output>...[exit status N]</output>`. The episode ends when the model writes `<answer>` (any
text: "done"), writes a turn without a command, or runs out of turns; then the task's check (a
test script) grades a snapshot of /work in a fresh jail, outside the session, in a clean
environment (`postrain.sandbox.grader`), and its verdict is the reward.
The session is closed when the environment is, whatever ended the episode.

Reward components: `passed` = 1.0 if the check exits 0, else 0.0 (weight 1.0); `format` = 1.0 if
every turn was well-formed (weight `format_weight`, default 0.0: logged only).

The suite (`SUITE`, 51 tasks: 17 kinds x 3 seeded instances, built by code, no downloads) has
file and text work (terminal_text.py) and repositories to fix and multi-step tasks
(terminal_repos.py). One instance of each kind, picked by a hash of its kind, is held out
(`eval_tasks`); `train_tasks` cycles the other 34 in a seeded order. Each task carries its
reference solution (shell steps with their exact outputs), from which `demonstrations` are made.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import random
from typing import Any, Iterator

import trio
from pydantic import Field, field_validator

from postrain.core import Options
from postrain.core.errors import PostrainError
from postrain.sandbox import ExecResult, Status
from postrain.sandbox.grader import check_request, check_verdict

from ..env.api import Environment, Reward, StepResult, check_options
from ..env.tools import format_answer, format_shell_output, format_tool_call, parse_action
from .terminal_repos import KINDS as REPO_KINDS
from .terminal_text import KINDS as TEXT_KINDS

NUM_INSTANCES = 3
KINDS = TEXT_KINDS + REPO_KINDS
WORK_DIR = "/work"
CHECK_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 10.0
GRADE_SLACK_S = 10.0  # the grader's run: the check's own limit plus laying the snapshot out
TERMINAL_INSTRUCTIONS = (
    "You work in a Linux shell, in the folder /work. To run a command, write it between <bash> and "
    "</bash>; one command line per turn (pipes and && are fine). Its output comes back between "
    "<output> and </output>, ending with its exit status. Files and the current folder persist "
    "between commands. When the task is done, write <answer>done</answer>."
)


class TerminalTaskError(PostrainError, RuntimeError):
    """A terminal task that cannot start: its setup failed in the session (a broken task)."""


class TerminalOptions(Options):
    """The task options of `terminal` (a config's `task_options`)."""

    max_turns: int = Field(10, ge=1, description="commands (and the final answer) per episode")
    command_timeout_s: float = Field(10.0, gt=0, description="wall-time limit of one command, seconds")
    max_output_chars: int = Field(1200, ge=100, description="characters of a command's output the "
                                  "model reads (the middle of stdout, the end of stderr are cut)")
    format_weight: float = Field(0.0, description="weight of the `format` reward component (0: logged only)")
    use_system_prompt: bool = Field(True, description="the instructions as a system message "
                                    "(false: prepended to the user message)")
    kinds: list[str] | None = Field(None, description="only tasks of these kinds (none: all 17)")

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            _check_kinds(value)
        return value


def _build_suite() -> list[dict]:
    return [make(index) for make in KINDS for index in range(NUM_INSTANCES)]


SUITE = _build_suite()
KIND_NAMES = tuple(dict.fromkeys(task["kind"] for task in SUITE))


def _held_out_index(kind: str) -> int:
    return hashlib.sha256(f"terminal:{kind}".encode()).digest()[0] % NUM_INSTANCES


EVAL_IDS = frozenset(f"terminal-{kind}-{_held_out_index(kind)}" for kind in KIND_NAMES)


def _check_kinds(kinds: list[str]) -> None:
    unknown = sorted(set(kinds) - set(KIND_NAMES))
    if unknown or not kinds:
        raise ValueError(f"kinds must name some of {list(KIND_NAMES)}, got {kinds}; fix: drop the "
                         f"unknown {unknown}")


def terminal_options(options: dict | TerminalOptions | None) -> TerminalOptions:
    """`options` checked (a dict, None or a `TerminalOptions`); TaskOptionsError names a bad one."""
    return check_options(TerminalOptions, options, "task 'terminal'")


def _of_kinds(tasks: list[dict], options: dict | TerminalOptions | None) -> list[dict]:
    kinds = terminal_options(options).kinds   # checked by TerminalOptions
    return tasks if kinds is None else [t for t in tasks if t["kind"] in kinds]


def train_split(options: dict | TerminalOptions | None = None) -> list[dict]:
    return _of_kinds([t for t in SUITE if t["id"] not in EVAL_IDS], options)


def eval_tasks(options: dict | TerminalOptions | None = None) -> list[dict]:
    return _of_kinds([t for t in SUITE if t["id"] in EVAL_IDS], options)


def train_tasks(seed: int = 0, options: dict | TerminalOptions | None = None) -> Iterator[dict]:
    """Endless: the training tasks, reshuffled (seeded) each pass."""
    rng = random.Random(f"terminal-train-{seed}")
    tasks = train_split(options)
    for epoch in itertools.count():
        order = list(tasks)
        rng.shuffle(order)
        for task in order:
            yield {**task, "id": f"{task['id']}-{seed}-{epoch}"}


def prompt_messages(task: dict, *, use_system_prompt: bool = True) -> list[dict]:
    if use_system_prompt:
        return [{"role": "system", "content": TERMINAL_INSTRUCTIONS},
                {"role": "user", "content": task["prompt"]}]
    return [{"role": "user", "content": f"{TERMINAL_INSTRUCTIONS}\n\n{task['prompt']}"}]


def demonstration(task: dict, options: dict | TerminalOptions | None = None) -> dict:
    """The reference solution as a conversation: each step a `<bash>` turn and the `<output>` the
    session gives for it (the step's recorded output, cut as `options` cut outputs), then
    `<answer>done</answer>`."""
    options = terminal_options(options)
    messages = prompt_messages(task, use_system_prompt=options.use_system_prompt)
    for step in task["solution"]:
        result = ExecResult(Status.OK if step["exit_code"] == 0 else Status.NONZERO_EXIT,
                            exit_code=step["exit_code"], stdout=step["stdout"].encode(),
                            stderr=step["stderr"].encode())
        messages += [{"role": "assistant", "content": format_tool_call(step["command"], "bash")},
                     {"role": "user", "content": format_shell_output(result, max_chars=options.max_output_chars)}]
    messages.append({"role": "assistant", "content": format_answer("done")})
    return {"messages": messages}


def demonstrations(num: int, seed: int = 0, options: dict | TerminalOptions | None = None) -> list[dict]:
    """`num` demonstrations of training tasks (never the held-out split), in a seeded order."""
    options = terminal_options(options)
    tasks = itertools.islice(train_tasks(seed, options), num)
    return [demonstration(t, options) for t in tasks]


def _status(result) -> str:
    status = getattr(result, "status", None)
    return str(getattr(status, "value", status))


class TerminalEnv(Environment):
    """Do a task in a shell (one sandbox session per episode); graded by the task's check script.

    Options: `TerminalOptions` (max_turns, command_timeout_s, max_output_chars, format_weight,
    use_system_prompt, kinds; defaults there). Needs a sandbox handle with sessions
    (`LocalSandbox`, or the environment actor's handle on the sandbox actor).
    """

    uses_sandbox = True
    tools = ("bash",)
    options_model = TerminalOptions
    options: TerminalOptions

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.session: Any = None   # the sandbox session (duck-typed); reset opens it
        self._exit_stack = contextlib.AsyncExitStack()

    async def reset(self, task: dict) -> list[dict]:
        """Open the session with the task's files and run its setup. Cancelled: the session may
        be open; `close` closes it."""
        self.task = task
        self.all_well_formed = True
        files = {path: body.encode() for path, body in task["files"].items()}
        self.session = await self._exit_stack.enter_async_context(self.require_sandbox().session(files=files))
        if task.get("setup"):
            result = await self.session.run(task["setup"], timeout_s=CHECK_TIMEOUT_S)
            if _status(result) != "ok":
                raise TerminalTaskError(f"task {task['id']}: its setup failed in the session "
                                        f"({format_shell_output(result)}); fix the task's setup script")
        return prompt_messages(task, use_system_prompt=self.options.use_system_prompt)

    async def step(self, action: str) -> StepResult:
        """Run a command and show its output, or end the episode and grade it. Cancelled while a
        command runs: the command ends within its limits; the episode should not go on."""
        parsed = parse_action(action, self.tools)
        self.all_well_formed &= parsed.well_formed
        if parsed.kind == "tool_call" and parsed.content.strip():
            result = await self.session.run(parsed.content, timeout_s=self.options.command_timeout_s)
            output = format_shell_output(result, max_chars=self.options.max_output_chars)
            return StepResult(output, False, info={"tool_status": _status(result)})
        info = {"answer": parsed.content} if parsed.kind == "answer" else {"problem": parsed.problem}
        reward, verdict = await self._grade()
        return StepResult(None, True, reward, {**info, **verdict})

    async def truncated(self) -> Reward:
        """Out of turns: the work done so far is graded all the same. Cancelled: no reward."""
        return (await self._grade())[0]

    async def _grade(self) -> tuple[Reward, dict]:
        """Grade out of the policy's reach (docs/sandbox.md, "Grader contract"): a snapshot of the
        session's /work, taken by its agent while no call runs (every process of a call ends
        with it), checked in a fresh jail by the grader's driver, in a clean environment; the
        verdict is the check's exit status as that driver saw it. Cancelled: no verdict; the
        grader's run ends within its limits."""
        snapshot = await self.session.snapshot()
        code, files = check_request(self.task["check"], snapshot, timeout_s=CHECK_TIMEOUT_S)
        result = await self.require_sandbox().exec(code, files=files, timeout_s=CHECK_TIMEOUT_S + GRADE_SLACK_S)
        verdict = check_verdict(result)
        reward = Reward({"passed": float(verdict.passed), "format": float(self.all_well_formed)},
                        {"format": self.options.format_weight})
        return reward, {"check_status": verdict.status, "check_output": verdict.stdout[-300:]}

    async def close(self) -> None:
        """Close the session (if one opened). Shielded, within CLOSE_TIMEOUT_S, so it runs even in
        a cancelled scope; past that the sandbox's own reaper and limits end the session."""
        with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            scope.shield = True
            await self._exit_stack.aclose()
