"""Counts in sentences a person reads: `counted(1, "held-out task")` is "1 held-out task"; `tally`
is "no_export 5, ok 3"."""
from __future__ import annotations

from typing import Mapping


def counted(num: int, noun: str, plural: str | None = None) -> str:
    """`num` and `noun`, the noun plural unless `num` is 1 (`plural`, else the noun and "s")."""
    return f"{num} {noun if num == 1 else (plural or noun + 's')}"


def tally(counts: Mapping[str, int]) -> str:
    """'no_export 5, ok 3': most frequent first, ties by name."""
    return ", ".join(f"{name} {count}" for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
