"""A company's report as text: one file per part, the same text in both forms.

    files = render_report(company, size, rng)   # {"income_statement.md": "...", ...}
    text = report_text(files)                   # the prompt form: every file, in order

Each statement is a Markdown table under a title line (`# NAME — Consolidated statement of
income`), with its unit in a sentence and in the header row (`| Line item (US$ thousands) |
FY2022 | FY2023 |`). Amounts in thousands are whole (`152,340`); in millions they have one
decimal (`152.3`); a negative amount is in parentheses (`(12,400)`): the cash-flow statement's
outflows. The notes (`notes.md`) are one paragraph a line (`Note 3: Employees. ...`), in
varied wording, with amounts written three ways (`$84.2 million`, `$84,213 thousand`,
`$84,213,000`). Larger sizes add filler: an unaudited quarterly table and paragraphs of
management's discussion and risk factors, whose numbers are no figure of the statements (a
facility count, a guidance range), so they lengthen the report without changing an answer.

The reference solver (`solver.py`) reads this text back; `format_amount` and
`format_note_amount` are the only writers of an amount.
"""
from __future__ import annotations

import random

from .company import BALANCE, CASH_FLOW, INCOME, ITEMS, NOTES, Company
from .options import ReportSize

FILE_NAMES = {INCOME: "income_statement.md", BALANCE: "balance_sheet.md", CASH_FLOW: "cash_flows.md"}
NOTES_FILE = "notes.md"
QUARTERLY_FILE = "quarterly_results.md"
DISCUSSION_FILE = "management_discussion.md"
RISKS_FILE = "risk_factors.md"
TITLES = {INCOME: "Consolidated statement of income", BALANCE: "Consolidated balance sheet",
          CASH_FLOW: "Consolidated statement of cash flows"}
UNIT_WORDS = {"thousands": "thousands of US dollars", "millions": "millions of US dollars"}


def format_amount(thousands: int, unit: str) -> str:
    """An amount ($ thousands) as its table shows it: `152,340` (thousands), `152.3` (millions:
    the amount is a multiple of 100), `(12,400)` when negative."""
    size = abs(thousands)
    if unit == "thousands":
        text = f"{size:,}"
    else:
        assert size % 100 == 0, f"{thousands} is not on the millions grid"
        text = f"{size // 1000:,}.{(size % 1000) // 100}"
    return f"({text})" if thousands < 0 else text


def format_note_amount(thousands: int, style: str) -> str:
    """An amount ($ thousands) as a note writes it: `$84.2 million`, `$84,213 thousand` or
    `$84,213,000` (style "millions", "thousands", "dollars")."""
    if style == "millions":
        return f"${format_amount(thousands, 'millions')} million"
    if style == "thousands":
        return f"${thousands:,} thousand"
    return f"${thousands * 1000:,}"


def render_statement(company: Company, statement: str) -> str:
    unit = company.units[statement]
    unit_label = "US$ thousands" if unit == "thousands" else "US$ millions"
    header = "| " + " | ".join([f"Line item ({unit_label})"] + [f"FY{y}" for y in company.years]) + " |"
    rule = "|---|" + "---:|" * len(company.years)
    rows = ["| " + " | ".join([label] + [format_amount(v, unit) for v in company.values[statement][label]]) + " |"
            for label in ITEMS[statement]]
    return "\n".join([f"# {company.name} — {TITLES[statement]}", "",
                      f"Fiscal years ended December 31. Amounts in {UNIT_WORDS[unit]}.", "",
                      header, rule, *rows]) + "\n"


def _pick(rng: random.Random, *phrasings: str) -> str:
    return rng.choice(phrasings)


def render_notes(company: Company, rng: random.Random) -> str:
    notes, last = company.notes, company.years[-1]
    units = company.units
    basis = (f"Note 1: Basis of presentation. The consolidated statements cover the fiscal years FY{company.years[0]} "
             f"to FY{last}, each ended December 31. The statement of income is presented in "
             f"{UNIT_WORDS[units[INCOME]]}, the balance sheet in {UNIT_WORDS[units[BALANCE]]} and the statement "
             f"of cash flows in {UNIT_WORDS[units[CASH_FLOW]]}; the notes state their own units.")
    segment_amount = format_note_amount(notes.segment_revenue, notes.segment_style)
    first, second = notes.segments
    segments = f"Note 2: Segments. The Company reports two segments, {first} and {second}. " + _pick(
        rng, f"Revenue of the {first} segment was {segment_amount} in FY{last}.",
        f"In FY{last} the {first} segment contributed {segment_amount} of revenue.")
    employees = "Note 3: Employees. " + _pick(
        rng, f"At the end of FY{last} the Company had {notes.employees:,} full-time employees.",
        f"The Company employed {notes.employees:,} people at the end of FY{last}.")
    shares = f"{notes.diluted_shares // 1_000_000:,}.{(notes.diluted_shares % 1_000_000) // 100_000} million"
    eps = "Note 4: Earnings per share. " + _pick(
        rng, f"The weighted average number of diluted shares outstanding in FY{last} was {shares}.",
        f"Diluted earnings per share for FY{last} are computed on {shares} weighted average diluted shares.")
    restated = notes.restatement
    previous = format_note_amount(restated.previous, restated.amount_style)
    where = TITLES[restated.statement].lower().replace("consolidated ", "")
    restatement = "Note 5: Restatement. " + _pick(
        rng, f"{restated.label} for FY{restated.year} has been restated {restated.reason}. It was previously "
             f"reported as {previous}; the restated amount is shown in the {where}.",
        f"The Company restated {restated.label[0].lower() + restated.label[1:]} for FY{restated.year} "
        f"{restated.reason}: the amount previously reported was {previous}, and the {where} shows the "
        f"restated amount.")
    debt = ("Note 6: Debt. Long-term debt consists of senior notes and a term loan with fixed rates; no "
            "covenant was breached during the years presented.")
    return "\n\n".join([f"# {company.name} — Notes to the financial statements", basis, segments, employees, eps,
                        restatement, debt]) + "\n"


def render_quarterly(company: Company, rng: random.Random) -> str:
    """Revenue of the last year by quarter (unaudited), in the income statement's unit; the
    quarters add up to the year."""
    unit = company.units[INCOME]
    grid = 100 if unit == "millions" else 1
    total = company.amount(INCOME, "Revenue", company.years[-1])
    weights = [rng.uniform(0.8, 1.2) for _ in range(4)]
    quarters = [int(round(total * w / sum(weights) / grid)) * grid for w in weights[:3]]
    quarters.append(total - sum(quarters))
    unit_label = "US$ thousands" if unit == "thousands" else "US$ millions"
    rows = [f"| Q{i + 1} FY{company.years[-1]} | {format_amount(q, unit)} |" for i, q in enumerate(quarters)]
    return "\n".join([f"# {company.name} — Quarterly results (unaudited)", "",
                      f"| Quarter ({unit_label}) | Revenue |", "|---|---:|", *rows]) + "\n"


_PLACES = ("Ohio", "Bavaria", "Ontario", "Jalisco", "Gujarat", "Queensland", "Catalonia", "Hokkaido")
_TOPICS = ("supply chain", "pricing", "customer concentration", "currency", "cyber security", "regulation",
           "labor markets", "interest rates", "raw materials", "product liability")


def _filler_paragraph(rng: random.Random, name: str, last: int) -> str:
    """One paragraph of prose whose numbers are no figure of the statements."""
    sentences = [
        f"{name} operates {rng.randint(3, 40)} facilities in {rng.randint(2, 19)} countries, the largest in "
        f"{rng.choice(_PLACES)}.",
        f"Management regards {rng.choice(_TOPICS)} as a principal risk and reviews it "
        f"{rng.choice(('quarterly', 'monthly', 'at every board meeting'))}.",
        f"For FY{last + 1}, management expects capital spending in a range of "
        f"{rng.randint(2, 9)} to {rng.randint(10, 19)} percent above the prior plan, subject to demand.",
        f"The addressable market for the Company's {rng.choice(_TOPICS)} offerings is estimated by third "
        f"parties at {rng.randint(2, 90)} billion US dollars.",
        f"A {rng.randint(5, 25)} percent change in {rng.choice(_TOPICS)} costs would not have changed the "
        f"Company's liquidity position materially.",
        f"The Company completed {rng.randint(1, 6)} small acquisitions in prior decades and integrates "
        f"them into its {rng.choice(('existing', 'regional', 'global'))} operations.",
    ]
    rng.shuffle(sentences)
    return " ".join(sentences[:rng.randint(3, 5)])


def render_report(company: Company, size: ReportSize, rng: random.Random) -> dict[str, str]:
    """The report's files, in reading order: the three statements, the notes, then (larger
    sizes) the quarterly table, management's discussion and risk factors."""
    files = {FILE_NAMES[s]: render_statement(company, s) for s in (INCOME, BALANCE, CASH_FLOW)}
    files[NOTES_FILE] = render_notes(company, rng)
    if size.quarterly_table:
        files[QUARTERLY_FILE] = render_quarterly(company, rng)
    if size.num_filler:
        paragraphs = [_filler_paragraph(rng, company.name, company.years[-1]) for _ in range(size.num_filler)]
        half = (len(paragraphs) + 1) // 2
        files[DISCUSSION_FILE] = "\n\n".join([f"# {company.name} — Management's discussion", *paragraphs[:half]]) + "\n"
        if paragraphs[half:]:
            files[RISKS_FILE] = "\n\n".join([f"# {company.name} — Risk factors", *paragraphs[half:]]) + "\n"
    return files


def files_read(reads: tuple[tuple[str, str], ...]) -> set[str]:
    """The files that hold what a solution reads (`questions.Work.reads`: a statement's line items,
    or "notes" and a note's title)."""
    return {NOTES_FILE if source == NOTES else FILE_NAMES[source] for source, _ in reads}


def report_text(files: dict[str, str]) -> str:
    """The prompt form's report: every file's text, in order, a blank line between."""
    return "\n".join(files.values())
