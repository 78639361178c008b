"""`postrain trace RUN_DIR SAMPLE_ID`: one sample's life, hop by hop, from the run's ledger.

RUN_DIR/ledger.jsonl holds every sample's state changes (created, generated,
rewarded, trained or dropped) and the notes the orchestrator adds from the
rollout's timeline: the episode at the environment actor, each generate call
to a generator (tokens, policy version), each tool call to the sandbox
(status), each judge call (rubric, verdict and reward or why it failed, the judge's tokens,
cached or not; the prompt and the reply are in the ledger's note). The trace prints them in
time order, relative to the sample's creation:

    sample b0-g1-s0
         +0.0 ms  created      orchestrator             batch 0, group 1: What is 3 + 4?
         +2.1 ms  rollout      orchestrator -> env
         +3.0 ms  generate     env -> generator         24 tokens, policy v1, 80.1 ms
        +83.9 ms  tool call    env -> sandbox           exec: ok, 7.2 ms
       +120.4 ms  judge call   env -> judge             rubric 3f2a...: verdict PASS (reward 1.000), 612 + 3 tokens, 950.2 ms
        ...
       +402.6 ms  rewarded     orchestrator             reward 1.100 (correct 1.000, format 1.000)
      +1503.0 ms  trained      learner                  step 1, staleness 0
    outcome: trained in step 1

(sample ids: `b{batch}-g{group}-s{sample}`, and `.r{k}` after the k-th resume.)
Retries and replays noted by the orchestrator show with their details. Then what the
model said, from RUN_DIR/samples.jsonl when the run recorded it (postrain samples prints
the same for many samples): the prompt, each completion and tool output, the reward and
the advantage.
"""
from __future__ import annotations

from pathlib import Path

from postrain.actors.orchestrator.ledger import read_events
from postrain.actors.orchestrator.sample_log import read_samples
from postrain.core.errors import PostrainError

from .samples import format_sample

HELP = "print one sample's life from a run's ledger: hops, tool calls, reward, the step that trained it"
NUM_KNOWN_IDS_SHOWN = 8


def add_arguments(parser) -> None:
    parser.add_argument("run_folder", help="the run folder (run_dir/name) holding ledger.jsonl")
    parser.add_argument("sample_id", help="a sample id, e.g. b0-g0-s0 (see ledger.jsonl)")


class TraceError(PostrainError, ValueError):
    """No ledger, or no such sample in it."""


def load_sample_events(run_folder: str | Path, sample_id: str) -> list[dict]:
    """The ledger events of one sample; TraceError naming a few known ids when it has none."""
    path = Path(run_folder) / "ledger.jsonl"
    if not path.exists():
        raise TraceError(f"no ledger at {path}; pass the run folder (run_dir/name) of a run that has "
                         "trained samples")
    events = read_events(path)
    mine = [event for event in events if event["sample_id"] == sample_id]
    if not mine:
        known = list(dict.fromkeys(event["sample_id"] for event in events))
        shown = ", ".join(known[:NUM_KNOWN_IDS_SHOWN]) or "(none: the ledger is empty)"
        more = f" ... ({len(known)} samples)" if len(known) > NUM_KNOWN_IDS_SHOWN else ""
        raise TraceError(f"unknown sample {sample_id!r} in {path}; known ids: {shown}{more}")
    return mine


def _at(event: dict) -> float:
    return event.get("at", event["time"])


def _hop_rows(event: dict, env: str) -> list[tuple[float, str, str, str]]:
    """(time, what, between, detail) rows of one event; an episode gives two (out and back)."""
    kind, at = event["event"], _at(event)
    duration = event.get("duration_ms")
    took = f"{duration:.1f} ms" if isinstance(duration, (int, float)) else "no duration"
    if kind == "episode":
        back = at + (duration or 0) / 1000
        return [(at, "rollout", f"orchestrator -> {env}", ""),
                (back, "rollout done", f"{env} -> orchestrator",
                 f"{event.get('num_turns', '?')} turns, {took}" + _failure(event))]
    if kind == "generate":
        versions = event.get("policy_versions") or []
        policy = "policy v" + "/v".join(str(v) for v in versions) if versions else "policy ?"
        return [(at, "generate", f"{env} -> {event.get('actor', 'generator')}",
                 f"{event.get('num_tokens', '?')} tokens, {policy}, {took}" + _failure(event))]
    if kind == "tool":
        tests = (f", {event['tests_passed']}/{event['num_tests']} tests passed"
                 if "num_tests" in event else "")
        return [(at, "tool call", f"{env} -> {event.get('actor', 'sandbox')}",
                 f"{event.get('call', 'exec')}: {event.get('status', '?')}{tests}, {took}")]
    if kind == "judge":
        return [(at, "judge call", f"{env} -> {event.get('actor', 'judge')}", _judge_detail(event, took))]
    return [(at, kind, *_state_row(event))]


def _judge_detail(event: dict, took: str) -> str:
    """A judge hop's line: the rubric, the verdict and its reward (or why it failed), the judge's
    tokens, the wait, and whether the verdict came from an earlier call (cached)."""
    call = event.get("call") or {}
    tokens = (f", {call['prompt_tokens']} + {call['completion_tokens']} tokens"
              if isinstance(call.get("prompt_tokens"), int) and isinstance(call.get("completion_tokens"), int) else "")
    if event.get("error"):
        outcome = "failed: " + str(event["error"]).partition("\n")[0]
    else:
        reward = call.get("reward")
        outcome = f"verdict {call.get('verdict', '?')}" + (f" (reward {reward:.3f})" if isinstance(reward, (int, float)) else "")
    cached = ", cached" if call.get("cached") else ""
    return f"rubric {event.get('rubric', '?')}: {outcome}{tokens}{cached}, {took}"


def _failure(event: dict) -> str:
    status = event.get("status", "")
    return f", {status}" if status.startswith("failed") else ""


def _state_row(event: dict) -> tuple[str, str]:
    kind = event["event"]
    if kind == "created":
        prompt = f": {event['prompt']}" if event.get("prompt") else ""
        return "orchestrator", f"batch {event.get('batch', '?')}, group {event.get('group', '?')}{prompt}"
    if kind == "generated":
        return "orchestrator", f"{event.get('tokens', '?')} policy tokens"
    if kind == "rewarded":
        parts = ", ".join(f"{name} {value:.3f}" for name, value in (event.get("components") or {}).items())
        statuses = event.get("tool_statuses") or []
        tools = f"; tool statuses {', '.join(statuses)}" if statuses else ""
        return "orchestrator", f"reward {event.get('reward', float('nan')):.3f} ({parts}){tools}"
    if kind == "trained":
        staleness = f", staleness {event['staleness']:g}" if isinstance(event.get("staleness"), (int, float)) else ""
        return "learner", f"step {event.get('step', '?')}{staleness}"
    if kind == "dropped":
        return "orchestrator", event.get("reason", "no reason recorded")
    extra = {k: v for k, v in event.items() if k not in ("time", "at", "sample_id", "event")}
    return event.get("actor", "orchestrator"), " ".join(f"{k}={v}" for k, v in extra.items())


def outcome(events: list[dict]) -> str:
    final = [e for e in events if e["event"] in ("trained", "dropped")]
    if not final:
        states = [e["event"] for e in events if e["event"] in ("created", "generated", "rewarded")]
        return f"in flight (last state: {states[-1] if states else 'unknown'})"
    last = final[-1]
    if last["event"] == "trained":
        return f"trained in step {last.get('step', '?')}"
    return f"dropped: {last.get('reason', 'no reason recorded')}"


def format_trace(sample_id: str, events: list[dict]) -> str:
    env = next((e.get("actor", "env") for e in events if e["event"] == "episode"), "env")
    rows = sorted((row for event in events for row in _hop_rows(event, env)), key=lambda row: row[0])
    origin = min(_at(e) for e in events if e["event"] == "created") if any(
        e["event"] == "created" for e in events) else rows[0][0]
    what_width = max(len(row[1]) for row in rows)
    between_width = max(len(row[2]) for row in rows)
    lines = [f"sample {sample_id}"]
    for at, what, between, detail in rows:
        lines.append(f"  {(at - origin) * 1000:+10.1f} ms  {what:<{what_width}}  {between:<{between_width}}  "
                     f"{detail}".rstrip())
    lines.append(f"outcome: {outcome(events)}")
    return "\n".join(lines)


def main(args) -> int:
    try:
        events = load_sample_events(args.run_folder, args.sample_id)
    except TraceError as exc:
        raise SystemExit(f"postrain trace: {exc}") from None
    print(format_trace(args.sample_id, events))
    texts = [row for row in read_samples(args.run_folder) if row.get("sample_id") == args.sample_id]
    if texts:
        print()
        print(format_sample(texts[-1]))
    return 0
