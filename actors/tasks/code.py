"""Code, multi-turn: write a function that passes unit tests run in the sandbox.

An episode (`CodeEnv`): the model sees the signature, the spec and the visible tests. Each
`<python>` block it writes is an attempt: the environment runs the visible tests against it in the
sandbox and answers with the verdicts and the failure messages (`<output>2 of 3 visible tests
passed. FAIL ...</output>`). When every visible test passes, or after `max_attempts` attempts, the
last attempt is graded on the hidden tests and the episode ends; an `<answer>` block submits its
code for grading at once, without a visible run (write, execute, read the error, correct).

Reward components: `hidden_tests` = fraction of the hidden tests passed (weight 1.0);
`format` = 1.0 if every turn was well-formed (weight `format_weight`, default 0.0: logged only).

Problems (`code_problems.PROBLEMS`, 65 written for postrain) are split by a hash of their name:
`EVAL_PROBLEMS` (10) form the held-out set, the rest train; `train_tasks` cycles the training
problems in a seeded order. A test is a comparison `call == expected` (expected: a literal); the
jail only evaluates the calls and the host compares the values (`postrain.sandbox.grader`), so a
solution cannot forge its reward. `build_test_file` makes a test file of them (for `run_tests`).
"""
from __future__ import annotations

import ast
import hashlib
import itertools
import random
from typing import Iterator

from pydantic import Field

from postrain.core import Options
from postrain.core.errors import PostrainError
from postrain.sandbox.grader import calls_request, judge_calls, literal_value

from ..env.api import Environment, Reward, StepResult
from ..env.tools import format_observation, parse_action, truncate_head
from .code_problems import PROBLEMS

NUM_EVAL_PROBLEMS = 10
DEFAULT_MAX_ATTEMPTS = 3

CODE_INSTRUCTIONS = (
    "Write the Python function described below. To test it, send the complete function between "
    "<python> and </python>: it runs against the visible tests and you see the failures. Fix it "
    "and send it again until the tests pass. To submit without testing, put the function between "
    "<answer> and </answer>."
)


class CodeTaskError(PostrainError, ValueError):
    """A malformed code problem or test."""


class CodeOptions(Options):
    """The task options of `code` (a config's `task_options`), all read by `CodeEnv`."""

    max_attempts: int = Field(DEFAULT_MAX_ATTEMPTS, ge=1, description="attempts on the visible tests "
                              "before grading (>= 1)")
    test_timeout_s: float = Field(2.0, gt=0, description="time limit of one test, seconds")
    run_timeout_s: float = Field(10.0, gt=0, description="wall-time limit of one sandbox run, seconds")
    format_weight: float = Field(0.0, description="weight of the `format` reward component (0: logged only)")
    use_system_prompt: bool = Field(True, description="the instructions as a system message "
                                    "(false: prepended to the user message)")
    max_turns: int | None = Field(None, ge=1, description="actions per episode; none: max_attempts + 1")


def _split_key(name: str) -> bytes:
    return hashlib.sha256(f"code:{name}".encode()).digest()


EVAL_PROBLEMS = frozenset(sorted((p["name"] for p in PROBLEMS), key=_split_key)[:NUM_EVAL_PROBLEMS])


def _parse_test(test: str) -> tuple[str, str]:
    try:
        node = ast.parse(test, mode="eval").body
    except SyntaxError as exc:
        raise CodeTaskError(f"a test must be a Python comparison 'call == expected', got {test!r}: "
                            f"{exc}; fix: e.g. \"add(1, 2) == 3\"") from None
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)):
        raise CodeTaskError(f"a test must be one comparison 'call == expected', got {test!r}; "
                            f"fix: e.g. \"add(1, 2) == 3\"")
    return ast.unparse(node.left), ast.unparse(node.comparators[0])


def build_test_file(func_name: str, tests: list[str]) -> str:
    """A test file (for `postrain.sandbox.run_tests`): one `test_<i>` per comparison, whose
    failure message reads `add(1, 2) returned 4, expected 3`."""
    lines = [f"from solution import {func_name}", ""]
    for i, test in enumerate(tests):
        call, expected = _parse_test(test)
        lines += [f"def test_{i}():",
                  f"    got = {call}",
                  f"    want = {expected}",
                  f"    assert got == want, {call!r} + ' returned ' + repr(got) + ', expected ' + repr(want)",
                  ""]
    return "\n".join(lines)


def problem_to_task(problem: dict, split: str) -> dict:
    """The task dict (plain data: it travels over the wire) for one problem."""
    return {"id": f"code-{split}-{problem['name']}", "name": problem["name"],
            "signature": problem["signature"], "description": problem["description"],
            "visible_tests": list(problem["visible_tests"]), "hidden_tests": list(problem["hidden_tests"])}


def train_problems() -> list[dict]:
    return [p for p in PROBLEMS if p["name"] not in EVAL_PROBLEMS]


def eval_problems() -> list[dict]:
    return [p for p in PROBLEMS if p["name"] in EVAL_PROBLEMS]


def train_tasks(seed: int = 0, options: dict | CodeOptions | None = None) -> Iterator[dict]:
    """Endless: the training problems, reshuffled (seeded) each pass (no option changes them)."""
    rng = random.Random(f"code-train-{seed}")
    problems = train_problems()
    for epoch in itertools.count():
        order = list(problems)
        rng.shuffle(order)
        for p in order:
            task = problem_to_task(p, "train")
            task["id"] = f"{task['id']}-{seed}-{epoch}"
            yield task


def eval_tasks(options: dict | CodeOptions | None = None) -> list[dict]:
    return [problem_to_task(p, "eval") for p in eval_problems()]


def prompt_text(task: dict) -> str:
    tests = "\n".join(task["visible_tests"])
    return (f"Write `{task['signature']}`.\n\n{task['description']}\n\n"
            f"Visible tests (each must be True):\n{tests}")


def prompt_messages(task: dict, *, use_system_prompt: bool = True) -> list[dict]:
    if use_system_prompt:
        return [{"role": "system", "content": CODE_INSTRUCTIONS},
                {"role": "user", "content": prompt_text(task)}]
    return [{"role": "user", "content": f"{CODE_INSTRUCTIONS}\n\n{prompt_text(task)}"}]


def _field(report, name: str, default=None):
    if isinstance(report, dict):
        return report.get(name, default)
    return getattr(report, name, default)


def visible_feedback(report, num_tests: int, attempts_left: int, *, max_chars: int = 1500) -> str:
    """What the model reads after an attempt: verdicts, failure messages, attempts left."""
    passed = _field(report, "passed") or {}
    errors = _field(report, "errors") or {}
    collect_error = _field(report, "collect_error")
    if collect_error or not passed:
        body = "Your code did not load:\n" + truncate_head(str(collect_error or "no test ran"), max_chars)
    else:
        num_passed = sum(bool(v) for v in passed.values())
        lines = [f"{num_passed} of {num_tests} visible tests passed."]
        for name, ok in passed.items():
            if not ok:
                lines.append(f"FAIL {name}: {str(errors.get(name, '')).strip()}")
        body = truncate_head("\n".join(lines), max_chars)
    if attempts_left:
        body += (f"\nYou have {attempts_left} attempt{'s' if attempts_left > 1 else ''} left: "
                 f"send the whole corrected function in <python></python>.")
    return format_observation(body)


class CodeEnv(Environment):
    """Write a function; test it on the visible tests, revise; graded on the hidden tests.

    Options (`CodeOptions`, defaults there): max_attempts, test_timeout_s (per test),
    run_timeout_s (per sandbox run), format_weight, use_system_prompt, max_turns (none:
    max_attempts + 1).
    """

    uses_sandbox = True
    options_model = CodeOptions
    options: CodeOptions

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_attempts = self.options.max_attempts
        if self.options.max_turns is None:
            self.max_turns = self.max_attempts + 1

    async def reset(self, task: dict) -> list[dict]:
        """Build the test files; the first messages. Does not wait (cancel-safe)."""
        self.task = task
        self.func_name = task["signature"].split("(")[0].removeprefix("def ").strip()
        self.visible = list(task["visible_tests"])
        self.hidden = list(task["hidden_tests"])
        for test in self.visible + self.hidden:
            literal_value(_parse_test(test)[1])  # CodeTaskError/ValueError now, not at grading
        self.num_attempts = 0
        self.all_well_formed = True
        return prompt_messages(task, use_system_prompt=self.options.use_system_prompt)

    async def _run(self, solution: str, tests: list[str]):
        """The test report of `tests` (`call == expected`), judged on the host (`judge_calls`: the
        jail reports each call's value, the expected values never enter it, so no solution can
        forge a pass; docs/sandbox.md, "Grader contract"). Cancelled: no report; the run still
        ends within its limits."""
        calls, expected = zip(*(_parse_test(test) for test in tests))
        code, files = calls_request(solution, list(calls), call_timeout_s=self.options.test_timeout_s)
        result = await self.require_sandbox().exec(code, files=files, timeout_s=self.options.run_timeout_s)
        return judge_calls(result, list(calls), list(expected))

    async def _grade(self, solution: str, info: dict) -> StepResult:
        """The final step: the hidden tests' pass fraction. Cancelled: no verdict; nothing changes."""
        report = await self._run(solution, self.hidden)
        passed = _field(report, "passed") or {}
        num_passed = sum(bool(v) for v in passed.values())
        fraction = num_passed / len(self.task["hidden_tests"])
        reward = Reward({"hidden_tests": fraction, "format": float(self.all_well_formed)},
                        {"format": self.options.format_weight})
        return StepResult(None, True, reward, {**info, "hidden_passed": num_passed,
                                               "attempts": self.num_attempts})

    async def step(self, action: str) -> StepResult:
        """Grade a submission, or run the visible tests and give feedback. Cancelled while
        testing: the attempt counts (num_attempts) without feedback; the episode should not go on."""
        parsed = parse_action(action)
        self.all_well_formed &= parsed.well_formed
        if parsed.kind == "none" or not parsed.content.strip():
            reward = Reward({"hidden_tests": 0.0, "format": 0.0},
                            {"format": self.options.format_weight})
            return StepResult(None, True, reward, {"problem": parsed.problem or "empty code"})
        if parsed.kind == "answer":
            return await self._grade(_strip_fence(parsed.content), {"submitted": True})
        self.num_attempts += 1
        report = await self._run(parsed.content, self.visible)
        passed = _field(report, "passed") or {}
        all_passed = bool(passed) and all(passed.values()) and not _field(report, "collect_error")
        if all_passed or self.num_attempts >= self.max_attempts:
            return await self._grade(parsed.content, {"visible_passed": all_passed})
        feedback = visible_feedback(report, len(self.task["visible_tests"]),
                                    self.max_attempts - self.num_attempts)
        return StepResult(feedback, False, info={"visible_passed": sum(map(bool, passed.values()))})

    async def truncated(self) -> Reward:
        """Out of turns: no hidden test passed. Does not wait (cancel-safe)."""
        return Reward({"hidden_tests": 0.0, "format": float(self.all_well_formed)},
                      {"format": self.options.format_weight})


def _strip_fence(code: str) -> str:
    lines = code.strip("\n").splitlines()
    if lines and lines[0].lstrip().startswith("```") and lines[-1].strip() == "```":
        return "\n".join(lines[1:-1])
    return code
