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
