"""Dataset tasks: prompts and reference answers from a local file, scored by a reward function.

    task = "dataset"
    task_options = { path = "data/train.jsonl", prompt_field = "question", answer_field = "answer",
                     reward = "math", eval_fraction = 0.05 }

The file is JSONL (one JSON object per line), JSON (a list of objects), Parquet, Arrow (an IPC
file or stream, as `datasets` writes them), or a folder of such files (read in name order; a
`datasets.save_to_disk` folder is one: its metadata files are skipped). Nothing is downloaded: the files are read with pyarrow.
The prompt field holds a string (one user message) or a list of chat messages; the answer field
the reference the reward reads (`rewards.py`: `exact`, `last_integer`, `math`, `code_tests`, or
'pkg.mod:fn' of fn(completion, example), which gets the whole row). Every row is checked when the
file is read: a missing field is a `DatasetError` naming the file and the row (1-based; the line
of a JSONL file).

Demonstrations (for a supervised warm start, `sft_steps`): with the option `demonstration`, a
format string over a row's fields (`"\\boxed{{{answer}}}"`), each training row becomes a chat
demonstration: the episode's first messages, then that assistant turn.

Held-out split, disjoint by construction: with `eval_path`, training reads all of `path` and
evaluation all of `eval_path`; without, a row is held out iff the first 8 bytes of
sha256(f"{split_seed}:" + its prompt as JSON) fall below `eval_fraction` of their range, so
the same prompt lands on the same side wherever it occurs. Training walks the training rows in
epochs, each shuffled by (seed, epoch); evaluation takes the first `num_eval` held-out rows in
file order.

The episode is single-turn by default: the prompt (after `system_prompt`, if set), one assistant
turn, its reward. With `max_tool_calls` > 0 it is multi-turn: the model may run Python in the
sandbox (`<python>...</python>`, the output comes back as the next user turn, the tool format of
`actors/env/tools.py`) up to that many times, then answers (`<answer>...</answer>`); the turn that
is not a tool call is scored, and an episode that runs out of turns is worth 0. A reward that
raises or hangs fails only its sample (`rewards.py`'s failure rule).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
from pathlib import Path
from typing import Iterator

from pydantic import Field, field_validator

from postrain.core import Options
from postrain.core.errors import PostrainError

from ..env.api import (Environment, EnvironmentContractError, Reward, StepResult, check_options,
                       validate_observation)
from ..env.tools import TOOL_INSTRUCTIONS, format_observation, format_tool_output, parse_action
from .rewards import RewardError, RewardFunction, load_reward

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
_DATASETS_METADATA = ("dataset_info.json", "state.json")   # what `datasets.save_to_disk` writes beside the data


class DatasetError(PostrainError, ValueError):
    """A dataset file that cannot be read, or a row without a field the task needs."""


class DatasetOptions(Options):
    """The task options of `dataset`."""

    path: str = Field(description="the training data: a .jsonl, .json, .parquet or .arrow file, or a "
                      "folder of them")
    eval_path: str | None = Field(None, description="the held-out data (same formats); none: a seeded "
                                  "`eval_fraction` of `path` is held out")
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="share of `path` held out when there is "
                                 "no eval_path (by a hash of the prompt)")
    split_seed: int = Field(0, description="seed of the held-out hash: another seed, another split")
    num_eval: int | None = Field(None, ge=0, description="held-out rows per evaluation, at most (none: all)")
    prompt_field: str = Field("prompt", description="the row's prompt: a string or a list of chat messages")
    answer_field: str = Field("answer", description="the row's reference answer (read by the built-in "
                              "rewards; a user reward gets the whole row)")
    reward: str = Field("exact", description="exact, last_integer, math (math-verify), code_tests "
                        "(sandbox) or 'pkg.mod:fn' of fn(completion, example) -> float | dict[str, float]")
    reward_timeout_s: float = Field(30.0, gt=0, description="a reward call past this fails its sample, "
                                    "seconds")
    system_prompt: str | None = Field(None, description="a system message before every prompt")
    demonstration: str | None = Field(None, description="the assistant turn of a supervised demonstration "
                                      "of a training row, a format string over its fields, e.g. "
                                      "'\\\\boxed{{{answer}}}' (for `sft_steps`); none: no demonstrations")
    max_tool_calls: int = Field(0, ge=0, description="Python runs in the sandbox the model may make "
                                "before it answers (<python>...</python>, then <answer>...</answer>); "
                                "0: single-turn, no sandbox unless the reward needs one")
    tool_timeout_s: float = Field(5.0, gt=0, description="wall-time limit of one Python run, seconds")

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, value: str) -> str:
        load_reward(value)   # RewardError (a ValueError) names the problem and the fix
        return value


def dataset_options(options: dict | DatasetOptions | None) -> DatasetOptions:
    """`options` checked (a dict, None or a `DatasetOptions`); TaskOptionsError names a bad one."""
    return check_options(DatasetOptions, options, "task 'dataset'")


# --------------------------------------------------------------------------- reading files
def data_files(path: str | Path) -> list[Path]:
    """The files of a dataset: `path` itself, or the readable files of a folder in name order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.suffix in SUFFIXES and p.is_file() and p.name not in _DATASETS_METADATA)
        if not files:
            raise DatasetError(f"dataset folder {path} holds no {'/'.join(SUFFIXES)} file; fix: point "
                               f"`path` at the data")
        return files
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist; fix: check `path` (relative paths are "
                           f"relative to the directory the run starts in)")
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"dataset file {path} is not {'/'.join(SUFFIXES)}; fix: convert it, e.g. "
                           f"datasets.Dataset.to_parquet")
    return [path]


def read_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) for every row of one file; `where` is 'FILE line N' or 'FILE row N' (1-based)."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield f"{path} line {number}", _parse_json_line(line, path, number)
        return
    if path.suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise DatasetError(f"{path} must hold a JSON list of objects; fix: or write it as JSONL")
    else:
        rows = _read_arrow(path).to_pylist()
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DatasetError(f"{path} row {number} is a {type(row).__name__}, not an object")
        yield f"{path} row {number}", row


def _parse_json_line(line: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path} line {number} is not JSON: {exc}") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{path} line {number} is a {type(row).__name__}, not a JSON object")
    return row


def _read_arrow(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        try:
            return pa.ipc.open_file(path).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_stream(path).read_all()   # `datasets` writes Arrow streams
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None


def check_row(where: str, row: dict, prompt_field: str, answer_field: str | None) -> dict:
    """`row`, once its prompt is a string or chat messages and its answer field exists."""
    for field in (prompt_field, answer_field):
        if field is not None and field not in row:
            raise DatasetError(f"{where} has no field {field!r} (it has {sorted(row)}); fix: set "
                               f"task option {'prompt_field' if field == prompt_field else 'answer_field'} "
                               f"to the right column, or fill the row")
    try:
        validate_observation(row[prompt_field], where=f"{where}: field {prompt_field!r}")
    except EnvironmentContractError as exc:
        raise DatasetError(str(exc)) from None
    return row


@functools.lru_cache(maxsize=8)
def _load(path: str, prompt_field: str, answer_field: str | None) -> tuple[tuple[str, dict], ...]:
    rows = tuple((where, check_row(where, row, prompt_field, answer_field))
                 for file in data_files(path) for where, row in read_rows(file))
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    return rows


def load_rows(path: str, options: DatasetOptions) -> tuple[tuple[str, dict], ...]:
    """Every (where, row) of the dataset at `path`, each checked (`check_row`). Read once per
    process and kept (the file must not change during a run)."""
    answer_field = options.answer_field if load_reward(options.reward).builtin else None
    return _load(str(path), options.prompt_field, answer_field)


# --------------------------------------------------------------------------- the split
def in_eval_split(prompt, split_seed: int, eval_fraction: float) -> bool:
    digest = hashlib.sha256(f"{split_seed}:{json.dumps(prompt, sort_keys=True)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < eval_fraction * 2 ** 64


def _split(options: DatasetOptions, held_out: bool) -> list[tuple[str, dict]]:
    if options.eval_path:
        return list(load_rows(options.eval_path if held_out else options.path, options))
    return [(where, row) for where, row in load_rows(options.path, options)
            if in_eval_split(row[options.prompt_field], options.split_seed, options.eval_fraction) == held_out]


def train_tasks(seed: int = 0, options: dict | DatasetOptions | None = None) -> Iterator[dict]:
    """An endless, deterministic stream of training rows: epochs, each shuffled by (seed, epoch)."""
    options = dataset_options(options)
    rows = _split(options, held_out=False)
    if not rows:
        raise DatasetError(f"dataset {options.path} has no training rows (eval_fraction = "
                           f"{options.eval_fraction} held all out); fix: lower eval_fraction")
    for epoch in itertools.count():
        order = list(range(len(rows)))
        random.Random(f"dataset-{seed}-{epoch}").shuffle(order)
        for i in order:
            where, row = rows[i]
            yield {"id": f"dataset-train-{seed}-{epoch}-{i}", "where": where, "example": row}


def eval_tasks(options: dict | DatasetOptions | None = None) -> list[dict]:
    """The held-out rows, in file order, at most `num_eval`."""
    options = dataset_options(options)
    rows = _split(options, held_out=True)[:options.num_eval]
    return [{"id": f"dataset-eval-{i}", "where": where, "example": row} for i, (where, row) in enumerate(rows)]


def demonstrations(num: int, seed: int = 0, options: dict | DatasetOptions | None = None) -> list[dict]:
    """`num` chat demonstrations for a supervised warm start: training rows (never held-out
    ones) in the training order, each answered with the `demonstration` template filled from
    the row (`"\\boxed{{{answer}}}"` -> `\\boxed{72}`)."""
    options = dataset_options(options)
    template = options.demonstration
    if not template:
        raise DatasetError("this dataset task has no demonstrations; fix: set task option demonstration to "
                           "the assistant turn as a format string over the row's fields, e.g. "
                           "'\\\\boxed{{{answer}}}', or set sft_steps = 0")
    out = []
    for task in itertools.islice(train_tasks(seed, options), num):
        try:
            answer = template.format(**task["example"])
        except (KeyError, IndexError, ValueError) as exc:
            raise DatasetError(f"task option demonstration {template!r} does not fit {task['where']}: "
                               f"{type(exc).__name__}: {exc}; fix: name the row's fields in braces and "
                               f"double literal braces") from None
        out.append({"messages": [*prompt_messages(task["example"], options),
                                 {"role": "assistant", "content": answer}]})
    return out


def prompt_messages(example: dict, options: DatasetOptions) -> list[dict]:
    """The first messages of an episode on `example` (demonstrations begin with the same): the
    system prompt (the tool instructions first when the tool is offered), then the prompt."""
    prompt = example[options.prompt_field]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    system = [text for text in (TOOL_INSTRUCTIONS if options.max_tool_calls else None,
                                options.system_prompt) if text]
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


# --------------------------------------------------------------------------- the environment
class DatasetEnv(Environment):
    """A prompt from a dataset row, answered in one turn (or after up to `max_tool_calls` Python
    runs in the sandbox), scored by the task's reward function. Options: `DatasetOptions`;
    `max_turns` is max_tool_calls + 1."""

    options_model = DatasetOptions
    options: DatasetOptions

    @classmethod
    def needs_sandbox(cls, options: DatasetOptions) -> bool:
        """The `code_tests` reward and the Python tool run code."""
        return load_reward(options.reward).uses_sandbox or options.max_tool_calls > 0

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reward: RewardFunction = load_reward(self.options.reward)
        self.max_tool_calls = self.options.max_tool_calls
        self.max_turns = self.max_tool_calls + 1

    async def reset(self, task: dict) -> list[dict]:
        """The prompt's messages (the tool instructions first when the tool is offered). Does
        not wait (cancel-safe)."""
        self.example = task["example"]
        self.num_tool_calls = 0
        return prompt_messages(self.example, self.options)

    async def step(self, action: str) -> StepResult:
        """Run a tool call, or score the answer. Raises RewardFailure (the sample is dropped).
        Cancellation: no result; a sandbox run or a sync reward's thread ends on its own."""
        if self.max_tool_calls:
            parsed = parse_action(action)
            if parsed.kind == "tool_call":
                return await self._run_tool(parsed.content)
        sandbox = self.require_sandbox() if self.reward.uses_sandbox else None
        reward = await self.reward.score(action, self.example, sandbox=sandbox,
                                         answer_field=self.options.answer_field,
                                         timeout_s=self.options.reward_timeout_s)
        return StepResult(None, True, reward)

    async def _run_tool(self, code: str) -> StepResult:
        if self.num_tool_calls >= self.max_tool_calls:
            return StepResult(format_observation("No more tool calls: give your final answer between "
                                                 "<answer> and </answer>."), False)
        self.num_tool_calls += 1
        result = await self.require_sandbox().exec(code, timeout_s=self.options.tool_timeout_s)
        return StepResult(format_tool_output(result), False)

    async def truncated(self) -> Reward:
        """Out of turns without an answer: worth 0 (no component). Does not wait (cancel-safe)."""
        return Reward()


__all__ = ["DatasetEnv", "DatasetError", "DatasetOptions", "RewardError", "demonstrations", "eval_tasks",
           "train_tasks"]
