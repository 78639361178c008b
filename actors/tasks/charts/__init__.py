"""`charts`: read a company chart (a PNG in the first message) and answer a question that needs arithmetic.

    spec = get_task("charts")
    task = spec.eval_tasks({"num_eval": 1})[0]
    task["question"]   # "By what percentage did revenue change from Q1 to Q4? ... rounded to one decimal place."
    task["answer"]     # 18.140...

A chart (revenue by quarter or year, margins by segment, units by region, headcount by department,
users by quarter, revenue and costs by year; bars or lines, each value labelled) is generated from a
seed and drawn with matplotlib; a question reads one value (level 1), two and combines them (2), or
several with arithmetic such as a percent change (3). The image reaches the model as an
OpenAI-style `image_url` content part; the vision-language policy that reads it is built
separately (a text-only policy refuses such a message: `postrain.actors.env.require_text_messages`).
The modules, one step each:

| module | what |
|---|---|
| `options.py` | `ChartsOptions` (the task options) |
| `figures.py` | the company's figures a chart shows (seeded) |
| `render.py` | the chart drawn to PNG bytes, deterministic; the data URL |
| `questions.py` | the questions in three levels, and their formulas |
| `grading.py` | the last number of the reply against the exact value, with an absolute tolerance |
| `solver.py` | the reference solver: the answer from the figures, written as a model would |
| `tasks.py` | a task from a chart seed and a level; the held-out split; the warm start's demonstrations |
| `env.py` | the environment: the image form and the Python tool form |
"""
from __future__ import annotations

from .env import ChartsEnv, chart_message
from .figures import METRICS, UNITS, Chart, Series, make_chart
from .grading import Grade, grade, graded_text, read_number
from .options import FORMS, KINDS, LEVELS, ChartsOptions, charts_options
from .questions import FORMULAS, LEVEL_OPS, exact_value, make_query
from .render import HEIGHT_PX, WIDTH_PX, data_url, draw, render_png
from .solver import solve
from .tasks import demonstrations, eval_tasks, in_eval_split, make_task, train_tasks

__all__ = ["FORMS", "FORMULAS", "HEIGHT_PX", "KINDS", "LEVELS", "LEVEL_OPS", "METRICS", "UNITS", "WIDTH_PX", "Chart",
           "ChartsEnv", "ChartsOptions", "Grade", "Series", "chart_message", "charts_options", "data_url", "demonstrations", "draw",
           "eval_tasks", "exact_value", "grade", "graded_text", "in_eval_split", "make_chart", "make_query",
           "make_task", "read_number", "render_png", "solve", "train_tasks"]
