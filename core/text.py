"""Counts in sentences a person reads: `counted(1, "held-out task")` is "1 held-out task"."""
from __future__ import annotations


def counted(num: int, noun: str, plural: str | None = None) -> str:
    """`num` and `noun`, the noun plural unless `num` is 1 (`plural`, else the noun and "s")."""
    return f"{num} {noun if num == 1 else (plural or noun + 's')}"
