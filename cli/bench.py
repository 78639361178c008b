"""`postrain bench NAME|all|NAME,NAME [--json] [--quick] [--skip NAME,...]`: run benchmarks.

Each benchmark is a module of `postrain.bench` named in its registry
(`postrain bench list`). `all` runs every one, in registry order, and prints
one table: bench, figure, ours, peer, ratio. With `--json` one JSON object per
benchmark is printed, one per line: {"bench", "config", "results", "peer",
"ratio"}. `--quick` runs fewer repeats on smaller inputs (a smoke run; its
figures are not for the README). When several run, a benchmark that fails
becomes an error row ({"bench", "error"} in JSON), the others still run, and
the exit status is 1. `--address HOST:PORT` runs `cluster` on that running Ray cluster.
"""
from __future__ import annotations

import importlib
import json
import sys
import traceback

from postrain.core.errors import PostrainError

HELP = "run a benchmark (or all) and print figures against its peer"


def add_arguments(parser) -> None:
    parser.add_argument("name", help="benchmark name, several joined by commas, or 'all'; "
                        "see `postrain bench list`")
    parser.add_argument("--json", action="store_true", help="print one JSON object per benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, not for the README)")
    parser.add_argument("--skip", default="", help="benchmarks to leave out of the run, joined by commas")
    parser.add_argument("--address", default=None, help="`cluster` only: a running Ray cluster's HOST:PORT "
                        "(default: start a local one of three nodes)")


def select(name: str, skip: str, registry: dict) -> list[str]:
    """The benchmark names to run, in order; SystemExit naming the choices for an unknown one."""
    names = list(registry) if name == "all" else [n for n in name.split(",") if n]
    skipped = [n for n in skip.split(",") if n]
    unknown = [n for n in names + skipped if n not in registry]
    if unknown:
        raise SystemExit(f"postrain bench: unknown benchmark {unknown[0]!r}; choose from: {', '.join(registry)} or 'all'")
    return [n for n in names if n not in skipped]


def main(args) -> int:
    registry = importlib.import_module("postrain.bench")
    if args.name == "list":
        for name in registry.BENCHMARKS:
            print(name)
        return 0
    names = select(args.name, args.skip, registry.BENCHMARKS)
    reports = []
    for name in names:
        if len(names) > 1:
            print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            options = {"address": args.address} if name == "cluster" and args.address else {}
            report = registry.run_benchmark(name, quick=args.quick, **options)
        except Exception as exc:
            if len(names) == 1 and isinstance(exc, PostrainError):   # bad input: one line, no traceback
                print(f"postrain bench {name}: {exc}", file=sys.stderr)
                return 1
            if len(names) == 1:
                raise
            traceback.print_exc(file=sys.stderr)
            report = {"bench": name, "error": f"{type(exc).__name__}: {exc}"}
        reports.append(report)
        if args.json:
            print(json.dumps(report), flush=True)
    if not args.json:
        only_skipped = len(reports) == 1 and "skipped" in reports[0]
        print(reports[0]["skipped"] if only_skipped else registry.format_table(reports))
    return 1 if any("error" in report for report in reports) else 0
