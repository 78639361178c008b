"""The units an answer is asked in, and how an answer's text is read as a number with a unit.

    unit = ANSWER_UNITS["percent"]            # asked "as a percentage, to one decimal place"
    read_answer("12.5%")                      # -> ReadAnswer(value=Fraction(1, 8), kind="fraction", ...)
    read_answer("$1.2 million")               # -> 1,200,000 dollars;  "1,200 thousand" the same

The answer format (the prompt states it): one number, with an optional sign (`-12.5%`, or an
accountant's `(12.5)`), optional thousands commas, an optional `$`, and an optional unit word:
`%`/`percent`, `x`/`times`, `thousand`/`k`, `million`/`m`/`mn`, `billion`/`bn`, `days`,
`per share`. Each is read into a kind (money in dollars, a dimensionless fraction, days):

- a unit word converts: `$1.2 million`, `1,200 thousand` and `$1,200,000` are one amount; `12.5%`
  and `0.125x` one fraction;
- a number with no unit word is read in the unit the question asks for: asked in millions,
  `1,234.5` is $1,234.5 million; asked as a percentage, `12.5` is 12.5% and `0.125` is 0.125%
  (not 12.5%). A `$` alone names money but no scale: asked in millions, `$1,234.5` is $1,234.5
  million;
- a unit of another kind than the question's (a percentage for an amount, days for a ratio) is
  wrong, whatever the number.

Anything else (two numbers, words around the number, a range) is no answer.
"""
from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

MONEY, FRACTION, DAYS = "money", "fraction", "days"


@dataclasses.dataclass(frozen=True)
class AnswerUnit:
    """A unit a question asks in: its kind, `scale` (one of it in the kind's base: dollars, a
    fraction, days), the `decimals` asked, the words the question uses and an example answer."""

    name: str
    kind: str
    scale: Fraction
    decimals: int
    phrase: str
    example: str

    def format(self, value: float) -> str:
        """`value` (in this unit) written as the example is, rounded to `decimals`."""
        text = f"{abs(value):,.{self.decimals}f}"
        sign = "-" if round(value, self.decimals) < 0 else ""
        if self.kind == MONEY:
            suffix = {10**6: " million", 10**3: " thousand", 1: ""}[int(self.scale)]
            return f"{sign}${text}{suffix}"
        return f"{sign}{text}" + {"percent": "%", "days": " days"}.get(self.name, "")


ANSWER_UNITS = {unit.name: unit for unit in (
    AnswerUnit("usd_millions", MONEY, Fraction(10**6), 1, "in millions of US dollars, to one decimal place",
               "$1,234.5 million"),
    AnswerUnit("usd_thousands", MONEY, Fraction(10**3), 1, "in thousands of US dollars, to one decimal place",
               "$456.7 thousand"),
    AnswerUnit("usd_per_share", MONEY, Fraction(1), 2, "in US dollars per share, to two decimal places", "$1.23"),
    AnswerUnit("percent", FRACTION, Fraction(1, 100), 1, "as a percentage, to one decimal place", "12.5%"),
    AnswerUnit("ratio", FRACTION, Fraction(1), 2, "as a ratio, to two decimal places", "1.85"),
    AnswerUnit("days", DAYS, Fraction(1), 1, "in days, to one decimal place", "45.2 days"),
)}

# unit word -> (kind, scale in the kind's base); None: money, scale from the question
UNIT_WORDS: dict[str, tuple[str, Fraction | None]] = {
    "%": (FRACTION, Fraction(1, 100)), "percent": (FRACTION, Fraction(1, 100)),
    "per cent": (FRACTION, Fraction(1, 100)),
    "x": (FRACTION, Fraction(1)), "times": (FRACTION, Fraction(1)),
    "k": (MONEY, Fraction(10**3)), "thousand": (MONEY, Fraction(10**3)), "thousands": (MONEY, Fraction(10**3)),
    "m": (MONEY, Fraction(10**6)), "mn": (MONEY, Fraction(10**6)), "mm": (MONEY, Fraction(10**6)),
    "million": (MONEY, Fraction(10**6)), "millions": (MONEY, Fraction(10**6)),
    "bn": (MONEY, Fraction(10**9)), "billion": (MONEY, Fraction(10**9)), "billions": (MONEY, Fraction(10**9)),
    "day": (DAYS, Fraction(1)), "days": (DAYS, Fraction(1)),
}
_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"
_WORDS = "|".join(sorted((re.escape(w) for w in UNIT_WORDS), key=len, reverse=True))
_ANSWER = re.compile(
    rf"^(?P<open>\()?(?P<sign>[-+\u2212])?(?P<cur>\$|us\$|usd)?(?P<sign2>[-+\u2212])?(?P<num>{_NUMBER})"
    rf"(?:\s*(?P<word>{_WORDS}))?(?:\s*(?:us dollars|dollars|usd))?(?:\s*per share)?(?P<close>\))?$")


@dataclasses.dataclass(frozen=True)
class ReadAnswer:
    """An answer's number and unit. `value` is in the kind's base when `kind` is set by a unit
    word (`scale_given`), else the bare number (to be read in the asked unit); `money`: a `$` or a
    currency word was written."""

    number: Fraction
    kind: str | None
    scale: Fraction | None
    money: bool


def read_answer(text: str) -> ReadAnswer | None:
    """`text` as one number with an optional unit (module docstring), or None when it is not."""
    compact = re.sub(r"\s+", " ", text.strip().lower()).replace("us $", "us$")
    match = _ANSWER.match(compact)
    if match is None or bool(match["open"]) != bool(match["close"]):
        return None
    if sum(bool(match[group]) for group in ("sign", "sign2", "open")) > 1:
        return None                      # "-$-5", "(-5)": no reading
    number = Fraction(match["num"].replace(",", ""))
    if match["open"] or (match["sign"] or match["sign2"] or "+") in "-\u2212":
        number = -number
    word = match["word"]
    kind, scale = UNIT_WORDS[word] if word else (None, None)
    money = bool(match["cur"]) or bool(re.search(r"(dollars|usd)", compact))
    if money and kind not in (None, MONEY):
        return None                      # "$12%": no reading
    return ReadAnswer(number, MONEY if money and kind is None else kind, scale, money)


def in_asked_unit(answer: ReadAnswer, unit: AnswerUnit) -> Fraction | None:
    """The answer's value in `unit` (the question's), or None when its unit is of another kind."""
    if answer.kind is not None and answer.kind != unit.kind:
        return None
    if answer.scale is None:             # no unit word: the asked unit
        return answer.number
    return answer.number * answer.scale / unit.scale
