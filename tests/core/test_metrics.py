"""Run metrics: JSONL rows, and TensorBoard scalars beside them where tensorboard is installed."""
import math
import sys

import pytest

from postrain.core.metrics import MetricsWriter, read_metrics


def test_rows_are_jsonl_with_time_kind_and_figures(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.log("train", step=1, reward_mean=0.5, kl=math.nan, phase="rl")
    writer.close()
    [row] = read_metrics(tmp_path, "train")
    assert row["step"] == 1 and row["reward_mean"] == 0.5 and row["kl"] is None and row["phase"] == "rl"
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_event_files_hold_every_numeric_figure_by_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path)
    assert writer.tensorboard_dir == tmp_path / "tensorboard"
    writer.log("train", step=1, reward_mean=0.25, kl=0.01, phase="rl")
    writer.log("train", step=2, reward_mean=0.75, kl=0.02, phase="rl")
    writer.log("eval", phase="after", accuracy=0.5)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")), "written as it logs"
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/reward_mean", "train/kl", "eval/accuracy"} <= set(events.Tags()["scalars"])
    rewards = events.Scalars("train/reward_mean")
    assert [(e.step, e.value) for e in rewards] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(1, 0.5)]  # its first eval row


def test_without_tensorboard_the_writer_logs_jsonl_alone(tmp_path, monkeypatch):
    for name in ("tensorboard", "tensorboard.summary.writer.event_file_writer"):
        monkeypatch.setitem(sys.modules, name, None)   # what a missing package looks like
    writer = MetricsWriter(tmp_path)
    assert writer.tensorboard_dir is None
    writer.log("train", step=1, reward_mean=0.5)
    writer.close()
    assert read_metrics(tmp_path, "train")[0]["reward_mean"] == 0.5
    assert not (tmp_path / "tensorboard").exists()
