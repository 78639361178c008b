"""The grader of `finance_docs`: the policy's final answer text against the expected value.

    grade("... so the margin is 41.2%. <answer>41.2%</answer>", expected, tolerance_units=1.0)
    # -> Grade(correct=True, answer="41.2%", reason="", cause="ok")

It reads only the final turn's text, never a file or a tool's output, so nothing the policy
runs can change a verdict. The answer is the content of the turn's last complete
`<answer>...</answer>`; a turn without one is not correct. That content must be one number
with an optional unit (`units.read_answer`); it is converted to the unit the question asked
in (`units.in_asked_unit`: a bare number is read in that unit; a unit of another kind is
wrong) and is correct iff

    |value - exact| <= tolerance_units * 10 ** -decimals      (in the asked unit)

where `exact` is the value computed from the report's figures and `decimals` the decimal places
the question asked for (one for amounts in millions, percentages and days; two for ratios and
per-share amounts). With the default `tolerance_units = 1.0`, 41.2% and 41.3% are right for
41.24%, 41.0% is not; $168.9 million and $169.0 million are right for $168.904 million, $169 is
too, $170 million is not.

`expected` is the task's `answer` map: {"value": the exact value in the asked unit (float),
"unit": a name of `units.ANSWER_UNITS`}.
"""
from __future__ import annotations

import dataclasses
import re

from .units import ANSWER_UNITS, in_asked_unit, read_answer

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Grade:
    """A verdict: `correct`; `answer`, the graded text (None: no complete answer tag); `reason`
    why it is not correct ("" when it is); `cause`, the kind of verdict for counting (the episode's
    info["cause"]): ok, no_answer, not_a_number, wrong_unit, out_of_tolerance."""

    correct: bool
    answer: str | None
    reason: str = ""
    cause: str = "ok"


def final_answer(text: str) -> str | None:
    """The content of the last complete `<answer>...</answer>` of `text`, stripped, or None."""
    found = ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def grade_answer(answer: str, expected: dict, *, tolerance_units: float = 1.0) -> Grade:
    """Grade one answer's text (the content of the answer tag) against `expected`."""
    unit = ANSWER_UNITS[expected["unit"]]
    read = read_answer(answer)
    if read is None:
        return Grade(False, answer, f"not one number with a unit, as in {unit.example!r}", "not_a_number")
    value = in_asked_unit(read, unit)
    if value is None:
        return Grade(False, answer, f"a {read.kind} unit, but the question asks {unit.phrase}", "wrong_unit")
    error = abs(float(value) - float(expected["value"]))
    tolerance = max(tolerance_units * 10.0 ** -unit.decimals, 1e-9 * abs(float(expected["value"])))
    if error > tolerance:
        return Grade(False, answer, f"off by {error:.4g} {unit.name}, more than the tolerance {tolerance:g}",
                     "out_of_tolerance")
    return Grade(True, answer)


def grade(text: str, expected: dict, *, tolerance_units: float = 1.0) -> Grade:
    """Grade a final turn: its last complete answer tag (module docstring)."""
    answer = final_answer(text)
    if answer is None:
        return Grade(False, None, "no <answer>...</answer> in the final turn", "no_answer")
    return grade_answer(answer, expected, tolerance_units=tolerance_units)
