"""The `postrain` command: one subcommand per module of `postrain.cli`.

A subcommand module defines (and imports torch only inside `main`, so that
`postrain --help` stays fast):

    HELP: str                              one line for `postrain --help`
    def add_arguments(parser) -> None      its flags
    def main(args) -> int                  runs it; the exit status

Run `postrain --help` or `postrain SUBCOMMAND --help`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> the module that implements it.
SUBCOMMANDS: dict[str, str] = {
    "up": "postrain.cli.up",
    "status": "postrain.cli.control",
    "down": "postrain.cli.down",
    "bench": "postrain.cli.bench",
    "plot": "postrain.cli.plot",
    "trace": "postrain.cli.trace",
    "sandbox": "postrain.cli.sandbox",
    "generate": "postrain.cli.generate",
    "eval": "postrain.cli.eval",
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
