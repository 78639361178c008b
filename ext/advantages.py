"""Rewards to advantages: shaping, group-relative baselines, DAPO dynamic sampling.

Layout rule for every function here: the samples of one prompt (a *group*) are
contiguous, so a flat reward vector of N = num_groups * group_size entries
reads as a (num_groups, group_size) matrix. The orchestrator emits rollouts
in that order.

Formulas (r: shaped reward of one sample, G: group size, g: its group):

- shaping        r = sum_k w_k * c_k  (+ overlong penalty, see `overlong_penalty`)
- GRPO           A = (r - mean_g(r)) / (std_g(r) + eps), std unbiased (divides by G - 1), eps = 1e-6
- Dr. GRPO       A = r - mean_g(r)
- RLOO           A = r - mean_{j in g, j != i}(r_j) = G / (G - 1) * (r - mean_g(r))
- dynamic sampling (DAPO): a group whose rewards are all equal has A = 0 for
  every sample and no learning signal; `filter_groups` drops it and counts it.
- groups of different sizes (`group_size` a list of sizes): the same formulas, each group
  over its own members. A sample lost to an infrastructure failure is simply absent from its
  group, so the others' advantages are exactly what they would be had it never been sampled;
  a group left with one sample has no baseline (A = 0, counted as zero variance).

`compute_advantages` is the one entry point callers use: it shapes and
normalises in one call, and on CUDA tensors it runs one fused CuPy kernel
(`postrain.ext.cupy_ops`); this module is the torch reference.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from . import cupy_ops
from .rl_ops_errors import RLOpsError

ADVANTAGE_MODES = ("grpo", "dr_grpo", "rloo")
GRPO_EPS = 1e-6


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    With L = response length, L_max = max_response_len_tokens, L_c = buffer_len_tokens:

        R(L) = 0                                  if L <= L_max - L_c
        R(L) = ((L_max - L_c) - L) / L_c * f      if L_max - L_c < L <= L_max
        R(L) = -f                                 if L > L_max

    f = penalty_factor (1.0 in the paper). The penalty is added to the shaped reward.
    """

    max_response_len_tokens: int
    buffer_len_tokens: int
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.buffer_len_tokens <= self.max_response_len_tokens:
            raise RLOpsError(
                "overlong penalty needs 0 < buffer_len_tokens <= max_response_len_tokens, got "
                f"buffer_len_tokens={self.buffer_len_tokens}, max_response_len_tokens="
                f"{self.max_response_len_tokens}; shrink the buffer or raise the maximum")


def overlong_penalty(response_lengths: torch.Tensor, penalty: OverlongPenalty) -> torch.Tensor:
    """The DAPO length penalty per sample (see `OverlongPenalty`); (N,) -> (N,) float32."""
    length = response_lengths.to(torch.float32)
    soft_start = float(penalty.max_response_len_tokens - penalty.buffer_len_tokens)
    ramp = (soft_start - length) / penalty.buffer_len_tokens * penalty.penalty_factor
    out = torch.where(length <= soft_start, torch.zeros_like(length), ramp)
    return torch.where(length > penalty.max_response_len_tokens,
                       torch.full_like(length, -penalty.penalty_factor), out)


def _stack_components(components: Mapping[str, torch.Tensor],
                      weights: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Components and weights in one name order: (K, N) float32 and (K,) float32."""
    if not components:
        raise RLOpsError("shape_rewards needs at least one reward component, got none; "
                         "pass e.g. {'correct': tensor}")
    unknown = sorted(set(weights) - set(components))
    if unknown:
        raise RLOpsError(f"reward weights name components that were not given: {unknown}; "
                         f"given components: {sorted(components)}")
    names = sorted(components)
    sizes = {name: tuple(components[name].shape) for name in names}
    if len(set(sizes.values())) != 1 or len(next(iter(sizes.values()))) != 1:
        raise RLOpsError(f"reward components must be 1-D tensors of one length (one value per "
                         f"sample), got shapes {sizes}")
    stacked = torch.stack([components[name].to(torch.float32) for name in names])  # (K, N)
    w = torch.tensor([float(weights.get(name, 1.0)) for name in names], dtype=torch.float32,
                     device=stacked.device)  # (K,)
    return stacked, w


def shape_rewards(components: Mapping[str, torch.Tensor], weights: Mapping[str, float] | None = None,
                  *, response_lengths: torch.Tensor | None = None,
                  overlong: OverlongPenalty | None = None) -> torch.Tensor:
    """r = sum_k w_k * c_k (+ overlong_penalty(L)); a missing weight counts as 1.0. -> (N,) float32."""
    stacked, w = _stack_components(components, weights or {})
    rewards = (w[:, None] * stacked).sum(0)
    if overlong is not None:
        if response_lengths is None:
            raise RLOpsError("the overlong penalty needs response_lengths (one length per sample), "
                             "got None; pass response_lengths or overlong=None")
        rewards = rewards + overlong_penalty(response_lengths.to(rewards.device), overlong)
    return rewards


def _as_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 2:
        raise RLOpsError(f"group_size must be >= 2 for group-relative advantages, got {group_size}; "
                         "sample at least two responses per prompt")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise RLOpsError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}; keep each prompt's samples contiguous")
    return rewards.view(-1, group_size)  # (num_groups, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, mode: str = "grpo",
                     eps: float = GRPO_EPS) -> torch.Tensor:
    """Group-relative advantages per sample (formulas in the module docstring). (N,) -> (N,)."""
    if mode not in ADVANTAGE_MODES:
        raise RLOpsError(f"advantage mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
    grouped = _as_groups(rewards.to(torch.float32), group_size)  # (num_groups, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    # a group of equal rewards has no signal: exactly 0, not its mean's rounding error
    # (which GRPO's division by std + eps would blow up to ~0.2)
    centred.masked_fill_(grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True), 0.0)
    if mode == "grpo":
        out = centred / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    elif mode == "dr_grpo":
        out = centred
    else:  # rloo: r_i - (sum - r_i) / (G - 1) == G / (G - 1) * (r_i - mean)
        out = centred * (group_size / (group_size - 1))
    return out.reshape(-1)


def ragged_group_advantages(rewards: torch.Tensor, group_sizes: Sequence[int], mode: str = "grpo",
                            eps: float = GRPO_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,), zero-variance flag per group (num_groups,) bool) for contiguous groups of
    the given sizes (module docstring). Invariant: sum(group_sizes) == N, every size >= 1."""
    if any(size < 1 for size in group_sizes) or sum(group_sizes) != rewards.numel():
        raise RLOpsError(f"group sizes must be >= 1 and sum to the {rewards.numel()} rewards, got "
                         f"{list(group_sizes)}; keep each prompt's samples contiguous")
    out, flat = [], rewards.to(torch.float32)
    zero = torch.zeros(len(group_sizes), dtype=torch.bool)
    for g, group in enumerate(torch.split(flat, list(group_sizes))):
        if group.numel() < 2 or bool(group.max() == group.min()):
            zero[g] = True
            out.append(torch.zeros_like(group))
        else:
            out.append(group_advantages(group, group.numel(), mode, eps))
    return torch.cat(out), zero


def _uniform_size(group_size: int | Sequence[int], n: int) -> int | None:
    """The common size where `group_size` is one (an int, or a list of equal sizes), else None."""
    if isinstance(group_size, int):
        return group_size
    sizes = list(group_size)
    return sizes[0] if sizes and len(set(sizes)) == 1 and sizes[0] >= 2 and sum(sizes) == n else None


@dataclass(frozen=True)
class GroupFilter:
    """What DAPO dynamic sampling keeps.

    Invariants: num_groups == num_kept_groups + num_dropped_groups;
    keep_samples == keep_groups.repeat_interleave(group_size).
    """

    keep_groups: torch.Tensor   # (num_groups,) bool: True where the group's rewards differ
    keep_samples: torch.Tensor  # (N,) bool
    num_groups: int
    num_dropped_groups: int

    @property
    def num_kept_groups(self) -> int:
        return self.num_groups - self.num_dropped_groups


def filter_groups(rewards: torch.Tensor, group_size: int) -> GroupFilter:
    """DAPO dynamic sampling: drop groups whose rewards have zero variance (all equal), count them."""
    grouped = _as_groups(rewards, group_size)
    keep = grouped.amax(dim=1) != grouped.amin(dim=1)  # (num_groups,)
    num_dropped = int((~keep).sum().item())
    return GroupFilter(keep_groups=keep, keep_samples=keep.repeat_interleave(group_size),
                       num_groups=grouped.shape[0], num_dropped_groups=num_dropped)


@dataclass(frozen=True)
class AdvantageResult:
    """`compute_advantages` output; all (N,) float32 except the counts."""

    advantages: torch.Tensor
    rewards: torch.Tensor          # shaped rewards, before the group baseline
    keep_samples: torch.Tensor     # (N,) bool; False in zero-variance groups (DAPO drops those)
    num_zero_variance_groups: int  # groups whose rewards are all equal


def compute_advantages_reference(components: Mapping[str, torch.Tensor],
                                 weights: Mapping[str, float] | None, group_size: int | Sequence[int], *,
                                 mode: str = "grpo", eps: float = GRPO_EPS,
                                 response_lengths: torch.Tensor | None = None,
                                 overlong: OverlongPenalty | None = None) -> AdvantageResult:
    """Torch reference of `compute_advantages` (shaping, then the group baseline)."""
    rewards = shape_rewards(components, weights, response_lengths=response_lengths, overlong=overlong)
    size = _uniform_size(group_size, rewards.numel())
    if size is None:
        assert not isinstance(group_size, int)  # _uniform_size returns an int group_size itself
        if mode not in ADVANTAGE_MODES:
            raise RLOpsError(f"advantage mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
        advantages, zero = ragged_group_advantages(rewards, group_size, mode, eps)
        keep = (~zero).repeat_interleave(torch.tensor(list(group_size)))
        return AdvantageResult(advantages=advantages, rewards=rewards, keep_samples=keep,
                               num_zero_variance_groups=int(zero.sum()))
    group_size = size
    advantages = group_advantages(rewards, group_size, mode, eps)
    groups = filter_groups(rewards, group_size)
    return AdvantageResult(advantages=advantages, rewards=rewards, keep_samples=groups.keep_samples,
                           num_zero_variance_groups=groups.num_dropped_groups)


def compute_advantages(components: Mapping[str, torch.Tensor], weights: Mapping[str, float] | None,
                       group_size: int | Sequence[int], *, mode: str = "grpo", eps: float = GRPO_EPS,
                       response_lengths: torch.Tensor | None = None,
                       overlong: OverlongPenalty | None = None,
                       backend: str = "auto") -> AdvantageResult:
    """Shaped rewards -> group-relative advantages, plus the zero-variance group count.

    backend: "auto" (CuPy fused kernel for CUDA tensors where CuPy imports, else torch),
    "torch" or "cupy" (raises where CuPy cannot run). Samples of a zero-variance group keep
    A = 0; `keep_samples` marks the rest, for callers that drop them (DAPO). `group_size` may be
    a list of contiguous group sizes (groups that lost samples): those run in torch.
    """
    device = next(iter(components.values())).device if components else torch.device("cpu")
    num = next(iter(components.values())).numel() if components else 0
    size = _uniform_size(group_size, num)
    if size is None:
        return compute_advantages_reference(components, weights, group_size, mode=mode, eps=eps,
                                            response_lengths=response_lengths, overlong=overlong)
    group_size = size
    if cupy_ops.use_cupy(backend, device):
        return _compute_advantages_fused(components, weights, group_size, mode=mode, eps=eps,
                                         response_lengths=response_lengths, overlong=overlong)
    return compute_advantages_reference(components, weights, group_size, mode=mode, eps=eps,
                                        response_lengths=response_lengths, overlong=overlong)


def _compute_advantages_fused(components, weights, group_size: int, *, mode: str, eps: float,
                              response_lengths=None, overlong=None) -> AdvantageResult:
    """`compute_advantages` as one kernel launch (cupy_ops.group_advantages_fused)."""
    if mode not in ADVANTAGE_MODES:
        raise RLOpsError(f"advantage mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
    stacked, w = _stack_components(components, weights or {})  # (K, N), (K,)
    num_groups = _as_groups(stacked[0], group_size).shape[0]
    if overlong is not None and response_lengths is None:
        raise RLOpsError("the overlong penalty needs response_lengths (one length per sample), "
                         "got None; pass response_lengths or overlong=None")
    rewards, advantages, zero_var = cupy_ops.group_advantages_fused(
        stacked, w, group_size, num_groups, mode=mode, eps=eps, response_lengths=response_lengths,
        overlong=overlong)
    keep = zero_var == 0
    return AdvantageResult(advantages=advantages, rewards=rewards,
                           keep_samples=keep.repeat_interleave(group_size),
                           num_zero_variance_groups=int((~keep).sum().item()))
