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

Chunked prefill (`prefill_chunk_tokens` > 0). A step reads at most `prefill_chunk_tokens`
prompt tokens in all (and at most `max_num_batched_tokens` minus the step's decode tokens),
so a long prompt is read over several steps while the running sequences keep decoding, one
token a step each. Prompts already being read (`prefilling`, admission order) get the budget
first, then new prompts are admitted with what is left. A prompt's blocks are reserved chunk
by chunk (`KVManager.allocate` for the first chunk, `append` for the next), so a block enters
the prefix index only in the step whose forward writes it; a prompt is admitted only while
its whole length fits in the free blocks. When blocks run short, prompts being read are
preempted (newest first) before any decoding sequence. Only a prompt's last chunk is
sampled from (`ScheduledSequence.completes_prompt`); the earlier chunks only write KV. A chunk
never ends inside an image run whose tokens attend both ways (Gemma 3): it stops before the run,
or, when it starts there, reads on to the run's end (`PrefillGroup.chunk_end`).
With `prefill_chunk_tokens` = 0 every prompt is read in one step (the default).

Scoring requests (`scoring`). A group with `logits_from` set is a sequence to score: its
logits are wanted at every position from `logits_from` on, so it takes at most that many
tokens from the prefix cache (`KVManager.allocate(max_cached=)`), its plan entries carry
`logits_from` (the runner keeps their logits from that position on), and after its last chunk it
never runs: the engine reads its rows and `release`s its blocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_manager import KVManager
from .sequence import EngineCounters, EngineError, PromptImages, Sequence


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
    completes_prompt: bool = True      # prefills: this row reads the prompt's last tokens, so the
                                       # step samples from it (False: an earlier chunk, KV only)
    logits_from: int | None = None     # prefills of a scoring request: the logits of every new token
                                       # at this position or later are wanted (None: sample the last)
    images: PromptImages | None = None  # prefills of a prompt with images: its rows (images.py); decodes:
                                        # only when its multimodal rotary table is needed

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
    def has_drafts(self) -> bool:
        return any(s.drafts for s in self.decodes)

    @property
    def has_scoring(self) -> bool:
        """A prefill row of a scoring request: its forward keeps that row's logits from its
        logits_from on (runner.py)."""
        return any(s.logits_from is not None for s in self.prefills)


@dataclass
class PrefillGroup:
    """A queued prefill: `seqs[0]` will own the blocks; the others fork from it."""

    seqs: list[Sequence]
    num_cached: int = 0        # prompt tokens the prefix cache held at admission
    num_scheduled: int = 0     # prompt tokens whose KV is written by the end of the current step
    logits_from: int | None = None   # a scoring request: the first position whose logits are wanted,
                                     # so at most that many tokens come from the prefix cache

    @property
    def prompt(self) -> list[int]:
        return self.seqs[0].token_ids

    @property
    def salt(self) -> int:
        """The prefix cache's salt: the prompt's images' (images.py), 0 for text."""
        images = self.seqs[0].request.images
        return 0 if images is None else images.salt

    def chunk_end(self, start: int, end: int) -> int:
        """`end` of a chunk from `start`, never inside an image run read in one chunk (images.py
        `PromptImages.chunk_end`: Gemma 3's runs attend both ways); `end` itself for text."""
        images = self.seqs[0].request.images
        return end if images is None else images.chunk_end(start, end)


class Scheduler:
    """Admission, preemption and step plans over a `KVManager` (see module docstring).

    Invariants: every sequence is in at most one of `waiting` (in a group), `prefilling` (as
    a group's first sequence) and `running`; a running or prefilling sequence holds blocks, a
    waiting one none; a prefilling group's first sequence holds exactly `num_scheduled` < its
    prompt's length tokens between steps; `running` is in admission order, so `running[-1]`
    is preempted first, after every prefilling group (tests/actors/generator/test_scheduler.py,
    test_chunked_prefill.py).
    """

    def __init__(self, kv: KVManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 counters: EngineCounters, prefill_chunk_tokens: int = 0):
        """counters: the engine's; this adds to num_prefill_tokens, num_cached_prompt_tokens
        and num_preemptions. prefill_chunk_tokens: prompt tokens read per step at most (0 = a
        whole prompt in one step)."""
        if prefill_chunk_tokens < 0:
            raise EngineError(f"prefill_chunk_tokens must be >= 0 (0 = off), got {prefill_chunk_tokens}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.counters = counters
        self.waiting: deque[PrefillGroup] = deque()   # FIFO; preempted sequences re-enter at the front
        self.prefilling: list[PrefillGroup] = []      # prompts part-read (chunked prefill), admission order
        self.running: list[Sequence] = []             # admission order: the last is preempted first

    def add(self, seqs: list[Sequence], logits_from: int | None = None) -> None:
        """Queue a request's samples: one prefill, then n - 1 forks. logits_from: a scoring
        request (one sequence), whose logits are wanted from that position on."""
        self.waiting.append(PrefillGroup(list(seqs), logits_from=logits_from))

    def schedule(self) -> StepPlan:
        """Reserve every running sequence's slots (preempting as needed), continue the prompts
        being read, admit waiting prompts, and return the step's plan (block tables read after
        all reservations)."""
        decoding = self._reserve_decode_slots()
        if self.prefill_chunk_tokens:
            budget = min(self.prefill_chunk_tokens,
                         self.max_num_batched_tokens - sum(1 + len(s.drafts) for s in decoding))
            chunks = self._continue_prefills(budget)
            budget -= sum(end - start for _, start, end in chunks)
            chunks += self._admit_chunked(len(decoding), budget, bool(chunks))
        else:
            chunks = [(g, g.num_cached, len(g.prompt)) for g in self._admit(len(decoding))]
        decodes = tuple(self._decode_entry(seq) for seq in decoding)
        prefills = tuple(self._prefill_entry(*chunk) for chunk in chunks)
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

    def release(self, entry: ScheduledSequence) -> None:
        """A scoring request's last chunk ran: free its blocks (it never runs; the full blocks
        stay in the prefix cache)."""
        self.kv.free(entry.seq_id)

    def drop_waiting(self, request) -> None:
        """Forget the queued and part-read prefills of `request` (aborted), freeing their blocks."""
        self.waiting = deque(g for g in self.waiting if g.seqs[0].request is not request)
        for group in [g for g in self.prefilling if g.seqs[0].request is request]:
            self.prefilling.remove(group)
            self.kv.free(group.seqs[0].seq_id)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it re-enters the queue first, to be recomputed."""
        self._requeue(seq)
        self.counters.num_preemptions += 1

    def recompute_all(self) -> None:
        """Every sequence gives up its KV (a weight swap under `exact`: the old weights wrote
        it): the running ones, then the part-read prompts, re-enter the queue in admission order,
        ahead of the waiting ones, to be read again by the new weights, keeping what they
        generated. Counted in `num_recomputed_on_swap`, not as preemptions."""
        self.counters.num_recomputed_on_swap += len(self.running) + len(self.prefilling)
        while self.prefilling:
            self._requeue_newest_prefilling()
        while self.running:
            self._requeue(self.running[-1])

    def _preempt_prefilling(self) -> PrefillGroup:
        """Stop reading the newest part-read prompt: free its blocks; it re-enters the queue first."""
        self.counters.num_preemptions += 1
        return self._requeue_newest_prefilling()

    def _requeue(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and put it first in the queue, keeping its tokens."""
        seq.drafts = []
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        self.waiting.appendleft(PrefillGroup([seq]))

    def _requeue_newest_prefilling(self) -> PrefillGroup:
        """Free the newest part-read prompt's blocks and put it first in the queue, to be read anew."""
        group = self.prefilling.pop()
        self.kv.free(group.seqs[0].seq_id)
        group.num_cached = group.num_scheduled = 0
        self.waiting.appendleft(group)
        return group

    # ------------------------------------------------------------------ steps of `schedule`

    def _reserve_decode_slots(self) -> list[Sequence]:
        """Reserve the next slot of every running sequence (and of its drafted tokens, which it
        gives up first when blocks run short), preempting part-read prompts, then running
        sequences from the back, if needed."""
        reserved: list[Sequence] = []
        while len(reserved) < len(self.running):
            seq = self.running[len(reserved)]
            if not self.kv.can_append(seq.seq_id, 1 + len(seq.drafts)):
                if seq.drafts:
                    seq.drafts = []
                elif self.prefilling:
                    self._preempt_prefilling()
                else:
                    self.preempt(self.running[-1])      # the newest; may be `seq` itself
                continue
            self.kv.append(seq.seq_id, seq.token_ids[-1:] + seq.drafts)
            reserved.append(seq)
        return reserved

    def _continue_prefills(self, budget: int) -> list[tuple[PrefillGroup, int, int]]:
        """The next chunk of each part-read prompt, oldest first, within `budget` tokens;
        a chunk that finds no blocks preempts the newest part-read prompt (maybe itself)."""
        chunks: list[tuple[PrefillGroup, int, int]] = []
        for group in list(self.prefilling):
            if budget <= 0:
                break
            if group not in self.prefilling:       # preempted for an older prompt's chunk
                continue
            start = group.num_scheduled
            end = group.chunk_end(start, min(len(group.prompt), start + budget))
            seq_id = group.seqs[0].seq_id
            while group in self.prefilling and not self.kv.can_append(seq_id, end - start):
                self._preempt_prefilling()
            if group not in self.prefilling:
                continue
            self.kv.append(seq_id, group.prompt[start:end])
            chunks.append(self._advance(group, start, end))
            budget -= end - start
        return chunks

    def _admit_chunked(self, num_decoding: int, budget: int, continued: bool
                       ) -> list[tuple[PrefillGroup, int, int]]:
        """Admit waiting prompts while the budget lasts; each reads its first chunk now.
        continued: this step reads a chunk of a prompt admitted earlier (which holds blocks even
        when it leaves `prefilling` with its last chunk), so a prompt that does not fit waits."""
        chunks: list[tuple[PrefillGroup, int, int]] = []
        num_seqs = num_decoding + sum(len(g.seqs) for g in self.prefilling)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            fan_out = len(group.seqs)
            if num_seqs + fan_out > self.max_num_seqs and num_seqs > 0:
                break
            if not self._has_room(len(group.prompt), fan_out, bool(chunks) or continued):
                break
            self.waiting.popleft()
            prompt = group.prompt
            cached = self.kv.match_prefix(prompt, group.logits_from, group.salt)
            end = group.chunk_end(cached, min(len(prompt), cached + budget))
            group.num_cached = self.kv.allocate(group.seqs[0].seq_id, prompt[:end], group.logits_from, group.salt)
            self._count_admission(group)
            self.prefilling.append(group)
            chunks.append(self._advance(group, group.num_cached, end))
            num_seqs += fan_out
            budget -= end - group.num_cached
        return chunks

    def _advance(self, group: PrefillGroup, start: int, end: int) -> tuple[PrefillGroup, int, int]:
        """Record that this step writes the group's prompt KV up to `end`; a group whose
        prompt is then whole leaves `prefilling` (the engine starts it running)."""
        group.num_scheduled = end
        if end == len(group.prompt):
            self.prefilling.remove(group)
        return group, start, end

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
            group.num_cached = self.kv.allocate(group.seqs[0].seq_id, tokens, group.logits_from, group.salt)
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
        if not admitted_any and not self.running and not self.prefilling:
            raise EngineError(
                f"a request needs {needed} KV blocks but the cache has only {self.kv.num_blocks}; "
                "raise kv_cache_mb/num_blocks or lower n or the prompt length")
        return False

    def _count_admission(self, group: PrefillGroup) -> None:
        first = group.seqs[0]
        self.counters.num_prefill_tokens += len(first.token_ids) - group.num_cached
        self.counters.num_cached_prompt_tokens += group.num_cached
        if len(first.token_ids) == len(first.request.output.prompt_token_ids):
            first.request.output.num_cached_prompt_tokens = group.num_cached

    def _decode_entry(self, seq: Sequence) -> ScheduledSequence:
        images = seq.request.images     # a decode carries them only for their rotary table (images.py)
        return ScheduledSequence(seq.seq_id, tuple(seq.token_ids[-1:] + seq.drafts), len(seq.token_ids) - 1,
                                 tuple(self.kv.block_table(seq.seq_id)), tuple(seq.drafts),
                                 images=images if images is not None and images.rope is not None else None)

    def _prefill_entry(self, group: PrefillGroup, start: int, end: int) -> ScheduledSequence:
        first = group.seqs[0]
        return ScheduledSequence(first.seq_id, tuple(group.prompt[start:end]), start,
                                 tuple(self.kv.block_table(first.seq_id)),
                                 fork_seq_ids=tuple(s.seq_id for s in group.seqs[1:]),
                                 completes_prompt=end == len(group.prompt), logits_from=group.logits_from,
                                 images=first.request.images)
