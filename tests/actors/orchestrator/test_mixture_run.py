"""A mixture end to end: `postrain up` with two [[tasks]], one of whose environments raises on
some prompts, its shares following the learning signal and with a KL target of its own. Groups never mix tasks, the failing
task's samples are dropped with the reason while both tasks train, each task is evaluated and
reported, the shares are logged every step, and `postrain samples --task` and `postrain report`
read the run by task."""
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from postrain.actors.orchestrator.ledger import read_events
from postrain.core.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).parent))
from test_orchestrator import FLAKY_TASK  # noqa: E402  (an environment that raises on sevens)


CONFIG = """
[run]
name = "mix"
run_dir = "{run_dir}"
driver = "orchestrator"
[shared]
model = "tiny"
[head]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120
[[tasks]]
task = "arithmetic"
options = {{ include_instructions = false, max_digits = 1, answer_format = "plain" }}
[[tasks]]
name = "flaky"
task = "flaky_task:TASK"
weight = 2
reward_range = [0, 2]
num_eval_tasks = 3
kl_target = 0.01
options = {{ include_instructions = false, max_digits = 1, answer_format = "plain" }}
[[actors]]
name = "generator"
cls = "postrain.actors.generator:GeneratorActor"
cpus = 0.5
memory_mb = 0
options = {{ kv_cache_mb = 16 }}
[[actors]]
name = "learner"
cls = "postrain.actors.learner:LearnerActor"
cpus = 0.5
memory_mb = 0
options = {{ learner = {{ lr = 1e-3, reference_model = "initial", kl_coef = 0.05 }} }}
[[actors]]
name = "env"
cls = "postrain.actors.env:EnvironmentActor"
cpus = 0.1
memory_mb = 0
[[actors]]
name = "orchestrator"
cls = "postrain.actors.orchestrator:OrchestratorActor"
cpus = 0.1
memory_mb = 0
options = {{ num_steps = 3, prompts_per_step = 4, samples_per_prompt = 2, sft_steps = 2, sft_batch_size = 4, num_eval_tasks = 4, max_environment_error_fraction = 1.0, task_weights = "signal", sampling = {{ max_new_tokens = 12 }} }}
"""


@pytest.mark.slow
def test_a_mixture_trains_each_task_in_its_own_groups_and_reports_each(tmp_path):
    (tmp_path / "flaky_task.py").write_text(FLAKY_TASK)
    (tmp_path / "run.toml").write_text(CONFIG.format(run_dir=tmp_path / "runs"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--config", "run.toml"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / "runs" / "mix"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["tasks"] == ["arithmetic", "flaky"] and summary["steps"] == 3
    assert set(summary["eval_by_task"]) == {"arithmetic", "flaky"}
    assert all(set(phases) == {"before", "after_sft", "after"} for phases in summary["eval_by_task"].values())
    # the run's accuracy is the mean of the tasks'
    by_task = summary["eval_by_task"]
    assert summary["eval_after"] == pytest.approx((by_task["arithmetic"]["after"] + by_task["flaky"]["after"]) / 2)
    evals = read_metrics(folder, "eval")
    assert all({"accuracy_arithmetic", "accuracy_flaky"} <= set(row) for row in evals)

    # groups never mix tasks; both tasks were drawn
    events = read_events(folder / "ledger.jsonl")
    tasks_of_group = defaultdict(set)
    for event in events:
        if event["event"] == "created":
            tasks_of_group[(event["batch"], event["group"])].add(event["task"])
    assert all(len(tasks) == 1 for tasks in tasks_of_group.values())
    assert set().union(*tasks_of_group.values()) == {"arithmetic", "flaky"}
    # the failing task's samples are dropped with the user's error; the other task's are not
    task_of = {e["sample_id"]: e["task"] for e in events if e["event"] == "created"}
    dropped = [e for e in events if e["event"] == "dropped" and "dislikes sevens" in e["reason"]]
    assert {task_of[e["sample_id"]] for e in dropped} <= {"flaky"}
    ledger = summary["ledger"]
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["in_flight"] == 0
    assert dropped and {task_of[e["sample_id"]] for e in events if e["event"] == "trained"} == {"arithmetic", "flaky"}

    train_rows = read_metrics(folder, "train")   # each task's figures in the steps that trained it
    assert {key for row in train_rows for key in row if key.startswith("reward_mean_")} == {
        "reward_mean_arithmetic", "reward_mean_flaky"}
    assert all(row[f"num_groups_{task}"] >= 1 for row in train_rows for task in ("arithmetic", "flaky")
               if f"reward_mean_{task}" in row)

    # the flaky task's KL coefficient is its own (its target), the other's the learner's
    assert all(row["kl_coef_flaky"] > 0 and row["kl_coef"] == 0.05 for row in train_rows
               if "reward_mean_flaky" in row)
    # the shares follow the signal: a row per step, each share at least the floor, summing to 1
    weights = read_metrics(folder, "task_weights")
    assert [row["step"] for row in weights] == [1, 2, 3]
    assert all(row["share_arithmetic"] + row["share_flaky"] == pytest.approx(1, abs=1e-3)
               and min(row["share_arithmetic"], row["share_flaky"]) >= 0.05 - 1e-4 for row in weights)

    shown = subprocess.run([sys.executable, "-m", "postrain.cli", "samples", str(folder), "--all", "--task",
                            "arithmetic", "--json", "--limit", "0"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    assert rows and {row["task"] for row in rows} == {"arithmetic"}
    report = subprocess.run([sys.executable, "-m", "postrain.cli", "report", str(folder)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    page = (folder / "report.html").read_text()
    assert "<h2>Tasks</h2><table id=tasks>" in page and "<td>flaky</td>" in page
