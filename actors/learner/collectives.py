"""Collectives: this learner's place among its ranks, and every sum and broadcast between them.

    comm = Collectives()                    # alone: every operation is a no-op
    comm.join(process_group)                # a rank of torch.distributed's group
    comm.all_reduce(counts)                 # a per-sample count or metric, each sample once
    comm.sum_gradients(params)              # the data-parallel gradient sum, one flat buffer

Invariant: world_size == 1 => no method touches torch.distributed. With context-parallel
rings (`rings` set), per-sample counts and metrics are summed over the data-parallel group
(one rank per ring: a ring's ranks hold the same samples), gradients over every rank.
"""
from __future__ import annotations

import torch
from torch.distributed import ProcessGroup, ReduceOp

from .context_parallel_step import LearnerRings


class Collectives:
    """The learner's process group, its rank and world size, and its context-parallel rings."""

    def __init__(self) -> None:
        self.group: ProcessGroup | None = None   # the learner's process group (None: the default one)
        self.world_size = 1
        self.rank = 0
        self.rings: LearnerRings | None = None   # context_parallel > 1 in a group

    def join(self, process_group: ProcessGroup | None = None) -> None:
        """Become a rank of torch.distributed's initialised group (`process_group`, or the default one)."""
        self.group = process_group
        self.world_size = torch.distributed.get_world_size(process_group)
        self.rank = torch.distributed.get_rank(process_group)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp.RedOpType | None = None) -> None:
        """Sum (or `op`) a per-sample count or metric over the ranks, in place, each sample once."""
        if self.world_size > 1:
            group = self.rings.dp_group if self.rings is not None else self.group
            torch.distributed.all_reduce(tensor, op=op or torch.distributed.ReduceOp.SUM, group=group)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """The maximum of a per-sample metric over the ranks, in place."""
        if self.world_size > 1:
            self.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every gradient over all ranks in one flat buffer (losses use global normalisers);
        a parameter without a gradient contributes zeros."""
        if self.world_size == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]   # every one, after the loop above
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Every rank's `tensors` become rank 0's, in place."""
        with torch.no_grad():
            for tensor in tensors:
                torch.distributed.broadcast(tensor, src=0, group=self.group)

    def barrier(self) -> None:
        """Wait for every rank (no-op alone)."""
        if self.world_size > 1:
            torch.distributed.barrier(group=self.group)
