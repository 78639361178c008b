"""The questions of `finance_docs`: templates x parameters (the variants), in three levels.

    variants(level=2, num_years=3)           # -> [Variant("growth", ("income", "Revenue")), ...]
    query = make_query(variant, company, rng)  # {"template", "params", "years"}: plain data
    question_text(query)                     # "By what percentage did revenue grow from FY2022 to ..."
    solve(query, figures)                    # -> Solution(value in the asked unit, reasoning steps)

A template is a formula over figures read from a report: `solve` runs it on a `Figures` (the
generator's numbers, `CompanyFigures`, to set the expected answer; the figures parsed back from
the rendered text, `solver.TextFigures`, for the reference solver). The formula is one code
path; where its figures come from is the point: the solver reads only the text. Each reading
is a reasoning step (`Revenue, FY2023: 168,904 (US$ thousands) = $168.904 million`), so a
solution is also a demonstration's working.

Levels: 1 lookups and one-step sums in one statement (answers in $ millions: the table's unit
is often not the asked one); 2 growth, margins, ratios and compound growth within a statement;
3 across statements (returns, cash conversion, working-capital days, a cash check), the notes
(per share, per employee, a segment's share) and the restatement (its size, and growth as
previously reported). `VARIANTS` lists every variant; a report too short for one (compound
growth needs three years) skips it.
"""
from __future__ import annotations

import dataclasses
import random
from fractions import Fraction
from typing import Callable, Protocol

from .company import BALANCE, CASH_FLOW, INCOME, NOTES, Company
from .units import ANSWER_UNITS

Number = Fraction | float


@dataclasses.dataclass(frozen=True)
class Figure:
    """A figure as read: `value` (dollars for an amount; a count of people or shares) and how
    the report shows it (`shown`)."""

    value: Fraction
    shown: str


class Figures(Protocol):
    """Where a solution's figures come from (the generator's numbers or the rendered text)."""

    def amount(self, statement: str, label: str, year: int) -> Figure: ...
    def segment_revenue(self, segment: str, year: int) -> Figure: ...
    def employees(self, year: int) -> Figure: ...
    def diluted_shares(self, year: int) -> Figure: ...
    def previously_reported(self, label: str, year: int) -> Figure: ...


@dataclasses.dataclass(frozen=True)
class Solution:
    """`value` in the question's unit (exact where the formula is rational), the working, and
    what was read (`Work.reads`, each once, in order)."""

    value: Number
    steps: tuple[str, ...]
    reads: tuple[tuple[str, str], ...]


def millions(value: Fraction) -> str:
    """Dollars as millions, exactly (`168904000` -> `168.904`)."""
    number = value / 10**6
    text = f"{float(number):,.3f}".rstrip("0").rstrip(".")
    assert Fraction(text.replace(",", "")) == number, (value, text)
    return text


class Work:
    """The working of one solution: each figure read becomes a step; values in $ millions."""

    def __init__(self, figures: Figures) -> None:
        self.figures = figures
        self.steps: list[str] = []
        self.reads: list[tuple[str, str]] = []   # (statement, label) or ("notes", the note's title), in order

    def amount(self, statement: str, label: str, year: int) -> Fraction:
        figure = self.figures.amount(statement, label, year)
        self.reads.append((statement, label))
        self.steps.append(f"{label}, FY{year}: {figure.shown} = ${millions(figure.value)} million")
        return figure.value / 10**6

    def note(self, what: str, figure: Figure, title: str, as_money: bool = True) -> Fraction:
        """A figure of the note titled `title` (`Segments`, `Employees`, ...)."""
        self.reads.append((NOTES, title))
        if as_money:
            self.steps.append(f"{what} (notes): {figure.shown} = ${millions(figure.value)} million")
            return figure.value / 10**6
        self.steps.append(f"{what} (notes): {figure.shown}")
        return figure.value

    def done(self, formula: str, value: Number, unit: str) -> Solution:
        self.steps.append(f"{formula} = {ANSWER_UNITS[unit].format(float(value))}")
        return Solution(value, tuple(self.steps), tuple(dict.fromkeys(self.reads)))


def _m(x: Number) -> str:
    return f"{float(x):,.6g}" if isinstance(x, float) else millions(Fraction(x) * 10**6)


@dataclasses.dataclass(frozen=True)
class Template:
    """A question template: `ask(params, years)` its text (without the unit sentence), `unit`
    the answer's unit, `years` how a question picks its fiscal years ("one": any year; "pair":
    a year and the one before; "span": first and last, needing three; "last"; "restated": the
    restated year and the next), `params` the variants' parameters, `solve` the formula."""

    name: str
    level: int
    unit: str
    years: str
    params: tuple[tuple[str, ...], ...]
    ask: Callable[[tuple[str, ...], list[int]], str]
    solve: Callable[[Work, tuple[str, ...], list[int]], Solution]

    def fits(self, num_years: int) -> bool:
        return num_years >= (3 if self.years == "span" else 2)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One template with one choice of its parameters (a line item); `key` names it in a task."""

    template: str
    params: tuple[str, ...]

    @property
    def key(self) -> str:
        return ":".join([self.template, *self.params])


def _lower(label: str) -> str:
    return label if label.startswith("Shareholders") else label[0].lower() + label[1:]


def _at(statement: str, year: int) -> str:
    return f"at the end of FY{year}" if statement == BALANCE else f"in FY{year}"


# -- level 1 ---------------------------------------------------------------------------------
LOOKUP_ITEMS = tuple((INCOME, label) for label in (
    "Revenue", "Cost of revenue", "Gross profit", "Selling, general and administrative", "Research and development",
    "Operating income", "Interest expense", "Income tax expense", "Net income")) + tuple((BALANCE, label) for label in (
        "Cash and cash equivalents", "Accounts receivable", "Inventory", "Total current assets",
        "Property, plant and equipment, net", "Total assets", "Accounts payable", "Total current liabilities",
        "Long-term debt", "Total liabilities", "Shareholders' equity")) + (
    (CASH_FLOW, "Net cash from operating activities"),)
CHANGE_ITEMS = ((INCOME, "Revenue"), (INCOME, "Operating income"), (INCOME, "Net income"),
                (BALANCE, "Cash and cash equivalents"), (BALANCE, "Total assets"), (BALANCE, "Long-term debt"),
                (BALANCE, "Shareholders' equity"))


def _lookup(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    value = w.amount(p[0], p[1], y[0])
    return w.done(f"{p[1]}, FY{y[0]}", value, "usd_millions")


def _change(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    before, after = w.amount(p[0], p[1], y[0]), w.amount(p[0], p[1], y[1])
    return w.done(f"change = {_m(after)} - {_m(before)}", after - before, "usd_millions")


def _capex(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    spent = -w.amount(CASH_FLOW, "Capital expenditures", y[0])
    return w.done("capital expenditures (an outflow, shown in parentheses)", spent, "usd_millions")


def _operating_expenses(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    parts = [w.amount(INCOME, label, y[0]) for label in
             ("Selling, general and administrative", "Research and development", "Depreciation and amortization")]
    return w.done(" + ".join(_m(x) for x in parts), sum(parts, Fraction(0)), "usd_millions")


# -- level 2 ---------------------------------------------------------------------------------
GROWTH_ITEMS = ((INCOME, "Revenue"), (INCOME, "Gross profit"), (INCOME, "Operating income"), (INCOME, "Net income"),
                (INCOME, "Selling, general and administrative"), (INCOME, "Research and development"),
                (BALANCE, "Total assets"), (BALANCE, "Shareholders' equity"),
                (CASH_FLOW, "Net cash from operating activities"))
MARGIN_ITEMS = (("Gross profit",), ("Operating income",), ("Net income",), ("Income before income taxes",),
                ("Selling, general and administrative",), ("Research and development",))
CAGR_ITEMS = ((INCOME, "Revenue"), (INCOME, "Net income"), (BALANCE, "Total assets"))


def _growth(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    before, after = w.amount(p[0], p[1], y[0]), w.amount(p[0], p[1], y[1])
    return w.done(f"growth = {_m(after)} / {_m(before)} - 1", (after / before - 1) * 100, "percent")


def _margin(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    part, revenue = w.amount(INCOME, p[0], y[0]), w.amount(INCOME, "Revenue", y[0])
    return w.done(f"{_m(part)} / {_m(revenue)}", part / revenue * 100, "percent")


def _ratio(top: tuple[tuple[str, str], ...], bottom: tuple[str, str], unit: str) -> Callable[..., Solution]:
    def solve(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
        parts = [w.amount(s, label, y[0]) for s, label in top]
        below = w.amount(bottom[0], bottom[1], y[0])
        above = sum(parts, Fraction(0))
        scale = 100 if unit == "percent" else 1
        return w.done(f"{' + '.join(_m(x) for x in parts)} / {_m(below)}", above / below * scale, unit)
    return solve


def _cagr(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    first, last = w.amount(p[0], p[1], y[0]), w.amount(p[0], p[1], y[1])
    num = y[1] - y[0]
    value = ((float(last) / float(first)) ** (1 / num) - 1) * 100
    return w.done(f"({_m(last)} / {_m(first)}) ^ (1/{num}) - 1", value, "percent")


# -- level 3 ---------------------------------------------------------------------------------
def _across(top: tuple[str, str], bottom: tuple[str, str], unit: str, *, sign: int = 1,
            per_year: float = 1.0) -> Callable[..., Solution]:
    """top / bottom (each a statement's line item) in `unit`; `sign` -1 reads an outflow as spent;
    `per_year` 365: days of the year."""
    def solve(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
        above = sign * w.amount(top[0], top[1], y[-1])
        below = w.amount(bottom[0], bottom[1], y[-1])
        scale = 100 if unit == "percent" else 1
        times = f" * {per_year:g}" if per_year != 1 else ""
        return w.done(f"{_m(above)} / {_m(below)}{times}", above / below * scale * Fraction(per_year), unit)
    return solve


def _roe_average(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    net = w.amount(INCOME, "Net income", y[1])
    before, after = (w.amount(BALANCE, "Shareholders' equity", year) for year in y)
    return w.done(f"{_m(net)} / (({_m(before)} + {_m(after)}) / 2)", net / ((before + after) / 2) * 100, "percent")


def _free_cash_flow(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    operating = w.amount(CASH_FLOW, "Net cash from operating activities", y[0])
    capex = w.amount(CASH_FLOW, "Capital expenditures", y[0])
    return w.done(f"{_m(operating)} - {_m(-capex)}", operating + capex, "usd_millions")


def _fcf_margin(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    operating = w.amount(CASH_FLOW, "Net cash from operating activities", y[0])
    capex = w.amount(CASH_FLOW, "Capital expenditures", y[0])
    revenue = w.amount(INCOME, "Revenue", y[0])
    return w.done(f"({_m(operating)} - {_m(-capex)}) / {_m(revenue)}", (operating + capex) / revenue * 100, "percent")


def _cash_check(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    end = w.amount(BALANCE, "Cash and cash equivalents", y[0])
    begin = w.amount(CASH_FLOW, "Cash at beginning of year", y[0])
    return w.done(f"{_m(end)} - {_m(begin)}", end - begin, "usd_millions")


def _eps(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    net = w.amount(INCOME, "Net income", y[0])
    shares = w.note("Diluted shares", w.figures.diluted_shares(y[0]), "Earnings per share", as_money=False) / 10**6
    return w.done(f"{_m(net)} million / {_m(shares)} million shares", net / shares, "usd_per_share")


def _per_employee(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    revenue = w.amount(INCOME, "Revenue", y[0])
    people = w.note("Employees", w.figures.employees(y[0]), "Employees", as_money=False)
    return w.done(f"{_m(revenue)} million / {int(people):,} employees, in thousands", revenue * 1000 / people,
                  "usd_thousands")


def _segment_share(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    segment = w.note(f"{p[0]} segment revenue", w.figures.segment_revenue(p[0], y[0]), "Segments")
    revenue = w.amount(INCOME, "Revenue", y[0])
    return w.done(f"{_m(segment)} / {_m(revenue)}", segment / revenue * 100, "percent")


def _restated_pair(w: Work, p: tuple[str, ...], y: list[int]) -> tuple[Fraction, Fraction]:
    restated = w.amount(p[0], p[1], y[0])
    previous = w.note(f"{p[1]}, FY{y[0]}, previously reported", w.figures.previously_reported(p[1], y[0]),
                      "Restatement")
    return restated, previous


def _restatement_amount(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    restated, previous = _restated_pair(w, p, y)
    return w.done(f"{_m(restated)} - {_m(previous)}", restated - previous, "usd_millions")


def _restatement_percent(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    restated, previous = _restated_pair(w, p, y)
    return w.done(f"{_m(restated)} / {_m(previous)} - 1", (restated / previous - 1) * 100, "percent")


def _previous_growth(w: Work, p: tuple[str, ...], y: list[int]) -> Solution:
    _, previous = _restated_pair(w, p, y)
    after = w.amount(p[0], p[1], y[1])
    return w.done(f"{_m(after)} / {_m(previous)} - 1", (after / previous - 1) * 100, "percent")


def _item_question(verb: str) -> Callable[[tuple[str, ...], list[int]], str]:
    return lambda p, y: f"What was {_lower(p[1])} {_at(p[0], y[0])}{verb}?"


TEMPLATES = {t.name: t for t in (
    # level 1
    Template("lookup", 1, "usd_millions", "one", LOOKUP_ITEMS,
             lambda p, y: f"What was {_lower(p[1])} {_at(p[0], y[0])}?", _lookup),
    Template("change", 1, "usd_millions", "pair", CHANGE_ITEMS,
             lambda p, y: f"By how much did {_lower(p[1])} change from FY{y[0]} to FY{y[1]} (a decrease is "
                          f"negative)?", _change),
    Template("capital_expenditures", 1, "usd_millions", "one", ((),),
             lambda p, y: f"How much cash did the Company spend on capital expenditures in FY{y[0]}?", _capex),
    Template("operating_expenses", 1, "usd_millions", "one", ((),),
             lambda p, y: f"What were total operating expenses in FY{y[0]}: selling, general and administrative, "
                          f"research and development, and depreciation and amortization together?",
             _operating_expenses),
    # level 2
    Template("growth", 2, "percent", "pair", GROWTH_ITEMS,
             lambda p, y: f"By what percentage did {_lower(p[1])} grow from FY{y[0]} to FY{y[1]} (a decline is "
                          f"negative)?", _growth),
    Template("margin", 2, "percent", "one", MARGIN_ITEMS,
             lambda p, y: f"What was {_lower(p[0])} as a percentage of revenue in FY{y[0]}?", _margin),
    Template("effective_tax_rate", 2, "percent", "one", ((),),
             lambda p, y: f"What was the effective tax rate (income tax expense over income before income taxes) "
                          f"in FY{y[0]}?", _ratio(((INCOME, "Income tax expense"),),
                                                  (INCOME, "Income before income taxes"), "percent")),
    Template("current_ratio", 2, "ratio", "one", ((),),
             lambda p, y: f"What was the current ratio (total current assets over total current liabilities) at "
                          f"the end of FY{y[0]}?", _ratio(((BALANCE, "Total current assets"),),
                                                          (BALANCE, "Total current liabilities"), "ratio")),
    Template("quick_ratio", 2, "ratio", "one", ((),),
             lambda p, y: f"What was the quick ratio (cash and cash equivalents plus accounts receivable, over "
                          f"total current liabilities) at the end of FY{y[0]}?",
             _ratio(((BALANCE, "Cash and cash equivalents"), (BALANCE, "Accounts receivable")),
                    (BALANCE, "Total current liabilities"), "ratio")),
    Template("debt_to_equity", 2, "ratio", "one", ((),),
             lambda p, y: f"What was the ratio of long-term debt to shareholders' equity at the end of FY{y[0]}?",
             _ratio(((BALANCE, "Long-term debt"),), (BALANCE, "Shareholders' equity"), "ratio")),
    Template("liabilities_to_assets", 2, "percent", "one", ((),),
             lambda p, y: f"What share of total assets did total liabilities make up at the end of FY{y[0]}?",
             _ratio(((BALANCE, "Total liabilities"),), (BALANCE, "Total assets"), "percent")),
    Template("compound_growth", 2, "percent", "span", CAGR_ITEMS,
             lambda p, y: f"What was the compound annual growth rate of {_lower(p[1])} from FY{y[0]} to "
                          f"FY{y[1]}?", _cagr),
    # level 3
    Template("return_on_assets", 3, "percent", "one", ((),),
             lambda p, y: f"What was the return on assets in FY{y[0]}: net income over total assets at the end of "
                          f"the year?", _across((INCOME, "Net income"), (BALANCE, "Total assets"), "percent")),
    Template("return_on_equity", 3, "percent", "one", ((),),
             lambda p, y: f"What was the return on equity in FY{y[0]}: net income over shareholders' equity at "
                          f"the end of the year?",
             _across((INCOME, "Net income"), (BALANCE, "Shareholders' equity"), "percent")),
    Template("return_on_average_equity", 3, "percent", "pair", ((),),
             lambda p, y: f"What was the return on average equity in FY{y[1]}: net income over the average of "
                          f"shareholders' equity at the ends of FY{y[0]} and FY{y[1]}?", _roe_average),
    Template("asset_turnover", 3, "ratio", "one", ((),),
             lambda p, y: f"What was the asset turnover in FY{y[0]}: revenue over total assets at the end of the "
                          f"year?", _across((INCOME, "Revenue"), (BALANCE, "Total assets"), "ratio")),
    Template("cash_conversion", 3, "ratio", "one", ((),),
             lambda p, y: f"What was the cash conversion in FY{y[0]}: net cash from operating activities over net "
                          f"income?", _across((CASH_FLOW, "Net cash from operating activities"),
                                              (INCOME, "Net income"), "ratio")),
    Template("free_cash_flow", 3, "usd_millions", "one", ((),),
             lambda p, y: f"What was free cash flow in FY{y[0]}: net cash from operating activities minus "
                          f"capital expenditures?", _free_cash_flow),
    Template("free_cash_flow_margin", 3, "percent", "one", ((),),
             lambda p, y: f"What was free cash flow (net cash from operating activities minus capital "
                          f"expenditures) as a percentage of revenue in FY{y[0]}?", _fcf_margin),
    Template("days_sales_outstanding", 3, "days", "one", ((),),
             lambda p, y: f"What were days sales outstanding in FY{y[0]}: accounts receivable at the end of the "
                          f"year over revenue, times 365?",
             _across((BALANCE, "Accounts receivable"), (INCOME, "Revenue"), "days", per_year=365)),
    Template("days_inventory", 3, "days", "one", ((),),
             lambda p, y: f"What were days of inventory in FY{y[0]}: inventory at the end of the year over cost "
                          f"of revenue, times 365?",
             _across((BALANCE, "Inventory"), (INCOME, "Cost of revenue"), "days", per_year=365)),
    Template("interest_coverage", 3, "ratio", "one", ((),),
             lambda p, y: f"What was the interest coverage in FY{y[0]}: operating income over interest expense?",
             _across((INCOME, "Operating income"), (INCOME, "Interest expense"), "ratio")),
    Template("capex_to_depreciation", 3, "ratio", "one", ((),),
             lambda p, y: f"What was the ratio of capital expenditures (from the statement of cash flows) to "
                          f"depreciation and amortization (from the statement of income) in FY{y[0]}?",
             _across((CASH_FLOW, "Capital expenditures"), (INCOME, "Depreciation and amortization"), "ratio",
                     sign=-1)),
    Template("payout_ratio", 3, "percent", "one", ((),),
             lambda p, y: f"What was the dividend payout ratio in FY{y[0]}: dividends paid (statement of cash "
                          f"flows) over net income (statement of income)?",
             _across((CASH_FLOW, "Dividends paid"), (INCOME, "Net income"), "percent", sign=-1)),
    Template("cash_check", 3, "usd_millions", "one", ((),),
             lambda p, y: f"Check the statements against each other: what is cash and cash equivalents on the "
                          f"balance sheet at the end of FY{y[0]} minus the cash at the beginning of FY{y[0]} in the "
                          f"statement of cash flows?", _cash_check),
    Template("earnings_per_share", 3, "usd_per_share", "last", ((),),
             lambda p, y: f"What were diluted earnings per share in FY{y[0]}: net income over the weighted average "
                          f"diluted shares given in the notes?", _eps),
    Template("revenue_per_employee", 3, "usd_thousands", "last", ((),),
             lambda p, y: f"What was revenue per employee in FY{y[0]}, using the year-end headcount in the notes?",
             _per_employee),
    Template("segment_share", 3, "percent", "last", ((),),
             lambda p, y: f"What share of FY{y[0]} revenue came from the segment named in the notes whose revenue "
                          f"they state?", _segment_share),
    Template("restatement_amount", 3, "usd_millions", "restated", ((),),
             lambda p, y: f"{p[1]} for FY{y[0]} was restated. By how much did the restatement change it (the "
                          f"restated figure minus the previously reported one)?", _restatement_amount),
    Template("restatement_percent", 3, "percent", "restated", ((),),
             lambda p, y: f"{p[1]} for FY{y[0]} was restated. By what percentage of the previously reported "
                          f"figure did the restatement change it?", _restatement_percent),
    Template("previous_growth", 3, "percent", "restated", ((),),
             lambda p, y: f"{p[1]} for FY{y[0]} was restated. By what percentage did {_lower(p[1])} grow from "
                          f"FY{y[0]} to FY{y[1]}, measured from the figure previously reported for FY{y[0]}?",
             _previous_growth),
)}
VARIANTS = tuple(Variant(t.name, params) for t in TEMPLATES.values() for params in t.params)


def variants(level: int, num_years: int) -> list[Variant]:
    """The variants of `level` a report of `num_years` years can ask."""
    return [v for v in VARIANTS if TEMPLATES[v.template].level == level and TEMPLATES[v.template].fits(num_years)]


def make_query(variant: Variant, company: Company, rng: random.Random) -> dict:
    """A question of `variant` about `company`: {"template", "params", "years"} (plain data).
    A template about the notes' segment or the restated item takes its parameters from them."""
    template, years = TEMPLATES[variant.template], list(company.years)
    params = list(variant.params)
    if template.years == "one":
        asked = [rng.choice(years)]
    elif template.years == "pair":
        at = rng.randrange(1, len(years))
        asked = [years[at - 1], years[at]]
    elif template.years == "span":
        asked = [years[0], years[-1]]
    elif template.years == "last":
        asked = [years[-1]]
    else:
        restated = company.notes.restatement
        asked = [restated.year, restated.year + 1]
        params = [restated.statement, restated.label]
    if variant.template == "segment_share":
        params = [company.notes.segments[0]]
    return {"template": variant.template, "params": params, "years": asked}


def question_text(query: dict) -> str:
    """The question, then the unit and precision it asks for."""
    template = TEMPLATES[query["template"]]
    unit = ANSWER_UNITS[template.unit]
    return f"{template.ask(tuple(query['params']), list(query['years']))} Answer {unit.phrase}."


def solve(query: dict, figures: Figures) -> Solution:
    """The answer to `query` from `figures`, with its working."""
    template = TEMPLATES[query["template"]]
    return template.solve(Work(figures), tuple(query["params"]), list(query["years"]))


def unit_of(query: dict) -> str:
    return TEMPLATES[query["template"]].unit


class CompanyFigures:
    """The generator's figures: what `make_task` sets the expected answer from."""

    def __init__(self, company: Company) -> None:
        self.company = company

    def amount(self, statement: str, label: str, year: int) -> Figure:
        return Figure(Fraction(self.company.amount(statement, label, year) * 1000), "")

    def segment_revenue(self, segment: str, year: int) -> Figure:
        assert segment == self.company.notes.segments[0] and year == self.company.years[-1]
        return Figure(Fraction(self.company.notes.segment_revenue * 1000), "")

    def employees(self, year: int) -> Figure:
        return Figure(Fraction(self.company.notes.employees), "")

    def diluted_shares(self, year: int) -> Figure:
        return Figure(Fraction(self.company.notes.diluted_shares), "")

    def previously_reported(self, label: str, year: int) -> Figure:
        restated = self.company.notes.restatement
        assert (label, year) == (restated.label, restated.year)
        return Figure(Fraction(restated.previous * 1000), "")
