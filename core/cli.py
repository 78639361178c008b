"""The `postrain` command: one subcommand per module, found by import path.

`core` may not import `actors` or `bench` (layers point one way), so each
subcommand is named here by the module that implements it. A subcommand
module defines:

    HELP: str                              one line for `postrain --help`
    def add_arguments(parser) -> None      its flags
    def main(args) -> int                  runs it; the exit status

Run `postrain --help` or `postrain SUBCOMMAND --help`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> module that implements it; imported only when used (torch is slow).
SUBCOMMANDS: dict[str, str] = {
    "up": "postrain.core.up",
    "status": "postrain.core.control",
    "down": "postrain.core.down",
    "bench": "postrain.core.bench_cli",
    "plot": "postrain.core.plot",
    "trace": "postrain.core.trace",
    "sandbox": "postrain.core.sandbox_cli",
    "generate": "postrain.actors.generate_cli",
    "eval": "postrain.actors.eval_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="postrain",
        description="RL post-training of language-model agents: actors over ZeroMQ, "
        "nsjail sandboxes, GRPO-family learners.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=module.HELP, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.main(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
