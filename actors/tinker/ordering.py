"""A training client's requests, run in `seq_id` order, each once.

    order = SeqOrder(model_id)
    request_id, is_new = order.add(seq_id, op)       # is_new False: a retry; its first request id
    op = order.pop_ready()                           # the next op in seq_id order, or None
    failed = order.skip_gap()                        # a gap that never filled: drop the waiting ops

The SDK numbers every request of a TrainingClient (forward_backward chunks, optim_step, saves)
1, 2, 3, ... and sends the chunks of one forward_backward at once, the first one last, so they
arrive out of order; the hosted service runs them in seq_id order, and so does this. A request
re-sent with a seq_id already seen (the SDK retries a POST whose answer it lost) gets the first
one's request id and is not run again: deduplication on (model_id, seq_id).

Invariants: every key of `waiting` is >= next_seq_id; `request_ids` holds every seq_id ever
accepted (the dedup record, as long as the tenant lives); an op leaves `waiting` exactly once,
by `pop_ready` or by `skip_gap`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import TinkerAPIError


@dataclass
class Op:
    """One accepted request: its future's id and its work (run in a worker thread)."""

    request_id: str
    work: Callable[[], object]


class SeqOrder:
    def __init__(self, model_id: str):
        self.model_id = model_id
        self.next_seq_id = 1
        self.waiting: dict[int, Op] = {}
        self.request_ids: dict[int, str] = {}
        self.running = False             # a drain task is taking ops out (the service's)

    def add(self, seq_id: int, op: Op) -> tuple[str, bool]:
        """(the request id for `seq_id`, whether `op` was queued); TinkerAPIError 400 for a seq_id
        that is behind and was never seen."""
        if seq_id in self.request_ids:
            return self.request_ids[seq_id], False
        if seq_id < self.next_seq_id:
            raise TinkerAPIError(400, f"seq_id {seq_id} of model {self.model_id!r} is behind the next one "
                                      f"({self.next_seq_id}) and was never received; a TrainingClient numbers "
                                      "its requests itself: do not reuse one model_id across clients")
        self.request_ids[seq_id] = op.request_id
        self.waiting[seq_id] = op
        return op.request_id, True

    def pop_ready(self) -> Op | None:
        op = self.waiting.pop(self.next_seq_id, None)
        if op is not None:
            self.next_seq_id += 1
        return op

    def gap_before(self, seq_id: int) -> bool:
        """Whether `seq_id` still waits on an earlier one that has not arrived."""
        return seq_id in self.waiting and self.next_seq_id not in self.waiting and self.next_seq_id < seq_id

    def skip_gap(self) -> tuple[list[Op], int]:
        """Drop every waiting op (their seq_id gap never filled); (the ops, the missing seq_id).
        The next op expected is the one after the last dropped."""
        missing = self.next_seq_id
        ops = [self.waiting[s] for s in sorted(self.waiting)]
        if self.waiting:
            self.next_seq_id = max(self.waiting) + 1
        self.waiting.clear()
        return ops, missing
