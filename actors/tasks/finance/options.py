"""The task options of `finance_docs` (a config's `task_options`), and the sizes of a report.

    options = finance_options({"form": "files", "size": "long", "levels": [2, 3]})

`FinanceOptions` holds every default; a bad option is a `TaskOptionsError` naming it (a level
outside 1..3 names the allowed levels, an unknown size the known sizes). `SIZES` says what each
`size` puts in a report: the fiscal years shown and the pages of filler prose (management's
discussion, risk factors, an unaudited quarterly table) that lengthen it without changing any
figure a question asks for.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field, field_validator

from postrain.core import Options

from ...env.api import check_options, known_subset

LEVELS = (1, 2, 3)
NUM_EVAL = 200
DEFAULT_TURNS = {"prompt": 1, "files": 8}


@dataclasses.dataclass(frozen=True)
class ReportSize:
    """What one `size` puts in a report: `num_years` fiscal years in each statement (>= 2, so a
    growth rate can be asked), `num_filler` filler paragraphs (0: the statements and the notes
    alone), whether the unaudited quarterly table is shown, and `excerpt`: only the parts the
    question reads (its statements, the notes where it needs them)."""

    num_years: int
    num_filler: int
    quarterly_table: bool
    excerpt: bool = False


SIZES = {   # the tokens of each one's first message: docs/environments.md, "Financial documents"
    "excerpt": ReportSize(num_years=2, num_filler=0, quarterly_table=False, excerpt=True),
    "short": ReportSize(num_years=2, num_filler=0, quarterly_table=False),
    "medium": ReportSize(num_years=3, num_filler=4, quarterly_table=True),
    "long": ReportSize(num_years=5, num_filler=40, quarterly_table=True),
    "very_long": ReportSize(num_years=5, num_filler=160, quarterly_table=True),
}


class FinanceOptions(Options):
    """The task options of `finance_docs`: the report's form and size, the question levels, the
    grader's tolerance and the files form's shell limits."""

    form: Literal["prompt", "files"] = Field(
        "prompt", description="prompt: the whole report in the first message, one reply; files: the "
        "report as files in /work of a sandbox session, read with <bash> commands")
    size: Literal["excerpt", "short", "medium", "long", "very_long"] = Field(
        "medium", description="the report's length: excerpt (2 years, only the parts the question reads), "
        "short (2 years, the statements and notes), medium (3 years, a little filler), long (5 years), "
        "very_long (5 years, much filler); docs/environments.md gives each one's tokens")
    levels: tuple[int, ...] = Field(
        LEVELS, description="question levels drawn (each equally often): 1 lookups and one-step sums, "
        "2 growth, margins and ratios in one statement, 3 across statements, notes and restatements")
    num_eval: int = Field(NUM_EVAL, ge=0, description="held-out questions in `eval_tasks`")
    tolerance_units: float = Field(
        1.0, ge=0.0, description="how far an answer may be from the exact value, in units of the last "
        "decimal place the question asks for (1.0: 12.3% or 12.4% for 12.34% asked to one decimal)")
    max_turns: int | None = Field(None, ge=1, description="actions per episode (default: 1 for prompt, "
                                  "8 for files)")
    command_timeout_s: float = Field(10.0, gt=0, description="files form: wall-time limit of one command, "
                                     "seconds")
    max_output_chars: int = Field(4000, ge=100, description="files form: characters of a command's output "
                                  "the model reads (the middle is cut)")

    @field_validator("levels")
    @classmethod
    def _known_levels(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        return known_subset("levels", value, LEVELS, "[1, 2]")


def finance_options(options: dict | FinanceOptions | None) -> FinanceOptions:
    """`options` checked (a dict, None or a `FinanceOptions`); TaskOptionsError names a bad one."""
    return check_options(FinanceOptions, options, "task 'finance_docs'")
