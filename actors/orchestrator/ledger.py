"""The sample ledger: every sample's life, so none is lost or trained twice.

A sample moves forward through

    created -> generated -> rewarded -> trained
         \\__________\\___________\\______> dropped (with a reason)

and never back. Invariant (checked by `check()`, asserted after every change
in debug runs, tested in tests/actors/orchestrator/test_ledger.py):

    num_created == num_in_flight + num_trained + num_dropped

where in flight means created, generated or rewarded. Each transition is also
an event line in `events_path` (JSONL: time, sample_id, state, and what the
caller adds: actor, step, reason, tool calls), which `postrain trace` reads.
`state_dict()` goes into checkpoints so that a resumed run knows which samples
were trained and which were in flight (those are dropped with reason
"interrupted" on resume, then re-created from the data cursor).

Segments: an episode whose history changed under the model (records/rollout.py) trains
several samples, one per segment. Segment 0 is the episode's own sample id; segment k >= 1 is
`segment_id(sample_id, k)`, created when the rollout comes back (its `created` event names
the episode: `segment_of`, `segment`), so each segment is trained or dropped on its own and
the invariant above counts segments. The episode's sample gets a "segments" note listing them.

Each event line is written whole or not at all (postrain.core.jsonl): on a full disk the
transition raises DiskFullError and the file still ends on a whole line.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from postrain.core.errors import PostrainError
from postrain.core.jsonl import JsonlAppender, read_jsonl

STATES = ("created", "generated", "rewarded", "trained", "dropped")
_ORDER = {state: index for index, state in enumerate(STATES)}
IN_FLIGHT = ("created", "generated", "rewarded")


def segment_id(sample_id: str, segment: int) -> str:
    """The ledger id of segment `segment` of episode `sample_id` (segment 0: `sample_id` itself)."""
    return sample_id if segment == 0 else f"{sample_id}.seg{segment}"


class LedgerError(PostrainError, ValueError):
    """A transition that breaks the lifecycle (unknown sample, going backwards, reusing an id)."""


class SampleLedger:
    def __init__(self, events_path: str | Path | None = None):
        self._state: dict[str, str] = {}                 # sample_id -> its current state
        self._counts: Counter = Counter()                # state -> number of samples in it now
        self.drop_reasons: Counter = Counter()           # reason -> number dropped for it
        self.events_path = Path(events_path) if events_path else None
        self._events_file = JsonlAppender(events_path) if events_path else None

    # -- transitions -------------------------------------------------------------

    def create(self, sample_id: str, **info: Any) -> None:
        if sample_id in self._state:
            raise LedgerError(f"sample {sample_id!r} already exists (state {self._state[sample_id]}); "
                              "sample ids must be unique")
        self._record(sample_id, "created", info)   # first: a full disk leaves the state unchanged
        self._state[sample_id] = "created"
        self._counts["created"] += 1

    def advance(self, sample_id: str, state: str, **info: Any) -> None:
        """Move a sample forward to generated, rewarded or trained."""
        if state not in ("generated", "rewarded", "trained"):
            raise LedgerError(f"advance to {state!r}: use generated, rewarded or trained "
                              "(create() and drop() for the others)")
        current = self._current(sample_id)
        if current == "dropped" or _ORDER[state] <= _ORDER[current]:
            raise LedgerError(f"sample {sample_id!r} cannot go from {current} to {state}")
        self._move(sample_id, current, state, info)

    def drop(self, sample_id: str, reason: str, **info: Any) -> None:
        current = self._current(sample_id)
        if current in ("trained", "dropped"):
            raise LedgerError(f"sample {sample_id!r} is already {current}; it cannot be dropped")
        self._move(sample_id, current, "dropped", {"reason": reason, **info})
        self.drop_reasons[reason] += 1

    def note(self, sample_id: str, event: str, **info: Any) -> None:
        """Record a hop that does not change the state (a tool call, a retry) for `postrain trace`."""
        self._current(sample_id)
        self._record(sample_id, event, info)

    # -- queries ------------------------------------------------------------------

    def state(self, sample_id: str) -> str:
        return self._current(sample_id)

    def in_flight(self) -> list[str]:
        return [sid for sid, state in self._state.items() if state in IN_FLIGHT]

    def counts(self) -> dict[str, Any]:
        """created (ever), in_flight, trained, dropped (ints), and drop reasons (reason -> count)."""
        in_flight = sum(self._counts[s] for s in IN_FLIGHT)
        return {"created": len(self._state), "in_flight": in_flight, "trained": self._counts["trained"],
                "dropped": self._counts["dropped"], "drop_reasons": dict(self.drop_reasons)}

    def check(self) -> None:
        counts = self.counts()
        if counts["created"] != counts["in_flight"] + counts["trained"] + counts["dropped"]:
            raise AssertionError(f"ledger does not balance: {counts}")

    # -- persistence ---------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"state": dict(self._state), "drop_reasons": dict(self.drop_reasons)}

    def events_offset(self) -> int:
        """Bytes in the event file so far. A checkpoint stores it with `state_dict()`: a resumed
        run cuts the file back to it, so the events match the restored states."""
        return 0 if self._events_file is None else self._events_file.size()

    def load_state_dict(self, data: dict) -> None:
        self._state = dict(data["state"])
        self._counts = Counter(self._state.values())
        self.drop_reasons = Counter(data["drop_reasons"])
        self.check()

    def close(self) -> None:
        if self._events_file is not None:
            self._events_file.close()
            self._events_file = None

    # -- internals -----------------------------------------------------------------

    def _current(self, sample_id: str) -> str:
        try:
            return self._state[sample_id]
        except KeyError:
            raise LedgerError(f"unknown sample {sample_id!r}; create() it first") from None

    def _move(self, sample_id: str, current: str, state: str, info: dict) -> None:
        self._record(sample_id, state, info)   # first: a full disk leaves the state unchanged
        self._state[sample_id] = state
        self._counts[current] -= 1
        self._counts[state] += 1

    def _record(self, sample_id: str, event: str, info: dict) -> None:
        if self._events_file is not None:
            self._events_file.append({"time": time.time(), "sample_id": sample_id, "event": event, **info})


def read_events(events_path: str | Path, sample_id: str | None = None) -> list[dict]:
    """The ledger's event lines (of one sample, if given), in order; a half-written last line
    (a writer killed mid-line) is skipped with a warning."""
    return [event for event in read_jsonl(events_path) if sample_id is None or event["sample_id"] == sample_id]
