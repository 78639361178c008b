"""The grader of `charts`: the number in the policy's final text against the exact value.

    grade("Q4 minus Q1: 775 - 656 = 119. Answer: $119", 119.0, tolerance=0.5)   # Grade(True, ...)
    read_number("a fall of -1,234.5%")                                         # -1234.5

The answer is the **last number** of the graded text: in the image form the whole reply, or the
content of its last complete `<answer>...</answer>` when it has one; in the tool form the content
of the answer tag (`env.py`). A number may carry a sign (`-` or `\u2212`, before or after a currency
sign), a currency sign (`$`, `\u20ac`, `\u00a3`), thousands commas (`1,234.5`) and a `%` or unit word after
it, which are ignored: the number is read in the unit the question asks for (a question asked in
$ millions reads `$1.2 billion` as 1.2). Digits glued to letters are not numbers (`Q4`, `FY2024`),
so "from Q1 to Q4" does not end a reply with 4. A text without a number is not correct.

Correct iff `|number - exact| <= tolerance` (absolute, in the asked unit; default 0.5, so any
rounding of the exact value to the asked precision is right and a misread whole-number value is
wrong wherever it enters the answer in full: a read, a difference, a sum).
"""
from __future__ import annotations

import dataclasses
import re

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"(?<![\w.,])([-\u2212]?)\s?[$\u20ac\u00a3]?\s?([-\u2212]?)(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")
SLACK = 1e-9   # float round-off in the comparison


@dataclasses.dataclass(frozen=True)
class Grade:
    """A verdict: `correct`; `value`, the number read (None: none); `reason` why it is not correct
    ("" when it is)."""

    correct: bool
    value: float | None
    reason: str = ""


def read_number(text: str) -> float | None:
    """The last number of `text` (module docstring), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    sign, sign_after_currency, digits, fraction = found[-1]
    value = float(digits.replace(",", "") + fraction)
    return -value if (sign or sign_after_currency) else value


def graded_text(reply: str) -> str:
    """What the image form grades: the last complete answer tag's content, else the whole reply."""
    found = ANSWER_TAG.findall(reply)
    return found[-1] if found else reply


def grade(text: str, exact: float, *, tolerance: float = 0.5) -> Grade:
    """Grade `text` (already the graded part: `graded_text`, or an answer tag's content)."""
    value = read_number(text)
    if value is None:
        return Grade(False, None, "no number in the answer")
    error = abs(value - exact)
    if error > tolerance + SLACK:
        return Grade(False, value, f"off by {error:.4g}, more than the tolerance {tolerance:g}")
    return Grade(True, value)
