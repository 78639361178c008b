"""What both implementations of the paged KV block allocator share: its contract in Python.

The compiled allocator (`_kvpool.pyx`) and its pure-Python twin (`_kvpool_py.py`, whose module
docstring holds the design note) raise the same errors, check arguments with the same rules and
limits, define the same block hash, and are checked against the same invariants
(`check_state`, on either one's `debug_state()`).

The block hash (identical in both implementations; token ids are int32):

    content = HASH_OFFSET; for t in tokens: content = _step(content, t)
    block_hash = _finish(_step(_step(content, parent_hash), salt)) or 1

A block's content hash does not depend on its parent, so a partial block's
hash state can be kept as one integer while tokens are appended.
"""
from __future__ import annotations

from postrain.core.errors import PostrainError

MASK64 = (1 << 64) - 1
HASH_OFFSET = 0xCBF29CE484222325
HASH_MULT = 0x9E3779B97F4A7C15
MAX_TOKEN_ID = (1 << 31) - 1
MAX_NUM_BLOCKS = 1 << 30


class KVPoolError(PostrainError):
    """Base of every error the allocator raises on misuse."""


class OutOfBlocksError(KVPoolError):
    """Not enough free blocks for the call; nothing was changed."""


class UnknownSequenceError(KVPoolError, LookupError):
    """The sequence id has no block table (never allocated, or already freed)."""


class SequenceExistsError(KVPoolError, ValueError):
    """The sequence id already has a block table."""


class InvalidBlockError(KVPoolError, IndexError):
    """A block id outside [0, num_blocks)."""


class InvalidArgumentError(KVPoolError, ValueError):
    """A bad configuration value, token id, salt or output array."""


# ---------------------------------------------------------------- hashing

def _step(h: int, v: int) -> int:
    h = ((h ^ v) * HASH_MULT) & MASK64
    return h ^ (h >> 29)


def _finish(content: int, parent_hash: int, salt: int) -> int:
    h = _step(_step(content, parent_hash), salt)
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & MASK64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & MASK64
    h ^= h >> 31
    return h or 1  # 0 means "no hash" in the block records


def block_hash(parent_hash: int, token_ids, salt: int = 0) -> int:
    """The chained hash of one full block: parent's hash (0 for the first), tokens, salt."""
    content = HASH_OFFSET
    for t in token_ids:
        content = _step(content, t)
    return _finish(content, parent_hash, salt)


def _check_salt(salt) -> int:
    if not isinstance(salt, int) or not 0 <= salt <= MASK64:
        raise InvalidArgumentError(f"salt must be an int in [0, 2**64), got {salt!r}; "
                                   f"hash adapter ids or policy versions into that range")
    return salt


def _check_out_width(width: int, num_blocks: int, seq_id) -> None:
    if num_blocks > width:
        raise InvalidArgumentError(f"out has {width} columns but sequence {seq_id!r} has "
                                   f"{num_blocks} blocks; size out to the longest block table")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError("kvpool invariant broken: " + message)


def check_state(state: dict, block_size_tokens: int, enable_prefix_caching: bool) -> None:
    """Check every invariant on a debug_state() dump (either implementation)."""
    B = block_size_tokens
    ref, hashes = state["ref_count"], state["block_hash"]
    n = len(ref)
    seqs = state["sequences"].values()
    uncached, cached = state["free_uncached"], state["free_cached"]
    free = uncached + cached
    _require(len(set(free)) == len(free), "each free block is on one free list, once")
    _require(set(free) == {b for b in range(n) if ref[b] == 0}, "free iff ref_count == 0")
    _require(all(hashes[b] == 0 for b in uncached), "uncached free blocks have no hash")
    _require(all(hashes[b] != 0 for b in cached), "cached free blocks have a hash")
    _require(state["index"] == {hashes[b]: b for b in range(n) if hashes[b]},
             "index == {block_hash[b]: b for hashed b}")
    _require(len(state["index"]) == sum(1 for h in hashes if h), "no two blocks share a hash")
    counts = [0] * n
    for s in seqs:
        table = s["block_table"]
        _require(len(table) == -(-s["num_tokens"] // B), "len(table) == ceil(num_tokens / B)")
        _require(len(set(table)) == len(table), "no block twice in one table")
        for i, b in enumerate(table):
            counts[b] += 1
            _require(not hashes[b] or i < s["num_tokens"] // B, "only full blocks are hashed")
        if s["num_tokens"] % B == 0:
            _require(s["partial_state"] == 0, "partial_state == 0 without a partial block")
        if not enable_prefix_caching:
            _require(s["last_hash"] == 0 and s["partial_state"] == 0, "no hashes with caching off")
    _require(counts == ref, "ref_count[b] == number of tables holding b")
    partial: dict[int, set[int]] = {}  # last (partial) block -> its fills
    for s in seqs:
        if s["num_tokens"] % B:
            key = s["block_table"][-1]
            partial.setdefault(key, set()).add(s["num_tokens"] % B)
    for s in seqs:
        for b in s["block_table"][:-1] if s["num_tokens"] % B else s["block_table"]:
            _require(b not in partial, "a partial block is the last block of every table holding it")
    _require(all(len(fills) == 1 for fills in partial.values()), "sharers of a partial block agree on its fill")
    st = state["stats"]
    _require(st["num_tokens"] == sum(s["num_tokens"] for s in seqs), "num_tokens == sum over sequences")
    _require(st["num_reserved_slots"] == B * sum(len(s["block_table"]) for s in seqs),
             "reserved slots == B * sum of table lengths")
    _require(st["num_free_blocks"] == len(free) and st["num_cached_free_blocks"] == len(cached),
             "free-block counters match the free lists")
    if not enable_prefix_caching:
        _require(not any(hashes), "no block hash with caching off")
