"""Reward functions for single-turn tasks: the built-ins and a user's own, called one way.

    reward = load_reward("math")                       # built-in: exact, last_integer, math, code_tests
    reward = load_reward("my_pkg.rewards:judge")       # yours: fn(completion, example) -> float | dict
    result = await reward.score(completion, example, answer_field="answer", sandbox=None, timeout_s=30)

A reward function takes the model's completion (the assistant turn's text) and the example (the
dataset row, a plain dict) and returns a float, or a dict of named floats (reward components,
summed with weight 1.0 each). A float becomes the component `reward`; the built-ins give
`correct` (1.0 or 0.0; `code_tests`: the fraction of tests passed), which `postrain eval` reports
as accuracy. User functions may be sync or async.

Built-ins (they read the reference answer from the example's answer field):

    exact         the final answer equals the reference, both stripped
    last_integer  the last integer of the final answer equals the last integer of the reference
                  (so a GSM8K answer "... #### 72" works as it is; commas and spaces ignored)
    math          math-verify: the completion's answer (\\boxed{...}, $...$ or the last number)
                  is mathematically equal to the reference (1/2 == 0.5 == \\frac{1}{2})
    code_tests    the reference is a Python test file of `assert CALL == EXPECTED` statements (in
                  `test_*` functions or at module level); the calls run against the final answer's
                  code (a ```python fence is stripped) in the sandbox, the values are compared on
                  the host (postrain.sandbox.grader.comparison_tests); `correct` is the fraction
                  of tests passed

The final answer of a completion is the text of its last `<answer>...</answer>`, or the whole
completion when it has none (`final_answer`).

Failure rule: a reward function that raises, returns something other than a finite float or a
dict of them, or does not return within `timeout_s` raises `RewardFailure` (an
`EnvironmentFailure`), so the caller drops that one sample with the reason in the ledger and the
run goes on. A sync function runs in a worker thread so that a hang cannot block the event loop;
a thread that never returns is abandoned (Python cannot kill it) and keeps its core busy.

Sandbox rule (`code_tests`): a failure the policy's code could have caused is a failure of that
code, never a dropped sample, or a policy that can cause one would turn its failures into drops.
A run that started and ended as sandbox_error (its worker died or stopped answering, nsjail lost
its exit status) scores 0, and the reason is logged. Only a failure that provably is not the
code's is retried once and then dropped (`RewardFailure`: counted in the ledger with its reason,
and logged): the sandbox could not start the run (its error begins with
`postrain.sandbox.NOT_STARTED`), or the sandbox call raised instead of returning a result (the
sandbox returns a result for whatever the code does, so a raise is its own failure or the
transport's).
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
from typing import Any, Callable

import trio

from postrain.core import import_object
from postrain.core.errors import PostrainError
from postrain.sandbox import NOT_STARTED
from postrain.sandbox.grader import TestFileError, calls_request, comparison_tests

from ..env.api import EnvironmentFailure, Reward

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INTEGER = re.compile(r"-?\d[\d,]*")
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_log = logging.getLogger(__name__)


class RewardError(PostrainError, ValueError):
    """A reward that cannot be loaded: an unknown built-in or a bad import path."""


class RewardFailure(EnvironmentFailure):
    """A reward function raised, hung or returned garbage for one sample (the sample is dropped)."""


def final_answer(completion: str) -> str:
    """The text of the last <answer>...</answer> of `completion`, else all of it; stripped."""
    tagged = _ANSWER_TAG.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (thousands commas allowed), or None."""
    found = _INTEGER.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits) if digits.lstrip("-") else None


def exact(completion: str, answer: Any) -> dict[str, float]:
    return {"correct": float(final_answer(completion) == str(answer).strip())}


def last_integer_match(completion: str, answer: Any) -> dict[str, float]:
    got, expected = last_integer(final_answer(completion)), last_integer(str(answer))
    return {"correct": float(got is not None and got == expected)}


def math_match(completion: str, answer: Any) -> dict[str, float]:
    """math-verify's equivalence of the completion's answer and the reference. Its own timeouts use
    signal.alarm, which works only in the main thread: they are off here (parsing_timeout=None) and
    `score`'s timeout bounds the call instead."""
    from math_verify import parse, verify
    logging.getLogger("math_verify").setLevel(logging.ERROR)   # "timeout is disabled" on every call
    reference = str(answer).strip()
    gold = parse(reference if "$" in reference or "\\boxed" in reference else f"${reference}$",
                 parsing_timeout=None)
    if not gold:
        raise RewardError(f"math-verify cannot parse the reference answer {reference!r}; fix: write it "
                          f"as a number or LaTeX (e.g. \\frac{{1}}{{2}})")
    predicted = parse(final_answer(completion), parsing_timeout=None)
    return {"correct": float(bool(predicted) and verify(gold, predicted, timeout_seconds=None))}


def strip_fence(completion: str) -> str:
    """The code of the last ```python fence of `completion`, else the completion itself."""
    fenced = _FENCE.findall(completion)
    return fenced[-1] if fenced else completion


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A loaded reward: `name` (the config's spelling), `fn`, and how it is called. Built-ins take
    (completion, answer); a user's function takes (completion, example). `uses_sandbox`: it runs
    code (`code_tests`), so the task needs a sandbox."""

    name: str
    fn: Callable[..., Any]
    builtin: bool = False
    uses_sandbox: bool = False

    async def score(self, completion: str, example: dict, *, answer_field: str, sandbox=None,
                    timeout_s: float = 30.0) -> Reward:
        """The reward of `completion` for `example`. Raises RewardFailure (raised, hung past
        `timeout_s`, or garbage). Cancellation: no reward; a sync function's worker thread is
        abandoned and runs on to its end."""
        try:
            with trio.fail_after(timeout_s):
                value = await self._call(completion, example, answer_field, sandbox)
        except trio.TooSlowError:
            raise RewardFailure(f"reward function {self.name!r} did not return within {timeout_s} s") from None
        except RewardFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's reward may raise anything
            raise RewardFailure(f"reward function {self.name!r} raised {type(exc).__name__}: {exc}"[:300]) from exc
        return self._to_reward(value)

    async def _call(self, completion: str, example: dict, answer_field: str, sandbox) -> Any:
        if self.uses_sandbox:
            return await self.fn(completion, example[answer_field], sandbox)
        args = (completion, example[answer_field]) if self.builtin else (completion, dict(example))
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(*args)
        value = await trio.to_thread.run_sync(lambda: self.fn(*args), abandon_on_cancel=True)
        if inspect.isawaitable(value):   # a sync function that returns a coroutine
            value = await value
        return value

    def _to_reward(self, value: Any) -> Reward:
        if isinstance(value, (int, float)):   # bool included: True is 1.0
            value = {"reward": float(value)}
        ok = isinstance(value, dict) and value and all(
            isinstance(k, str) and isinstance(x, (int, float)) and math.isfinite(x) for k, x in value.items())
        if not ok:
            raise RewardFailure(f"reward function {self.name!r} returned {str(value)[:80]!r}; fix: return a "
                                f"finite float or a non-empty dict of name -> finite float")
        return Reward({k: float(x) for k, x in value.items()})


async def _code_tests(completion: str, tests: Any, sandbox) -> dict[str, float]:
    """The fraction of the reference's tests passed, judged on the host (`comparison_tests`): the
    jail evaluates the calls, the expected values never enter it, so no solution forges a pass.
    A sandbox failure follows the sandbox rule (module docstring): 0 if the code may have caused it,
    else one retry, then RewardFailure."""
    if sandbox is None:
        raise RewardFailure("reward function 'code_tests' needs a sandbox and the environment has none; "
                            "fix: add a SandboxActor to the run (the dataset task then asks for it)")
    try:
        reference = comparison_tests(str(tests))
    except TestFileError as exc:
        raise RewardFailure(f"reward function 'code_tests': the example's test file: {exc}") from None
    calls, _ = reference.flat()
    code, files = calls_request(strip_fence(final_answer(completion)), calls, imports=list(reference.imports))
    result = await _started_run(sandbox, code, files)
    field = (lambda name: result.get(name)) if isinstance(result, dict) else (lambda name: getattr(result, name, None))
    if str(getattr(field("status"), "value", field("status"))) == "sandbox_error":
        _log.warning("code_tests: the solution's run ended as sandbox_error (%s); scored 0, as the code may "
                     "have caused it", field("error") or "no detail")
        return {"correct": 0.0}
    report = reference.judge(result)
    return {"correct": report.num_passed / len(reference.tests)}


async def _started_run(sandbox, code: str, files: dict[str, bytes], num_tries: int = 2):
    """`sandbox.exec`'s result of a run the sandbox started; RewardFailure after `num_tries` runs it
    could not start (a raise, or an error that begins with NOT_STARTED), none of them the code's."""
    for attempt in range(1, num_tries + 1):
        try:
            result = await sandbox.exec(code, files=files)
        except Exception as exc:  # noqa: BLE001 - the sandbox's own failure, or its transport's
            reason = f"the sandbox call raised {type(exc).__name__}: {exc}"
        else:
            error = result.get("error") if isinstance(result, dict) else getattr(result, "error", "")
            if not str(error or "").startswith(NOT_STARTED):
                return result
            reason = f"the sandbox could not start the run ({error})"
        _log.warning("code_tests: %s (try %d of %d)", reason[:300], attempt, num_tries)
    raise RewardFailure(f"reward function 'code_tests': {reason}"[:300] + "; not the code's failure, so the "
                        "sample is dropped, not scored 0")


_BUILTINS: dict[str, Callable[..., Any]] = {"exact": exact, "last_integer": last_integer_match,
                                             "math": math_match, "code_tests": _code_tests}


def load_reward(spec: str) -> RewardFunction:
    """A built-in reward by name, or a user's function by import path 'package.module:function'."""
    if spec in _BUILTINS:
        return RewardFunction(spec, _BUILTINS[spec], builtin=True,
                              uses_sandbox=spec == "code_tests")
    if ":" not in spec:
        raise RewardError(f"unknown reward {spec!r}; fix: use a built-in {list(_BUILTINS)} or an "
                          f"import path 'package.module:function' of fn(completion, example) -> float | dict")
    try:
        fn = import_object(spec)
    except ImportError as exc:
        raise RewardError(f"cannot load reward {spec!r}: {exc}; fix: check the import path") from exc
    if not callable(fn):
        raise RewardError(f"reward {spec!r} is a {type(fn).__name__}, not a function; fix: point at "
                          f"fn(completion, example) -> float | dict[str, float]")
    return RewardFunction(spec, fn)
