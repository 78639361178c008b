"""The task options of `charts` (a config's `task_options`).

    options = charts_options({"form": "tool", "levels": [2, 3], "kinds": ["bar"]})

`ChartsOptions` holds every default; a bad option is a `TaskOptionsError` naming it (a level
outside 1..3 names the allowed levels, an unknown chart kind the known kinds).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from postrain.core import Options

from ...env.api import check_options, known_subset

LEVELS = (1, 2, 3)
KINDS = ("bar", "line")
FORMS = ("image", "tool")
NUM_EVAL = 200


class ChartsOptions(Options):
    """The task options of `charts`: the episode's form, the chart kinds and question levels drawn,
    the grader's tolerance and the tool form's limits."""

    form: Literal["image", "tool"] = Field(
        "image", description="image: the chart and the question in one user message, one reply whose last "
        "number is graded; tool: the same message, the model may run Python (<python>) before it answers "
        "in <answer></answer>")
    levels: tuple[int, ...] = Field(
        LEVELS, description="question levels drawn (each equally often): 1 read one value, 2 read two "
        "values and combine them, 3 several reads and arithmetic (percent change, average, share)")
    kinds: tuple[str, ...] = Field(KINDS, description="chart kinds drawn: a subset of bar, line (a line chart "
                                   "shows a series over time)")
    num_eval: int = Field(NUM_EVAL, ge=0, description="held-out questions in `eval_tasks`")
    tolerance: float = Field(
        0.5, ge=0.0, description="how far an answer may be from the exact value, absolute, in the unit the "
        "question asks for ($ millions, percent or percentage points, units): 0.5 accepts any rounding")
    max_tool_calls: int = Field(2, ge=0, description="tool form: Python runs per episode; beyond it the model "
                                "is told to answer")
    tool_timeout_s: float = Field(5.0, gt=0, description="tool form: wall-time limit of one Python run, seconds")
    format_weight: float = Field(0.1, description="tool form: weight of the `format` reward component (1 if "
                                 "every turn was a well-formed tool call or answer)")
    max_turns: int | None = Field(None, ge=1, description="actions per episode (default: 1 for image, "
                                  "max_tool_calls + 2 for tool)")

    @field_validator("levels")
    @classmethod
    def _known_levels(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        return known_subset("levels", value, LEVELS, "[1, 2]")

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return known_subset("kinds", value, KINDS, '["bar"]')

    def turns(self) -> int:
        """Actions per episode: `max_turns`, or the form's default."""
        if self.max_turns is not None:
            return self.max_turns
        return 1 if self.form == "image" else self.max_tool_calls + 2


def charts_options(options: dict | ChartsOptions | None) -> ChartsOptions:
    """`options` checked (a dict, None or a `ChartsOptions`); TaskOptionsError names a bad one."""
    return check_options(ChartsOptions, options, "task 'charts'")
