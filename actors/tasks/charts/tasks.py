"""The tasks of `charts`: a chart drawn from a seed and one question about it, and the split.

    task = make_task(chart_seed, level, options, "charts-train-0-0")
    # {"id", "chart_seed", "level", "chart": {...figures...}, "query": {...}, "question", "answer": float}

A task is a function of its chart seed and its level (and the `kinds` option, which the chart's
kind is drawn from): the chart from random.Random("charts:SEED"), the question from
random.Random("charts:SEED:LEVEL"). It carries the chart's figures, not its image: the
environment renders the PNG at reset (`render.render_png`, the same bytes for the same figures),
so only small plain data crosses the wire. `answer` is the exact value (a float) in the unit the
question asks for.

Held-out split, disjoint by construction: a chart seed belongs to the evaluation split iff the first
byte of sha256("charts:" + seed) is < `EVAL_HASH_CUTOFF` (about 5%). `train_tasks` draws seeds from
its own stream and skips those; `eval_tasks` draws from a fixed stream (`EVAL_SEED`) and keeps only
those, so no chart is in both. Each task's level is drawn evenly from `levels`.
"""
from __future__ import annotations

import hashlib
import itertools
import random
from typing import Iterator

from .figures import make_chart
from .options import ChartsOptions, charts_options
from .questions import exact_value, make_query

EVAL_SEED = 20261220
EVAL_HASH_CUTOFF = 13          # of 256: ~5% of chart seeds are held out


def in_eval_split(chart_seed: int) -> bool:
    return hashlib.sha256(f"charts:{chart_seed}".encode()).digest()[0] < EVAL_HASH_CUTOFF


def make_task(chart_seed: int, level: int, options: ChartsOptions, task_id: str) -> dict:
    """The task of `level` on the chart of `chart_seed` (plain data: it travels on the wire)."""
    chart = make_chart(random.Random(f"charts:{chart_seed}"), options.kinds)
    query = make_query(chart, level, random.Random(f"charts:{chart_seed}:{level}"))
    return {"id": task_id, "chart_seed": chart_seed, "level": level, "chart": chart.to_dict(), "query": query,
            "question": query["question"], "answer": float(exact_value(query, chart))}


def train_tasks(seed: int = 0, options: dict | ChartsOptions | None = None) -> Iterator[dict]:
    """An endless, deterministic stream of training tasks (never a held-out chart). Bad options
    raise here, not at the first task."""
    return _train_tasks(seed, charts_options(options))


def _train_tasks(seed: int, options: ChartsOptions) -> Iterator[dict]:
    rng = random.Random(f"charts-train-{seed}")
    for i in itertools.count():
        chart_seed, level = rng.getrandbits(63), rng.choice(options.levels)
        if not in_eval_split(chart_seed):
            yield make_task(chart_seed, level, options, f"charts-train-{seed}-{i}")


def eval_tasks(options: dict | ChartsOptions | None = None) -> list[dict]:
    """The held-out set: `num_eval` tasks, each on a chart of the evaluation split."""
    options = charts_options(options)
    rng = random.Random(f"charts-eval-{EVAL_SEED}")
    out: list[dict] = []
    while len(out) < options.num_eval:
        chart_seed, level = rng.getrandbits(63), rng.choice(options.levels)
        if in_eval_split(chart_seed):
            out.append(make_task(chart_seed, level, options, f"charts-eval-{len(out)}"))
    return out


def demonstrations(num: int, seed: int = 0, options: dict | ChartsOptions | None = None) -> list[dict]:
    """`num` demonstrations for the warm start: a training task's first messages (the chart as an
    image content part, the question) and the reference solver's reply (its reads, then the answer),
    in the task's form."""
    from .env import first_messages
    from .figures import Chart
    from .solver import solve

    options = charts_options(options)
    out = []
    for task in itertools.islice(_train_tasks(seed, options), num):
        reply = solve(Chart.from_dict(task["chart"]), task["query"], form=options.form)
        out.append({"messages": [*first_messages(task, options.form), {"role": "assistant", "content": reply}]})
    return out

