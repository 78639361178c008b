"""The tasks of `finance_docs`: a generated report and one question about it, and the split.

    task = make_task(report_seed, variant, options, "finance-docs-train-0-0")
    # {"id", "level", "variant", "query", "question", "files", "answer": {"value", "unit"}}

A task is a function of its report seed, its variant and the report's size: the company
(`company.make_company`) and the report's text (`render.render_report`) come from the report
seed alone, the question's years from the seed and the variant (an "excerpt" keeps only the
files the question reads). The expected answer is the
question's formula on the generator's figures (`questions.CompanyFigures`); the reference
solver must find the same from the text (tests/actors/tasks/test_finance_docs.py).

Held-out split, disjoint by construction: a report seed belongs to the evaluation split iff
the first byte of sha256("finance_docs:" + seed) is < `EVAL_HASH_CUTOFF` (about 5%).
`train_tasks` draws seeds from its own stream and skips those; `eval_tasks` draws from a fixed
stream (`EVAL_SEED`) and keeps only those, so no report is ever in both. Each task's level is
drawn evenly from `levels`, then its variant evenly from that level's.
"""
from __future__ import annotations

import hashlib
import itertools
import random
from typing import Iterator

from .company import make_company
from .options import SIZES, FinanceOptions, finance_options
from .questions import TEMPLATES, CompanyFigures, Variant, make_query, question_text, solve, unit_of, variants
from .render import files_read, render_report

EVAL_SEED = 20261214
EVAL_HASH_CUTOFF = 13          # of 256: ~5% of report seeds are held out


def in_eval_split(report_seed: int) -> bool:
    return hashlib.sha256(f"finance_docs:{report_seed}".encode()).digest()[0] < EVAL_HASH_CUTOFF


def make_task(report_seed: int, variant: Variant, options: FinanceOptions, task_id: str) -> dict:
    """The task of `variant` on the report of `report_seed` (plain data: it travels on the wire)."""
    size = SIZES[options.size]
    company = make_company(random.Random(f"finance_docs:{report_seed}"), size.num_years)
    files = render_report(company, size, random.Random(f"finance_docs:{report_seed}:render"))
    query = make_query(variant, company, random.Random(f"finance_docs:{report_seed}:{variant.key}"))
    solution = solve(query, CompanyFigures(company))
    if size.excerpt:
        files = {name: text for name, text in files.items() if name in files_read(solution.reads)}
    return {"id": task_id, "level": TEMPLATES[variant.template].level, "variant": variant.key,
            "report_seed": report_seed, "query": query, "question": question_text(query), "files": files,
            "answer": {"value": float(solution.value), "unit": unit_of(query)}}


def _draw(rng: random.Random, options: FinanceOptions) -> tuple[int, Variant]:
    level = rng.choice(options.levels)
    variant = rng.choice(variants(level, SIZES[options.size].num_years))
    return rng.getrandbits(63), variant


def train_tasks(seed: int = 0, options: dict | FinanceOptions | None = None) -> Iterator[dict]:
    """An endless, deterministic stream of training tasks (never a held-out report). Bad options
    raise here, not at the first task."""
    return _train_tasks(seed, finance_options(options))


def _train_tasks(seed: int, options: FinanceOptions) -> Iterator[dict]:
    rng = random.Random(f"finance_docs-train-{seed}")
    for i in itertools.count():
        report_seed, variant = _draw(rng, options)
        if not in_eval_split(report_seed):
            yield make_task(report_seed, variant, options, f"finance-docs-train-{seed}-{i}")


def eval_tasks(options: dict | FinanceOptions | None = None) -> list[dict]:
    """The held-out set: `num_eval` tasks, each on a report of the evaluation split."""
    options = finance_options(options)
    rng = random.Random(f"finance_docs-eval-{EVAL_SEED}")
    out: list[dict] = []
    while len(out) < options.num_eval:
        report_seed, variant = _draw(rng, options)
        if in_eval_split(report_seed):
            out.append(make_task(report_seed, variant, options, f"finance-docs-eval-{len(out)}"))
    return out
