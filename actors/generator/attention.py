"""Attention backends: how a step's new keys and values reach the paged KV cache and how its
queries attend over it.

    metadata = PagedMetadata(positions, slot_mapping, block_tables, context_lens)
    step = GatherSdpaBackend().bind(metadata, kv_manager.kv_caches)
    logits = model(input_ids, paged=step, ...)      # each layer calls step.attend(layer, q, k, v)

The seam. The model (`postrain.actors.models.blocks.PagedAttention`) only hands each layer's
rotated q, k, v for the step's new tokens to the bound step; a backend decides how keys and
values are stored and read. `GatherSdpaBackend` is the CPU one: scatter the new k/v into
their slots, gather every sequence's blocks back into a dense (B, L) view, and run SDPA
with a causal mask on absolute positions. A fused paged-attention GPU kernel is a second
`AttentionBackend` whose `bind` returns an object reading the cache through
`block_tables`/`context_lens` directly (no gather); the runner takes it as `backend=`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..models.blocks import PagedAttention, group_mask, grouped_attention

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
# one (key, value) per layer, each (num_blocks, block_size_tokens, num_kv_heads, head_dim)


@dataclass(frozen=True)
class PagedMetadata:
    """Where one forward's new tokens go in the paged cache, and what each sequence sees.

    Shapes: B sequences, T = the most new tokens any of them has (1 for pure decode).
    Invariants: positions[b, :n_b] == context_lens[b] - n_b + arange(n_b) for the n_b real
    tokens of row b; padding columns carry slot -1 (never written) and position 0; every
    slot of row b lies in a block of block_tables[b] (tests/actors/generator/test_runner.py).
    """

    positions: torch.Tensor        # (B, T) int64 absolute positions of the new tokens
    slot_mapping: torch.Tensor     # (B, T) int64 block_id * block_size_tokens + offset; -1 = padding
    block_tables: torch.Tensor     # (B, max_blocks) int64 block ids, padded with 0
    context_lens: torch.Tensor     # (B,) int64 tokens in the cache after this step's writes
    num_padding: int = -1          # slots equal to -1; -1 = count them

    def __post_init__(self):
        if self.num_padding < 0:
            object.__setattr__(self, "num_padding", int((self.slot_mapping < 0).sum()))


class AttentionBackend(ABC):
    """One way to store and attend over the paged KV cache. Stateless across steps: all of a
    step's state lives in the object `bind` returns."""

    @abstractmethod
    def bind(self, metadata: PagedMetadata, kv_caches: KVCaches) -> PagedAttention:
        """The step's attention: `attend(layer_idx, q, k, v)` writes k, v (B, T, Hkv, D) at
        `metadata.slot_mapping` in `kv_caches[layer_idx]` and returns q's attention output
        (B, T, H, D) over each sequence's cached keys (query t sees positions <= its own)."""


class GatherSdpaBackend(AttentionBackend):
    """The CPU backend: index_copy the new k/v into their slots, index_select each sequence's
    blocks, grouped-query SDPA with an additive causal bias built once per step."""

    def bind(self, metadata: PagedMetadata, kv_caches: KVCaches) -> "GatherSdpaStep":
        return GatherSdpaStep(metadata, kv_caches)


class GatherSdpaStep:
    """`GatherSdpaBackend` bound to one forward. Invariant: `_bias` is None until the first
    layer attends, then the (B, 1, G*T, L) bias every later layer of this step reuses."""

    def __init__(self, metadata: PagedMetadata, kv_caches: KVCaches):
        self.metadata = metadata
        self.positions = metadata.positions
        self.kv_caches = kv_caches
        self._bias: torch.Tensor | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self._write_and_gather(k, v, self.kv_caches[layer_idx])   # (B, L, Hkv, D)
        if self._bias is None:
            self._bias = self._attention_bias(q.shape[2] // k.shape[2], q.dtype)
        out = grouped_attention(q, keys, values, self._bias)                   # (B, T, Hkv, G, D)
        return out.reshape(q.shape)                                            # (B, T, H, D)

    def _write_and_gather(self, k, v, cache: tuple[torch.Tensor, torch.Tensor]):
        key_cache, value_cache = cache
        _, _, heads, dim = key_cache.shape
        meta = self.metadata
        slots = meta.slot_mapping.reshape(-1)
        new_k, new_v = k.reshape(-1, heads, dim), v.reshape(-1, heads, dim)
        if meta.num_padding:
            valid = slots >= 0
            slots, new_k, new_v = slots[valid], new_k[valid], new_v[valid]
        key_cache.view(-1, heads, dim).index_copy_(0, slots, new_k.to(key_cache.dtype))
        value_cache.view(-1, heads, dim).index_copy_(0, slots, new_v.to(value_cache.dtype))
        batch = meta.block_tables.shape[0]
        flat_tables = meta.block_tables.reshape(-1)
        gathered_k = key_cache.index_select(0, flat_tables).view(batch, -1, heads, dim)  # (B, L, Hkv, D)
        gathered_v = value_cache.index_select(0, flat_tables).view(batch, -1, heads, dim)
        return gathered_k.to(k.dtype), gathered_v.to(v.dtype)

    def _attention_bias(self, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, groups * T, L) additive mask (0 or -inf): query t sees cached key j iff
        j <= its position. Built once per forward; every layer shares it."""
        block_size = self.kv_caches[0][0].shape[1]
        positions = self.positions
        keys = torch.arange(self.metadata.block_tables.shape[1] * block_size, device=positions.device)
        mask = group_mask((keys[None, None, :] <= positions[:, :, None])[:, None], groups)
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill_(~mask, float("-inf"))
