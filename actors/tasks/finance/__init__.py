"""`finance_docs`: questions about generated company reports, graded numerically with a unit.

    spec = get_task("finance_docs")
    task = spec.eval_tasks({"size": "short"})[0]
    task["question"]   # "What was gross profit as a percentage of revenue in FY2023? Answer as a ..."
    task["answer"]     # {"value": 41.237..., "unit": "percent"}

A report (income statement, balance sheet and statement of cash flows over several years, each
table in its own unit, notes in prose with a restatement) is generated from a seed; a question
needs lookups and arithmetic over it (growth, margins, ratios, checks across statements,
restated figures). The modules, one step each:

| module | what |
|---|---|
| `options.py` | `FinanceOptions` (the task options) and the report sizes |
| `company.py` | the company's figures and its notes' facts (seeded) |
| `render.py` | the report's text: one file per part (the prompt form joins them) |
| `questions.py` | templates x parameters (the variants) in three levels; the formulas |
| `units.py` | the units asked, and how an answer's text is read as a number with a unit |
| `solver.py` | the reference solver: the figures parsed back from the text |
| `grading.py` | the grader: the final answer tag against the expected value, with a tolerance |
| `tasks.py` | a task from a report seed and a variant; the held-out split |
| `prompts.py`, `demos.py`, `env.py` | the first message, the warm start's demonstrations, the environment |
"""
from __future__ import annotations

from .demos import demonstration, demonstrations
from .env import FinanceDocsEnv
from .grading import Grade, grade, grade_answer
from .options import LEVELS, SIZES, FinanceOptions, finance_options
from .questions import TEMPLATES, VARIANTS, Variant, variants
from .solver import FinanceReportError, TextFigures, solve_text
from .tasks import eval_tasks, in_eval_split, make_task, train_tasks

__all__ = ["LEVELS", "SIZES", "TEMPLATES", "VARIANTS", "FinanceDocsEnv", "FinanceOptions", "FinanceReportError",
           "Grade", "TextFigures", "Variant", "demonstration", "demonstrations", "eval_tasks", "finance_options",
           "grade", "grade_answer", "in_eval_split", "make_task", "solve_text", "train_tasks", "variants"]
