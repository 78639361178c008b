"""A real short RL run (`postrain up`, every role a real process, the tiny model) on the long-context
task (actors/tasks/long_context.py) under a context policy: episodes outgrow the context and go on
in new segments, every segment trains as its own sample, the ledger balances, and `postrain trace`
shows an episode's segments; the shipped config (actors/configs/long_context.toml) validates. The
default selection runs one strategy; the other two are behind the
`arch_matrix` marker (`pytest -m arch_matrix tests/actors/tasks/test_long_context_run.py`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[3] / "actors" / "configs" / "long_context.toml"
STRATEGIES = [pytest.param("drop_oldest_turns"),
              pytest.param("truncate_tool_outputs", marks=pytest.mark.arch_matrix),
              pytest.param("summarize", marks=pytest.mark.arch_matrix)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_episodes_longer_than_the_context_train_every_segment_in_a_short_run(tmp_path, monkeypatch, strategy):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from task_runs import run_config, run_task   # tests/actors/task_runs.py
    actors = run_config(tmp_path, "", {})["actors"]
    env = next(a for a in actors if a["name"] == "env")
    env["options"] = {"max_total_tokens": 1024, "context": {"max_tokens": 400, "strategy": strategy,
                                                            "keep_chars": 30}}
    orchestrator = actors[-1]["options"]
    orchestrator.update(num_eval_tasks=0, prompts_per_step=2, sampling={"max_new_tokens": 8})
    summary, folder = run_task(tmp_path, "long_context", {"num_files": 3, "file_lines": 3},
                               extra={"actors": actors})
    ledger = summary["ledger"]
    assert summary["steps"] == 1 and ledger["in_flight"] == 0
    assert ledger["created"] == ledger["trained"] + ledger["dropped"], ledger
    events = [json.loads(line) for line in (folder / "ledger.jsonl").read_text().splitlines()]
    notes = [e for e in events if e["event"] == "segments"]
    assert notes, "episodes outgrew the context"
    segment_ids = {sid for note in notes for sid in note["segment_ids"]}
    trained = {e["sample_id"] for e in events if e["event"] == "trained"}
    assert ledger["created"] == 4 + len(segment_ids) and ledger["trained"] == len(trained) == ledger["created"]
    episode = notes[0]["sample_id"]
    trace = subprocess.run([sys.executable, "-m", "postrain.cli", "trace", str(folder), episode],
                           capture_output=True, text=True, timeout=120)
    assert trace.returncode == 0, trace.stderr
    assert f"segment_ids={notes[0]['segment_ids']}" in trace.stdout and "trained in step 1" in trace.stdout
    segment = subprocess.run([sys.executable, "-m", "postrain.cli", "trace", str(folder), notes[0]["segment_ids"][0]],
                             capture_output=True, text=True, timeout=120)
    assert segment.returncode == 0 and "trained in step 1" in segment.stdout, segment.stdout + segment.stderr


def test_the_shipped_long_context_config_validates_and_places(capsys):
    from postrain import cli
    assert cli.main(["up", "--config", str(CONFIG), "--dry-run"]) == 0
    assert "env: cores" in capsys.readouterr().out
