"""Run metrics: one JSON object per line in RUN_FOLDER/metrics.jsonl.

    writer = MetricsWriter(run_folder)
    writer.log("train", step=3, reward_mean=0.4, kl=0.01)

Every line has `time`, `kind` (train, eval, rollout, sync, queue, ...) and
the figures, named with their unit where they have one. Figures must be
numbers, strings or booleans; NaN is written as null. `read_metrics` reads
them back (for plots, summaries and tests).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_folder: str | Path):
        self.path = Path(run_folder) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)

    def log(self, kind: str, **figures) -> dict:
        row = {"time": round(time.time(), 3), "kind": kind}
        for name, value in figures.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            elif hasattr(value, "item"):
                value = value.item()
            row[name] = value
        self._file.write(json.dumps(row) + "\n")
        return row

    def close(self) -> None:
        self._file.close()


def read_metrics(run_folder: str | Path, kind: str | None = None) -> list[dict]:
    path = Path(run_folder) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if kind is None or row["kind"] == kind]
