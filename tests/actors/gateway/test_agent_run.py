"""A real short RL run (`postrain up`, every role a real process, the tiny model) whose environment is
the shipped OpenAI Agents SDK example (examples/agents/arithmetic_agent.py) playing through the
gateway: the ledger balances, samples train, and `postrain trace` shows each episode's model calls."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agents" / "arithmetic_agent.py"


@pytest.mark.slow
def test_an_agent_environment_trains_in_a_short_run(tmp_path, monkeypatch):
    pytest.importorskip("agents", reason="the example needs the OpenAI Agents SDK: pip install 'postrain[agents]'")
    shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from task_runs import run_config, run_task   # tests/actors/task_runs.py
    actors = run_config(tmp_path, "", {})["actors"]
    gateway = {"name": "gateway", "cls": "postrain.actors.gateway:GatewayActor", "cpus": 0.1, "memory_mb": 0}
    actors.insert([a["name"] for a in actors].index("env"), gateway)
    orchestrator = actors[-1]["options"]
    orchestrator.update(num_eval_tasks=0, prompts_per_step=2)   # the cheapest run that trains: 2 x 2 samples
    summary, folder = run_task(tmp_path, "arithmetic_agent:ArithmeticAgent", {"max_digits": 1, "num_eval": 2},
                               extra={"actors": actors})
    ledger = summary["ledger"]
    assert summary["steps"] == 1 and ledger["created"] == 4 and ledger["in_flight"] == 0
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["trained"] == 4, ledger
    events = [json.loads(line) for line in (folder / "ledger.jsonl").read_text().splitlines()]
    sample_id = next(e["sample_id"] for e in events if e.get("event") == "trained")
    trace = subprocess.run([sys.executable, "-m", "postrain.cli", "trace", str(folder), sample_id],
                           capture_output=True, text=True, timeout=120)
    assert trace.returncode == 0, trace.stderr
    assert "generate" in trace.stdout and "gateway" in trace.stdout and "policy v0" in trace.stdout, trace.stdout
