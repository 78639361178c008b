"""The figures a chart shows: one company metric over quarters, years, segments, regions or
departments, drawn from a seed.

    chart = make_chart(random.Random("charts:17"), kinds=("bar", "line"))
    chart.title          # "Northwind Labs: revenue by quarter, FY2024"
    chart.series[0]      # Series(name="Revenue", values=(412, 455, 431, 502))

Every value is a whole number in the chart's unit (the bars and points carry it as a label), and
the values of a series are distinct, so "the highest" and "the lowest" are one category each. A
`Chart` is plain data on the wire (`to_dict` / `from_dict`).
"""
from __future__ import annotations

import dataclasses
import random

COMPANIES = ("Northwind Labs", "Bluefin Systems", "Cedar & Pine Co.", "Helios Motors", "Quarry Foods",
             "Orbit Logistics", "Maple Health", "Tidewater Energy", "Lumen Retail", "Kestrel Software",
             "Granite Bank", "Juniper Media")
QUARTERS = ("Q1", "Q2", "Q3", "Q4")
SEGMENTS = ("Cloud", "Devices", "Services", "Advertising", "Licensing", "Hardware")
REGIONS = ("North America", "Europe", "Asia Pacific", "Latin America", "Middle East", "Africa")
DEPARTMENTS = ("Engineering", "Sales", "Support", "Marketing", "Finance", "Operations")


@dataclasses.dataclass(frozen=True)
class Unit:
    """A chart's unit: the axis label, how an answer in it is named in a question, and whether
    values add up (a total or a share of revenue means something; of margins it does not)."""

    name: str
    axis: str          # the value axis's label
    answer: str        # "Answer in ..." for a value or a difference
    money: bool        # a $ sign may precede an answer
    additive: bool


UNITS = {unit.name: unit for unit in (
    Unit("usd_millions", "$ millions", "$ millions", money=True, additive=True),
    Unit("percent", "%", "percent", money=False, additive=False),
    Unit("thousand_units", "thousand units", "thousands of units", money=False, additive=True),
    Unit("employees", "employees", "employees", money=False, additive=True),
    Unit("million_users", "million users", "millions of users", money=False, additive=True),
)}


@dataclasses.dataclass(frozen=True)
class Metric:
    """What a chart can show: `name` (a series' name), its unit, its category axis (`axis`, singular;
    "quarter" and "year" are time, so a line chart can show it), the value range of a first draw,
    and `second`: the name of a second series drawn below the first (revenue's operating costs)."""

    name: str
    unit: str
    axis: str
    low: int
    high: int
    second: str | None = None

    @property
    def over_time(self) -> bool:
        return self.axis in ("quarter", "year")


METRICS = (
    Metric("Revenue", "usd_millions", "quarter", 120, 2400),
    Metric("Revenue", "usd_millions", "year", 150, 3000),
    Metric("Revenue", "usd_millions", "year", 200, 3000, second="Operating costs"),
    Metric("Gross margin", "percent", "quarter", 18, 62),
    Metric("Operating margin", "percent", "segment", 4, 45),
    Metric("Revenue", "usd_millions", "segment", 40, 1800),
    Metric("Units sold", "thousand_units", "region", 20, 950),
    Metric("Headcount", "employees", "department", 40, 1500),
    Metric("Monthly active users", "million_users", "quarter", 5, 400),
)


@dataclasses.dataclass(frozen=True)
class Series:
    name: str
    values: tuple[int, ...]   # one per category, in the chart's order; distinct


@dataclasses.dataclass(frozen=True)
class Chart:
    """One chart: `kind` ("bar" or "line"), the company, the metric's unit (a key of `UNITS`), the
    category `axis` (singular) and its `categories` in drawing order, and one or two series (a second
    series is always below the first, category by category). `fiscal_year` names the year of a
    quarterly chart (0 for others)."""

    kind: str
    company: str
    unit: str
    axis: str
    categories: tuple[str, ...]
    series: tuple[Series, ...]
    fiscal_year: int = 0

    @property
    def title(self) -> str:
        names = " and ".join(s.name.lower() for s in self.series)
        year = f", FY{self.fiscal_year}" if self.fiscal_year else ""
        return f"{self.company}: {names} by {self.axis}{year}"

    def value(self, series: str, category: str) -> int:
        """The value of `series` at `category`, as the chart labels it."""
        by_name = {s.name: s for s in self.series}
        return by_name[series].values[self.categories.index(category)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Chart":
        series = tuple(Series(s["name"], tuple(int(v) for v in s["values"])) for s in data["series"])
        return cls(kind=data["kind"], company=data["company"], unit=data["unit"], axis=data["axis"],
                   categories=tuple(data["categories"]), series=series, fiscal_year=int(data["fiscal_year"]))


def _trend(rng: random.Random, num: int, low: int, high: int) -> list[int]:
    """A series over time: a start in the lower half of the range, then steps of -12%..+20%."""
    values = [rng.randint(low, (low + high) // 2)]
    for _ in range(num - 1):
        values.append(max(low, min(high, round(values[-1] * (1 + rng.uniform(-0.12, 0.2))))))
    return values


def _distinct(draw) -> list[int]:
    """Redraw until no two values are equal (at most 100 tries; the ranges make one enough nearly always)."""
    for _ in range(100):
        values = draw()
        if len(set(values)) == len(values):
            return values
    raise AssertionError("no distinct values in 100 draws: a metric's range is too narrow")


def make_chart(rng: random.Random, kinds: tuple[str, ...]) -> Chart:
    """A chart drawn from `rng`, of one of `kinds` (a line chart only for a metric over time)."""
    kind = rng.choice(kinds)
    metric = rng.choice([m for m in METRICS if kind == "bar" or m.over_time])
    company = rng.choice(COMPANIES)
    fiscal_year = 0
    categories: tuple[str, ...]
    if metric.axis == "quarter":
        categories, fiscal_year = QUARTERS, rng.randint(2019, 2025)
    elif metric.axis == "year":
        start, num_years = rng.randint(2015, 2020), rng.randint(4, 6)
        categories = tuple(str(start + i) for i in range(num_years))
    else:
        pool = {"segment": SEGMENTS, "region": REGIONS, "department": DEPARTMENTS}[metric.axis]
        categories = tuple(rng.sample(pool, rng.randint(3, 5)))
    num = len(categories)
    if metric.over_time:
        first = _distinct(lambda: _trend(rng, num, metric.low, metric.high))
    else:
        first = _distinct(lambda: [rng.randint(metric.low, metric.high) for _ in range(num)])
    series = [Series(metric.name, tuple(first))]
    if metric.second is not None:
        second = _distinct(lambda: [round(v * rng.uniform(0.6, 0.92)) for v in first])
        series.append(Series(metric.second, tuple(second)))
    return Chart(kind=kind, company=company, unit=metric.unit, axis=metric.axis, categories=tuple(categories),
                 series=tuple(series), fiscal_year=fiscal_year)
