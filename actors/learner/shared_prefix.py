"""Shared-prefix group training: micro-batches in which each shared prefix is computed once.

    order, micro = plan_micro_batches(packed, micro_batch_size=8, enable_shared_prefix=True)
    # micro[k].shared is a PrefixPlan (or None: the plain padded path is cheaper there)

Design note. The samples of a GRPO group continue one prompt, and the samples of an agent's
episodes often continue one system prompt and the same first turns. A causal model computes
the same hidden states, keys and values for a shared prefix in every sample, so the learner
may compute them once per micro-batch and let each sample's own tokens (its suffix) attend to
them: the forward values are the same, and autograd sums the gradients of every suffix into
the one prefix, which is what the plain path sums over its copies. So the loss, the gradients
and the logprobs equal the plain path's up to float rounding, whatever is trained inside the
prefix (a prefix may end mid-conversation, after trained tokens): the trained positions read
their hidden states from the prefix rows or the suffix rows through `PrefixPlan.hidden_rows`.

Which samples share what: the batch is sorted lexicographically by token ids, so samples with
long common prefixes become neighbours; each micro-batch is cut into runs of neighbours by a
small dynamic program that maximises the tokens saved, sum over runs of (size - 1) * prefix.
A run's prefix is its members' longest common prefix, kept one token short of its shortest
member, so every suffix has a token; a sample that shares nothing is a run of its own, split
so that its suffix is no longer than the groups' (a prefix token costs G rows, a suffix token B).
Cost: a micro-batch computes G * P + B * S token rows (G
prefixes padded to P, B suffixes padded to S) against B * T on the plain path; the plan of
the whole batch is the cheaper of the shared plan and the plain one (sorted by length), so a
batch whose samples share nothing trains exactly as before.
"""
from __future__ import annotations

import torch

from ..models.llama import SharedPrefixBatch
from .packed import PackedBatch, PrefixPlan

__all__ = ["PrefixPlan", "common_prefix_lengths", "plan_micro_batches", "prefix_plan", "runs_of_shared_prefixes"]


def plan_micro_batches(packed: PackedBatch, micro_batch_size: int,
                       enable_shared_prefix: bool) -> tuple[torch.Tensor, list[PackedBatch]]:
    """(order, micro-batches): the samples in `order` (B,) int64, cut into consecutive micro-batches
    of `micro_batch_size`, each with its PrefixPlan where that is cheaper than padding. Without
    shared prefixes (disabled, or no cheaper) samples are sorted by length, so short ones pad to
    short ones; every order gives the same gradient (the losses use whole-batch normalisers)."""
    lengths = packed.attention_mask.sum(-1)
    by_length = torch.argsort(lengths, stable=True)
    plain = _cut(packed.select(by_length), micro_batch_size)
    if not enable_shared_prefix:
        return by_length, plain
    lexicographic = torch.tensor(sorted(range(packed.num_samples),
                                        key=lambda i: packed.input_ids[i, :int(lengths[i])].tolist()))
    shared = [_with_plan(mb) for mb in _cut(packed.select(lexicographic), micro_batch_size)]
    if sum(map(_cost, shared)) < sum(map(_cost, plain)):
        return lexicographic, shared
    return by_length, plain


def _cut(packed: PackedBatch, size: int) -> list[PackedBatch]:
    return [packed.rows(s, min(s + size, packed.num_samples)) for s in range(0, packed.num_samples, size)]


def _cost(mb: PackedBatch) -> int:
    """Token rows the forward pass of this micro-batch computes."""
    return mb.shared.num_token_rows if mb.shared is not None else mb.input_ids.numel()


def _with_plan(mb: PackedBatch) -> PackedBatch:
    plan = prefix_plan(mb.input_ids, mb.attention_mask.sum(-1))
    if plan is not None and plan.num_token_rows < mb.input_ids.numel():
        mb.shared = plan
    return mb


def common_prefix_lengths(input_ids: torch.Tensor, lengths: torch.Tensor) -> list[int]:
    """(B - 1) common prefix lengths of neighbouring samples, each at most the shorter one's length - 1."""
    out = []
    for b in range(input_ids.shape[0] - 1):
        n = int(min(lengths[b], lengths[b + 1])) - 1
        same = (input_ids[b, :n] == input_ids[b + 1, :n]).long()
        out.append(int(same.cumprod(0).sum()))
    return out


def runs_of_shared_prefixes(neighbour_prefixes: list[int]) -> list[tuple[int, int, int]]:
    """Cut B samples (B - 1 neighbour prefix lengths) into runs (start, stop, prefix_len) that
    maximise sum((stop - start - 1) * prefix_len); prefix_len = min of the run's neighbour prefixes,
    0 for a run of one. Ties keep samples apart. O(B^2); B is a micro-batch."""
    num = len(neighbour_prefixes) + 1
    best = [0] * (num + 1)          # best[j]: the most saved by samples [0, j)
    cut = [0] * (num + 1)           # cut[j]: the start of the last run of that best
    for stop in range(1, num + 1):
        best[stop], cut[stop] = best[stop - 1], stop - 1
        shared = None
        for start in range(stop - 2, -1, -1):
            shared = neighbour_prefixes[start] if shared is None else min(shared, neighbour_prefixes[start])
            saved = best[start] + (stop - start - 1) * shared
            if saved > best[stop]:
                best[stop], cut[stop] = saved, start
    runs, stop = [], num
    while stop > 0:
        start = cut[stop]
        prefix = min(neighbour_prefixes[start:stop - 1]) if stop - start > 1 else 0
        runs.append((start, stop, prefix))
        stop = start
    return runs[::-1]


def prefix_plan(input_ids: torch.Tensor, lengths: torch.Tensor) -> PrefixPlan | None:
    """The shared-prefix layout of a micro-batch (input_ids (B, T), right-padded, lengths (B,)),
    or None when no two samples share a token."""
    runs = runs_of_shared_prefixes(common_prefix_lengths(input_ids, lengths))
    if all(stop - start == 1 for start, stop, _ in runs):
        return None
    num, width = input_ids.shape
    group_of = torch.zeros(num, dtype=torch.int64)
    prefix_lens = torch.zeros(len(runs), dtype=torch.int64)
    firsts = torch.zeros(len(runs), dtype=torch.int64)
    for g, (start, stop, shared) in enumerate(runs):
        group_of[start:stop], prefix_lens[g], firsts[g] = g, shared, start
    grouped = torch.tensor([stop - start > 1 for start, stop, _ in runs])[group_of]   # (B,)
    longest_suffix = int((lengths - prefix_lens[group_of])[grouped].max())
    for g, (start, stop, _) in enumerate(runs):
        if stop - start == 1:      # alone: as much in the suffix as the groups' suffixes pad to
            prefix_lens[g] = min(max(int(lengths[start]) - longest_suffix, 0), int(lengths[start]) - 1)
    own_prefix = prefix_lens[group_of]                                           # (B,)
    suffix_lens = lengths - own_prefix                                           # (B,) >= 1
    prefix_width, suffix_width = int(prefix_lens.max()), int(suffix_lens.max())
    prefix_mask = (torch.arange(prefix_width)[None, :] < prefix_lens[:, None]).long()    # (G, P)
    prefix_ids = input_ids[firsts, :prefix_width] * prefix_mask
    suffix_mask = (torch.arange(suffix_width)[None, :] < suffix_lens[:, None]).long()    # (B, S)
    at = (own_prefix[:, None] + torch.arange(suffix_width)[None, :]).clamp(max=width - 1)
    suffix_ids = input_ids.gather(1, at) * suffix_mask
    t = torch.arange(width)[None, :]                                             # positions (1, T)
    in_prefix = t < own_prefix[:, None]
    prefix_row = group_of[:, None] * prefix_width + t
    suffix_row = (len(runs) * prefix_width + torch.arange(num)[:, None] * suffix_width
                  + (t - own_prefix[:, None]))
    hidden_rows = torch.where(in_prefix, prefix_row, suffix_row)
    hidden_rows = torch.where(t < lengths[:, None], hidden_rows, torch.zeros_like(hidden_rows))
    return PrefixPlan(SharedPrefixBatch(prefix_ids, prefix_mask, suffix_ids, suffix_mask, group_of),
                      hidden_rows)
