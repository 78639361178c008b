"""A long-context task: find one setting in a generated repository, read file by file.

    What is the value of `cache_ttl_s` in this repository? Files: app.cfg, db.cfg, ... Read a
    file with <open>NAME</open>; answer with <answer>VALUE</answer>.

Each task is a generated repository (seeded, deterministic): `num_files` files of `file_lines`
lines (`name = value` settings), one of which sets the asked name. The model reads a file with
`<open>NAME</open>` and its whole text comes back as the next turn (a long tool output); it
answers `<answer>VALUE</answer>`. An action with neither shows the next file not yet shown (a
pager), so even a policy that has not learnt the tool reads the repository turn by turn, and an
episode outgrows a small context after a few turns: the task the context policies
(actors/env/context.py) run on (actors/configs/long_context.toml). No sandbox is needed.

Reward components: `correct` 1.0 iff the answer equals the value exactly (after stripping
spaces). Held-out tasks come from a fixed seed (`EVAL_SEED`); a training task whose asked value
is one of theirs is skipped, so the two splits share no answer.
"""
from __future__ import annotations

import random
import re
from typing import Iterator

from pydantic import Field

from postrain.core import Options

from ..env.api import Environment, Reward, StepResult, check_options

EVAL_SEED = 20261203
NUM_EVAL = 50
WORDS = ("cache", "queue", "worker", "retry", "timeout", "batch", "buffer", "shard", "lease", "window",
         "flush", "limit", "pool", "route", "token", "index")
UNITS = ("s", "ms", "mb", "count", "ratio", "port", "level")
OPEN = re.compile(r"<open>\s*([^<\s]+)\s*</open>")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class LongContextOptions(Options):
    """The task options of `long_context` (a config's `task_options`)."""

    num_files: int = Field(6, ge=1, le=256, description="files in each repository")
    file_lines: int = Field(40, ge=1, le=10000, description="settings per file (a line is ~30 tokens "
                            "with SmolLM2's tokenizer, ~30 bytes with the byte tokenizer)")
    max_turns: int | None = Field(None, ge=1, description="actions per episode (default: num_files + 2)")


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


class LongContextEnv(Environment):
    """Reads files of a generated repository (module docstring); `correct` on the exact answer."""

    options_model = LongContextOptions
    options: LongContextOptions
    tools = ()

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.options.max_turns is None:
            self.max_turns = self.options.num_files + 2

    async def reset(self, task: dict) -> str:
        """The question. Does not wait (cancel-safe)."""
        self.files: dict[str, str] = dict(task["files"])
        self.answer = str(task["answer"])
        self.unread = list(self.files)
        return task["question"]

    async def step(self, action: str) -> StepResult:
        """An answer ends the episode; `<open>NAME</open>` shows that file, anything else the next
        unread one. Does not wait (cancel-safe)."""
        answer = ANSWER.search(action)
        if answer is not None:
            correct = answer.group(1).strip() == self.answer
            return StepResult(None, True, Reward({"correct": float(correct)}), {"answer": answer.group(1)})
        opened = OPEN.search(action)
        name = opened.group(1) if opened else (self.unread[0] if self.unread else None)
        if name is None:
            return StepResult("Every file was shown. Answer with <answer>VALUE</answer>.", False)
        if name not in self.files:
            return StepResult(f"No file {name!r}. Files: {', '.join(self.files)}.", False)
        if name in self.unread:
            self.unread.remove(name)
        return StepResult(f"{name}:\n{self.files[name]}", False, info={"file": name})

    async def truncated(self) -> Reward:
        """Out of turns without an answer: not correct. Holds no state (cancel-safe)."""
        return Reward({"correct": 0.0})
