"""`postrain trace RUN_DIR SAMPLE_ID`: one sample's life from a synthetic ledger.jsonl."""
import argparse
import json

import pytest

from postrain.cli import trace as trace_command

T0 = 1000.0
EVENTS = [
    {"time": T0, "sample_id": "b0-g0-s0", "event": "created", "batch": 0, "group": 0, "prompt": "What is 3 + 4?"},
    {"time": T0, "sample_id": "b0-g0-s1", "event": "created", "batch": 0, "group": 0, "prompt": "What is 3 + 4?"},
    {"time": T0 + 0.5, "sample_id": "b0-g0-s0", "event": "episode", "at": T0 + 0.002, "actor": "env",
     "duration_ms": 300.0, "num_turns": 2},
    {"time": T0 + 0.5, "sample_id": "b0-g0-s0", "event": "generate", "at": T0 + 0.003, "actor": "generator",
     "duration_ms": 80.0, "num_tokens": 24, "policy_versions": [1]},
    {"time": T0 + 0.5, "sample_id": "b0-g0-s0", "event": "tool", "at": T0 + 0.090, "actor": "sandbox",
     "call": "exec", "duration_ms": 7.5, "status": "ok"},
    {"time": T0 + 0.5, "sample_id": "b0-g0-s0", "event": "generate", "at": T0 + 0.100, "actor": "generator",
     "duration_ms": 50.0, "num_tokens": 9, "policy_versions": [1, 2]},
    {"time": T0 + 0.5, "sample_id": "b0-g0-s0", "event": "generated", "tokens": 33},
    {"time": T0 + 0.5, "sample_id": "b0-g0-s0", "event": "rewarded", "reward": 1.1,
     "components": {"correct": 1.0, "format": 1.0}, "tool_statuses": ["ok"]},
    {"time": T0 + 0.6, "sample_id": "b0-g0-s1", "event": "dropped", "reason": "rollout failed: boom"},
    {"time": T0 + 1.5, "sample_id": "b0-g0-s0", "event": "trained", "step": 1, "staleness": 0},
]


def trace(folder, sample_id, capsys) -> str:
    assert trace_command.main(argparse.Namespace(run_folder=str(folder), sample_id=sample_id)) == 0
    return capsys.readouterr().out


def trace_error(folder, sample_id) -> str:
    with pytest.raises(SystemExit) as exit_info:
        trace_command.main(argparse.Namespace(run_folder=str(folder), sample_id=sample_id))
    return str(exit_info.value.code)


def write_ledger(folder):
    (folder / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))


def test_trace_prints_hops_tool_calls_reward_and_step_in_time_order(tmp_path, capsys):
    write_ledger(tmp_path)
    lines = trace(tmp_path, "b0-g0-s0", capsys).splitlines()
    assert lines[0] == "sample b0-g0-s0"
    body = "\n".join(lines)
    expected_in_order = [
        ("+0.0 ms", "created", "batch 0, group 0: What is 3 + 4?"),
        ("+2.0 ms", "rollout", "orchestrator -> env"),
        ("+3.0 ms", "generate", "env -> generator", "24 tokens, policy v1, 80.0 ms"),
        ("+90.0 ms", "tool call", "env -> sandbox", "exec: ok, 7.5 ms"),
        ("+100.0 ms", "generate", "9 tokens, policy v1/v2, 50.0 ms"),
        ("+302.0 ms", "rollout done", "env -> orchestrator", "2 turns, 300.0 ms"),
        ("+500.0 ms", "generated", "33 policy tokens"),
        ("+500.0 ms", "rewarded", "reward 1.100 (correct 1.000, format 1.000); tool statuses ok"),
        ("+1500.0 ms", "trained", "learner", "step 1, staleness 0"),
    ]
    position = 0
    for parts in expected_in_order:
        index = next(i for i, line in enumerate(lines) if i > position and all(p in line for p in parts))
        position = index
    assert lines[-1] == "outcome: trained in step 1"
    assert "b0-g0-s1" not in body


def test_a_dropped_sample_shows_its_reason(tmp_path, capsys):
    write_ledger(tmp_path)
    out = trace(tmp_path, "b0-g0-s1", capsys)
    assert "dropped" in out and out.splitlines()[-1] == "outcome: dropped: rollout failed: boom"


def test_an_unknown_sample_id_is_an_error_listing_known_ids(tmp_path):
    write_ledger(tmp_path)
    message = trace_error(tmp_path, "b9-g9-s9")
    assert message.startswith("postrain trace: unknown sample 'b9-g9-s9'")
    assert "known ids: b0-g0-s0, b0-g0-s1" in message
    assert "no ledger at" in trace_error(tmp_path / "nowhere", "b0-g0-s0")


def test_trace_ends_with_what_the_model_said_when_the_run_recorded_it(tmp_path, capsys):
    write_ledger(tmp_path)
    (tmp_path / "samples.jsonl").write_text(json.dumps({
        "sample_id": "b0-g0-s0", "step": 1, "group": 0, "outcome": "trained", "reward": 1.1,
        "components": {"correct": 1.0}, "advantage": 0.7, "prompt": "What is 3 + 4?",
        "turns": [{"completion": "<python>print(3 + 4)</python>", "tool_output": "<output>7</output>"},
                  {"completion": "<answer>7</answer>", "tool_output": ""}]}) + "\n")
    out = trace(tmp_path, "b0-g0-s0", capsys)
    hops, texts = out.split("outcome: trained in step 1\n\n")
    assert texts.startswith("sample b0-g0-s0  step 1  group 0  trained  reward 1.100 (correct 1.000)")
    assert "  completion 1:\n    <python>print(3 + 4)</python>\n  tool output 1:\n    <output>7</output>" in texts
    assert "  completion 2:\n    <answer>7</answer>" in texts
    assert trace(tmp_path, "b0-g0-s1", capsys).splitlines()[-1].startswith("outcome: dropped")   # no text line


def test_an_agent_episode_traces_from_the_environment_to_the_gateway_with_its_turns(tmp_path, capsys):
    """An agent episode's hops (actors/env/agent.py) as `postrain trace` shows them: the episode is
    the environment actor's, each model call goes to the gateway, the turns are its calls."""
    import trio

    from postrain.actors.env.agent import AgentEnvironment, agent_rollout
    from postrain.actors.env.api import Reward
    from postrain.actors.env.timeline import Timeline, note_hops
    from postrain.actors.orchestrator.ledger import SampleLedger
    from postrain.actors.records import (CLOSE_EPISODE, EpisodeCall, EpisodeSegment, EpisodeSegments,
                                         GatewayAddress)

    class Gateway:   # the gateway actor's two replies: an episode of two calls
        name = "gateway"

        async def call(self, kind, request=None):
            if kind is not CLOSE_EPISODE:
                return None
            calls = [EpisodeCall(1, 2, [0], T0 + 0.01, 5.0), EpisodeCall(4, 1, [0], T0 + 0.02, 4.0)]
            return EpisodeSegments([EpisodeSegment([1, 2, 3, 4, 5], [0, 1, 1, 0, 1], [0.0, -1.0, -1.0, 0.0, -1.0],
                                                   [-1, 0, 0, -1, 0], calls)], num_calls=2)

    class Agent(AgentEnvironment):
        async def run(self, client, task):
            return Reward({"correct": 1.0})

    address = GatewayAddress(url="http://127.0.0.1:9", base_url="http://127.0.0.1:9/v1", model="tiny")
    rollout = trio.run(agent_rollout, Agent(), {}, Gateway(), address, Timeline(), "env-0")
    ledger = SampleLedger(tmp_path / "ledger.jsonl")
    ledger.create("b0-g0-s0", batch=0, group=0)
    note_hops(ledger, "b0-g0-s0", rollout.timeline)
    shown = trace(tmp_path, "b0-g0-s0", capsys)
    assert "orchestrator -> env-0" in shown and shown.count("env-0 -> gateway") == 2
    assert "2 turns" in shown and "gateway -> gateway" not in shown and "? turns" not in shown


def test_a_judge_call_is_a_line_with_its_verdict_tokens_and_whether_it_was_cached():
    call = {"rubric": "3f2a", "messages": [{"role": "system", "content": "You are a judge."}],
            "reply": "VERDICT: PASS", "latency_s": 0.9, "verdict": "PASS", "raw": 1.0, "reward": 1.0,
            "prompt_tokens": 612, "completion_tokens": 3, "cached": True}
    events = [EVENTS[0],
              {"time": T0 + 0.5, "sample_id": "b0-g0-s0", "event": "judge", "at": T0 + 0.120, "actor": "judge",
               "duration_ms": 1.5, "rubric": "3f2a", "call": call},
              {"time": T0 + 0.5, "sample_id": "b0-g0-s0", "event": "judge", "at": T0 + 0.200, "actor": "judge",
               "duration_ms": 900.0, "rubric": "3f2a", "status": "failed: JudgeFailed",
               "error": "judge answered out of format: an empty reply\nmore", "call": {**call, "cached": False}}]
    lines = trace_command.format_trace("b0-g0-s0", events).splitlines()
    assert lines[2].split(None, 2)[2].split() == (
        "judge call env -> judge rubric 3f2a: verdict PASS (reward 1.000), 612 + 3 tokens, cached, 1.5 ms").split()
    assert lines[3].endswith("rubric 3f2a: failed: judge answered out of format: an empty reply, 612 + 3 tokens, "
                             "900.0 ms")
