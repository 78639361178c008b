"""The CAD suite: every variant of every family and level, the held-out split, the task streams.

Variants are generated, seeded and deterministic: variant i of (family, level) is drawn by
`random.Random(f"cad:{family}:{level}:{i}")`, so adding a variant never changes another.
`NUM_PER_LEVEL` (20) variants per level and 3 levels give 60 per family, 180 in all.

Held-out split, disjoint by construction: in each (family, level) the `NUM_EVAL_PER_LEVEL` (3)
variants with the smallest sha256("cad:" + id) are the evaluation set (27 in all); the other
153 train. `train_tasks` cycles the training variants in a seeded order, reshuffled each pass.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import random
from typing import Callable, Iterator

from . import box, bracket, plate
from .part import Part

FAMILIES: dict[str, Callable[[random.Random, int], Part]] = {"plate": plate.make, "bracket": bracket.make,
                                                            "box": box.make}
LEVELS = (1, 2, 3)
NUM_PER_LEVEL = 20
NUM_EVAL_PER_LEVEL = 3


def variant_id(family: str, level: int, index: int) -> str:
    return f"cad-{family}-{level}-{index}"


def make_variant(family: str, level: int, index: int) -> dict:
    """The task dict of one variant (deterministic)."""
    part = FAMILIES[family](random.Random(f"cad:{family}:{level}:{index}"), level)
    return part.task(variant_id(family, level, index))


@functools.lru_cache(maxsize=1)
def all_variants() -> tuple[dict, ...]:
    """Every variant, family by family, level by level (built once per process)."""
    return tuple(make_variant(family, level, i) for family in FAMILIES for level in LEVELS
                 for i in range(NUM_PER_LEVEL))


def _split_key(task_id: str) -> bytes:
    return hashlib.sha256(f"cad:{task_id}".encode()).digest()


@functools.lru_cache(maxsize=1)
def eval_ids() -> frozenset[str]:
    """The held-out variants' ids: per (family, level), the NUM_EVAL_PER_LEVEL smallest hashes."""
    out: set[str] = set()
    for family in FAMILIES:
        for level in LEVELS:
            ids = [variant_id(family, level, i) for i in range(NUM_PER_LEVEL)]
            out.update(sorted(ids, key=_split_key)[:NUM_EVAL_PER_LEVEL])
    return frozenset(out)


def selected(tasks, families: list[str] | None, levels: list[int] | None) -> list[dict]:
    """The tasks of the chosen families and levels (None: all)."""
    return [t for t in tasks if (families is None or t["family"] in families)
            and (levels is None or t["level"] in levels)]


def train_split(families: list[str] | None = None, levels: list[int] | None = None) -> list[dict]:
    return selected([t for t in all_variants() if t["id"] not in eval_ids()], families, levels)


def eval_split(families: list[str] | None = None, levels: list[int] | None = None) -> list[dict]:
    return selected([t for t in all_variants() if t["id"] in eval_ids()], families, levels)


def cycle(tasks: list[dict], seed: int) -> Iterator[dict]:
    """Endless: `tasks` reshuffled (seeded) each pass, ids made unique per pass."""
    rng = random.Random(f"cad-train-{seed}")
    for epoch in itertools.count():
        order = list(tasks)
        rng.shuffle(order)
        for task in order:
            yield {**task, "id": f"{task['id']}-{seed}-{epoch}"}
