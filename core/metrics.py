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
(the head does). The events are written with tensorboard's own event writer, not torch's
SummaryWriter, so that a role which never runs the model (the orchestrator) does not import torch.

A full disk: a row is written whole or not at all, and `log` raises DiskFullError
(core/jsonl.py), so the file never ends in half a line; a TensorBoard write refused for
want of space raises the same error. A writer of rows that may be lost (the head's queue
and balance rows: `skip_rows_when_full=True`) skips such a row instead, with one warning.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DiskFullError
from .jsonl import JsonlAppender, disk_full_error, is_disk_full, read_jsonl

if TYPE_CHECKING:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

log = logging.getLogger("postrain.metrics")


class MetricsWriter:
    def __init__(self, run_folder: str | Path, tensorboard: bool = True, skip_rows_when_full: bool = False):
        self.path = Path(run_folder) / "metrics.jsonl"
        self.skip_rows_when_full = skip_rows_when_full
        self.num_skipped = 0   # rows a full disk had no room for (skip_rows_when_full only)
        self._file = JsonlAppender(self.path)
        self._rows_per_kind: Counter[str] = Counter()
        self._tensorboard = open_tensorboard(Path(run_folder) / "tensorboard") if tensorboard else None
        self.tensorboard_dir = Path(self._tensorboard.get_logdir()) if self._tensorboard is not None else None

    def log(self, kind: str, **figures: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"time": round(time.time(), 3), "kind": kind}
        for name, value in figures.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            elif hasattr(value, "item"):
                value = value.item()
            row[name] = value
        try:
            self._file.append(row)
        except DiskFullError as exc:
            if not self.skip_rows_when_full:
                raise
            if not self.num_skipped:
                log.warning("metrics rows skipped from now on while the disk is full: %s", exc)
            self.num_skipped += 1
            return row
        self._rows_per_kind[kind] += 1
        if self._tensorboard is not None:
            try:
                self._log_scalars(row)
            except OSError as exc:
                if is_disk_full(exc):
                    assert self.tensorboard_dir is not None   # set with the writer
                    raise disk_full_error(self.tensorboard_dir, exc) from None
                raise
        return row

    def size(self) -> int:
        """Bytes in metrics.jsonl now, every logged row included (a checkpoint's offset)."""
        return self._file.size()

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def _log_scalars(self, row: dict[str, Any]) -> None:
        assert self._tensorboard is not None   # `log` calls this only with a writer
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            step = self._rows_per_kind[row["kind"]]
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=f"{row['kind']}/{name}", simple_value=float(value))
                  for name, value in row.items()
                  if name not in ("time", "kind", "step") and isinstance(value, (int, float))
                  and not isinstance(value, bool)]
        if values:
            self._tensorboard.add_event(Event(wall_time=row["time"], step=step, summary=Summary(value=values)))
        self._tensorboard.flush()


def open_tensorboard(log_dir: Path) -> EventFileWriter | None:
    """An event file writer on log_dir (TensorBoard's own), or None where tensorboard is not installed."""
    try:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        return None
    return EventFileWriter(str(log_dir))


def read_metrics(run_folder: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    path = Path(run_folder) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = list(read_jsonl(path))   # a half-written last row (a killed writer) is skipped
    return [row for row in rows if kind is None or row["kind"] == kind]
