"""`score_tokens` and `score_reward`: what a scorer (a frozen model beside the policy,
actors/scorer/) is asked and what it answers.

The teacher's rows, aligned with `token_ids` (the convention `TrainBatch.behavior_logprobs`
follows): for a sequence of T tokens, row t in [0, T) is the teacher's distribution over the
token at position t, conditioned on token_ids[:t]. Rows before `score_from` (row 0 always)
are zeros. Per sequence (`SequenceScores`, numpy arrays that travel as wire frames):

- `topk_ids` int32 (T, k): the k most likely ids of each row, most likely first;
- `topk_logprobs` float32 (T, k): their log-probabilities (log_softmax of the logits, temperature 1);
- `tail_logmass` float32 (T,): log of the probability outside the top k, log(1 - sum(exp(topk))),
  at least log(1e-20) (`TAIL_LOGMASS_FLOOR`) where the top k hold all the mass in float32;
- `token_logprobs` float32 (T,): the log-probability of the actual token token_ids[t].

A judge scorer answers the generator's `GENERATE` (records/generate.py) instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from postrain.core.messages import MessageKind
from postrain.core.record import Record, Vector, codec

TAIL_LOGMASS_FLOOR = math.log(1e-20)   # -46.05: the tail of a row whose top k hold all the mass


@dataclass(frozen=True, slots=True)
class TokenScoresRequest(Record):
    """`score_tokens`: sequences to score and, per sequence, the first row wanted (>= 1, at most
    its length: a sequence scored from its length has no row); top_k None: the scorer's own."""

    token_ids: list[Vector]
    score_from: list[int]
    top_k: int | None = None

    def _check(self) -> None:
        if len(self.score_from) != len(self.token_ids):
            self.fail_field("score_from", self.score_from, f"one entry per sequence ({len(self.token_ids)})")
        for i, (ids, start) in enumerate(zip(self.token_ids, self.score_from)):
            if len(ids) < 2:
                self.fail_field("token_ids", ids, f"sequences of at least 2 tokens (sequence {i} has {len(ids)})")
            if not 1 <= start <= len(ids):
                self.fail_field("score_from", self.score_from,
                                f"in [1, len(token_ids[i])] (sequence {i}: {start}, its length {len(ids)}); "
                                "row 0 has no context, so the first row that can be scored is 1")
        if self.top_k is not None and self.top_k < 1:
            self.fail_field("top_k", self.top_k, ">= 1 (or None: the scorer's configured top_k)")


@dataclass(frozen=True, slots=True)
class SequenceScores(Record):
    """One sequence's teacher rows (module docstring): topk_ids (T, k) int32, topk_logprobs
    (T, k) float32, tail_logmass (T,) float32, token_logprobs (T,) float32. Invariant: the four
    have T rows."""

    topk_ids: Vector
    topk_logprobs: Vector
    tail_logmass: Vector
    token_logprobs: Vector

    def _check(self) -> None:
        rows = len(self.topk_ids)
        for name in ("topk_logprobs", "tail_logmass", "token_logprobs"):
            if len(getattr(self, name)) != rows:
                self.fail_field(name, getattr(self, name), f"one row per token ({rows}, as topk_ids)")
        shape = getattr(self.topk_ids, "shape", None)
        if shape is not None and getattr(self.topk_logprobs, "shape", shape) != shape:
            self.fail_field("topk_logprobs", self.topk_logprobs, f"of topk_ids' shape {tuple(shape)}")

    @property
    def top_k(self) -> int:
        """k, the ids kept per row (0 for a sequence without rows)."""
        shape = getattr(self.topk_ids, "shape", None)
        if shape is not None:
            return int(shape[1]) if len(shape) == 2 else 0
        return len(self.topk_ids[0]) if len(self.topk_ids) else 0   # type: ignore[index]  # a list of rows


def _encode_sequences(sequences: list[SequenceScores]) -> list[dict[str, Any]]:
    return [s.to_wire() for s in sequences]


def _decode_sequences(items: list[dict[str, Any]]) -> list[SequenceScores]:
    return [SequenceScores.from_wire(item) for item in items]


@dataclass(frozen=True, slots=True)
class TokenScoresReply(Record):
    """The `score_tokens` reply: one `SequenceScores` per requested sequence, in order; the
    scorer's model spec (for the trace); policy_version is 0 (scorers are frozen)."""

    sequences: list[SequenceScores] = field(metadata=codec(_encode_sequences, _decode_sequences))
    model: str
    policy_version: int = 0


@dataclass(frozen=True, slots=True)
class RewardScoresRequest(Record):
    """`score_reward`: sequences for a reward model, as token ids (prompt + completion, in the
    reward model's own vocabulary) or as conversations ({"role", "content"} messages, the last
    the reply to score), which the scorer renders with the reward model's chat template.
    Exactly one of the two."""

    token_ids: list[Vector] | None = None
    conversations: list[list[dict[str, Any]]] | None = None

    def _check(self) -> None:
        if (self.token_ids is None) == (self.conversations is None):
            self.fail_field("token_ids", self.token_ids, "given, or conversations instead (exactly one of the two)")
        for i, ids in enumerate(self.token_ids or []):
            if len(ids) < 1:
                self.fail_field("token_ids", self.token_ids, f"sequences of at least 1 token (sequence {i} is empty)")
        for i, conversation in enumerate(self.conversations or []):
            if not conversation or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in conversation):
                self.fail_field("conversations", conversation, f"non-empty lists of {{'role', 'content'}} "
                                f"messages with str values (conversation {i})")


@dataclass(frozen=True, slots=True)
class RewardScoresReply(Record):
    """The `score_reward` reply: the reward model's score of each sequence, in order."""

    scores: list[float]


# The scorer's messages (actors/scorer/actor.py).
SCORE_TOKENS = MessageKind("score_tokens", TokenScoresRequest, TokenScoresReply)
SCORE_REWARD = MessageKind("score_reward", RewardScoresRequest, RewardScoresReply)
