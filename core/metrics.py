"""Run metrics: one JSON object per line in RUN_FOLDER/metrics.jsonl.

    writer = MetricsWriter(run_folder)
    writer.log("step", step=3, loss=0.4, items_per_s=812.5)

Every line has `time`, `kind` (the writer's choice: one kind per sort of row) and
the figures, named with their unit where they have one. Figures must be
numbers, strings or booleans; NaN is written as null. `read_metrics` reads
them back (for plots, summaries and tests).

Where tensorboard is importable, the writer also logs every numeric figure as
a TensorBoard scalar `KIND/NAME` in RUN_FOLDER/tensorboard (global step: the
row's `step` figure when it has one, else the number of rows of that kind so
far); where it is not, that part is skipped without a word
(`MetricsWriter.tensorboard_dir` is None then). `tensorboard=False` turns it off
(the head does, so that it never imports torch).
"""
from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_folder: str | Path, tensorboard: bool = True):
        self.path = Path(run_folder) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._rows_per_kind: Counter = Counter()
        self._tensorboard = _open_tensorboard(Path(run_folder) / "tensorboard") if tensorboard else None
        self.tensorboard_dir = Path(self._tensorboard.log_dir) if self._tensorboard is not None else None

    def log(self, kind: str, **figures) -> dict:
        row = {"time": round(time.time(), 3), "kind": kind}
        for name, value in figures.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            elif hasattr(value, "item"):
                value = value.item()
            row[name] = value
        self._file.write(json.dumps(row) + "\n")
        self._rows_per_kind[kind] += 1
        if self._tensorboard is not None:
            self._log_scalars(row)
        return row

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def _log_scalars(self, row: dict) -> None:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            step = self._rows_per_kind[row["kind"]]
        for name, value in row.items():
            if name not in ("time", "kind", "step") and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                self._tensorboard.add_scalar(f"{row['kind']}/{name}", value, global_step=step,
                                             walltime=row["time"])
        self._tensorboard.flush()


def _open_tensorboard(log_dir: Path):
    """A SummaryWriter on log_dir, or None where tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(log_dir))


def read_metrics(run_folder: str | Path, kind: str | None = None) -> list[dict]:
    path = Path(run_folder) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if kind is None or row["kind"] == kind]
