"""The learner's context-parallel step: `learner = { context_parallel = N }` with `ranks = M * N`.

    [[actors]]
    name = "learner"
    cls = "postrain.actors.learner:LearnerActor"
    ranks = 4                                   # 2 rings of 2 ranks, data parallel over the rings
    options = { learner = { context_parallel = 2 } }

Design note. Ranks [k*N, (k+1)*N) form ring k (context_parallel.py). The learner group's rank 0
cuts a batch into one shard per ring, so every rank of a ring holds the same samples (the same
micro-batches, planned alike). Each rank runs the model on its zig-zag slice of every
sequence, attention round the ring, and scores the trained tokens of its slice only (its
hidden rows through the LM head, so the head's weight gradient is that of its own tokens).
The per-token logprobs and entropies (B, T - 1 floats per micro-batch, tiny next to the
activations) are then all-gathered over the ring, so every rank of the ring holds the whole
micro-batch's tensors and computes the SAME loss as one process would on those samples: any
`agg_mode`, any loss preset (sequence-level ratios included), the KL term, the entropy bonus.
The gather's backward hands each rank the loss's gradient at its own positions (no sum: the
loss is the same on every rank of the ring), so the gradients, summed over all ranks by the
learner's all-reduce (or, under strategy "fsdp", by FSDP's reduce-scatter, a sum over all
ranks: the parameters are sharded over every rank, rings and data parallel alike), are one
process's gradients on the whole batch.

Invariants: counts and metric sums are the same on every rank of a ring, so the learner sums
them over its data-parallel group (one rank per ring: `LearnerRings.dp_group`), never over
all ranks; gradients are summed over all ranks (each rank holds its tokens' part). The
shared-prefix path is not taken (each sequence's prefix runs whole, split round the ring:
exact, like every path). Refused, with the reason named: mixture-of-experts policies (routing
replay, the router's loss), and attention logit softcapping (Gemma 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .batch import LearnerError
from .context_parallel import Ring, context_parallel_groups, zigzag_positions


@dataclass(frozen=True)
class LearnerRings:
    """This rank's context-parallel ring and its data-parallel group (one rank of each ring)."""

    ring: Ring
    dp_group: object


def check_ranks(context_parallel: int, ranks: int) -> None:
    """LearnerError unless `ranks` (the learner's processes) is a multiple of context_parallel."""
    if context_parallel > 1 and ranks % context_parallel:
        raise LearnerError(f"learner.context_parallel = {context_parallel} needs the learner's ranks to be a "
                           f"multiple of {context_parallel}, got ranks = {ranks}: set ranks = "
                           f"{context_parallel * max(1, ranks // context_parallel)} on the learner's entry "
                           "(rings of context_parallel ranks, data parallel over the rings) or lower "
                           "context_parallel")


def rank_shards(batch, ranks: int, context_parallel: int) -> list:
    """The batch record each of `ranks` ranks trains: one shard per ring (group.shard_batch),
    the same for every rank of a ring (ranks [k*N, (k+1)*N) get shard k)."""
    from .group import shard_batch

    check_ranks(context_parallel, ranks)
    return [shard for shard in shard_batch(batch, ranks // context_parallel) for _ in range(context_parallel)]


def join_rings(context_parallel: int, world_size: int, routing_active: bool) -> LearnerRings:
    """Form the rings of the learner's group (a collective: every rank calls it once the group
    exists)."""
    check_ranks(context_parallel, world_size)
    if routing_active:
        raise LearnerError("learner.context_parallel > 1 does not support mixture-of-experts policies "
                           "(routing replay and the router's loss need whole sequences per rank); "
                           "set context_parallel = 1")
    ring, dp_group = context_parallel_groups(context_parallel)
    return LearnerRings(ring, dp_group)


class GatherRing(torch.autograd.Function):
    """(..., Tl) this rank's zig-zag slice -> (..., L) the whole sequences, from every rank of
    the ring; backward: the gradient at this rank's positions (the loss downstream is the same
    on every rank of the ring, so no sum)."""

    @staticmethod
    def forward(ctx, local, ring: Ring, positions, length: int):
        parts = [torch.empty_like(local) for _ in range(ring.size)]
        dist.all_gather(parts, local.contiguous(), group=ring.group)
        full = local.new_zeros(*local.shape[:-1], length)
        for rank, part in enumerate(parts):
            full[..., zigzag_positions(length, ring.size, rank).to(local.device)] = part
        ctx.positions = positions
        return full

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.positions], None, None, None
