"""Learner batches: validation, padding and per-sample fields, from the records that travel.

A batch is a record (postrain.actors.records, records/train.py): a `TrainBatch` for an RL step,
an `SftBatch` for a supervised one. Per sample (arrays travel as extra frames):

    token_ids          prompt + response, the EXACT sampled ids
    loss_mask          same length as token_ids; 1 = produced by the policy
    behavior_logprobs  (TrainBatch) same length; the generator's logprob of each token
    policy_versions    (TrainBatch, optional) same length per token, or one int per sample
    advantages         (TrainBatch) per sample (B,), or per token (same length as token_ids)
    rewards / reward_components / group_ids   (TrainBatch, instead of advantages) scalar
                       rewards or named components (weighted by the config), over contiguous
                       groups of equal size: the learner computes group-relative advantages
    teacher_topk_ids / teacher_topk_logprobs / teacher_tail_logmass   (TrainBatch, optional)
                       the teacher's top-k rows for distillation, (T, k), (T, k), (T,), one k
                       for the whole batch; on trained rows the ids are distinct and the
                       log-probs and tails finite (learner/distill.py)

The record checks the shapes it can see (one entry per sample); `pack_batch` checks the rest
(per-token lengths, loss_mask[i][0] == 0) and pads. Entries where loss_mask is 0 (prompt, tool
output) are ignored in behavior_logprobs and policy_versions. Token t is scored from the prefix
before it, so the learner works on targets = ids[1:] and every per-token field is shifted the
same way.
"""
from __future__ import annotations

import numpy as np
import torch

from postrain.core.errors import PostrainError

from ..records import SftBatch, TrainBatch
from .packed import PackedBatch, PrefixPlan

__all__ = ["LearnerError", "PackedBatch", "PrefixPlan", "group_size_of", "group_sizes_of", "pack_batch", "reward_components_of"]


class LearnerError(PostrainError, ValueError):
    """A batch, config or checkpoint the learner cannot use; the message names the rule and the fix."""


def _as_1d(value, name: str, index: int, dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
    else:
        t = torch.from_numpy(np.asarray(value)) if isinstance(value, np.ndarray) else torch.tensor(value)
    if t.dim() != 1:
        raise LearnerError(f"{name}[{index}] must be 1-D (one entry per token), got shape {tuple(t.shape)}")
    return t.to(dtype)


def _as_vector(value, name: str, num_samples: int, dtype=torch.float32) -> torch.Tensor:
    t = value.detach().to("cpu") if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    t = t.to(dtype).reshape(-1)
    if t.numel() != num_samples:
        raise LearnerError(f"{name} must hold one value per sample ({num_samples}), got {t.numel()}")
    return t


def pack_batch(batch: TrainBatch | SftBatch, *, advantages: torch.Tensor | None = None) -> PackedBatch:
    """Validate a batch record (module docstring) and pad it. `advantages` (B,) overrides a
    TrainBatch's; an SftBatch's behaviour logprobs and advantages are zeros."""
    if not isinstance(batch, (TrainBatch, SftBatch)):
        raise LearnerError(f"a learner batch is a TrainBatch or an SftBatch (postrain.actors.records), got "
                           f"{type(batch).__name__}; build one, e.g. TrainBatch(token_ids=..., loss_mask=..., "
                           "behavior_logprobs=..., advantages=...)")
    ids = [_as_1d(x, "token_ids", i, torch.int64) for i, x in enumerate(batch.token_ids)]
    num = len(ids)
    if num == 0:
        raise LearnerError("the batch is empty; send at least one sample")
    lengths = [len(x) for x in ids]
    if min(lengths) < 2:
        raise LearnerError(f"every sample needs >= 2 tokens (a prompt and a response), got a sample of "
                           f"{min(lengths)}")
    masks = _per_token(batch.loss_mask, "loss_mask", lengths, torch.bool)
    if any(bool(m[0]) for m in masks):
        raise LearnerError("loss_mask[i][0] must be 0: the first token has no prefix to be scored from; "
                           "the prompt's tokens are not trained")
    width = max(lengths)
    input_ids = torch.zeros(num, width, dtype=torch.int64)
    attention = torch.zeros(num, width, dtype=torch.int64)
    loss_mask = torch.zeros(num, width, dtype=torch.bool)
    behavior = torch.zeros(num, width, dtype=torch.float32)
    versions = torch.full((num, width), -1, dtype=torch.int64)
    for i, n in enumerate(lengths):
        input_ids[i, :n], attention[i, :n], loss_mask[i, :n] = ids[i], 1, masks[i]
    if isinstance(batch, TrainBatch):   # RL: behaviour logprobs and versions
        for i, lp in enumerate(_per_token(batch.behavior_logprobs, "behavior_logprobs", lengths, torch.float32)):
            behavior[i, :lengths[i]] = lp
        _fill_versions(batch.policy_versions, versions, lengths)
    if advantages is None:
        advantages = (_batch_advantages(batch.advantages, lengths, width) if isinstance(batch, TrainBatch)
                      else torch.zeros(num))
    adv = advantages if advantages.dim() == 1 else advantages[:, 1:]
    packed = PackedBatch(input_ids, attention, loss_mask[:, 1:], behavior[:, 1:] * loss_mask[:, 1:],
                         versions[:, 1:], adv.to(torch.float32))
    if isinstance(batch, TrainBatch) and batch.has_teacher_rows:
        _pack_teacher(batch, packed, lengths)
    if batch.images is not None:
        packed.images = [list(files or []) for files in batch.images]
    return packed


def _pack_teacher(batch: TrainBatch, packed: PackedBatch, lengths: list[int]) -> None:
    """The teacher's rows, padded and shifted like every per-token field, onto `packed`; checked
    on the trained rows (one k, distinct ids, finite log-probs and tails)."""
    assert batch.teacher_topk_ids is not None and batch.teacher_topk_logprobs is not None
    assert batch.teacher_tail_logmass is not None   # the record's rule: all three or none
    ids = [_as_2d(x, "teacher_topk_ids", i, torch.int64) for i, x in enumerate(batch.teacher_topk_ids)]
    ks = sorted({int(x.shape[1]) for x in ids})
    if len(ks) != 1:
        raise LearnerError(f"teacher_topk_ids must have one k for the whole batch, got k in {ks}; score every "
                           "sample with one top_k")
    num, width, k = len(lengths), max(lengths), ks[0]
    table = torch.zeros(num, width, k, dtype=torch.int64)
    logp = torch.zeros(num, width, k, dtype=torch.float32)
    tail = torch.zeros(num, width, dtype=torch.float32)
    for i, n in enumerate(lengths):
        table[i, :n] = ids[i]
        logp[i, :n] = _as_2d(batch.teacher_topk_logprobs[i], "teacher_topk_logprobs", i, torch.float32)
        tail[i, :n] = _as_1d(batch.teacher_tail_logmass[i], "teacher_tail_logmass", i, torch.float32)
    packed.teacher_ids, packed.teacher_logp, packed.teacher_tail = table[:, 1:], logp[:, 1:], tail[:, 1:]
    sel = packed.loss_mask
    rows = packed.teacher_ids[sel].sort(-1).values
    if k > 1 and bool((rows[:, 1:] == rows[:, :-1]).any()):
        sample, position = _first(sel, (rows[:, 1:] == rows[:, :-1]).any(-1))
        raise LearnerError(f"teacher_topk_ids[{sample}][{position}] repeats an id; a trained token's row holds "
                           "the teacher's k most likely ids, each once (was the row scored? rows before the "
                           "scorer's score_from are zeros)")
    finite = torch.isfinite(packed.teacher_logp[sel]).all(-1) & torch.isfinite(packed.teacher_tail[sel])
    if not bool(finite.all()):
        sample, position = _first(sel, ~finite)
        raise LearnerError(f"teacher_topk_logprobs / teacher_tail_logmass [{sample}][{position}] is not finite; "
                           "the tail is log(1 - sum(exp(top-k logprobs))) clamped to >= log(1e-20)")


def _first(sel: torch.Tensor, bad_rows: torch.Tensor) -> tuple[int, int]:
    """(sample, token position in token_ids) of the first selected row flagged in `bad_rows`."""
    index = int(bad_rows.nonzero()[0, 0])
    sample, target = sel.nonzero()[index].tolist()
    return sample, target + 1


def _as_2d(value, name: str, index: int, dtype) -> torch.Tensor:
    t = value.detach().to("cpu") if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if t.dim() != 2:
        raise LearnerError(f"{name}[{index}] must be 2-D (one row of k per token), got shape {tuple(t.shape)}")
    return t.to(dtype)


def _per_token(values, name: str, lengths: list[int], dtype) -> list[torch.Tensor]:
    if len(values) != len(lengths):
        raise LearnerError(f"{name} must have one entry per sample ({len(lengths)}), got {len(values)}")
    out = []
    for i, (v, n) in enumerate(zip(values, lengths)):
        t = _as_1d(v, name, i, dtype)
        if len(t) != n:
            raise LearnerError(f"{name}[{i}] has {len(t)} entries but token_ids[{i}] has {n}; align it "
                               "with token_ids (one entry per token, prompt included)")
        out.append(t)
    return out


def _fill_versions(values, versions: torch.Tensor, lengths: list[int]) -> None:
    if values is None:
        return
    if len(values) != len(lengths):
        raise LearnerError(f"policy_versions must have one entry per sample ({len(lengths)}), "
                           f"got {len(values)}")
    for i, (v, n) in enumerate(zip(values, lengths)):
        if isinstance(v, (int, np.integer)) or (isinstance(v, torch.Tensor) and v.dim() == 0):
            versions[i, :n] = int(v)
        else:
            versions[i, :n] = _per_token([v], "policy_versions", [n], torch.int64)[0]


def _batch_advantages(adv, lengths: list[int], width: int) -> torch.Tensor:
    """A TrainBatch's own advantages: (B,) per sample or (B, width) per token."""
    num = len(lengths)
    if adv is None:
        raise LearnerError("an RL batch needs 'advantages', or 'rewards'/'reward_components' with "
                           "'group_ids' for the learner to compute them")
    first = adv[0] if len(adv) else None
    if isinstance(adv, (list, tuple)) and first is not None and np.ndim(first) == 1:
        out = torch.zeros(num, width)
        for i, a in enumerate(_per_token(adv, "advantages", lengths, torch.float32)):
            out[i, :lengths[i]] = a
        return out
    return _as_vector(adv, "advantages", num)


def group_size_of(group_ids, num_samples: int) -> int:
    """The common size of contiguous groups; raises LearnerError if groups interleave or differ."""
    sizes = group_sizes_of(group_ids, num_samples)
    if len(set(sizes)) != 1:
        raise LearnerError(f"groups must all have the same size for group-relative advantages, got sizes "
                           f"{sorted(set(sizes))}; drop or pad incomplete groups first")
    return sizes[0]


def group_sizes_of(group_ids, num_samples: int) -> list[int]:
    """The sizes of contiguous groups, in order (a group that lost samples to a failure is
    smaller); raises LearnerError if groups interleave."""
    ids = _as_vector(group_ids, "group_ids", num_samples, torch.int64).tolist()
    sizes, seen, prev = [], set(), object()
    for g in ids:
        if g != prev:
            if g in seen:
                raise LearnerError(f"group {g} is not contiguous in the batch; put each prompt's samples "
                                   "next to each other")
            seen.add(g)
            sizes.append(0)
            prev = g
        sizes[-1] += 1
    return sizes


def reward_components_of(batch: TrainBatch, num_samples: int) -> dict[str, torch.Tensor]:
    """A TrainBatch's rewards as named components ({"reward": rewards} for plain rewards)."""
    if batch.reward_components is not None:
        return {k: _as_vector(v, f"reward_components[{k!r}]", num_samples)
                for k, v in batch.reward_components.items()}
    if batch.rewards is not None:
        return {"reward": _as_vector(batch.rewards, "rewards", num_samples)}
    raise LearnerError("the batch has neither 'advantages' nor 'rewards'/'reward_components'; give one (only "
                       "learner.loss = \"opd\", distillation alone, trains without them)")
