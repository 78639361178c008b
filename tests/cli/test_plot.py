"""`postrain plot RUN_DIR`: PNG charts from a synthetic run folder."""
import argparse
import json

import pytest

from postrain.cli import plot as plot_command
from postrain.cli.plot import PlotError, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def synthetic_run(folder, with_queues=True, kl=0.01):
    rows = [{"time": 100.0, "kind": "eval", "phase": "before", "accuracy": 0.0}]
    rows += [{"time": 100.0 + i / 10, "kind": "sft", "step": i + 1, "loss": 2.0 / (i + 1)} for i in range(4)]
    rows += [{"time": 101.0, "kind": "eval", "phase": "after_sft", "accuracy": 0.6}]
    for step in range(1, 6):
        rows.append({"time": 101.0 + step, "kind": "train", "step": step, "reward_mean": 0.1 * step,
                     "correct_mean": 0.08 * step, "kl": kl * step, "tokens_per_s": 5000 + step,
                     "staleness_max": step % 2})
        if with_queues:
            rows.append({"time": 101.5 + step, "kind": "queue", "prompts_waiting": step, "sandbox_queue": 2})
    rows.append({"time": 110.0, "kind": "eval", "phase": "after", "accuracy": 0.7})
    write_jsonl(folder / "metrics.jsonl", rows)
    write_jsonl(folder / "ledger.jsonl", [{"time": 105.0, "sample_id": f"b0-g0-s{i}", "event": "trained",
                                           "step": 1, "staleness": i % 3} for i in range(7)])


def test_plot_writes_a_png_per_chart(tmp_path):
    synthetic_run(tmp_path)
    written, skipped = plot_run(tmp_path)
    names = {path.name for path in written}
    assert names == {"reward.png", "accuracy.png", "warm_start.png", "kl.png", "throughput.png", "staleness.png",
                     "queues.png"}
    assert skipped == {}
    for path in written:
        assert path.parent == tmp_path / "plots" and path.read_bytes()[:8] == PNG_MAGIC


def test_missing_series_are_skipped_with_a_note(tmp_path, capsys):
    synthetic_run(tmp_path, with_queues=False)
    (tmp_path / "ledger.jsonl").unlink()
    assert plot_command.main(argparse.Namespace(run_folder=str(tmp_path))) == 0
    out = capsys.readouterr().out
    assert "skipped queues.png: no queue rows" in out
    assert f"wrote {tmp_path / 'plots' / 'staleness.png'}" in out   # from the train rows instead
    assert not (tmp_path / "plots" / "queues.png").exists()


def test_an_absent_or_empty_metrics_file_is_a_clear_error(tmp_path):
    with pytest.raises(PlotError, match="metrics.jsonl does not exist; pass the run folder"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="metrics.jsonl is empty"):
        plot_run(tmp_path)
    with pytest.raises(SystemExit, match="postrain plot: .*metrics.jsonl is empty"):
        plot_command.main(argparse.Namespace(run_folder=str(tmp_path)))


def test_accuracy_is_a_point_per_evaluation_against_wall_time(tmp_path):
    synthetic_run(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows.insert(9, {"time": 103.0, "kind": "eval", "phase": "step_2", "step": 2, "accuracy": 0.65,
                    "accuracy_sampled": 0.5})
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    figure = plot_command._accuracy_chart(plot_command.load_run(tmp_path))
    greedy, sampled = figure.axes[0].get_lines()
    assert list(greedy.get_xdata()) == pytest.approx([0.0, 1 / 60, 3 / 60, 10 / 60])   # minutes
    assert list(greedy.get_ydata()) == [0.0, 0.6, 0.65, 0.7]
    assert list(sampled.get_ydata()) == [0.5]


def test_kl_is_drawn_only_when_the_run_uses_kl(tmp_path):
    synthetic_run(tmp_path, kl=0.0)
    written, skipped = plot_run(tmp_path)
    assert "kl.png" not in {path.name for path in written}
    assert skipped == {"kl.png": "KL is 0 at every step: the run does not use KL (kl_coef = 0, no kl_target)"}


def test_the_warm_start_loss_is_a_point_per_sft_row_and_a_run_without_one_skips_it(tmp_path):
    synthetic_run(tmp_path)
    run = plot_command.load_run(tmp_path)
    (line,) = plot_command._warm_start_chart(run).axes[0].get_lines()
    assert list(line.get_xdata()) == [1, 2, 3, 4] and list(line.get_ydata()) == [2.0, 1.0, 2 / 3, 0.5]
    run["sft"] = []
    assert "sft_steps = 0" in plot_command._warm_start_chart(run)


def test_queues_are_one_panel_per_actor_with_a_moving_average(tmp_path):
    assert plot_command.queue_panels(["env_queued", "env_running", "sandbox_queued", "prompts_waiting"]) == {
        "env": ["env_queued", "env_running"], "sandbox": ["sandbox_queued"], "prompts_waiting": ["prompts_waiting"]}
    assert plot_command.moving_average([0, 10, 0, 10, 20], 2) == [0, 5, 5, 5, 15]
    rows = [{"time": 100.0 + 2 * i, "kind": "queue", "env_queued": i % 3, "env_running": 1,
             "generator_queued": 5 - i % 2} for i in range(12)]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    figure = plot_command._queues_chart(plot_command.load_run(tmp_path))
    assert [axes.get_ylabel() for axes in figure.axes] == ["env", "generator"]
    assert len(figure.axes[0].get_lines()) == 4   # queued and running, each smoothed and raw
