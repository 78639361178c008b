"""Arithmetic graded by a judge model: `task = "arithmetic_judged"`.

The arithmetic task (actors/tasks/arithmetic.py: the same problems, splits, knobs and
demonstrations) whose reward is a judge's rubric score instead of a program's check, so the
plumbing of judge rewards (a judge scorer, its rubric, the guard, shared verdicts, failures that
leave a sample out of its group's baseline) runs on a task whose right answers are known. Reward
components (`ArithmeticJudgedEnv`):

    judge    the judge's reward for the final turn, by `rubric` (PASS/FAIL: 1 or 0), weight 1
    correct  the programmatic check (arithmetic's): 1.0 iff the answer is the value,
             weight 0: it trains nothing, and says how often the judge agrees with it
    format   (answer_format = "tagged" only) as arithmetic's, weight `format_weight`

Options (`ArithmeticJudgedOptions`): arithmetic's, with `answer_format = "plain"` by default
(the bare question, one reply without a tool), plus `judge` (the judge scorer's name, which the
environment actor's `scorers` option must list), `rubric` (a `Rubric`; the default below asks
whether the final answer is right, PASS/FAIL) and `judge_timeout_s`. The judge sees the question
as the context and the final turn's text as the output, fenced and escaped
(actors/scorer/judge.py). Every episode of an environment actor asks one shared Judge
(`Scorers.judge`), so a group that repeats an answer asks the judge once.

Agreement: `judge_agreement(samples)` is the share of the samples whose judge verdict (reward >=
0.5) equals the check, over a run's samples.jsonl rows (actors/orchestrator/sample_log.py) or
any rows with both components:

    python -c "from postrain.actors.tasks.arithmetic_judged import judge_agreement as a; print(a('runs/arithmetic_judged'))"

A sample whose judge gave no verdict is not among them: its rollout failed (JudgeFailed), and the
ledger holds it as dropped with the reason.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import Field

from postrain.core.errors import PostrainError
from postrain.core.jsonl import read_jsonl

from ..env.api import EnvironmentContractError, Reward, StepResult
from ..scorer.rubric import PassFailVerdict, Rubric
from .arithmetic import ArithmeticEnv, ArithmeticOptions

SAMPLES_FILE = "samples.jsonl"   # a run folder's sample log (actors/orchestrator/sample_log.py)
DEFAULT_RUBRIC = Rubric(
    "Is the final answer to the question correct? Work out the value of the arithmetic expression in "
    "the question yourself, then find the final answer in the output (its last number). PASS when the "
    "final answer equals the value, FAIL when it differs or the output gives no number. Judge the "
    "final answer only: the working before it and how it is written do not matter.",
    PassFailVerdict(), max_new_tokens=256)


class AgreementError(PostrainError, ValueError):
    """No sample to compute a judge's agreement over (no rows with both components)."""


class ArithmeticJudgedOptions(ArithmeticOptions):
    """The task options of `arithmetic_judged`: arithmetic's (`ArithmeticOptions`), plain answers
    by default, and the judge's."""

    answer_format: Literal["tagged", "plain"] = Field(
        "plain", description="plain: the bare question, one reply without a tool (the judge reads it); "
        "tagged: Python tool calls, then <answer>N</answer> (the judge reads the final turn)")
    judge: str = Field("judge", description="the judge scorer's name: a ScorerActor with serves = \"generate\" "
                       "that the environment actor's scorers option lists")
    rubric: Rubric = Field(DEFAULT_RUBRIC, description="what the judge is asked: { instructions = \"...\", "
                           "verdict = { kind = \"pass_fail\" } } (docs/scorers.md); default: is the final "
                           "answer correct, PASS/FAIL")
    judge_timeout_s: float = Field(120.0, gt=0, description="one judge call's time limit, seconds; past it "
                                   "the sample is dropped (JudgeFailed)")


class ArithmeticJudgedEnv(ArithmeticEnv):
    """Arithmetic whose reward is a judge's verdict on the final turn (module docstring)."""

    options_model = ArithmeticJudgedOptions
    options: ArithmeticJudgedOptions

    async def reset(self, task: dict) -> list[dict]:
        """Arithmetic's first messages, once the judge scorer is known to be there. Does not wait."""
        if self.options.judge not in self.scorers:
            have = ", ".join(sorted(self.scorers)) or "none"
            raise EnvironmentContractError(
                f"task 'arithmetic_judged' asks the judge scorer {self.options.judge!r}, which this environment "
                f"was not given (it has: {have}); fix: add a ScorerActor named {self.options.judge!r} with "
                f"serves = \"generate\" and list it in the environment actor's options, scorers = "
                f"[{self.options.judge!r}] (or set task_options.judge to its name)")
        self.question = str(task["question"])
        return await super().reset(task)

    def _judged(self, check: Reward, judge: float) -> Reward:
        components = {"judge": judge, "correct": check.components.get("correct", 0.0)}   # correct: weight 0
        weights = {"correct": 0.0}
        if "format" in check.components:
            components["format"] = check.components["format"]
            weights["format"] = check.weights.get("format", self.options.format_weight)
        return Reward(components, weights)

    async def step(self, action: str) -> StepResult:
        """Arithmetic's step; the final one is judged. A judge that gives no verdict raises
        JudgeFailed (the sample is dropped). Cancellation: as arithmetic's, and as `Judge.judge`."""
        result = await super().step(action)
        if not result.done:
            return result
        assert result.reward is not None, "arithmetic's final step has its reward"
        judge = self.scorers.judge(self.options.judge, self.options.rubric, timeout_s=self.options.judge_timeout_s)
        verdict = await judge.judge(action, context=self.question)
        return StepResult(None, True, self._judged(result.reward, verdict.reward),
                          {**result.info, "judge_verdict": verdict.call.verdict})

    async def truncated(self) -> Reward:
        """No answer in time: nothing to judge, and not correct. Does not wait (cancel-safe)."""
        return self._judged(await super().truncated(), 0.0)


def judge_agreement(samples: str | Path | Iterable[dict]) -> float:
    """The share of samples whose judge verdict (the `judge` component >= 0.5) agrees with the
    programmatic check (`correct` >= 0.5). `samples`: rows as samples.jsonl holds them (their
    `components`), a samples.jsonl file, or a run folder holding one. Rows without both
    components (another task's, a truncated log line) are left out; AgreementError when none
    is left."""
    if isinstance(samples, (str, Path)):
        path = Path(samples)
        samples = read_jsonl(path / SAMPLES_FILE if path.is_dir() else path)
    agree = total = 0
    for row in samples:
        components = row.get("components") or {}
        judge, check = components.get("judge"), components.get("correct")
        if not (isinstance(judge, (int, float)) and isinstance(check, (int, float))):
            continue
        if math.isnan(judge) or math.isnan(check):
            continue
        total += 1
        agree += (judge >= 0.5) == (check >= 0.5)
    if not total:
        raise AgreementError("no sample has both a 'judge' and a 'correct' component; fix: pass the rows (or the "
                             "run folder) of an arithmetic_judged run whose samples were judged")
    return agree / total
