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

import hashlib

import torch

from ..models.llama import SharedPrefixBatch
from .packed import PackedBatch, PrefixPlan

__all__ = ["PrefixPlan", "common_prefix_lengths", "plan_micro_batches", "prefix_plan", "runs_of_shared_prefixes"]


def plan_micro_batches(packed: PackedBatch, micro_batch_size: int,
                       enable_shared_prefix: bool) -> tuple[torch.Tensor, list[PackedBatch]]:
    """(order, micro-batches): the samples in `order` (B,) int64, cut into consecutive micro-batches
    of at most `micro_batch_size`, each with its PrefixPlan where that is cheaper than padding.
    Without shared prefixes (disabled, or no cheaper) samples are sorted by length, so short ones
    pad to short ones; every order gives the same gradient (the losses use whole-batch normalisers).

    A batch of samples of very different shapes (a mixture of tasks: prompts and answers of other
    lengths) is not padded to its longest sample: the plain order starts a new micro-batch where
    padding would pass MAX_PADDING of the real tokens, and the shared order sorts by the class of
    each sample's prompt length (its first trained token: a group's samples share it) before the
    tokens, and keeps two classes in one micro-batch only where that costs fewer token rows."""
    lengths = packed.attention_mask.sum(-1)
    by_length = torch.argsort(lengths, stable=True)
    plain = _cut_by_padding(packed.select(by_length), micro_batch_size)
    if not enable_shared_prefix:
        return by_length, plain
    prompts = [int(p) for p in packed.loss_mask.int().argmax(-1)]
    classes = [length_class(p, min(prompts)) for p in prompts]
    shown = image_keys(packed)
    lexicographic = torch.tensor(sorted(range(packed.num_samples),
                                        key=lambda i: (classes[i], shown[i],
                                                       packed.input_ids[i, :int(lengths[i])].tolist())))
    shared = _cut_by_class(packed.select(lexicographic), micro_batch_size, [classes[i] for i in lexicographic])
    if sum(map(_cost, shared)) < sum(map(_cost, plain)):
        return lexicographic, shared
    return by_length, plain


MAX_PADDING = 0.5   # the plain order's micro-batch pads at most this share of its real tokens more


def length_class(length: int, shortest: int) -> int:
    """Lengths in classes a factor of 2 wide counted from the shortest: [s, 2s) is 0, [2s, 4s) is 1,
    ... A batch whose prompts are all within a factor of 2 (one task, as a rule) is one class, so
    its order is the plain lexicographic one."""
    return (length // max(shortest, 1)).bit_length() - 1


def _cut_by_padding(packed: PackedBatch, size: int) -> list[PackedBatch]:
    """Consecutive micro-batches of at most `size` samples, a new one started where the next sample
    would make the padded width times the samples exceed (1 + MAX_PADDING) x the real tokens."""
    lengths = [int(n) for n in packed.attention_mask.sum(-1)]
    starts, start, longest, real = [0], 0, 0, 0
    for i, n in enumerate(lengths):
        count, wider = i - start, max(longest, n)
        if count and (count == size or (count + 1) * wider > (1 + MAX_PADDING) * (real + n)):
            starts.append(i)
            start, wider, real = i, n, 0
        longest, real = wider, real + n
    bounds = starts + [len(lengths)]
    return [packed.rows(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def _cut_by_class(packed: PackedBatch, size: int, classes: list[int]) -> list[PackedBatch]:
    """Micro-batches with their plans: runs of one class cut every `size` samples, then neighbouring
    pieces merged (at most `size` samples) where the merged plan costs no more token rows."""
    bounds = [i for i in range(1, len(classes)) if classes[i] != classes[i - 1]]
    pieces = [(lo, min(lo + size, hi)) for lo, hi in zip([0] + bounds, bounds + [len(classes)])
              for lo in range(lo, hi, size)]
    merged: list[tuple[int, int, PackedBatch]] = []
    for lo, hi in pieces:
        piece = _with_plan(packed.rows(lo, hi))
        if merged and hi - merged[-1][0] <= size:
            first, _, last = merged[-1]
            both = _with_plan(packed.rows(first, hi))
            if _cost(both) <= _cost(last) + _cost(piece):
                merged[-1] = (first, hi, both)
                continue
        merged.append((lo, hi, piece))
    return [mb for _, _, mb in merged]


def _cost(mb: PackedBatch) -> int:
    """Token rows the forward pass of this micro-batch computes."""
    return mb.shared.num_token_rows if mb.shared is not None else mb.input_ids.numel()


def image_keys(packed: PackedBatch) -> list[tuple[bytes, ...]]:
    """Per sample the hashes of its image files (all () for a text batch)."""
    if not packed.images:
        return [()] * packed.num_samples
    return [tuple(hashlib.sha256(data).digest() for data in files) for files in packed.images]


def _with_plan(mb: PackedBatch) -> PackedBatch:
    plan = prefix_plan(mb.input_ids, mb.attention_mask.sum(-1), image_keys(mb))
    if plan is not None and plan.num_token_rows < mb.input_ids.numel():
        mb.shared = plan
    return mb


def common_prefix_lengths(input_ids: torch.Tensor, lengths: torch.Tensor,
                          shown: list[tuple[bytes, ...]] | None = None) -> list[int]:
    """(B - 1) common prefix lengths of neighbouring samples, each at most the shorter one's length - 1;
    0 where the two show different images (`shown`: per sample its image keys), whose placeholder
    ids are the same tokens over other pixels."""
    out = []
    for b in range(input_ids.shape[0] - 1):
        if shown is not None and shown[b] != shown[b + 1]:
            out.append(0)
            continue
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


def prefix_plan(input_ids: torch.Tensor, lengths: torch.Tensor,
                shown: list[tuple[bytes, ...]] | None = None) -> PrefixPlan | None:
    """The shared-prefix layout of a micro-batch (input_ids (B, T), right-padded, lengths (B,);
    `shown`: per sample its image keys, so only samples with the same images share a prefix), or
    None when no two samples share a token."""
    runs = runs_of_shared_prefixes(common_prefix_lengths(input_ids, lengths, shown))
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
