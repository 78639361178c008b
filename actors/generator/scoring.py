"""Scoring requests: a sequence's teacher rows from one prefill, nothing sampled.

    request_id = engine.add_score_request(token_ids, score_from=P, top_k=32)
    ... engine.step() until it finishes ...
    output.scores.topk_ids, .topk_logprobs, .tail_logmass, .token_logprobs   # a `Scores`

The rows follow `postrain.actors.records.scorer`'s convention: row t in [0, T) is the model's
distribution over token t given token_ids[:t], so it comes from the logits at position t - 1;
rows before `score_from` (row 0 always) are zeros. Each row is log_softmax(logits) at
temperature 1 in float32: its k most likely ids (most likely first) and their logprobs, the
log of the mass outside them and the logprob of the actual token.

Design note. A scoring request is a prompt (the whole sequence) that the scheduler admits,
batches, chunks and preempts like any other; its plan entries carry `logits_from` =
score_from - 1, the first position whose logits are wanted. Two consequences:
- the prefix cache may hold positions past that one (a sample that shares a longer prefix
  with one scored earlier): the KV manager takes at most `logits_from` tokens from it
  (`KVManager.allocate(max_cached=)`), so every wanted position is computed;
- the runner projects, for such a row, every new position from `logits_from` on (a mask
  through the model's `logits_to_keep`: no padding's logits), and the engine reduces each
  row's slice here (`score_logits`) as soon as the forward returns, in pieces of
  `ROWS_PER_PIECE` positions, so no (T, V) log-softmax lives longer than its piece.
After its last chunk the request finishes: its blocks are freed (full ones stay in the prefix
cache, so the group's other samples find the shared prompt there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

TAIL_LOGMASS_FLOOR = math.log(1e-20)   # as postrain.actors.records.scorer's (kept torch-free there)
ROWS_PER_PIECE = 512                   # positions reduced at once: bounds the (n, V) float32 temporaries


@dataclass
class Scores:
    """One sequence's teacher rows (module docstring): topk_ids int32 (T, k), topk_logprobs
    float32 (T, k), tail_logmass float32 (T,), token_logprobs float32 (T,)."""

    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    tail_logmass: np.ndarray
    token_logprobs: np.ndarray

    @classmethod
    def zeros(cls, num_tokens: int, top_k: int) -> "Scores":
        return cls(np.zeros((num_tokens, top_k), np.int32), np.zeros((num_tokens, top_k), np.float32),
                   np.zeros(num_tokens, np.float32), np.zeros(num_tokens, np.float32))


def score_logits(logits: torch.Tensor, targets: torch.Tensor, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk ids, topk logprobs, tail log-mass, target logprobs) of logits (n, V) and the
    tokens they predict, targets (n,): log_softmax in float32, the tail as the logsumexp of
    every logprob outside the top k (exact, where 1 - sum(exp(top k)) would cancel), floored
    at TAIL_LOGMASS_FLOOR."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_logprobs, top_ids = logprobs.topk(top_k, dim=-1)
    token_logprobs = logprobs.gather(1, targets[:, None].to(logprobs.device))[:, 0]
    logprobs.scatter_(1, top_ids, float("-inf"))                    # only the tail is left
    tail = torch.logsumexp(logprobs, dim=-1).clamp_(min=TAIL_LOGMASS_FLOOR)
    return top_ids, top_logprobs, tail, token_logprobs


class ScoreState:
    """A scoring request's rows as its chunks are read. Invariant: `rows` holds every row t in
    [score_from, T) whose predicting position t - 1 a forward has returned, zeros elsewhere."""

    __slots__ = ("targets", "score_from", "top_k", "rows")

    def __init__(self, token_ids: list[int], score_from: int, top_k: int):
        self.targets = torch.tensor(token_ids, dtype=torch.long)
        self.score_from = score_from
        self.top_k = top_k
        self.rows = Scores.zeros(len(token_ids), top_k)

    @property
    def logits_from(self) -> int:
        """The first position whose logits are wanted (the prefix cache stops before it)."""
        return self.score_from - 1

    def add(self, start_position: int, logits: torch.Tensor) -> None:
        """Reduce the logits (n, V) of positions start_position .. + n - 1 (one plan entry's
        new tokens) into the rows they predict; positions before `logits_from` and the
        sequence's last (it predicts nothing) are skipped."""
        first = max(start_position, self.logits_from)
        stop = min(start_position + logits.shape[0], len(self.targets) - 1)
        targets, rows = self.targets, self.rows
        for begin in range(first, stop, ROWS_PER_PIECE):
            end = min(stop, begin + ROWS_PER_PIECE)
            piece = logits[begin - start_position:end - start_position]
            ids, top, tail, token = score_logits(piece, targets[begin + 1:end + 1], self.top_k)
            rows.topk_ids[begin + 1:end + 1] = ids.cpu().numpy()
            rows.topk_logprobs[begin + 1:end + 1] = top.cpu().numpy()
            rows.tail_logmass[begin + 1:end + 1] = tail.cpu().numpy()
            rows.token_logprobs[begin + 1:end + 1] = token.cpu().numpy()
