"""The `postrain` command: one subcommand per module of `postrain.cli`.

A subcommand module defines (and imports torch only inside `main`, so that
`postrain --help` stays fast):

    HELP: str                              one line for `postrain --help`
    DESCRIPTION: str                       optional: `postrain NAME --help`'s text (else the docstring)
    def add_arguments(parser) -> None      its flags
    def main(args) -> int                  runs it; the exit status

Run `postrain --help` or `postrain SUBCOMMAND --help`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from postrain.core.extras import missing_extra_message

# name -> the module that implements it.
SUBCOMMANDS: dict[str, str] = {
    "up": "postrain.cli.up",
    "status": "postrain.cli.control",
    "down": "postrain.cli.down",
    "bench": "postrain.cli.bench",
    "plot": "postrain.cli.plot",
    "trace": "postrain.cli.trace",
    "samples": "postrain.cli.samples",
    "sandbox": "postrain.cli.sandbox",
    "generate": "postrain.cli.generate",
    "eval": "postrain.cli.eval",
    "export": "postrain.cli.export",
    "serve": "postrain.cli.serve",
    "init": "postrain.cli.init",
    "report": "postrain.cli.report",
    "sweep": "postrain.cli.sweep",
}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what is wrong and where the help is (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}; see `{self.prog} --help`\n")


def version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError, version as package_version
    try:
        return package_version("postrain")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="postrain",
        description="RL post-training of language-model agents: actors over ZeroMQ, "
        "nsjail sandboxes, GRPO-family learners.",
    )
    parser.add_argument("--version", action="version", version=f"postrain {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.__doc__),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # named with the subcommand they were given to
        parser.exit(2, f"postrain {args.command}: unrecognized arguments: {' '.join(extra)}; see "
                       f"`postrain {args.command} --help`\n")
    try:
        status = int(importlib.import_module(SUBCOMMANDS[args.command]).main(args) or 0)
        sys.stdout.flush()   # here, not at exit: a reader that left is then caught below
        return status
    except BrokenPipeError:   # `postrain status | head`: the reader left; nothing is wrong here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:   # a module of an extra that is not installed: one line
        message = missing_extra_message(exc)
        if message is None:
            raise
        print(f"postrain {args.command} {message}", file=sys.stderr)
        return 1


def run() -> None:
    """The `postrain` command: `main()`, then exit with its status, without the interpreter's
    teardown of modules (core/runtime.py `exit_without_teardown_of_modules`: about 0.5 s less a
    command). An exception still ends it the usual way, with its traceback."""
    from postrain.core.runtime import exit_without_teardown_of_modules
    exit_without_teardown_of_modules(main())


if __name__ == "__main__":
    run()
