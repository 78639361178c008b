"""A generated company's figures: three statements over several fiscal years, and the facts its
notes state in prose. Seeded and deterministic: `make_company(rng, num_years)`.

Every amount is an int in thousands of US dollars. Each statement is shown in one unit
(`Company.units`: "thousands" or "millions" with one decimal, drawn per statement), and every
amount is generated on the grid its table can show exactly: a multiple of 100 (thousand) in a
table in millions. An amount shown in two statements (net income and depreciation in the income
statement and the cash-flow statement; cash on the balance sheet and at the end of the
cash-flow statement) is on the coarser grid of the two, so both tables show the same figure.
Subtotals are sums of the components as shown, so every table adds up.

The invariants a test holds (`tests/actors/tasks/test_finance_docs.py`):
    gross profit = revenue - cost of revenue; net income > 0; operating cash flow > 0;
    total assets = total liabilities and shareholders' equity; shareholders' equity > 0;
    cash at end of year (cash flows) = cash and cash equivalents (balance sheet);
    cash at beginning of year = the previous year's cash at end of year.

Notes facts (`Notes`): a segment's revenue, the year-end headcount and the diluted share count
of the last year, and one restatement: a line item of a year before the last, whose figure in
the tables is the restated one and whose previously reported figure only the note gives.
"""
from __future__ import annotations

import dataclasses
import random

INCOME = "income"
BALANCE = "balance"
CASH_FLOW = "cash_flow"
STATEMENTS = (INCOME, BALANCE, CASH_FLOW)
NOTES = "notes"   # the source of a figure the notes state (beside the three statements)
UNIT_GRID = {"thousands": 1, "millions": 100}   # unit -> the amounts it shows exactly, in $ thousands

INCOME_ITEMS = ("Revenue", "Cost of revenue", "Gross profit", "Selling, general and administrative",
                "Research and development", "Depreciation and amortization", "Operating income",
                "Interest expense", "Income before income taxes", "Income tax expense", "Net income")
BALANCE_ITEMS = ("Cash and cash equivalents", "Accounts receivable", "Inventory", "Total current assets",
                 "Property, plant and equipment, net", "Goodwill", "Total assets", "Accounts payable",
                 "Accrued liabilities", "Total current liabilities", "Long-term debt", "Total liabilities",
                 "Shareholders' equity", "Total liabilities and shareholders' equity")
CASH_FLOW_ITEMS = ("Net income", "Depreciation and amortization", "Changes in working capital",
                   "Net cash from operating activities", "Capital expenditures",
                   "Net cash from investing activities", "Proceeds from (repayment of) debt", "Dividends paid",
                   "Net cash from financing activities", "Net change in cash", "Cash at beginning of year",
                   "Cash at end of year")
ITEMS = {INCOME: INCOME_ITEMS, BALANCE: BALANCE_ITEMS, CASH_FLOW: CASH_FLOW_ITEMS}
RESTATABLE = ((INCOME, "Revenue"), (INCOME, "Cost of revenue"), (INCOME, "Selling, general and administrative"),
              (BALANCE, "Accounts receivable"), (BALANCE, "Inventory"))

_FIRST = ("North", "Blue", "Granite", "Silver", "Harbor", "Summit", "Pine", "Cedar", "Iron", "Bright",
          "Delta", "Atlas", "Crescent", "Falcon", "Juniper", "Keystone", "Meridian", "Orchid", "Quarry", "Vale")
_SECOND = ("wind", "field", "stone", "ridge", "brook", "gate", "point", "crest", "wood", "line")
_KIND = ("Tools", "Foods", "Logistics", "Materials", "Devices", "Software", "Textiles", "Instruments",
         "Packaging", "Pharma")
SEGMENTS = ("Industrial", "Consumer", "Services", "Healthcare", "Retail", "Energy", "Aerospace", "Digital")


@dataclasses.dataclass(frozen=True)
class Restatement:
    """`label` of `statement` for fiscal `year` was restated: the tables show the restated figure;
    `previous` (the previously reported amount, $ thousands) is only in the note, written in
    `amount_style` (see `render.format_note_amount`)."""

    statement: str
    label: str
    year: int
    previous: int
    amount_style: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Notes:
    """The facts the notes state in prose, each for the last fiscal year; amounts in $ thousands,
    each on the grid its `*_style` can write exactly."""

    segments: tuple[str, str]        # the two segments; the first one's revenue is stated
    segment_revenue: int
    segment_style: str
    employees: int                   # headcount at the end of the year
    diluted_shares: int              # weighted average diluted shares, a multiple of 100,000
    restatement: Restatement


@dataclasses.dataclass(frozen=True)
class Company:
    """One company's report data. `values[statement][label]` holds one amount per fiscal year of
    `years` (oldest first), in $ thousands; `units[statement]` is how its table shows them."""

    name: str
    years: tuple[int, ...]
    units: dict[str, str]
    values: dict[str, dict[str, tuple[int, ...]]]
    notes: Notes

    def amount(self, statement: str, label: str, year: int) -> int:
        return self.values[statement][label][self.years.index(year)]


def _on(grid: int, x: float) -> int:
    """`x` rounded to a multiple of `grid`."""
    return int(round(x / grid)) * grid


def make_company(rng: random.Random, num_years: int) -> Company:
    """A company with `num_years` (>= 2) fiscal years of figures and its notes' facts."""
    assert num_years >= 2, num_years
    last = rng.randint(2019, 2026)
    years = tuple(range(last - num_years + 1, last + 1))
    units = {statement: rng.choice(("thousands", "millions")) for statement in STATEMENTS}
    grid = {statement: UNIT_GRID[unit] for statement, unit in units.items()}
    income = _income(rng, num_years, grid)
    cash_flow = _cash_flow(rng, income, grid)
    balance = _balance(rng, income, cash_flow, grid)
    values = {INCOME: income, BALANCE: balance, CASH_FLOW: cash_flow}
    name = f"{rng.choice(_FIRST)}{rng.choice(_SECOND)} {rng.choice(_KIND)} Inc."
    return Company(name, years, units, values, _notes(rng, years, values))


def _income(rng: random.Random, num_years: int, grid: dict[str, int]) -> dict[str, tuple[int, ...]]:
    g, shared = grid[INCOME], max(grid[INCOME], grid[CASH_FLOW])
    revenue = rng.uniform(20_000, 900_000)
    cogs_share, sga_share = rng.uniform(0.45, 0.62), rng.uniform(0.1, 0.17)   # operating margin >= 7%
    rnd_share, da_share, tax_rate = rng.uniform(0.02, 0.06), rng.uniform(0.02, 0.035), rng.uniform(0.15, 0.3)
    interest_share = rng.uniform(0.005, 0.02)
    rows: dict[str, list[int]] = {label: [] for label in INCOME_ITEMS}
    for _ in range(num_years):
        revenue *= 1 + rng.uniform(-0.08, 0.25)
        rev = _on(g, revenue)
        cogs = _on(g, rev * (cogs_share + rng.uniform(-0.03, 0.03)))
        sga = _on(g, rev * (sga_share + rng.uniform(-0.01, 0.01)))
        rnd = _on(g, rev * (rnd_share + rng.uniform(-0.005, 0.005)))
        da = _on(shared, rev * da_share)
        interest = _on(g, rev * interest_share * rng.uniform(0.8, 1.2))
        gross = rev - cogs
        operating = gross - sga - rnd - da
        pretax = operating - interest
        net = _on(shared, pretax * (1 - tax_rate))
        for label, value in zip(INCOME_ITEMS, (rev, cogs, gross, sga, rnd, da, operating, interest, pretax,
                                               pretax - net, net)):
            rows[label].append(value)
    return {label: tuple(v) for label, v in rows.items()}


def _cash_flow(rng: random.Random, income: dict[str, tuple[int, ...]],
               grid: dict[str, int]) -> dict[str, tuple[int, ...]]:
    g, cash_grid = grid[CASH_FLOW], max(grid[BALANCE], grid[CASH_FLOW])
    revenue = income["Revenue"]
    cash = _on(cash_grid, revenue[0] * rng.uniform(0.05, 0.2))
    rows: dict[str, list[int]] = {label: [] for label in CASH_FLOW_ITEMS}
    for i, rev in enumerate(revenue):
        net, da = income["Net income"][i], income["Depreciation and amortization"][i]
        working = _on(g, (net + da) * rng.uniform(-0.4, 0.25))
        capex = -_on(g, rev * rng.uniform(0.03, 0.08))
        debt = _on(g, rev * rng.uniform(-0.05, 0.06))
        dividends = -_on(g, net * rng.uniform(0.1, 0.45))
        end_raw = cash + net + da + working + capex + debt + dividends
        floor = _on(cash_grid, rev * 0.03)
        if end_raw < floor:                  # borrow enough to keep some cash
            debt += _on(g, floor - end_raw + g)
            end_raw = cash + net + da + working + capex + debt + dividends
        working += _on(cash_grid, end_raw) - end_raw   # the end of year lands on the balance sheet's grid
        operating, investing, financing = net + da + working, capex, debt + dividends
        end = cash + operating + investing + financing
        for label, value in zip(CASH_FLOW_ITEMS, (net, da, working, operating, capex, investing, debt, dividends,
                                                  financing, end - cash, cash, end)):
            rows[label].append(value)
        cash = end
    return {label: tuple(v) for label, v in rows.items()}


def _balance(rng: random.Random, income: dict[str, tuple[int, ...]], cash_flow: dict[str, tuple[int, ...]],
             grid: dict[str, int]) -> dict[str, tuple[int, ...]]:
    g = grid[BALANCE]
    ar_days, inv_days, ap_days = rng.uniform(30, 70), rng.uniform(40, 110), rng.uniform(25, 60)
    ppe_share, accrued_share = rng.uniform(0.2, 0.6), rng.uniform(0.03, 0.08)
    goodwill = _on(g, income["Revenue"][0] * rng.uniform(0.05, 0.3))
    debt_share = rng.uniform(0.1, 0.45)
    rows: dict[str, list[int]] = {label: [] for label in BALANCE_ITEMS}
    for i, rev in enumerate(income["Revenue"]):
        cogs = income["Cost of revenue"][i]
        cash = cash_flow["Cash at end of year"][i]
        ar = _on(g, rev * ar_days / 365 * rng.uniform(0.9, 1.1))
        inventory = _on(g, cogs * inv_days / 365 * rng.uniform(0.9, 1.1))
        current = cash + ar + inventory
        ppe = _on(g, rev * ppe_share * rng.uniform(0.95, 1.05))
        assets = current + ppe + goodwill
        payable = _on(g, cogs * ap_days / 365 * rng.uniform(0.9, 1.1))
        accrued = _on(g, rev * accrued_share)
        current_liabilities = payable + accrued
        debt = max(min(_on(g, rev * debt_share), _on(g, 0.7 * assets - current_liabilities)), g)
        liabilities = current_liabilities + debt
        equity = assets - liabilities
        for label, value in zip(BALANCE_ITEMS, (cash, ar, inventory, current, ppe, goodwill, assets, payable,
                                                accrued, current_liabilities, debt, liabilities, equity, assets)):
            rows[label].append(value)
    return {label: tuple(v) for label, v in rows.items()}


NOTE_STYLES = ("millions", "thousands", "dollars")   # "$84.2 million", "$84,213 thousand", "$84,213,000"
RESTATEMENT_REASONS = ("to correct an error in the timing of revenue recognition",
                       "to correct the classification of certain freight costs",
                       "after a review of inventory costing", "to correct an error in the accrual of rebates",
                       "following the adoption of a new accounting standard")


def _notes(rng: random.Random, years: tuple[int, ...], values: dict[str, dict[str, tuple[int, ...]]]) -> Notes:
    last = len(years) - 1
    segments = tuple(rng.sample(SEGMENTS, 2))
    segment_style = rng.choice(NOTE_STYLES)
    segment_grid = 100 if segment_style == "millions" else 1
    segment_revenue = _on(segment_grid, values[INCOME]["Revenue"][last] * rng.uniform(0.3, 0.7))
    employees = int(values[INCOME]["Revenue"][last] / rng.uniform(150, 450))
    diluted_shares = _on(100, rng.uniform(5_000, 200_000)) * 1000
    statement, label = rng.choice(RESTATABLE)
    index = rng.randrange(0, last)
    shown = values[statement][label][index]
    style = rng.choice(NOTE_STYLES)
    note_grid, sign = (100 if style == "millions" else 1), rng.choice((-1, 1))
    previous = _on(note_grid, shown * (1 + sign * rng.uniform(0.02, 0.08)))
    if previous == shown:                # a restatement changes the figure
        previous += sign * note_grid
    restatement = Restatement(statement, label, years[index], previous, style, rng.choice(RESTATEMENT_REASONS))
    return Notes((segments[0], segments[1]), segment_revenue, segment_style, max(employees, 120), diluted_shares,
                 restatement)
