"""The reference solver: answers a question from the report's text alone.

    solution = solve_text(report_text(task["files"]), task["query"])
    solution.value        # in the asked unit; equals the task's expected value
    solution.steps        # the working, each figure as the text shows it

`TextFigures` parses what the policy is shown, never the generator's numbers: each statement's
Markdown table under its title line (the unit from its header row: `(US$ thousands)` or
`(US$ millions)`, parentheses for negatives) and the notes' paragraphs (`Note N: Title. ...`),
whose amounts are read in any of the three ways they are written. The formula is the
question's template (`questions.solve`), so that a solver which agrees with the expected value
on every question proves the rendered report holds every figure the answer needs, in the units
it says. A figure the text lacks is a `FinanceReportError` naming it.
"""
from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

from postrain.core.errors import PostrainError

from .company import BALANCE, CASH_FLOW, INCOME
from .questions import Figure, Solution, solve
from .render import TITLES

_TITLE = re.compile(r"^# .+ — (?P<title>.+)$")
_HEADER = re.compile(r"^\| Line item \(US\$ (?P<unit>thousands|millions)\) \|(?P<years>.*)\|$")
_NOTE = re.compile(r"^Note \d+: (?P<title>[^.]+)\. (?P<body>.*)$")
_NOTE_AMOUNT = r"\$(?P<num>[\d,]+(?:\.\d+)?)(?: (?P<scale>million|thousand))?"
_SCALES = {"thousands": 1000, "millions": 10**6, "thousand": 1000, "million": 10**6, None: 1}
_STATEMENT_OF_TITLE = {title: statement for statement, title in TITLES.items()}


class FinanceReportError(PostrainError, ValueError):
    """A report text that lacks a figure a question needs (a broken renderer or a foreign text)."""


def _number(cell: str) -> Decimal:
    negative = cell.startswith("(") and cell.endswith(")")
    value = Decimal(cell.strip("()").replace(",", ""))
    return -value if negative else value


def _note_amount(match: re.Match) -> Fraction:
    return Fraction(Decimal(match["num"].replace(",", ""))) * _SCALES[match["scale"]]


class TextFigures:
    """The figures of a report's text (module docstring); implements `questions.Figures`."""

    def __init__(self, text: str) -> None:
        self.tables: dict[str, dict[tuple[str, int], Figure]] = {s: {} for s in (INCOME, BALANCE, CASH_FLOW)}
        self.notes: dict[str, str] = {}
        lines = text.splitlines()
        for at, line in enumerate(lines):
            title = _TITLE.match(line)
            if title and title["title"] in _STATEMENT_OF_TITLE:
                self._read_table(_STATEMENT_OF_TITLE[title["title"]], lines[at + 1:])
            note = _NOTE.match(line)
            if note:
                self.notes[note["title"]] = note["body"]

    def _read_table(self, statement: str, lines: list[str]) -> None:
        rows = iter(lines)
        header = next((match for match in (_HEADER.match(line) for line in rows) if match), None)
        if header is None:
            raise FinanceReportError(f"the {TITLES[statement].lower()} has no header row "
                                     f"'| Line item (US$ thousands|millions) | FY... |'")
        unit = header["unit"]
        years = [int(cell.strip().removeprefix("FY")) for cell in header["years"].split("|")]
        for line in rows:
            if line.startswith("|---"):
                continue
            if not line.startswith("| "):
                break
            label, *cells = [cell.strip() for cell in line.strip("|").split("|")]
            for year, cell in zip(years, cells, strict=True):
                dollars = Fraction(_number(cell)) * _SCALES[unit]
                self.tables[statement][(label, year)] = Figure(dollars, f"{cell} (US$ {unit})")

    def amount(self, statement: str, label: str, year: int) -> Figure:
        try:
            return self.tables[statement][(label, year)]
        except KeyError:
            raise FinanceReportError(f"the report has no {label!r} for FY{year} in its "
                                     f"{TITLES[statement].lower()}") from None

    def _note(self, title: str) -> str:
        if title not in self.notes:
            raise FinanceReportError(f"the report has no note titled {title!r}; its notes: {sorted(self.notes)}")
        return self.notes[title]

    def _search(self, title: str, pattern: str, what: str, year: int) -> re.Match:
        body = self._note(title)
        match = re.search(pattern, body)
        if match is None or f"FY{year}" not in body:
            raise FinanceReportError(f"note {title!r} states no {what} for FY{year}: {body!r}")
        return match

    def segment_revenue(self, segment: str, year: int) -> Figure:
        match = self._search("Segments", rf"{re.escape(segment)} segment\D*?{_NOTE_AMOUNT}", "segment revenue", year)
        return Figure(_note_amount(match), match.group(0)[match.group(0).index("$"):])

    def employees(self, year: int) -> Figure:
        match = self._search("Employees", r"(?P<num>[\d,]+) (?:full-time employees|people)", "headcount", year)
        return Figure(Fraction(int(match["num"].replace(",", ""))), f"{match['num']} employees")

    def diluted_shares(self, year: int) -> Figure:
        match = self._search("Earnings per share", r"(?P<num>[\d,]+\.\d) million", "share count", year)
        return Figure(Fraction(Decimal(match["num"].replace(",", ""))) * 10**6, f"{match['num']} million shares")

    def previously_reported(self, label: str, year: int) -> Figure:
        body = self._note("Restatement")
        if label.lower() not in body.lower():
            raise FinanceReportError(f"the restatement note is not about {label!r}: {body!r}")
        match = self._search("Restatement", _NOTE_AMOUNT, "previously reported amount", year)
        return Figure(_note_amount(match), match.group(0))


def solve_text(text: str, query: dict) -> Solution:
    """The answer to `query` (a task's "query") from the report's text `text`."""
    return solve(query, TextFigures(text))
