"""Elastic cores in a real run: the same samples, the same lifecycles, as with pinned cores.

Two `postrain up` runs of one small config and seed, one with the learner and the generator
`elastic`, one pinned, run side by side. The elastic run moves cores (its "cores" metrics rows:
the generator's core lent to the learner for the warm start, and back) and ends with the same
ledger: every sample id, its batch and group, and its lifecycle up to the step that trained it.
"""
import json
import subprocess
import sys

import pytest

from postrain.actors.orchestrator.ledger import STATES, read_events
from postrain.core.metrics import read_metrics

CONFIG = """
[run]
name = "run"
run_dir = "{run_dir}"
driver = "orchestrator"
[shared]
model = "tiny"
task = "arithmetic"
task_options = {{ include_instructions = false, max_digits = 1 }}
[head]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120
[balancer]
enabled = false
[[actors]]
name = "sandbox"
cls = "postrain.actors.sandbox:SandboxActor"
cpus = 0.2
memory_mb = 0
options = {{ mode = "warm", num_workers = 1 }}
[[actors]]
name = "generator"
cls = "postrain.actors.generator:GeneratorActor"
cpus = 0.7
elastic = {elastic}
memory_mb = 0
options = {{ kv_cache_mb = 16 }}
[[actors]]
name = "learner"
cls = "postrain.actors.learner:LearnerActor"
cpus = 0.7
elastic = {elastic}
memory_mb = 0
options = {{ learner = {{ lr = 1e-3 }} }}
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
options = {{ num_steps = 2, prompts_per_step = 2, samples_per_prompt = 2, max_staleness = 1, sft_steps = 2, sft_batch_size = 4, num_eval_tasks = 2, sampling = {{ max_new_tokens = 16 }} }}
"""


def lifecycles(folder) -> dict:
    """sample id -> (batch, group, [(state, step or reason)]) from the run's ledger."""
    samples = {}
    for event in read_events(folder / "ledger.jsonl"):
        if event["event"] == "created":
            samples[event["sample_id"]] = (event["batch"], event["group"], [])
        if event["event"] in STATES:
            samples[event["sample_id"]][2].append((event["event"], event.get("step", event.get("reason"))))
    return samples


@pytest.mark.variants     # the pinned-core runs of the suite are its cheaper variant
def test_a_run_with_elastic_cores_ends_with_the_same_ledger_as_one_with_pinned_cores(tmp_path):
    runs = {}
    for elastic in ("true", "false"):
        config = tmp_path / f"{elastic}.toml"
        config.write_text(CONFIG.format(run_dir=tmp_path / elastic, elastic=elastic))
        runs[elastic] = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config",
                                          str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)
    for elastic, process in runs.items():
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, f"elastic = {elastic}:\n{out[-3000:]}"
    elastic, pinned = tmp_path / "true" / "run", tmp_path / "false" / "run"

    moves = read_metrics(elastic, "cores")
    seen = [(row["because"], row["busy"], row["action"], row["giver"], row["taker"], row["taker_threads"])
            for row in moves]
    assert seen[:3] == [("generator", True, "lend", "learner", "generator", 2),    # the first evaluation
                        ("generator", False, "return", "generator", "learner", 1),
                        ("learner", True, "lend", "generator", "learner", 2)]      # the warm start
    assert ("learner", False, "return", "learner", "generator", 1) in seen
    assert read_metrics(pinned, "cores") == []
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (elastic, pinned)]
    assert summaries[0]["cores_moved"] == len(moves) and summaries[1]["cores_moved"] == 0

    assert summaries[0]["ledger"] == summaries[1]["ledger"]
    assert summaries[0]["ledger"]["trained"] == 2 * 2 * 2
    assert lifecycles(elastic) == lifecycles(pinned)
