"""The sample ledger: every sample's life, so none is lost or trained twice.

A sample moves forward through

    created -> generated -> rewarded -> trained
         \\__________\\___________\\______> dropped (with a reason)

and never back. Invariant (checked by `check()`, asserted after every change
in debug runs, tested in tests/core/test_ledger.py):

    num_created == num_in_flight + num_trained + num_dropped

where in flight means created, generated or rewarded. Each transition is also
an event line in `events_path` (JSONL: time, sample_id, state, and what the
caller adds: actor, step, reason, tool calls), which `postrain trace` reads.
`state_dict()` goes into checkpoints so that a resumed run knows which samples
were trained and which were in flight (those are dropped with reason
"interrupted" on resume, then re-created from the data cursor).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from postrain.core.errors import PostrainError

STATES = ("created", "generated", "rewarded", "trained", "dropped")
_ORDER = {state: index for index, state in enumerate(STATES)}
IN_FLIGHT = ("created", "generated", "rewarded")


class LedgerError(PostrainError, ValueError):
    """A transition that breaks the lifecycle (unknown sample, going backwards, reusing an id)."""


class SampleLedger:
    def __init__(self, events_path: str | Path | None = None):
        self._state: dict[str, str] = {}                 # sample_id -> its current state
        self._counts: Counter = Counter()                # state -> number of samples in it now
        self.drop_reasons: Counter = Counter()           # reason -> number dropped for it
        self.events_path = Path(events_path) if events_path else None
        self._events_file = open(events_path, "a", buffering=1) if events_path else None

    # -- transitions -------------------------------------------------------------

    def create(self, sample_id: str, **info: Any) -> None:
        if sample_id in self._state:
            raise LedgerError(f"sample {sample_id!r} already exists (state {self._state[sample_id]}); "
                              "sample ids must be unique")
        self._state[sample_id] = "created"
        self._counts["created"] += 1
        self._record(sample_id, "created", info)

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
        self.drop_reasons[reason] += 1
        self._move(sample_id, current, "dropped", {"reason": reason, **info})

    def note(self, sample_id: str, event: str, **info: Any) -> None:
        """Record a hop that does not change the state (a tool call, a retry) for `postrain trace`."""
        self._current(sample_id)
        self._record(sample_id, event, info)

    # -- queries ------------------------------------------------------------------

    def state(self, sample_id: str) -> str:
        return self._current(sample_id)

    def in_flight(self) -> list[str]:
        return [sid for sid, state in self._state.items() if state in IN_FLIGHT]

    def counts(self) -> dict[str, int]:
        """created (ever), in_flight, trained, dropped, and drop reasons."""
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
        if self._events_file is None:
            return 0
        self._events_file.flush()
        return self.events_path.stat().st_size

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
        self._state[sample_id] = state
        self._counts[current] -= 1
        self._counts[state] += 1
        self._record(sample_id, state, info)

    def _record(self, sample_id: str, event: str, info: dict) -> None:
        if self._events_file is not None:
            self._events_file.write(json.dumps({"time": time.time(), "sample_id": sample_id,
                                                "event": event, **info}, default=str) + "\n")


def read_events(events_path: str | Path, sample_id: str | None = None) -> list[dict]:
    """The ledger's event lines (of one sample, if given), in order."""
    events = []
    with open(events_path) as lines:
        for line in lines:
            event = json.loads(line)
            if sample_id is None or event["sample_id"] == sample_id:
                events.append(event)
    return events
