"""The scheduler: which sequences run this step and with which tokens, as a typed `StepPlan`.

    scheduler.add(prefill_group)      # a new request's n samples, queued
    plan = scheduler.schedule()       # reserve slots, preempt, admit; the plan to run
    ... run plan.decodes, then plan.prefills ...
    scheduler.start_running(entry)    # after a prefill: fork the samples, they decode next step
    scheduler.finish(seq)             # a sample stopped: its blocks are freed

Design note. Every step first reserves, in admission order, the slot of each running
sequence's last sampled token and of its drafted tokens (`KVManager.append`); when blocks
run short a sequence gives up its drafts first, then the most recently admitted sequence is
preempted: its blocks are freed and it re-enters the front of the queue, to be recomputed
keeping what it generated. Then waiting prompts are admitted, first come first served,
while the batch has room in sequences (max_num_seqs, counting every sample a prompt forks
into), in new prompt tokens (max_num_batched_tokens: a prompt longer than it runs alone)
and in blocks (the prompt plus one copy-on-write block per extra sample). A request with n
samples is pre-filled ONCE: its first sequence owns the blocks and the others fork from it
after the prefill. The plan lists decodes before prefills: the decode forward runs first,
so any block it completes is written before a prefix-cache hit of this step's prefills
reads it. The scheduler decides; it never runs the model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_manager import KVManager
from .sequence import EngineError, Sequence


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step. Invariant: the KV manager holds exactly
    `positions.stop` tokens of `seq_id` once the plan is made, laid out in `block_table`."""

    seq_id: int
    input_ids: tuple[int, ...]         # the new tokens whose KV this step writes (prompt part, or
                                       # the last sampled token followed by `drafts`)
    start_position: int                # tokens of the sequence already in the cache
    block_table: tuple[int, ...]       # its block ids, in order, after this step's reservations
    drafts: tuple[int, ...] = ()       # drafted tokens to verify (decodes only): input_ids[1:]
    fork_seq_ids: tuple[int, ...] = ()  # samples that fork from it after its prefill (prefills only)

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def positions(self) -> range:
        return range(self.start_position, self.start_position + len(self.input_ids))


@dataclass(frozen=True)
class StepPlan:
    """What one engine step runs: two forwards, decodes first (see the module's design note)."""

    decodes: tuple[ScheduledSequence, ...]    # running sequences: 1 token (+ drafts) each
    prefills: tuple[ScheduledSequence, ...]   # admitted prompts: their uncached tokens

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.decodes + self.prefills)

    @property
    def has_drafts(self) -> bool:
        return any(s.drafts for s in self.decodes)


@dataclass
class PrefillGroup:
    """A queued prefill: `seqs[0]` will own the blocks; the others fork from it."""

    seqs: list[Sequence]
    num_cached: int = 0        # prompt tokens the prefix cache held at admission


class Scheduler:
    """Admission, preemption and step plans over a `KVManager` (see module docstring).

    Invariants: every sequence is in at most one of `waiting` (in a group) and `running`; a
    running sequence holds blocks, a waiting one none; `running` is in admission order, so
    `running[-1]` is preempted first (tests/actors/generator/test_scheduler.py).
    """

    def __init__(self, kv: KVManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 counters: dict):
        """counters: the engine's; this adds to num_prefill_tokens, num_cached_prompt_tokens
        and num_preemptions."""
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.counters = counters
        self.waiting: deque[PrefillGroup] = deque()   # FIFO; preempted sequences re-enter at the front
        self.running: list[Sequence] = []             # admission order: the last is preempted first

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's samples: one prefill, then n - 1 forks."""
        self.waiting.append(PrefillGroup(list(seqs)))

    def schedule(self) -> StepPlan:
        """Reserve every running sequence's slots (preempting as needed), admit waiting
        prompts, and return the step's plan (block tables read after all reservations)."""
        decoding = self._reserve_decode_slots()
        admitted = self._admit(len(decoding))
        decodes = tuple(self._decode_entry(seq) for seq in decoding)
        prefills = tuple(self._prefill_entry(group) for group in admitted)
        return StepPlan(decodes, prefills)

    def start_running(self, group: ScheduledSequence, seqs: list[Sequence]) -> None:
        """After a prefill: fork its samples from its first sequence; all of them now run."""
        for child_id in group.fork_seq_ids:
            self.kv.fork(group.seq_id, child_id)
        self.running.extend(seqs)

    def finish(self, seq: Sequence) -> None:
        """A sample stopped: free its blocks if it holds any."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)

    def drop_waiting(self, request) -> None:
        """Forget the queued prefills of `request` (aborted)."""
        self.waiting = deque(g for g in self.waiting if g.seqs[0].request is not request)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it re-enters the queue first, to be recomputed."""
        seq.drafts = []
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        self.waiting.appendleft(PrefillGroup([seq]))
        self.counters["num_preemptions"] += 1

    # ------------------------------------------------------------------ steps of `schedule`

    def _reserve_decode_slots(self) -> list[Sequence]:
        """Reserve the next slot of every running sequence (and of its drafted tokens, which it
        gives up first when blocks run short), preempting from the back if needed."""
        reserved: list[Sequence] = []
        while len(reserved) < len(self.running):
            seq = self.running[len(reserved)]
            if not self.kv.can_append(seq.seq_id, 1 + len(seq.drafts)):
                if seq.drafts:
                    seq.drafts = []
                    continue
                self.preempt(self.running[-1])      # the newest; may be `seq` itself
                continue
            self.kv.append(seq.seq_id, seq.token_ids[-1:] + seq.drafts)
            reserved.append(seq)
        return reserved

    def _admit(self, num_decoding: int) -> list[PrefillGroup]:
        admitted: list[PrefillGroup] = []
        num_seqs, num_tokens = num_decoding, 0
        while self.waiting:
            group = self.waiting[0]
            tokens = group.seqs[0].token_ids
            fan_out = len(group.seqs)
            if num_seqs + fan_out > self.max_num_seqs and num_seqs > 0:
                break
            if num_tokens + len(tokens) > self.max_num_batched_tokens and admitted:
                break
            if not self._has_room(len(tokens), fan_out, bool(admitted)):
                break
            self.waiting.popleft()
            group.num_cached = self.kv.allocate(group.seqs[0].seq_id, tokens)
            admitted.append(group)
            num_seqs += fan_out
            num_tokens += len(tokens) - group.num_cached
            self._count_admission(group)
        return admitted

    def _has_room(self, num_tokens: int, fan_out: int, admitted_any: bool) -> bool:
        """Room for the prompt plus one copy-on-write block per extra sample."""
        needed = -(-num_tokens // self.kv.block_size_tokens) + fan_out - 1
        if needed <= self.kv.num_free_blocks:
            return True
        if not admitted_any and not self.running:
            raise EngineError(
                f"a request needs {needed} KV blocks but the cache has only {self.kv.num_blocks}; "
                "raise kv_cache_mb/num_blocks or lower n or the prompt length")
        return False

    def _count_admission(self, group: PrefillGroup) -> None:
        first = group.seqs[0]
        self.counters["num_prefill_tokens"] += len(first.token_ids) - group.num_cached
        self.counters["num_cached_prompt_tokens"] += group.num_cached
        if len(first.token_ids) == len(first.request.output.prompt_token_ids):
            first.request.output.num_cached_prompt_tokens = group.num_cached

    def _decode_entry(self, seq: Sequence) -> ScheduledSequence:
        return ScheduledSequence(seq.seq_id, tuple(seq.token_ids[-1:] + seq.drafts), len(seq.token_ids) - 1,
                                 tuple(self.kv.block_table(seq.seq_id)), tuple(seq.drafts))

    def _prefill_entry(self, group: PrefillGroup) -> ScheduledSequence:
        first = group.seqs[0]
        return ScheduledSequence(first.seq_id, tuple(first.token_ids[group.num_cached:]), group.num_cached,
                                 tuple(self.kv.block_table(first.seq_id)),
                                 fork_seq_ids=tuple(s.seq_id for s in group.seqs[1:]))
