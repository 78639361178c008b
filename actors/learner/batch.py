"""Rollout batches for the learner: the wire format, validation, padding and micro-batches.

A batch is a plain dict (msgpack-able; arrays travel as extra frames):

    {"token_ids":        [ids_0, ids_1, ...],     # per sample: prompt + response, the EXACT sampled ids
     "loss_mask":        [m_0, m_1, ...],         # same length as ids_i; 1 = produced by the policy
     "behavior_logprobs": [lp_0, lp_1, ...],      # same length; lp_i[t] = generator's logprob of ids_i[t]
     "policy_versions":  [v_0, v_1, ...],         # optional; same length per token, or one int per sample
     "advantages":       [a_0, a_1, ...],         # (B,) per sample, or per token (same length as ids_i)
     # or, instead of advantages:
     "rewards":          [r_0, r_1, ...],         # (B,) scalar rewards ...
     "reward_components": {"correct": [...], ...},  # ... or named components (weighted by the config)
     "group_ids":        [g_0, g_1, ...]}         # (B,) samples of one prompt; contiguous, equal sizes

Entries where loss_mask is 0 (prompt, tool output) are ignored in behavior_logprobs and
policy_versions. Token t is scored from the prefix before it, so the learner works on
targets = ids[1:] and every per-token field is shifted the same way; loss_mask[0] must be 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from postrain.core.errors import PostrainError

if TYPE_CHECKING:
    from .shared_prefix import PrefixPlan


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


@dataclass
class PackedBatch:
    """A batch padded on the right. Shapes: B samples, T the longest sample; per-token fields
    are aligned with targets = input_ids[:, 1:], so they are (B, T - 1).

    Invariants: loss_mask <= attention_mask[:, 1:]; advantages is (B,) or (B, T - 1); `shared`
    describes these rows (rows() and select() drop it: a plan belongs to one micro-batch).
    """

    input_ids: torch.Tensor          # (B, T) int64, 0 past each sample's end
    attention_mask: torch.Tensor     # (B, T) int64, 1 = real token
    loss_mask: torch.Tensor          # (B, T - 1) bool: target t+1 was produced by the policy
    behavior_logp: torch.Tensor      # (B, T - 1) float32 (0 where loss_mask is False)
    policy_versions: torch.Tensor    # (B, T - 1) int64, -1 where unknown
    advantages: torch.Tensor         # (B,) or (B, T - 1) float32
    shared: "PrefixPlan | None" = None   # shared-prefix layout of a micro-batch (actors/learner/shared_prefix.py)

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def rows(self, start: int, stop: int) -> "PackedBatch":
        """Samples [start, stop), trimmed to their own longest length (a micro-batch)."""
        width = max(int(self.attention_mask[start:stop].sum(-1).max()), 2)
        adv = self.advantages[start:stop]
        return PackedBatch(
            self.input_ids[start:stop, :width], self.attention_mask[start:stop, :width],
            self.loss_mask[start:stop, :width - 1], self.behavior_logp[start:stop, :width - 1],
            self.policy_versions[start:stop, :width - 1], adv if adv.dim() == 1 else adv[:, :width - 1])

    def select(self, indices: torch.Tensor) -> "PackedBatch":
        """The samples at `indices` (B',) int64, in that order, at the same width."""
        return PackedBatch(*(getattr(self, f)[indices] for f in (
            "input_ids", "attention_mask", "loss_mask", "behavior_logp", "policy_versions", "advantages")))

    def to(self, device) -> "PackedBatch":
        return PackedBatch(*(getattr(self, f).to(device) for f in (
            "input_ids", "attention_mask", "loss_mask", "behavior_logp", "policy_versions", "advantages")),
            shared=None if self.shared is None else self.shared.to(device))


def pack_batch(batch: dict, *, require_rl_fields: bool = True,
               advantages: torch.Tensor | None = None) -> PackedBatch:
    """Validate a batch dict (module docstring) and pad it. `advantages` (B,) overrides the batch's;
    without RL fields (SFT) behaviour logprobs and advantages are zeros."""
    if not isinstance(batch, dict) or "token_ids" not in batch or "loss_mask" not in batch:
        got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise LearnerError("a batch must be a dict with at least 'token_ids' and 'loss_mask' (one list "
                           f"per sample); got {got}")
    ids = [_as_1d(x, "token_ids", i, torch.int64) for i, x in enumerate(batch["token_ids"])]
    num = len(ids)
    if num == 0:
        raise LearnerError("the batch is empty; send at least one sample")
    lengths = [len(x) for x in ids]
    if min(lengths) < 2:
        raise LearnerError(f"every sample needs >= 2 tokens (a prompt and a response), got a sample of "
                           f"{min(lengths)}")
    masks = _per_token(batch, "loss_mask", lengths, torch.bool)
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
    if require_rl_fields:
        if "behavior_logprobs" not in batch:
            raise LearnerError("an RL batch needs 'behavior_logprobs' (the generator's logprob of every "
                               "token, aligned with token_ids); use the sft step for supervised data")
        for i, lp in enumerate(_per_token(batch, "behavior_logprobs", lengths, torch.float32)):
            behavior[i, :lengths[i]] = lp
        _fill_versions(batch.get("policy_versions"), versions, lengths)
    if advantages is None:
        advantages = _batch_advantages(batch, lengths, width) if require_rl_fields else torch.zeros(num)
    adv = advantages if advantages.dim() == 1 else advantages[:, 1:]
    return PackedBatch(input_ids, attention, loss_mask[:, 1:], behavior[:, 1:] * loss_mask[:, 1:],
                       versions[:, 1:], adv.to(torch.float32))


def _per_token(batch: dict, name: str, lengths: list[int], dtype) -> list[torch.Tensor]:
    values = batch[name]
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
            versions[i, :n] = _per_token({"policy_versions": [v]}, "policy_versions", [n], torch.int64)[0]


def _batch_advantages(batch: dict, lengths: list[int], width: int) -> torch.Tensor:
    """The batch's own advantages: (B,) per sample or (B, width) per token."""
    num = len(lengths)
    if "advantages" not in batch:
        raise LearnerError("an RL batch needs 'advantages', or 'rewards'/'reward_components' with "
                           "'group_ids' for the learner to compute them")
    adv = batch["advantages"]
    first = adv[0] if len(adv) else None
    if isinstance(adv, (list, tuple)) and first is not None and np.ndim(first) == 1:
        out = torch.zeros(num, width)
        for i, a in enumerate(_per_token(batch, "advantages", lengths, torch.float32)):
            out[i, :lengths[i]] = a
        return out
    return _as_vector(adv, "advantages", num)


def group_size_of(group_ids, num_samples: int) -> int:
    """The common size of contiguous groups; raises LearnerError if groups interleave or differ."""
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
    if len(set(sizes)) != 1:
        raise LearnerError(f"groups must all have the same size for group-relative advantages, got sizes "
                           f"{sorted(set(sizes))}; drop or pad incomplete groups first")
    return sizes[0]


def reward_components_of(batch: dict, num_samples: int) -> dict[str, torch.Tensor]:
    if "reward_components" in batch:
        return {k: _as_vector(v, f"reward_components[{k!r}]", num_samples)
                for k, v in batch["reward_components"].items()}
    if "rewards" in batch:
        return {"reward": _as_vector(batch["rewards"], "rewards", num_samples)}
    raise LearnerError("the batch has neither 'advantages' nor 'rewards'/'reward_components'")
