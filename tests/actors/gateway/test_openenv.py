"""The OpenEnv adapter (actors/env/openenv_adapter.py): a small environment written with OpenEnv's own
API (openenv_words.py, beside this file) served as a local process by the adapter, played through
`postrain eval`'s episode driver; its server's rewards are the episode's, and bad options are named."""
from __future__ import annotations

from pathlib import Path

import pytest

from postrain.actors import TaskOptionsError, get_task
from postrain.cli.eval import evaluate
from postrain.core.testing import async_test

HERE = Path(__file__).resolve().parent
TASK = "postrain.actors.env.openenv_adapter:OpenEnvEnvironment"
OPTIONS = {"app": "openenv_words:app", "observation_field": "prompt", "num_eval": 4, "max_turns": 2}


@pytest.mark.slow
@async_test
async def test_an_openenv_environment_runs_in_postrain_eval_with_its_own_reward(monkeypatch):
    pytest.importorskip("openenv", reason="pip install openenv-core")
    monkeypatch.setenv("PYTHONPATH", str(HERE))   # the server process imports openenv_words from here
    seen = []

    async def policy(messages):
        """Says the word asked for, except 'river', which it never gets right."""
        seen.append(messages[-1]["content"])
        word = messages[-1]["content"].rstrip(".").split()[-1]
        return "banana" if word == "river" else word
    result = await evaluate("tiny", TASK, OPTIONS, None, 8, policy=policy)
    assert result["num_tasks"] == 4 and result["num_failed"] == 0
    # eval seeds 1e6 + i: apple, river, stone, cloud; river is asked twice (max_turns = 2)
    assert seen == ["Say the word apple.", "Say the word river.", "No. Say the word river.", "Say the word stone.",
                    "Say the word cloud."]
    assert result["accuracy"] == pytest.approx(0.75)   # the server's rewards: 1 for the word said, else 0


def test_openenv_options_name_the_fix():
    spec = get_task(TASK)
    with pytest.raises(TaskOptionsError, match="give exactly one of app"):
        spec.check_options({})
    with pytest.raises(TaskOptionsError, match="action_feild"):
        spec.check_options({"base_url": "http://127.0.0.1:1", "action_feild": "x"})
    tasks = spec.eval_tasks(spec.check_options({"base_url": "http://127.0.0.1:1", "num_eval": 3}))
    assert [t["seed"] for t in tasks] == [1_000_000, 1_000_001, 1_000_002]


@pytest.mark.slow
@pytest.mark.arch_matrix   # a whole `postrain up` (~30-60 s): deselected by default; docs/agents.md says how to run it
def test_an_openenv_environment_trains_in_a_short_run(tmp_path, monkeypatch):
    """The adapter's environment (its server a local process the env actor starts) in a real short
    `postrain up`: one GRPO step of 3 prompts x 2 samples trains, the ledger balances, and the
    rewards are the server's."""
    pytest.importorskip("openenv", reason="pip install openenv-core")
    import json
    import shutil
    shutil.copy(HERE / "openenv_words.py", tmp_path / "openenv_words.py")   # tmp_path is on the run's PYTHONPATH
    monkeypatch.syspath_prepend(str(HERE.parent))
    from task_runs import run_task   # tests/actors/task_runs.py
    summary, folder = run_task(tmp_path, TASK, {**OPTIONS, "num_eval": 2})
    ledger = summary["ledger"]
    assert summary["steps"] == 1 and ledger["in_flight"] == 0, summary
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["trained"] == 6, ledger
    events = [json.loads(line) for line in (folder / "ledger.jsonl").read_text().splitlines()]
    rewarded = [e for e in events if e.get("event") == "rewarded"]
    assert rewarded and all(set(e.get("reward_components", {"openenv": 0})) <= {"openenv"} for e in rewarded), rewarded[:2]
