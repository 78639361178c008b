"""`postrain down RUN_DIR`: stop a running run cleanly (see postrain.cli.control)."""
from __future__ import annotations

from .control import down_main as main  # noqa: F401

HELP = "stop a running run cleanly (`postrain down RUN_DIR`)"


def add_arguments(parser) -> None:
    parser.add_argument("run_folder", help="the run folder (run_dir/name) of a running `postrain up`")
