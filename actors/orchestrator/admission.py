"""Admission: when an RL batch may start generating, and the buffer of batches admitted and not yet trained.

Design note (the admission rule). Batch b, `prompts_per_step` prompts with
`samples_per_prompt` samples each, may start generating only once the learner
has trained batch b - 1 - max_staleness. So every token of batch b was
sampled by a policy at most `max_staleness` versions behind the one that
trains on it; `max_staleness = 0` is the synchronous on-policy loop, through
the same code. While the learner trains batch b, generation of the next
`max_staleness` batches goes on. Stale tokens carry their version, and the
learner's decoupled objective handles them. `max_buffered_batches` (0: no bound
beyond the staleness rule) also bounds the buffer: batches admitted and not yet
trained (1 makes the loop synchronous, like max_staleness 0). Why admission
waits ("staleness" or "buffer_full") is `backpressure` in the orchestrator's
heartbeat load, which the head's balancer logs.

One task admits (batches in order, `admit`), one task trains (batches in order,
`wait_generated` then `retire`); the rollout pool fills each admitted batch and
sets its `generated` event. Everything here runs on the orchestrator's event loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from .scored_sample import ScoredSample

BACKPRESSURE = ("none", "staleness", "buffer_full")


@dataclass(slots=True)
class AdmittedBatch:
    """Batch `index` between admission and training. The rollout pool appends each sample's
    outcome to its group (a ScoredSample, or None for a failed sample), and the reason of each
    sample the environment failed to `environment_failures`, and sets `generated` once every
    sample has one: then len(groups[g]) == samples_per_prompt for every g."""

    index: int
    num_samples: int
    groups: list[list[ScoredSample | None]]
    environment_failures: list[str] = field(default_factory=list)
    generated: anyio.Event = field(default_factory=anyio.Event)


class Admission:
    """The staleness and buffer rule (module docstring) and its backpressure state."""

    def __init__(self, max_staleness: int, max_buffered_batches: int):
        self.max_staleness = max_staleness
        self.max_buffered_batches = max_buffered_batches       # 0: no bound
        # The data cursor: batches 0..num_trained-1 are trained. Only `retire` and `start_at` change it.
        self.num_trained = 0
        # Admitted, not yet trained. Invariant (`check`): its keys are
        # num_trained..num_trained + len(buffered) - 1, at most max_staleness + 1 of them, and at
        # most max_buffered_batches when that is > 0.
        self.buffered: dict[int, AdmittedBatch] = {}
        # Why `admit` waits now, one of BACKPRESSURE; "none" while it does not wait.
        self.backpressure = "none"
        self.stopping = False
        self._changed = anyio.Event()   # set (and replaced) on every admit, retire and stop

    def start_at(self, num_trained: int) -> None:
        """Set the data cursor before the RL loop starts (0, or a resumed run's next batch)."""
        assert not self.buffered, "the cursor moves only between runs of the loop"
        self.num_trained = num_trained

    def wait_reason(self, batch: int) -> str:
        """Why `batch` may not start yet ("none": it may)."""
        if batch - self.num_trained > self.max_staleness:
            return "staleness"
        if self.max_buffered_batches and len(self.buffered) >= self.max_buffered_batches:
            return "buffer_full"
        return "none"

    async def admit(self, batch: int, groups: int, samples_per_group: int) -> AdmittedBatch | None:
        """Wait until `batch` (the next after the last admitted) may start, and buffer it; None
        once `stop` was called. Cancelled: nothing is admitted, backpressure is back to "none"."""
        assert batch == self.num_trained + len(self.buffered), (batch, self.num_trained,
                                                                sorted(self.buffered))
        try:
            while (reason := self.wait_reason(batch)) != "none" and not self.stopping:
                self.backpressure = reason
                await self._changed.wait()
        finally:
            self.backpressure = "none"
        if self.stopping:
            return None
        admitted = self.buffered[batch] = AdmittedBatch(batch, groups * samples_per_group,
                                                        [[] for _ in range(groups)])
        self._notify()
        return admitted

    async def wait_generated(self, batch: int) -> AdmittedBatch | None:
        """The batch once every sample of it has an outcome; None when `stop` came before it was
        admitted. Cancelled: nothing changes (the batch stays buffered)."""
        while batch not in self.buffered:
            if self.stopping:
                return None
            changed = self._changed
            await changed.wait()
        admitted = self.buffered[batch]
        await admitted.generated.wait()
        return admitted

    def retire(self, batch: int) -> None:
        """`batch` is trained: it leaves the buffer and the cursor moves past it."""
        assert batch == self.num_trained and batch in self.buffered, (batch, self.num_trained)
        del self.buffered[batch]
        self.num_trained += 1
        self._notify()

    def stop(self) -> None:
        """No further batch is admitted; waiters wake up."""
        self.stopping = True
        self._notify()

    def figures(self) -> dict:
        """The admission's part of the orchestrator's heartbeat load."""
        return {"backpressure": self.backpressure, "num_trained": self.num_trained,
                "buffer_batches": len(self.buffered),
                "buffer_samples": sum(b.num_samples for b in self.buffered.values()),
                "max_staleness": self.max_staleness}

    def check(self) -> None:
        """Assert the invariants beside the state (tests/actors/orchestrator/test_admission.py)."""
        assert sorted(self.buffered) == list(range(self.num_trained, self.num_trained + len(self.buffered)))
        assert len(self.buffered) <= self.max_staleness + 1
        assert not self.max_buffered_batches or len(self.buffered) <= self.max_buffered_batches
        assert self.backpressure in BACKPRESSURE

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
