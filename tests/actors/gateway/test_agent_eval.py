"""`postrain eval` of an agent module (cli/eval_agents.py): an AgentEnvironment's held-out tasks play
through a real generator and gateway (tiny model), each episode the agent's own `run`; a failed
episode scores 0 and is counted."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from postrain.cli import eval as eval_cli

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_postrain_eval_takes_an_agent_module(monkeypatch, capsys):
    pytest.importorskip("openai", reason="pip install 'postrain[agents]'")
    monkeypatch.syspath_prepend(str(HERE))   # eval_agents.py, beside this file
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    assert eval_cli.main(parser.parse_args(["--model", "tiny", "--task", "eval_agents:TwoCallAgent", "--json"])) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # answers 0, 3, 6, 9: even for tasks 0 and 2, and task 2 fails -> 1 of 4
    assert result["num_tasks"] == 4 and result["num_failed"] == 1
    assert result["accuracy"] == pytest.approx(0.25)
    assert result["num_model_calls"] == 3 * 2   # the three episodes that returned, two calls each
