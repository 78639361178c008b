"""The reference solver of `charts`: the answer from the chart's figures (not its image), written
as a model would write it.

    reply = solve(chart, query)    # "775 - 656 = 119.\nAnswer: 119"; "... <answer>18.1</answer>" (tool form)

It reads each value the query names by its series and category label (`Chart.value`, the number
the chart labels), applies the question's formula, rounds to the precision the question asks for
and writes the working and the answer with the unit's signs ($, thousands commas, %). The grader
must score it 1.0 on every question (tests/actors/tasks/test_charts.py): each question is answerable
from the values shown, at the stated precision, within the tolerance, and the grader reads such
replies.
"""
from __future__ import annotations

from fractions import Fraction

from .figures import UNITS, Chart
from .questions import FORMULAS


def answer_text(value: float, decimals: int, unit: str, money: bool) -> str:
    """`value` rounded to `decimals`, with thousands commas, a `$` for money and a `%` for percent."""
    rounded = round(value, decimals)
    text = f"{abs(rounded):,.{decimals}f}"
    sign = "-" if rounded < 0 else ""
    if unit in ("percent", "percentage points"):
        return f"{sign}{text}%"
    return f"{sign}${text}" if money else f"{sign}{text}"


def solve(chart: Chart, query: dict, *, form: str = "image") -> str:
    """The solver's reply to `query` about `chart`: its reads, then the answer (module docstring)."""
    values = [chart.value(series, category) for series, category in query["reads"]]
    exact = float(FORMULAS[query["op"]]([Fraction(v) for v in values]))
    answer = answer_text(exact, query["decimals"], query["unit"], UNITS[chart.unit].money and query["unit"] != "percent")
    reads = ", ".join(f"{series} {category}: {value:,}" for (series, category), value in zip(query["reads"], values))
    if form == "tool":
        return f"From the chart: {reads}. {query['op'].replace('_', ' ')} = <answer>{answer}</answer>"
    return f"From the chart: {reads}.\n{query['op'].replace('_', ' ').capitalize()}: {answer}\nAnswer: {answer}"
