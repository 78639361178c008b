"""`postrain up`: start a run (head = supervisor + scheduler) from a TOML config."""
from __future__ import annotations

HELP = "start a run: the head, then every actor the config names"


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="TOML run config (default: the built-in tiny run)")
    parser.add_argument("--dry-run", action="store_true", help="print the placement plan and exit")


def main(args) -> int:
    raise SystemExit("postrain up: not built yet")
