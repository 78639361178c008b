"""The KV manager: the paged KV cache tensors and the block allocator that hands out their blocks.

    kv = KVManager.for_model(model, block_size_tokens=8, kv_cache_mb=256)   # kv_dtype="int8": 8-bit
    num_cached = kv.allocate(seq_id, prompt_ids)    # prefix-cache hits come back already filled
                                                    # (max_cached=: at most that many: scoring)
    kv.fork(seq_id, child_id)                       # n samples share the prompt's blocks
    kv.append(seq_id, [token])                      # reserve the next slot (copy-on-write as needed)
    kv.free(seq_id)

Design note: the allocator (`postrain.ext.KVBlockPool`, Cython with a pure-Python twin) only
does bookkeeping: block ids, ref counts, chained block hashes for prefix caching, LRU
eviction, fork and copy-on-write. Whenever it answers with (src, dst) pairs, the KV manager
copies those blocks in every layer's tensors before anything reads them, so the tensors
always hold what the allocator's tables say. The model never sees this class; an attention
backend reads and writes `kv_caches` through a step's block tables and slots.

The cache's dtype (`kv_dtype`: float32, bfloat16, int8 or float8_e4m3; `kv_dtype.py`) sets
the bytes of a block, so the same `kv_cache_mb` holds more blocks in a narrower dtype (int8
with its scales: 3.76x float32's at head dim 64); the allocator only counts blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from postrain.ext import KVBlockPool

if TYPE_CHECKING:   # the pool's type: the compiled pool has its pure-Python twin's API
    from postrain.ext.kvpool import PythonKVBlockPool

from ..models.protocol import CausalLM
from .kv_dtype import KVCache, KVDtype, copy_block, kv_dtype_spec


def new_kv_caches(config, num_blocks: int, block_size_tokens: int, dtype: torch.dtype | KVDtype,
                  device: torch.device | str = "cpu") -> list[tuple[KVCache, KVCache]]:
    """Zeroed per-layer (key, value) caches, each (num_blocks, block_size_tokens, Hkv, D): plain
    tensors of a torch dtype, or what a `KVDtype` stores (8-bit codes with scales)."""
    spec = dtype if isinstance(dtype, KVDtype) else kv_dtype_spec(None, dtype)
    shape = (num_blocks, block_size_tokens, config.num_kv_heads, config.head_dim)
    return [(spec.empty(shape, device, keys=True), spec.empty(shape, device))
            for _ in range(config.num_layers)]


def blocks_in(kv_cache_mb: float, bytes_per_block: int) -> int:
    """Blocks of bytes_per_block that fit in kv_cache_mb MiB, at least 2."""
    return max(2, int(kv_cache_mb * 2**20 // bytes_per_block))


class KVManager:
    """Blocks of the paged KV cache for the engine's sequences (see module docstring).

    Invariants: len(kv_caches) == config.num_layers; every cache is (pool.num_blocks,
    block_size_tokens, Hkv, D) of `kv_dtype`; a block the pool reports copied (src -> dst) holds
    src's keys and values in every layer before the next forward
    (tests/actors/generator/test_kv_manager.py, test_kv_dtype.py).
    `pool` may be replaced by a pool of the same shape before the first request (tests swap in
    a checked twin).
    """

    def __init__(self, pool: PythonKVBlockPool, kv_caches: list[tuple[KVCache, KVCache]],
                 kv_dtype: KVDtype | None = None):
        self.pool = pool
        self.kv_caches = kv_caches
        self.block_size_tokens = pool.block_size_tokens
        self.kv_dtype = kv_dtype or kv_dtype_spec(None, kv_caches[0][0].dtype)

    @classmethod
    def for_model(cls, model: CausalLM, *, block_size_tokens: int, num_blocks: int | None = None,
                  kv_cache_mb: float = 256.0, enable_prefix_caching: bool = True,
                  kv_dtype: str | None = None) -> "KVManager":
        """A cache on the model's device in `kv_dtype` (None = the model's dtype): num_blocks
        blocks, or as many as fit in kv_cache_mb (at least 2; `blocks_in`)."""
        cfg = model.config
        weight = next(model.parameters())
        spec = kv_dtype_spec(kv_dtype, weight.dtype)
        if num_blocks is None:
            num_blocks = blocks_in(kv_cache_mb, spec.bytes_per_token(cfg) * block_size_tokens)
        pool = KVBlockPool(num_blocks, block_size_tokens, enable_prefix_caching)
        return cls(pool, new_kv_caches(cfg, num_blocks, block_size_tokens, spec, weight.device), spec)

    # ------------------------------------------------------------------ allocator, with the copies done

    def allocate(self, seq_id: int, token_ids: list[int], max_cached: int | None = None, salt: int = 0) -> int:
        """Blocks for a new sequence's tokens; returns how many leading tokens the prefix cache
        already holds (their KV is in the tensors; the rest is written by the next forward).
        max_cached: take at most that many tokens from the cache (a scoring request wants the
        logits from that position on, so it must be computed); None: the allocator's rule
        (all but the last token at most). The tokens past the limit are reserved as an append,
        so their full blocks still enter the prefix index. salt: blocks match only blocks of the
        same salt (a prompt's images: generator/images.py)."""
        if max_cached is None or max_cached >= len(token_ids) - 1:
            return self.pool.allocate(seq_id, token_ids, salt)
        num_cached = self.pool.allocate(seq_id, token_ids[:max_cached + 1], salt)
        self.append(seq_id, token_ids[max_cached + 1:])
        return num_cached

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (ref counts up; copy-on-write later)."""
        self.pool.fork(parent_id, child_id)

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return self.pool.can_append(seq_id, num_tokens)

    def append(self, seq_id: int, token_ids: list[int]) -> None:
        """Reserve slots for token_ids at the sequence's end (copying any shared block first)."""
        self.copy_blocks(self.pool.append(seq_id, token_ids))

    def truncate(self, seq_id: int, token_ids: list[int]) -> None:
        """Cut the sequence back to token_ids. Raises OutOfBlocksError when its cut block is
        shared and no free block is left to copy it into (nothing changed then)."""
        self.copy_blocks(self.pool.truncate(seq_id, token_ids))

    def free(self, seq_id: int) -> None:
        self.pool.free(seq_id)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Do the allocator's copy-on-write block copies, (src, dst) block ids, in every layer."""
        for src, dst in pairs:
            for key_cache, value_cache in self.kv_caches:
                copy_block(key_cache, src, dst)
                copy_block(value_cache, src, dst)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (after a weight swap: old KV must not be reused)."""
        self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ queries

    def match_prefix(self, token_ids: list[int], max_cached: int | None = None, salt: int = 0) -> int:
        """How many leading tokens `allocate` (with the same max_cached and salt) would take from
        the prefix cache now (read-only)."""
        if max_cached is not None:
            token_ids = token_ids[:max_cached + 1]
        return self.pool.match_prefix(token_ids, salt)

    def block_table(self, seq_id: int) -> list[int]:
        return self.pool.block_table(seq_id)

    def num_tokens(self, seq_id: int) -> int:
        return self.pool.num_tokens(seq_id)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def stats(self) -> dict:
        return self.pool.stats()

    def utilization(self, seq_ids: list[int]) -> float:
        """Token slots holding these sequences' KV over the slots of the blocks they hold.

        Physical: a block shared by n forked samples counts once (the prompt's KV, stored
        once, is not n times as useful), so this is what the reserved memory actually holds.
        """
        fill: dict[int, int] = {}
        size = self.block_size_tokens
        for seq_id in seq_ids:
            num_tokens = self.pool.num_tokens(seq_id)
            for i, block in enumerate(self.pool.block_table(seq_id)):
                fill[block] = max(fill.get(block, 0), min(size, num_tokens - i * size))
        return sum(fill.values()) / (len(fill) * size) if fill else 0.0
