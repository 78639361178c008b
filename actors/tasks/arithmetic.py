"""Arithmetic with a Python tool: `What is 3817 * 29 - 412?`

The model may run Python in the sandbox (`<python>print(3817 * 29 - 412)</python>`), read the
`<output>`, and answer (`<answer>110281</answer>`). Reward components (`ArithmeticEnv`):

    correct  1.0 if the final answer equals the value (weight 1.0)
    format   1.0 if every turn was a well-formed tool call or answer (weight 0.1)

With `answer_format = "plain"` the episode is one turn without a tool: the prompt is the bare
question, the reply's last integer is the answer (`What is 37 + 58?` -> `37 + 58 = 95`), and
`correct` is the only component. No sandbox is needed then.

Problems are generated, seeded and deterministic: `make_problem(rng, config)` draws
`num_operands` integers of `min_digits..max_digits` digits joined by `operators`; the value
follows Python's precedence. Difficulty knobs are fields of `ArithmeticOptions` (the task
options), which checks their ranges and holds every default.

Held-out split, disjoint by construction: an expression belongs to the evaluation split iff the
first byte of sha256("arithmetic:" + expression) is < `EVAL_HASH_CUTOFF` (about 5%).
`train_tasks` skips those; `eval_tasks` keeps only those (fixed seed `EVAL_SEED`,
`NUM_EVAL` problems). The same expression can therefore never be in both.
"""
from __future__ import annotations

import ast
import hashlib
import itertools
import operator
import random
from typing import Iterator, Literal

from pydantic import Field, model_validator

from postrain.core import Options
from postrain.core.errors import PostrainError

from ..env.api import Environment, Reward, StepResult, check_options
from ..env.tools import TOOL_INSTRUCTIONS, format_observation, format_tool_output, parse_action
from .rewards import last_integer

EVAL_SEED = 20261130
NUM_EVAL = 200
EVAL_HASH_CUTOFF = 13          # of 256: ~5% of expressions are held out
OPERATORS = ("+", "-", "*")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class ArithmeticConfigError(PostrainError, ValueError):
    """An expression that is not integers joined by + - * (`evaluate`)."""


class ArithmeticOptions(Options):
    """The task options of `arithmetic` (a config's `task_options`): the problem generator's
    difficulty knobs and `ArithmeticEnv`'s, each default in its field; ranges are checked here
    (1 <= min_digits <= max_digits <= 9, 2 <= min_operands <= max_operands <= 6)."""

    min_digits: int = Field(1, description="digits of each operand, at least")
    max_digits: int = Field(3, description="digits of each operand, at most (<= 9)")
    min_operands: int = Field(2, description="numbers per expression, at least (>= 2)")
    max_operands: int = Field(3, description="numbers per expression, at most (<= 6)")
    operators: tuple[str, ...] = Field(OPERATORS, description="a non-empty subset of + - *")
    num_eval: int = Field(NUM_EVAL, ge=0, description="held-out problems in `eval_tasks`")
    max_tool_calls: int = Field(2, description="Python runs per episode; beyond it the model is told "
                                "to answer")
    tool_timeout_s: float = Field(5.0, gt=0, description="wall-time limit of one Python run, seconds")
    format_weight: float = Field(0.1, description="weight of the `format` reward component")
    use_system_prompt: bool = Field(True, description="the tool instructions as a system message "
                                    "(false: prepended to the user message)")
    include_instructions: bool = Field(True, description="false: the bare question (for a warm-started "
                                       "tiny model)")
    max_turns: int = Field(4, ge=1, description="actions per episode before it is truncated")
    mental_products: float = Field(
        0.0, ge=0.0, le=1.0, description="share of the warm start's demonstrations of a problem with "
        "a `*` that answer from memory (the right value, no tool call, its digits out of the "
        "loss): a teacher whose mental multiplication a small student cannot copy, so RL has "
        "to find the tool for products")
    answer_format: Literal["tagged", "plain"] = Field(
        "tagged", description="tagged: Python tool calls, then <answer>N</answer>; plain: the bare "
        "question, one reply without a tool, whose last integer is the answer")

    @model_validator(mode="after")
    def _ranges(self) -> "ArithmeticOptions":
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(f"digits must satisfy 1 <= min_digits <= max_digits <= 9, got "
                             f"{self.min_digits}..{self.max_digits}; fix: e.g. min_digits=1, max_digits=3")
        if not 2 <= self.min_operands <= self.max_operands <= 6:
            raise ValueError(f"operands must satisfy 2 <= min_operands <= max_operands <= 6, got "
                             f"{self.min_operands}..{self.max_operands}; fix: e.g. 2..3")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {self.operators!r}; "
                             f"fix: e.g. ['+', '*']")
        return self


def arithmetic_options(options: dict | ArithmeticOptions | None) -> ArithmeticOptions:
    """`options` checked (a dict, None or an `ArithmeticOptions`); TaskOptionsError names a bad one."""
    return check_options(ArithmeticOptions, options, "task 'arithmetic'")


def evaluate(expression: str) -> int:
    """The value of an expression of integers and + - * (Python precedence); no eval()."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ArithmeticConfigError(f"not an integer + - * expression: {expression!r}")
    return walk(ast.parse(expression, mode="eval"))


def in_eval_split(expression: str) -> bool:
    return hashlib.sha256(f"arithmetic:{expression}".encode()).digest()[0] < EVAL_HASH_CUTOFF


def make_problem(rng: random.Random, config: ArithmeticOptions) -> dict:
    """One problem: {"question", "expression", "answer"} (answer: int)."""
    num = rng.randint(config.min_operands, config.max_operands)
    numbers = [rng.randint(10 ** (d - 1) if d > 1 else 0, 10 ** d - 1)
               for d in (rng.randint(config.min_digits, config.max_digits) for _ in range(num))]
    ops = [rng.choice(config.operators) for _ in range(num - 1)]
    expression = " ".join([str(numbers[0])] + [f"{o} {n}" for o, n in zip(ops, numbers[1:])])
    return {"question": f"What is {expression}?", "expression": expression,
            "answer": evaluate(expression)}


def train_tasks(seed: int = 0, options: dict | ArithmeticOptions | None = None) -> Iterator[dict]:
    """An endless, deterministic stream of training problems (never one of the eval split).
    Bad options raise here, not at the first problem."""
    return _train_tasks(seed, arithmetic_options(options))


def _train_tasks(seed: int, config: ArithmeticOptions) -> Iterator[dict]:
    rng = random.Random(f"arithmetic-train-{seed}")
    for i in itertools.count():
        problem = make_problem(rng, config)
        if not in_eval_split(problem["expression"]):
            yield {"id": f"arithmetic-train-{seed}-{i}", **problem}


def eval_tasks(options: dict | ArithmeticOptions | None = None) -> list[dict]:
    """The held-out set: `num_eval` distinct problems (or fewer when the knobs allow fewer)."""
    config = arithmetic_options(options)
    num = config.num_eval
    rng = random.Random(f"arithmetic-eval-{EVAL_SEED}")
    out: list[dict] = []
    seen: set[str] = set()
    for _ in range(200_000):
        problem = make_problem(rng, config)
        if in_eval_split(problem["expression"]) and problem["expression"] not in seen:
            seen.add(problem["expression"])
            out.append({"id": f"arithmetic-eval-{len(out)}", **problem})
            if len(out) == num:
                break
    return out


def answer_matches(answer: str, expected: int) -> bool:
    """True iff `answer` is the integer `expected` (commas, spaces, a trailing '.' or '.0' ok)."""
    text = answer.strip().rstrip(".").replace(",", "").replace("_", "").replace(" ", "")
    try:
        return int(text) == expected
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return False
    return value.is_integer() and int(value) == expected


def plain_answer_correct(reply: str, expected: int) -> bool:
    """A plain reply is right iff its last integer is `expected` (`37 + 58 = 95.` -> 95)."""
    return last_integer(reply) == expected


def prompt_messages(question: str, *, use_system_prompt: bool = True,
                    include_instructions: bool = True) -> list[dict]:
    """The first observation of an arithmetic episode (demonstrations use the same).
    Without instructions the format must come from a supervised warm start (tiny models)."""
    if not include_instructions:
        return [{"role": "user", "content": question}]
    if use_system_prompt:
        return [{"role": "system", "content": TOOL_INSTRUCTIONS}, {"role": "user", "content": question}]
    return [{"role": "user", "content": f"{TOOL_INSTRUCTIONS}\n\n{question}"}]


class ArithmeticEnv(Environment):
    """Answer an arithmetic question, optionally after running Python.

    Options (`ArithmeticOptions`, defaults there): max_tool_calls (more calls are not run, the
    model is told to answer), tool_timeout_s, format_weight, use_system_prompt,
    include_instructions (false: the bare question, for a warm-started tiny model), max_turns,
    answer_format ("plain": one turn, no tool, judged by `plain_answer_correct`).
    """

    uses_sandbox = True
    options_model = ArithmeticOptions
    options: ArithmeticOptions

    @classmethod
    def needs_sandbox(cls, options: ArithmeticOptions) -> bool:
        """Plain answers run no tool."""
        return options.answer_format == "tagged"

    @property
    def plain(self) -> bool:
        return self.options.answer_format == "plain"

    async def reset(self, task: dict) -> list[dict]:
        """The first messages. Does not wait (cancel-safe)."""
        self.expected = int(task["answer"])
        self.num_tool_calls = 0
        self.all_well_formed = True
        if self.plain:
            return [{"role": "user", "content": task["question"]}]
        return prompt_messages(task["question"],
                               use_system_prompt=self.options.use_system_prompt,
                               include_instructions=self.options.include_instructions)

    def _reward(self, correct: bool) -> Reward:
        return Reward({"correct": float(correct), "format": float(self.all_well_formed)},
                      {"format": self.options.format_weight})

    async def step(self, action: str) -> StepResult:
        """Judge an answer or run a tool call. Cancelled during a tool call: the call counts
        against max_tool_calls without an observation; the episode should not go on."""
        if self.plain:
            correct = plain_answer_correct(action, self.expected)
            return StepResult(None, True, Reward({"correct": float(correct)}), {"answer": action})
        parsed = parse_action(action)
        self.all_well_formed &= parsed.well_formed
        if parsed.kind == "answer":
            correct = answer_matches(parsed.content, self.expected)
            return StepResult(None, True, self._reward(correct), {"answer": parsed.content})
        if parsed.kind == "none":
            return StepResult(None, True, self._reward(False), {"problem": parsed.problem})
        if self.num_tool_calls >= self.options.max_tool_calls:
            return StepResult(format_observation("No more tool calls: give your final answer "
                                                 "between <answer> and </answer>."), False)
        self.num_tool_calls += 1
        result = await self.require_sandbox().exec(parsed.content, timeout_s=self.options.tool_timeout_s)
        status = result.get("status") if isinstance(result, dict) else getattr(result, "status", None)
        return StepResult(format_tool_output(result), False, info={"tool_status": str(status)})

    async def truncated(self) -> Reward:
        """No answer in time: not correct. Does not wait (cancel-safe)."""
        return Reward({"correct": 0.0}) if self.plain else self._reward(False)
