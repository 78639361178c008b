"""JSONL files a full disk or a kill cannot break: whole lines or nothing, torn tails repaired.

The full disk is real: a small tmpfs (the `small_disk` fixture, tests/conftest.py).
"""
import json

import pytest

from postrain.core.errors import DiskFullError
from postrain.core.jsonl import JsonlAppender, read_jsonl, repair_torn_tail
from postrain.core.metrics import MetricsWriter, read_metrics


def fill_until_full(out: JsonlAppender, row: dict) -> int:
    """Append `row` until the disk refuses one; returns how many went in."""
    for count in range(100_000):
        try:
            out.append({**row, "n": count})
        except DiskFullError as exc:
            assert str(out.path) in str(exc) and "free space" in str(exc), exc
            return count
    raise AssertionError("the disk never filled")


def assert_whole_lines(path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), "the file ends on a whole line"
    return [json.loads(line) for line in data.splitlines()]


def test_a_full_disk_refuses_the_whole_line_and_the_file_stays_whole(small_disk):
    folder = small_disk(64)
    out = JsonlAppender(folder / "events.jsonl")
    written = fill_until_full(out, {"pad": "x" * 333})   # 350-byte lines: the last one is split by the page end
    rows = assert_whole_lines(folder / "events.jsonl")
    assert [row["n"] for row in rows] == list(range(written)), "every accepted line is there, in order"
    with pytest.raises(DiskFullError):
        out.append({"pad": "x" * 333, "n": "again"})   # the same line meets the same full page
    assert len(assert_whole_lines(folder / "events.jsonl")) == written


def test_metrics_writer_raises_or_skips_on_a_full_disk_and_keeps_its_file_whole(small_disk):
    folder = small_disk(32)
    writer = MetricsWriter(folder, tensorboard=False)
    with pytest.raises(DiskFullError, match="metrics.jsonl"):
        for step in range(100_000):
            writer.log("train", step=step, note="y" * 200)
    head_rows = MetricsWriter(folder, tensorboard=False, skip_rows_when_full=True)
    head_rows.log("queue", env_queued=3, note="y" * 200)   # no room (as long as the refused row): skipped,
    #                                                      not raised: the head must go on
    assert head_rows.num_skipped == 1
    rows = assert_whole_lines(folder / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(len(rows)))
    assert read_metrics(folder, "train") == rows


def test_a_torn_last_line_is_cut_on_repair_and_skipped_by_readers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = b'{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n'
    path.write_bytes(whole + b'{"kind": "tra')          # what a writer killed mid-line leaves
    assert [row["step"] for row in read_jsonl(path)] == [1, 2], "readers skip the torn line"
    assert repair_torn_tail(path) == (len(whole), b'{"kind": "tra')
    assert path.read_bytes() == whole
    assert repair_torn_tail(path) is None, "a whole file is left alone"
    path.write_bytes(whole + b'{"kind": "tr{"kind": "train", "step": 3}\n')   # torn, then another writer's line
    assert repair_torn_tail(path) == (len(whole), b'{"kind": "tr{"kind": "train", "step": 3}\n')
    assert repair_torn_tail(tmp_path / "missing.jsonl") is None


def test_a_broken_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b\n{"c": 3}\n')
    with pytest.raises(ValueError, match="ledger.jsonl:2 is not a JSON line"):
        list(read_jsonl(path))
