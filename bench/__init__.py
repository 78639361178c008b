"""postrain.bench: the benchmark suite behind `postrain bench`.

A benchmark is a module here with one function:

    def run(quick: bool) -> dict   # {"config": {...}, "results": {...}, "peer": {...}}

`results` and `peer` hold the same figure names, ours and the reference's,
measured in the same run; `run_benchmark` adds `ratio` (ours / theirs) for
every figure both have. Figures are medians over repeats. Names carry their
unit (`rtt_p50_us`, `msgs_per_s`). A benchmark that needs what this machine lacks returns
{"skipped": "the one line that says why"} instead, and is reported so, not as a failure.

A benchmark that runs the `postrain` command (a whole `postrain up`) starts it as a child
process from `postrain_command`: the bench drives the application layer's command line as a
user does and never imports it (the layers point one way: tests/test_layers.py).
"""
from __future__ import annotations

import importlib
import math
import sys
from importlib.metadata import entry_points

from postrain.core.errors import PostrainError

BENCHMARKS: dict[str, str] = {
    "messaging": "postrain.bench.messaging",
    "sandbox": "postrain.bench.sandbox",
    "rl_ops": "postrain.bench.rl_ops",
    "generate": "postrain.bench.generate",
    "kvpool": "postrain.bench.kvpool",
    "learner": "postrain.bench.learner",
    "e2e": "postrain.bench.e2e",
    "default_run": "postrain.bench.default_run",
    "trl": "postrain.bench.trl",
    "device": "postrain.bench.device",
    "cluster": "postrain.bench.cluster",
    "gateway": "postrain.bench.gateway",
    "long": "postrain.bench.long",
    "scorers": "postrain.bench.scorers",
    "cad": "postrain.bench.cad",
    "mixture": "postrain.bench.mixture",
    "limits": "postrain.bench.limits",
    "exact": "postrain.bench.exact",
    "vision": "postrain.bench.vision",
    "tinker": "postrain.bench.tinker",
}


def postrain_command(*args: str) -> list[str]:
    """The argv of `postrain ARGS` for a child process: this interpreter running the module of
    the installed package's `postrain` console script (its entry point, `pip install -e .`)."""
    scripts = entry_points(group="console_scripts", name="postrain")
    if len(scripts) != 1:
        raise PostrainError(f"found {len(scripts)} `postrain` console scripts, need exactly 1; install "
                            "postrain once in this environment (pip install -e .)")
    (script,) = scripts
    return [sys.executable, "-m", script.module, *args]


def run_benchmark(name: str, quick: bool = False, **options) -> dict:
    """Run one benchmark; `options` go to its `run` (`address=` for `cluster`)."""
    module = importlib.import_module(BENCHMARKS[name])
    report = module.run(quick=quick, **options)
    if report.get("skipped"):           # nothing to measure on this machine (e.g. no GPU), not a failure
        return {"bench": name, "skipped": report["skipped"]}
    peer = report.get("peer", {})
    ratio = {}
    for key, ours in report["results"].items():
        theirs = peer.get(key)
        if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and theirs:
            ratio[key] = round(ours / theirs, 3)
    return {"bench": name, "config": report.get("config", {}), "results": report["results"],
            "peer": peer, "ratio": ratio}


def _fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "-" if value is None else str(value)


def format_table(reports: list[dict]) -> str:
    """One row per figure: bench, figure, ours, peer, ratio. A report with an `error` (a bench
    that failed) is one row whose figure column says so."""
    rows = [("bench", "figure", "ours", "peer", "ratio")]
    for report in reports:
        if "error" in report:
            rows.append((report["bench"], f"error: {report['error']}", "-", "-", "-"))
            continue
        if "skipped" in report:
            rows.append((report["bench"], report["skipped"], "-", "-", "-"))
            continue
        for key, ours in report["results"].items():
            rows.append((report["bench"], key, _fmt(ours), _fmt(report["peer"].get(key)),
                         _fmt(report["ratio"].get(key))))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
