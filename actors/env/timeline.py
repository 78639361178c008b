"""A rollout's timeline: the hops of one episode between actors, for `postrain trace`.

The environment actor records each call it makes for an episode, as it
happens, and returns the list with the rollout (`rollout["timeline"]`):

    {"hop": "episode",  "actor": "env", "start": 1764517000.10, "duration_ms": 420.5, "num_turns": 2}
    {"hop": "generate", "actor": "generator", "start": ..., "duration_ms": 80.1, "num_tokens": 24,
     "policy_versions": [3]}
    {"hop": "tool", "actor": "sandbox", "call": "exec", "start": ..., "duration_ms": 7.2, "status": "ok"}

`start` is the host's wall clock (time.time()), which every actor of a run on
one host shares; `duration_ms` is measured on a monotonic clock. A failed call
is recorded with `status` "failed: <error type>" before its error goes on. The
orchestrator copies each hop into the sample ledger as a note
(`note_hops`), so ledger.jsonl holds a sample's whole life.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from ..records import ExecReply, RunTestsReply


class Timeline:
    """The hops of one episode, in the order they started. Owned by one episode's task."""

    def __init__(self):
        self.hops: list[dict] = []

    @contextmanager
    def hop(self, hop: str, actor: str, **info):
        """Time one call: yields the hop's dict (add what came back to it); a raised error
        records `status` "failed: TYPE" and goes on."""
        record = {"hop": hop, "actor": actor, "start": time.time(), **info}
        self.hops.append(record)
        began = time.perf_counter()
        try:
            yield record
        except BaseException as exc:
            record["status"] = f"failed: {type(exc).__name__}"
            raise
        finally:
            record["duration_ms"] = round((time.perf_counter() - began) * 1000, 3)

    def to_list(self) -> list[dict]:
        return list(self.hops)


def tool_status(reply: ExecReply | RunTestsReply) -> dict:
    """What a trace shows of a sandbox reply: its status (and tests passed, for run_tests)."""
    if isinstance(reply, RunTestsReply):
        return {"status": reply.result.status, "tests_passed": sum(reply.passed.values()),
                "num_tests": len(reply.passed)}
    return {"status": reply.status}


def note_hops(ledger, sample_id: str, timeline: list[dict] | None) -> None:
    """Copy a rollout's hops into the ledger as notes: event = the hop's kind, `at` = its start."""
    for hop in timeline or []:
        info = {key: value for key, value in hop.items() if key not in ("hop", "start")}
        ledger.note(sample_id, hop["hop"], at=hop["start"], **info)
