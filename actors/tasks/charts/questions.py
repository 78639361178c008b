"""Questions about a chart, in three levels, and the formula of each.

    query = make_query(chart, level=3, rng=random.Random(...))
    # {"op": "percent_change", "reads": [["Revenue", "Q1"], ["Revenue", "Q4"]], "decimals": 1,
    #  "question": "By what percentage did revenue change from Q1 to Q4? ... Round to one decimal place."}
    exact_value(query, chart)   # the formula on the chart's figures

A query names the values it reads (`reads`: [series, category] pairs, in the formula's order) and
its operation (`op`, a key of `FORMULAS`); the answer is in the unit the question states, asked to
`decimals` places (0: a whole number; every value on a chart is whole, so a read, a difference, a
sum or a total is exact; `ONE_DECIMAL` ops are asked to one place).

| level | ops | reads |
|---|---|---|
| 1 | `value` | one value |
| 2 | `change` (over time), `difference` (between categories, or revenue minus costs), `sum` (additive units), `range` (highest minus lowest) | two values (`range`: finds the two extremes) |
| 3 | `percent_change` (over time, not of a percentage), `average`, `total` and `share` (additive units), `margin` (revenue and costs: profit as % of revenue) | several values and arithmetic |
"""
from __future__ import annotations

import random
from fractions import Fraction
from typing import Callable

from .figures import UNITS, Chart

FORMULAS: dict[str, Callable[[list[Fraction]], Fraction]] = {
    "value": lambda v: v[0],
    "change": lambda v: v[1] - v[0],
    "difference": lambda v: v[0] - v[1],
    "sum": lambda v: v[0] + v[1],
    "range": lambda v: max(v) - min(v),
    "percent_change": lambda v: (v[1] - v[0]) / v[0] * 100,
    "average": lambda v: sum(v, Fraction(0)) / len(v),
    "total": lambda v: sum(v, Fraction(0)),
    "share": lambda v: v[0] / sum(v[1:], Fraction(0)) * 100,
    "margin": lambda v: (v[0] - v[1]) / v[0] * 100,
}
LEVEL_OPS = {
    1: ("value",),
    2: ("change", "difference", "sum", "range"),
    3: ("percent_change", "average", "total", "share", "margin"),
}
ONE_DECIMAL = ("percent_change", "average", "share", "margin")   # the others are whole numbers
PLURAL_METRICS = {"Units sold", "Monthly active users", "Operating costs"}


def applies(op: str, chart: Chart) -> bool:
    """Whether `op` makes sense on `chart` (a change needs time; a total needs an additive unit; a
    margin needs revenue and costs)."""
    additive, over_time, two = UNITS[chart.unit].additive, chart.axis in ("quarter", "year"), len(chart.series) == 2
    return {"value": True, "change": over_time, "difference": not over_time or two, "sum": additive,
            "range": True, "percent_change": over_time and additive, "average": True, "total": additive,
            "share": additive, "margin": two}[op]


def exact_value(query: dict, chart: Chart) -> Fraction:
    """The exact answer: the query's formula on the values it reads."""
    return FORMULAS[query["op"]]([Fraction(chart.value(s, c)) for s, c in query["reads"]])


def _where(chart: Chart, category: str) -> str:
    return {"segment": f"in the {category} segment", "department": f"in the {category} department"}.get(
        chart.axis, f"in {category}")


def _label(chart: Chart, category: str) -> str:
    return {"segment": f"the {category} segment", "department": f"the {category} department"}.get(chart.axis, category)


def _unit_phrase(chart: Chart, op: str) -> str:
    """The unit the answer is asked in."""
    if op in ("percent_change", "share", "margin"):
        return "percent"
    if chart.unit == "percent" and op in ("change", "difference", "range"):
        return "percentage points"
    return UNITS[chart.unit].answer


def make_query(chart: Chart, level: int, rng: random.Random) -> dict:
    """A question of `level` about `chart`: an op that applies to it, and the categories it reads."""
    op = rng.choice([op for op in LEVEL_OPS[level] if applies(op, chart)])
    first = chart.series[0].name
    metric = first.lower()
    was = "were" if first in PLURAL_METRICS else "was"
    axes = f"{chart.axis}s shown"
    a, b = sorted(rng.sample(range(len(chart.categories)), 2))
    ca, cb = chart.categories[a], chart.categories[b]
    if op in ("value", "difference", "margin") and len(chart.series) == 2:
        c = rng.choice(chart.categories)
        second = chart.series[1].name
        if op == "value":
            name = rng.choice([first, second])
            reads = [[name, c]]
            text = f"What {'were' if name in PLURAL_METRICS else 'was'} {name.lower()} {_where(chart, c)}?"
        elif op == "difference":
            reads = [[first, c], [second, c]]
            text = f"What was {metric} minus {second.lower()} {_where(chart, c)}?"
        else:
            reads = [[first, c], [second, c]]
            text = (f"What was the operating margin {_where(chart, c)}, that is, {metric} minus "
                    f"{second.lower()} as a percentage of {metric}?")
    elif op == "value":
        c = rng.choice(chart.categories)
        reads, text = [[first, c]], f"What {was} {metric} {_where(chart, c)}?"
    elif op == "change":
        reads = [[first, ca], [first, cb]]
        text = f"By how much did {metric} change from {ca} to {cb}? Give a negative number if it fell."
    elif op == "difference":
        if rng.random() < 0.5:
            ca, cb = cb, ca
        reads = [[first, ca], [first, cb]]
        text = (f"How much higher {was} {metric} {_where(chart, ca)} than {_where(chart, cb)}? Give a negative "
                f"number if it was lower.")
    elif op == "sum":
        reads = [[first, ca], [first, cb]]
        text = f"What {was} {metric} {_where(chart, ca)} and {_where(chart, cb)} combined?"
    elif op == "range":
        reads = [[first, c] for c in chart.categories]
        text = f"What is the difference between the highest and the lowest {metric} across the {axes}?"
    elif op == "percent_change":
        reads = [[first, ca], [first, cb]]
        text = f"By what percentage did {metric} change from {ca} to {cb}? Give a negative number if it fell."
    elif op in ("average", "total"):
        reads = [[first, c] for c in chart.categories]
        text = f"What {was} the {op} {metric} across the {axes}?"
    else:   # share
        c = rng.choice(chart.categories)
        reads = [[first, c]] + [[first, x] for x in chart.categories]
        text = f"What share of the total {metric} across the {axes} came from {_label(chart, c)}?"
    decimals = 1 if op in ONE_DECIMAL else 0
    precision = "rounded to one decimal place" if decimals else "as a whole number"
    return {"op": op, "reads": reads, "decimals": decimals, "unit": _unit_phrase(chart, op),
            "question": f"{text} Answer in {_unit_phrase(chart, op)}, {precision}."}
