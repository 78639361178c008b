"""A long-context task: find one setting in a generated repository.

    What is the value of `cache_ttl_s` in this repository? Files: app.cfg, db.cfg, ... Read a
    file with <open>NAME</open>; answer with <answer>VALUE</answer>.

Each task is a generated repository (seeded, deterministic): `num_files` files of `file_lines`
lines (`name = value` settings), one of which sets the asked name. Three forms (`form`), the
same repositories and questions in each:

- "pager" (the default): the model reads a file with `<open>NAME</open>` and its whole text
  comes back as the next turn (a long tool output); it answers `<answer>VALUE</answer>`. An
  action with neither shows the next file not yet shown (a pager), so even a policy that has
  not learnt the tool reads the repository turn by turn, and an episode outgrows a small context
  after a few turns: the task the context policies (actors/env/context.py) run on
  (actors/configs/long_context.toml). No sandbox.
- "prompt": every file is in the first message, then the question; one turn, the answer.
- "shell": the files lie in /work of a sandbox session (one per episode); the model runs one
  shell command line per turn (`<bash>grep -r NAME /work</bash>`, its output cut to
  `max_output_chars`) and answers; a turn with neither ends the episode, not correct.

A line is ~19 SmolLM2 tokens, so `num_files * file_lines * 19` sizes the repository
(`postrain bench long` measures SmolLM2 at about 4k and 7k tokens: bench/long_task.py).

Reward components: `correct` 1.0 iff the answer equals the value exactly (after stripping
spaces). Held-out tasks come from a fixed seed (`EVAL_SEED`); a training task whose asked value
is one of theirs is skipped, so the two splits share no answer.
"""
from __future__ import annotations

import contextlib
import random
import re
from typing import Any, Iterator, Literal

import trio
from pydantic import Field

from postrain.core import Options

from ..env.api import Environment, Reward, StepResult, check_options
from ..env.tools import format_shell_output, parse_action

EVAL_SEED = 20261203
NUM_EVAL = 50
WORDS = ("cache", "queue", "worker", "retry", "timeout", "batch", "buffer", "shard", "lease", "window",
         "flush", "limit", "pool", "route", "token", "index")
UNITS = ("s", "ms", "mb", "count", "ratio", "port", "level")
OPEN = re.compile(r"<open>\s*([^<\s]+)\s*</open>")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
WORK_DIR = "/work"
CLOSE_TIMEOUT_S = 10.0
DEFAULT_TURNS = {"prompt": 1, "shell": 6}   # "pager": num_files + 2


class LongContextOptions(Options):
    """The task options of `long_context` (a config's `task_options`)."""

    num_files: int = Field(6, ge=1, le=256, description="files in each repository")
    file_lines: int = Field(40, ge=1, le=10000, description="settings per file (a line is ~19 tokens "
                            "with SmolLM2's tokenizer, ~30 bytes with the byte tokenizer)")
    form: Literal["pager", "prompt", "shell"] = Field("pager", description="how the repository is read: "
                                                      "opened file by file (pager), all in the prompt, "
                                                      "or with shell commands in a sandbox session")
    max_turns: int | None = Field(None, ge=1, description="actions per episode (default: num_files + 2 "
                                  "for pager, 1 for prompt, 6 for shell)")
    command_timeout_s: float = Field(10.0, gt=0, description="shell form: wall-time limit of one command")
    max_output_chars: int = Field(2000, ge=100, description="shell form: characters of a command's "
                                  "output the model reads (the middle is cut)")


def make_task(rng: random.Random, options: LongContextOptions, task_id: str) -> dict:
    """One repository and its question (plain data: it travels on the wire)."""
    names = [f"{rng.choice(WORDS)}_{k}.cfg" for k in range(options.num_files)]
    files, settings = {}, []
    for name in names:
        lines = []
        for _ in range(options.file_lines):
            key = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{rng.choice(UNITS)}_{rng.randrange(10**4):04d}"
            value = f"{rng.randrange(16**6):06x}"
            lines.append(f"{key} = {value}")
            settings.append((key, value))
        files[name] = "\n".join(lines)
    key, value = rng.choice(settings)
    question = (f"What is the value of `{key}` in this repository? Files: {', '.join(names)}. Read a file "
                f"with <open>NAME</open>; answer with <answer>VALUE</answer>.")
    return {"id": task_id, "question": question, "files": files, "answer": value}


def eval_tasks(options: dict | LongContextOptions | None = None) -> list[dict]:
    opts = check_options(LongContextOptions, options, "task 'long_context'")
    rng = random.Random(EVAL_SEED)
    return [make_task(rng, opts, f"long-context-eval-{i}") for i in range(NUM_EVAL)]


def train_tasks(seed: int = 0, options: dict | LongContextOptions | None = None) -> Iterator[dict]:
    opts = check_options(LongContextOptions, options, "task 'long_context'")
    held_out = {task["answer"] for task in eval_tasks(opts)}
    rng = random.Random(seed)
    i = 0
    while True:
        task = make_task(rng, opts, f"long-context-{seed}-{i}")
        i += 1
        if task["answer"] not in held_out:
            yield task


def key_of(task: dict) -> str:
    """The setting a task asks for (its question's first `...` span)."""
    return task["question"].split("`")[1]


def prompt_question(task: dict) -> str:
    """The "prompt" form's message: every file, then the question."""
    files = "\n\n".join(f"== {name} ==\n{text}" for name, text in task["files"].items())
    return (f"A repository of {len(task['files'])} files:\n\n{files}\n\nWhat is the value of "
            f"`{key_of(task)}` in this repository? Answer with <answer>VALUE</answer>.")


def shell_question(task: dict) -> str:
    """The "shell" form's message: where the files are and how to run a command."""
    return (f"A repository of {len(task['files'])} files is in the folder {WORK_DIR}: "
            f"{', '.join(task['files'])}. What is the value of `{key_of(task)}` in this repository? To "
            "run a shell command, write one command line between <bash> and </bash>; its output comes "
            "back between <output> and </output>. Answer with <answer>VALUE</answer>.")


class LongContextEnv(Environment):
    """Reads files of a generated repository (module docstring); `correct` on the exact answer.
    The "shell" form holds one sandbox session per episode, closed by `close`."""

    uses_sandbox = True
    options_model = LongContextOptions
    options: LongContextOptions
    tools: tuple[str, ...] = ()

    @classmethod
    def needs_sandbox(cls, options: LongContextOptions) -> bool:
        """Only the shell form runs commands."""
        return options.form == "shell"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_turns = self.options.max_turns or DEFAULT_TURNS.get(self.options.form, self.options.num_files + 2)
        self.tools = ("bash",) if self.options.form == "shell" else ()
        self.session: Any = None   # the shell form's sandbox session (duck-typed); reset opens it
        self._exit_stack = contextlib.AsyncExitStack()

    async def reset(self, task: dict) -> str:
        """The question (with every file in the prompt form). The shell form opens the session
        with the files in /work; cancelled then, the session may be open: `close` closes it.
        The other forms do not wait (cancel-safe)."""
        self.files: dict[str, str] = dict(task["files"])
        self.answer = str(task["answer"])
        self.unread = list(self.files)
        if self.options.form == "prompt":
            return prompt_question(task)
        if self.options.form == "shell":
            files = {name: text.encode() for name, text in self.files.items()}
            self.session = await self._exit_stack.enter_async_context(self.require_sandbox().session(files=files))
            return shell_question(task)
        return task["question"]

    def _graded(self, answer: str) -> StepResult:
        correct = answer.strip() == self.answer
        return StepResult(None, True, Reward({"correct": float(correct)}), {"answer": answer})

    async def step(self, action: str) -> StepResult:
        """An answer ends the episode. Pager: `<open>NAME</open>` shows that file, anything else
        the next unread one; prompt: anything else ends it, not correct; shell: a `<bash>` command
        runs in the session (cancelled: it ends within its limits), anything else ends it, not
        correct. The pager and prompt forms do not wait (cancel-safe)."""
        if self.options.form == "shell":
            return await self._shell_step(action)
        answer = ANSWER.search(action)
        if answer is not None:
            return self._graded(answer.group(1))
        if self.options.form == "prompt":
            return StepResult(None, True, Reward({"correct": 0.0}), {"problem": "no <answer>"})
        opened = OPEN.search(action)
        name = opened.group(1) if opened else (self.unread[0] if self.unread else None)
        if name is None:
            return StepResult("Every file was shown. Answer with <answer>VALUE</answer>.", False)
        if name not in self.files:
            return StepResult(f"No file {name!r}. Files: {', '.join(self.files)}.", False)
        if name in self.unread:
            self.unread.remove(name)
        return StepResult(f"{name}:\n{self.files[name]}", False, info={"file": name})

    async def _shell_step(self, action: str) -> StepResult:
        parsed = parse_action(action, self.tools)
        if parsed.kind == "answer":
            return self._graded(parsed.content)
        if parsed.kind == "tool_call" and parsed.content.strip():
            result = await self.session.run(parsed.content, timeout_s=self.options.command_timeout_s)
            status = getattr(result.status, "value", result.status)
            return StepResult(format_shell_output(result, max_chars=self.options.max_output_chars), False,
                              info={"tool_status": str(status)})
        return StepResult(None, True, Reward({"correct": 0.0}), {"problem": parsed.problem or "empty command"})

    async def truncated(self) -> Reward:
        """Out of turns without an answer: not correct. Holds no state (cancel-safe)."""
        return Reward({"correct": 0.0})

    async def close(self) -> None:
        """Close the shell form's session (if one opened). Shielded, within CLOSE_TIMEOUT_S, so it
        runs even in a cancelled scope; past that the sandbox's reaper and limits end it."""
        with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            scope.shield = True
            await self._exit_stack.aclose()
