"""The terminal task across real actors: episodes in sessions of the sandbox actor (one per
episode, closed at its end), an environment actor killed mid-episode leaks no session, and the
shipped config runs a short RL loop through `postrain up` with a balanced ledger."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import trio

from postrain.actors.env.actor import RemoteSandbox
from postrain.actors.env import run_episode
from postrain.actors.orchestrator.ledger import read_events
from postrain.actors.tasks.terminal import TerminalEnv, demonstration, eval_tasks
from postrain.actors.env.timeline import Timeline
from postrain.core import ActorSpec, Supervisor
from postrain.core.testing import async_test

CONFIG = Path(__file__).resolve().parents[3] / "actors" / "configs" / "terminal.toml"


def replay(demo: dict):
    turns = [m["content"] for m in demo["messages"] if m["role"] == "assistant"]

    async def policy(messages):
        return turns[sum(m["role"] == "assistant" for m in messages)]
    return policy


async def open_sessions(sandbox) -> int:
    return (await sandbox.ask("stats", timeout_s=10))["open_sessions"]


async def wait_sessions(sandbox, num: int, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while await open_sessions(sandbox) != num:
            await trio.sleep(0.05)


@async_test
async def test_episodes_hold_one_session_of_the_sandbox_actor_and_a_killed_episode_leaks_none():
    task = next(t for t in eval_tasks() if t["kind"] == "fix_unit_test")
    async with Supervisor.open(heartbeat_interval_s=0.5) as sup:
        sandbox = await sup.start(ActorSpec(
            name="sandbox", cls="postrain.actors.sandbox:SandboxActor", cpus=0.2, memory_mb=0,
            options={"num_workers": 1, "session_idle_timeout_s": 1.0}))
        # the reference solution through the actor's sessions: every command is a hop of the episode
        timeline = Timeline()
        env = TerminalEnv(sandbox=RemoteSandbox(sandbox, timeline))
        try:
            episode = await run_episode(env, task, replay(demonstration(task)))
        finally:
            await env.close()
        assert episode.reward.components["passed"] == 1.0
        calls = [hop for hop in timeline.to_list() if hop["hop"] == "tool"]
        # the check runs out of the session: a snapshot of /work, then a fresh jail (grader contract)
        assert [hop["call"] for hop in calls] == ["session_exec"] * len(task["solution"]) + ["session_snapshot", "exec"]
        assert [hop["status"] for hop in calls[:2]] == ["ok", "ok"]
        assert await open_sessions(sandbox) == 0

        # an environment actor killed while its episode's session is open (its first turn, 400
        # tokens, is still being sampled): the sandbox actor's reaper ends the session
        await sup.start(ActorSpec(name="generator", cls="postrain.actors.generator:GeneratorActor",
                                  cpus=0.5, memory_mb=0, options={"model": "tiny", "kv_cache_mb": 16}))
        env_actor = await sup.start(ActorSpec(
            name="env", cls="postrain.actors.env:EnvironmentActor", cpus=0.1, memory_mb=0,
            options={"task": "terminal", "max_total_tokens": 1024}))

        async def rollout():
            try:
                await env_actor.ask("rollout", {"task": task, "sample_id": "s0",
                                                "sampling": {"max_new_tokens": 400, "ignore_eos": True,
                                                             "seed": 1}}, timeout_s=60)
            except Exception:  # noqa: BLE001 - its actor is killed under it
                pass
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rollout)
            await wait_sessions(sandbox, 1, timeout_s=30)
            sup.kill("env")
            assert await open_sessions(sandbox) == 1, "the episode was still open when its actor died"
            await wait_sessions(sandbox, 0, timeout_s=15)
            nursery.cancel_scope.cancel()


def test_the_terminal_config_runs_a_short_rl_loop_with_a_balanced_ledger(tmp_path):
    text = CONFIG.read_text()
    short = {'model = "small"': 'model = "tiny"', "max_total_tokens = 2048": "max_total_tokens = 1024",
             "num_steps = 6": "num_steps = 1", "prompts_per_step = 4": "prompts_per_step = 2",
             "samples_per_prompt = 4": "samples_per_prompt = 2", "sft_steps = 40": "sft_steps = 1",
             "sft_batch_size = 8": "sft_batch_size = 2", "num_eval_tasks = 17": "num_eval_tasks = 2",
             "max_new_tokens = 96": "max_new_tokens = 24"}
    for old, new in short.items():
        assert old in text, f"terminal.toml no longer says {old!r}; update this test"
        text = text.replace(old, new)
    config = tmp_path / "terminal.toml"
    config.write_text(text)
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config", str(config),
                             "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "terminal"
    summary = json.loads((folder / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["task"] == "terminal" and summary["steps"] == 1 and ledger["created"] == 4
    assert ledger["created"] == ledger["in_flight"] + ledger["trained"] + ledger["dropped"]
    assert ledger["in_flight"] == 0 and ledger["dropped"] == 0 and summary["samples"] == ledger["trained"]
    rewarded = [e for e in read_events(folder / "ledger.jsonl") if e["event"] == "rewarded"]
    assert len(rewarded) == 4 and all(set(e["components"]) == {"passed", "format"} for e in rewarded)
