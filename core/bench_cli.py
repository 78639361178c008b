"""`postrain bench NAME|all [--json] [--quick]`: run benchmarks.

Each benchmark is a module of `postrain.bench` named in its registry. With
`--json` one JSON object per benchmark is printed, one per line:
{"bench", "config", "results", "peer", "ratio"}; otherwise a table.
"""
from __future__ import annotations

import importlib
import json

HELP = "run a benchmark (or all) and print figures against its peer"


def add_arguments(parser) -> None:
    parser.add_argument("name", help="benchmark name, or 'all'; see `postrain bench list`")
    parser.add_argument("--json", action="store_true", help="print one JSON object per benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, not for the README)")


def main(args) -> int:
    registry = importlib.import_module("postrain.bench")
    if args.name == "list":
        for name in registry.BENCHMARKS:
            print(name)
        return 0
    names = list(registry.BENCHMARKS) if args.name == "all" else [args.name]
    unknown = [n for n in names if n not in registry.BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark {unknown[0]!r}; choose one of: "
                         f"{', '.join(registry.BENCHMARKS)} or 'all'")
    reports = []
    for name in names:
        report = registry.run_benchmark(name, quick=args.quick)
        reports.append(report)
        if args.json:
            print(json.dumps(report), flush=True)
    if not args.json:
        print(registry.format_table(reports))
    return 0
