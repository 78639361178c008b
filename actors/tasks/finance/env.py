"""`FinanceDocsEnv`: answer a question about a generated company report; graded numerically.

- prompt form (`form = "prompt"`): `reset` shows the whole report and the question in one user
  message; the first reply is graded and ends the episode. No sandbox.
- files form (`form = "files"`): `reset` opens a sandbox session with the report's files in
  /work; each turn whose first tag is `<bash>` runs that command line in the session (its
  output cut to `max_output_chars`); the first turn without a command is graded and ends the
  episode; past `max_turns` (default 8) the episode is truncated, not correct.

Reward: `correct` 1.0 iff the final turn's last `<answer>...</answer>` holds the value in an
accepted form within the tolerance (`grading.grade`), else 0.0. The grader reads that text
only, with the expected value from the task (never from the session), so nothing the policy
runs or writes changes the verdict. `info` holds the graded answer and why it failed.
"""
from __future__ import annotations

import contextlib
from typing import Any

import trio

from ...env.api import Environment, Reward, StepResult
from ...env.tools import format_shell_output, parse_action
from .grading import grade
from .options import DEFAULT_TURNS, FinanceOptions
from .prompts import files_message, prompt_message

CLOSE_TIMEOUT_S = 10.0


class FinanceDocsEnv(Environment):
    """Reads a company report (module docstring); `correct` on the graded final answer. The files
    form holds one sandbox session per episode, closed by `close`."""

    uses_sandbox = True
    options_model = FinanceOptions
    options: FinanceOptions
    tools: tuple[str, ...] = ()

    @classmethod
    def needs_sandbox(cls, options: FinanceOptions) -> bool:
        """Only the files form runs commands."""
        return options.form == "files"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_turns = self.options.max_turns or DEFAULT_TURNS[self.options.form]
        self.tools = ("bash",) if self.options.form == "files" else ()
        self.session: Any = None   # the files form's sandbox session (duck-typed); reset opens it
        self._exit_stack = contextlib.AsyncExitStack()

    async def reset(self, task: dict) -> str:
        """The first message. The files form opens the session with the report in /work;
        cancelled then, the session may be open: `close` closes it. The prompt form does not
        wait (cancel-safe)."""
        self.expected = dict(task["answer"])
        if self.options.form == "prompt":
            return prompt_message(task)
        files = {name: text.encode() for name, text in task["files"].items()}
        self.session = await self._exit_stack.enter_async_context(self.require_sandbox().session(files=files))
        return files_message(task)

    def _graded(self, action: str) -> StepResult:
        verdict = grade(action, self.expected, tolerance_units=self.options.tolerance_units)
        info = {"answer": verdict.answer, "cause": verdict.cause, **({"problem": verdict.reason} if verdict.reason else {})}
        return StepResult(None, True, Reward({"correct": float(verdict.correct)}), info)

    async def step(self, action: str) -> StepResult:
        """Grade the turn, or (files form) run its command. Cancelled while a command runs: the
        command ends within its limits; the episode should not go on."""
        if self.options.form == "files":
            parsed = parse_action(action, self.tools)
            if parsed.kind == "tool_call" and parsed.content.strip():
                result = await self.session.run(parsed.content, timeout_s=self.options.command_timeout_s)
                status = getattr(result.status, "value", result.status)
                return StepResult(format_shell_output(result, max_chars=self.options.max_output_chars), False,
                                  info={"tool_status": str(status)})
        return self._graded(action)

    async def truncated(self) -> Reward:
        """Out of turns without an answer: not correct. Holds no state (cancel-safe)."""
        return Reward({"correct": 0.0})

    async def close(self) -> None:
        """Close the files form's session (if one opened). Shielded, within CLOSE_TIMEOUT_S, so it
        runs even in a cancelled scope; past that the sandbox's reaper and limits end it."""
        with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            scope.shield = True
            await self._exit_stack.aclose()
