"""Context-parallel training: one long sequence split across N ranks, attention as a ring.

    cp, dp = context_parallel_groups(context_parallel=2)     # every rank calls it (torch.distributed up)
    shard = shard_sequence(input_ids, cp)                     # this rank's zig-zag slice of the tokens
    losses = shard_token_losses(model, shard, cp)            # (B, T) its tokens' next-token losses
    (losses.sum() / shard.num_labels).backward()              # its share of the mean next-token loss
    all_reduce_gradients(model, cp, dp)                       # = one process's gradients on the batch

Design note. A sequence of L tokens is cut into 2N equal chunks and rank r holds chunks r
and 2N - 1 - r (the zig-zag split): under a causal mask the early chunks attend to few keys
and the late ones to many, so pairing them gives every rank the same attention work. Each
rank runs the whole model on its L / N tokens with their true positions (rotary included);
only attention needs the other ranks' tokens. It runs through the model's attention seam
(the `paged=` object the generator's backends also fill, `models.blocks.PagedAttention`):
`RingAttention.attend` starts from its own key/value block and passes blocks to the next
rank while receiving the previous rank's, N - 1 times, merging each block's softmax into
the running output by its log-sum-exp (online softmax), with the causal (and sliding-window)
mask on absolute positions. The backward pass goes round the ring again: each key/value
block travels with the gradient of its keys and values, which every rank adds to, and comes
home after N hops. Memory per rank is the model's activations for L / N tokens plus two
key/value blocks in flight; no rank ever holds the L x L scores.

Invariants: every rank of a ring calls every layer's attend in the same order (the model is
the same on all of them); `positions` are the ones `shard_sequence` gave; the sum over the
ring of each rank's share (its token losses over `num_labels`) is the mean next-token loss
of the whole sequence, so its gradients, summed over the ring (`all_reduce_gradients`),
equal one process's to float32 rounding
(tests/actors/learner/test_context_parallel.py). Data parallelism composes: ranks
[k*N, (k+1)*N) form ring k, ranks with the same place in their ring form a data-parallel group,
and gradients are summed over the ring and averaged over the data-parallel group.

A peer that is gone or silent fails the step with `RingBroken`, naming this rank and the
one it was waiting on (the ring never mends in place; the learner group's rule applies).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from postrain.core.errors import PostrainError

IGNORE = -100       # a label no loss is taken on (padding)


class RingBroken(PostrainError):
    """A rank of a context-parallel ring did not send or receive its key/value block."""


class ContextParallelError(PostrainError, ValueError):
    """A context-parallel setting or input that cannot work."""


@dataclass(frozen=True)
class Ring:
    """One rank's context-parallel ring: `size` ranks of `group`, this one at `rank`."""

    group: dist.ProcessGroup | None   # a torch.distributed process group (None = the default group)
    size: int
    rank: int
    timeout_s: float = 300.0

    def global_rank(self, ring_rank: int) -> int:
        return dist.get_global_rank(self.group, ring_rank) if self.group is not None else ring_rank


def context_parallel_groups(context_parallel: int, timeout_s: float = 300.0) -> tuple[Ring, object]:
    """Split the default group into rings of `context_parallel` consecutive ranks and
    data-parallel groups across them; returns (this rank's Ring, its data-parallel group).
    Every rank must call it (process groups are made collectively)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if context_parallel < 1 or world % context_parallel:
        raise ContextParallelError(f"context_parallel={context_parallel} must divide the learner's "
                                   f"{world} ranks; pick a divisor of ranks (the rest is data parallel)")
    timeout = timedelta(seconds=timeout_s)
    ring_group = dp_group = None
    for k in range(world // context_parallel):
        ranks = list(range(k * context_parallel, (k + 1) * context_parallel))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            ring_group = group
    for place in range(context_parallel):
        ranks = list(range(place, world, context_parallel))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            dp_group = group
    return Ring(ring_group, context_parallel, rank % context_parallel, timeout_s), dp_group


# -- the split -----------------------------------------------------------------------------

def zigzag_positions(seq_len: int, size: int, rank: int) -> torch.Tensor:
    """The positions ring rank `rank` of `size` holds: chunks rank and 2*size - 1 - rank of
    2*size equal chunks (seq_len must be a multiple of 2*size)."""
    if seq_len % (2 * size):
        raise ContextParallelError(f"a sequence of {seq_len} tokens does not split into {2 * size} equal "
                                   f"chunks; pad it to a multiple of {2 * size} (shard_sequence does)")
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


@dataclass(frozen=True)
class Shard:
    """One rank's slice of a batch of sequences: tokens, next-token labels (IGNORE where none),
    their absolute positions (T,), and how many labels the whole batch has."""

    input_ids: torch.Tensor      # (B, T)
    labels: torch.Tensor         # (B, T)
    positions: torch.Tensor      # (T,) the same for every row
    num_labels: int              # over the whole sequences, all ranks together


def shard_sequence(input_ids: torch.Tensor, ring: Ring, pad_id: int = 0) -> Shard:
    """This rank's zig-zag slice of `input_ids` (B, L) (the same full batch on every rank of the
    ring), padded at the end to a multiple of 2 * ring.size (padding is never a label and,
    being last, never seen by a real token)."""
    batch, length = input_ids.shape
    labels = torch.full_like(input_ids, IGNORE)
    labels[:, :-1] = input_ids[:, 1:]
    padded = -(-length // (2 * ring.size)) * 2 * ring.size
    if padded != length:
        input_ids = F.pad(input_ids, (0, padded - length), value=pad_id)
        labels = F.pad(labels, (0, padded - length), value=IGNORE)
    positions = zigzag_positions(padded, ring.size, ring.rank)
    return Shard(input_ids[:, positions], labels[:, positions], positions, batch * (length - 1))


def shard_logits(model, shard: Shard, ring: Ring) -> torch.Tensor:
    """The logits (B, T, V) of this rank's tokens, each seeing every earlier token of its
    sequence on any rank of the ring (and no later one)."""
    positions = shard.positions.to(shard.input_ids.device)
    attention = RingAttention(ring, positions.expand(shard.input_ids.shape[0], -1))
    return model.lm_head(model.hidden_states(shard.input_ids, paged=attention))


def shard_token_losses(model, shard: Shard, ring: Ring) -> torch.Tensor:
    """Next-token cross-entropy (B, T) of this rank's tokens, float32; 0 where no label."""
    logits = shard_logits(model, shard, ring).float()
    losses = F.cross_entropy(logits.flatten(0, 1), shard.labels.flatten(), ignore_index=IGNORE,
                             reduction="none")
    return losses.view(shard.labels.shape)


def all_reduce_gradients(model, ring: Ring, dp_group=None) -> None:
    """Sum every gradient over the ring (each rank holds part of each sequence's loss), then
    average it over the data-parallel group (each group trains its own sequences)."""
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    for param in model.parameters():
        if param.grad is None:
            continue
        if ring.size > 1:
            dist.all_reduce(param.grad, group=ring.group)
        if dp_size > 1:
            dist.all_reduce(param.grad, group=dp_group)
            param.grad.div_(dp_size)


# -- ring attention ----------------------------------------------------------------------

class RingAttention:
    """The model's attention seam (`models.blocks.PagedAttention`) for a context-parallel
    forward: every layer's attention runs round `ring` (see the module's design note)."""

    def __init__(self, ring: Ring, positions: torch.Tensor):
        self.ring = ring
        self.positions = positions                                       # (B, T) this rank's positions
        self._key_positions = [zigzag_positions(positions.shape[1] * ring.size, ring.size, r).to(positions.device)
                               for r in range(ring.size)]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None, scale: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
        if softcap is not None:
            raise ContextParallelError("context parallel does not support attention logit softcapping "
                                       "(Gemma 2); train this model with context_parallel = 1")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return _RingAttentionFn.apply(q, k, v, self, window, scale)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q (B, T, H, D) -> (B, Hkv, G*T, D): the G query heads of a KV head as extra rows."""
    batch, seq, heads, dim = q.shape
    groups = heads // kv_heads
    return q.view(batch, seq, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * seq, dim)


def _ungrouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, G*T, D) -> (B, T, H, D), the inverse of `_grouped`."""
    batch, kv_heads, rows, dim = x.shape
    groups = heads // kv_heads
    return x.view(batch, kv_heads, groups, rows // groups, dim).permute(0, 3, 1, 2, 4).reshape(
        batch, rows // groups, heads, dim)


class _Exchange:
    """One hop of the ring: send `tensor` to the next rank, receive the previous rank's."""

    def __init__(self, ring: Ring, tensor: torch.Tensor, what: str, tag: int):
        self.ring, self.what = ring, what
        self.prev = (ring.rank - 1) % ring.size
        self.received = torch.empty_like(tensor)
        nxt = ring.global_rank((ring.rank + 1) % ring.size)
        try:
            self.works = [dist.isend(tensor, nxt, group=ring.group, tag=tag),
                          dist.irecv(self.received, ring.global_rank(self.prev), group=ring.group, tag=tag)]
        except RuntimeError as exc:
            raise self._broken(exc) from exc

    def wait(self) -> torch.Tensor:
        try:
            for work in self.works:
                assert work is not None, "isend/irecv give None only to a rank outside the group"
                work.wait(timedelta(seconds=self.ring.timeout_s))
        except RuntimeError as exc:
            raise self._broken(exc) from exc
        return self.received

    def _broken(self, exc: Exception) -> RingBroken:
        r = self.ring
        return RingBroken(f"context-parallel ring broken: ring rank {r.rank} (global {r.global_rank(r.rank)}) "
                          f"exchanging {self.what} with ring rank {self.prev} (global "
                          f"{r.global_rank(self.prev)}) and {(r.rank + 1) % r.size} failed: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; "
                          "every rank of the ring restarts (see the learner group's rule)")


KEY_TILE = 512      # keys scored at once: scores are (B, Hkv, G*T, KEY_TILE) float32 at most


def _tiles(num_keys: int) -> list[slice]:
    return [slice(start, min(start + KEY_TILE, num_keys)) for start in range(0, num_keys, KEY_TILE)]


def _block_scores(qg, k_block, q_pos, k_pos, window, scale):
    """Scores (B, Hkv, R, Tk) of grouped queries against one key block, masked (-inf) where a
    query may not see a key; None when it sees none of them."""
    visible = k_pos[None, :] <= q_pos[:, None]                                # (R, Tk)
    if window is not None:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    if not bool(visible.any()):
        return None
    scores = (qg @ k_block.permute(0, 2, 3, 1).float()).mul_(scale)           # (B, Hkv, R, Tk)
    return scores.masked_fill_(~visible, float("-inf"))


class _RingAttentionFn(torch.autograd.Function):
    """out = softmax(q k^T * scale + causal mask) v over the whole ring's keys, with the
    flash-attention backward; float32 inside."""

    @staticmethod
    def forward(ctx, q, k, v, attention: RingAttention, window, scale):
        ring = attention.ring
        heads, kv_heads = q.shape[2], k.shape[2]
        groups = heads // kv_heads
        qg = _grouped(q.float(), kv_heads)                                    # (B, Hkv, R, D)
        q_pos = attention.positions[0].repeat(groups)                          # (R,) row g*T + t
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.size):
            exchange = _Exchange(ring, kv, "key/value blocks", 0) if step < ring.size - 1 else None
            k_pos = attention._key_positions[(ring.rank - step) % ring.size]
            for tile in _tiles(k_pos.shape[0]):
                scores = _block_scores(qg, kv[0, :, tile], q_pos, k_pos[tile], window, scale)
                if scores is None:
                    continue
                block_lse = torch.logsumexp(scores, dim=-1)                   # -inf: row sees none
                safe = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)
                block_out = scores.sub_(safe[..., None]).exp_() @ kv[1, :, tile].transpose(1, 2).float()
                new_lse = torch.logaddexp(lse, block_lse)
                new_safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
                out = (out.mul_(torch.exp(lse - new_safe)[..., None])
                       .add_(block_out.mul_(torch.exp(block_lse - new_safe)[..., None])))
                lse = new_lse
            if exchange is not None:
                kv = exchange.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attention, ctx.window, ctx.scale = attention, window, scale
        return _ungrouped(out, heads).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        attention, window, scale = ctx.attention, ctx.window, ctx.scale
        ring = attention.ring
        heads, kv_heads = q.shape[2], k.shape[2]
        groups = heads // kv_heads
        qg = _grouped(q.float(), kv_heads)
        dout = _grouped(grad_out.float(), kv_heads)                            # (B, Hkv, R, D)
        q_pos = attention.positions[0].repeat(groups)
        delta = (dout * out).sum(-1, keepdim=True)                             # (B, Hkv, R, 1)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v]).float().contiguous()                          # (2, B, Tk, Hkv, D)
        dkv = torch.zeros_like(kv)
        for step in range(ring.size):
            k_pos = attention._key_positions[(ring.rank - step) % ring.size]
            for tile in _tiles(k_pos.shape[0]):
                scores = _block_scores(qg, kv[0, :, tile], q_pos, k_pos[tile], window, scale)
                if scores is None:
                    continue
                p = scores.sub_(lse[..., None]).exp_()                        # (B, Hkv, R, tile)
                k_block, v_block = kv[0, :, tile].transpose(1, 2), kv[1, :, tile].transpose(1, 2)
                ds = (dout @ v_block.transpose(-1, -2)).sub_(delta).mul_(p).mul_(scale)
                dq += ds @ k_block
                dkv[0, :, tile] += (ds.transpose(-1, -2) @ qg).transpose(1, 2)
                dkv[1, :, tile] += (p.transpose(-1, -2) @ dout).transpose(1, 2)
            # the gradient travels with its block and comes home after ring.size hops
            grads = _Exchange(ring, dkv, "key/value gradients", 1) if ring.size > 1 else None
            blocks = _Exchange(ring, kv, "key/value blocks", 0) if step < ring.size - 1 else None
            if blocks is not None:
                kv = blocks.wait()
            if grads is not None:
                dkv = grads.wait()
        dq = _ungrouped(dq, heads).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None
