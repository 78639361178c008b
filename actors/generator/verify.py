"""Speculative decoding inside the engine: drafting a step's tokens and verifying them.

    propose_drafts(running, proposer, max_position_embeddings)   # sets each seq.drafts
    verdicts = verify_drafts(logits, seqs, options)              # tokens to keep, per sequence

Design note: speculation is exact. The proposers (`speculative`) guess tokens; each running
sequence's drafts ride in its plan entry (the scheduler reserves their slots, dropping them
first when blocks run short); the decode forward scores the last token and every draft
together, and `sampling.verify_rows` keeps each sequence's accepted drafts plus one token,
drawn so that the kept tokens have exactly the distribution of plain sampling. The engine
then rolls the rejected drafts' slots back (`KVManager.truncate`).
"""
from __future__ import annotations

import torch

from .sampling import verify_rows
from .sequence import EngineCounters, Sequence
from .speculative import Proposer, SpeculativeOptions, next_num_draft_tokens


def verify_width(num_drafts: list[int]) -> int:
    """Drafted tokens per sequence that one step verifies at most: the largest w that at least
    half the batch drafts. Every row of the verify forward is as wide as the widest (1 + w
    positions), so a few drafting sequences must not widen a large batch that drafts
    nothing (at batch 32 a 5-position forward costs ~2x a decode step on this CPU)."""
    ranked = sorted(num_drafts, reverse=True)
    return ranked[(len(ranked) - 1) // 2] if ranked else 0


def propose_drafts(running: list[Sequence], proposer: Proposer, max_position_embeddings: int) -> None:
    """Set each running sequence's drafted tokens for this step (cut to `verify_width`)."""
    drafting: list[tuple[Sequence, int]] = []
    for seq in running:
        params = seq.request.params
        # Room: tokens the sample may still emit after this step's own, and positions.
        room = min(seq.num_draft_tokens, params.max_new_tokens - len(seq.output.token_ids) - 1,
                   max_position_embeddings - len(seq.token_ids))
        seq.drafts = []
        if room > 0:
            drafting.append((seq, room))
    if drafting:
        requests = [(seq.token_ids, seq.request.prompt_key, room) for seq, room in drafting]
        for (seq, _), draft in zip(drafting, proposer.propose_batch(requests)):
            seq.drafts = list(draft)
    width = verify_width([len(s.drafts) for s in running])
    for seq in running:
        del seq.drafts[width:]


def verify_drafts(logits: torch.Tensor, seqs: list[Sequence], options: SpeculativeOptions,
                  counters: EngineCounters) -> list[tuple[list[int], list[float], int]]:
    """Per sequence: (tokens to emit, their logprobs, number of drafts it verified). Clears
    each seq.drafts, counts drafted/accepted tokens and verify steps in `counters`, and adapts
    each sequence's k. logits (B, T, V) from the runner's decode forward with drafts."""
    verdicts = verify_rows(logits, [s.drafts for s in seqs], [s.request.params for s in seqs],
                           [s.generator for s in seqs])
    out = []
    for seq, (tokens, logprobs) in zip(seqs, verdicts):
        num_drafted, num_accepted = len(seq.drafts), len(tokens) - 1
        seq.drafts = []
        counters.num_drafted_tokens += num_drafted
        counters.num_accepted_tokens += num_accepted
        counters.num_verify_steps += bool(num_drafted)
        if options.adaptive:
            seq.num_draft_tokens = next_num_draft_tokens(seq.num_draft_tokens, num_drafted, num_accepted,
                                                         options.num_draft_tokens)
        out.append((tokens, logprobs, num_drafted))
    return out
