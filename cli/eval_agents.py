"""`postrain eval` of an agent module: an `AgentEnvironment` task played through a gateway.

A generator actor and a gateway actor are started for the model under a local supervisor (the
pair `postrain serve` starts, on a free port), and each held-out task is one episode of the
agent's `run(client, task)` through the same function the environment actor trains with
(`postrain.actors.env.agent.agent_rollout`), one after another. The agent's own sampling
settings apply. An episode that fails (the agent raised, returned no Reward, made no model
call) scores 0 and is counted in `num_failed`.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile


async def evaluate_agent(model_spec: str, task, task_options, tasks: list[dict], errors) -> dict:
    """Held-out accuracy of `model_spec` on an agent task (the module docstring); `errors`: as
    `score_episodes`'. Cancelled: no result; the actors stop with the supervisor, an episode's
    worker thread is abandoned."""
    import importlib.util

    from postrain.core.errors import PostrainError
    if importlib.util.find_spec("openai") is None:
        raise PostrainError(f"task {task.name!r} is an agent (AgentEnvironment), whose episodes need the "
                            "openai client; fix: pip install 'postrain[agents]'")
    from postrain.actors.env import score_episodes
    from postrain.actors.env.agent import agent_rollout
    from postrain.actors.env.timeline import Timeline
    from postrain.actors.records import GATEWAY_ADDRESS
    from postrain.core import Supervisor

    from .serve import specs

    args = argparse.Namespace(model=model_spec, host="127.0.0.1", port=0, served_model_name=None,
                              kv_cache_mb=64, max_num_seqs=32, seed=0)
    num_calls = 0
    # The actors' own logs go to files (the console shows eval's lines only), kept while eval runs.
    with tempfile.TemporaryDirectory(prefix="postrain-eval-logs-") as log_dir:
        async with Supervisor.open(log_dir=log_dir) as supervisor:
            for spec in specs(args):
                gateway = await supervisor.start(spec)
            address = await gateway.call(GATEWAY_ADDRESS)

            async def play(env, item):
                nonlocal num_calls
                rollout = await agent_rollout(env, item, gateway, address, Timeline())
                num_calls += rollout.num_turns
                return rollout

            scores, failed = await score_episodes(task, task_options, tasks, play, errors)
    return {"task": task.name, "model": str(model_spec), "num_tasks": len(tasks), "num_failed": failed,
            "accuracy": statistics.fmean(scores) if scores else 0.0, "num_model_calls": num_calls}
