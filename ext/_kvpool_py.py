"""Pure-Python twin of the paged KV-cache block allocator (`_kvpool.pyx`).

This is the reference: the Cython extension must return exactly what this
module returns for every call (same block ids, same hashes, same errors), and
`tests/ext/test_kvpool_stateful.py` runs both side by side to prove it. It is
also the fallback where the extension is not built; import the allocator from
`postrain.ext.kvpool`, which picks the compiled one.

Design note. The pool is `num_blocks` fixed-size blocks of `block_size_tokens`
token slots. A sequence owns a block table (block ids, in token order); block
`b` is shared by `ref_count[b]` tables. Full blocks get a chained 64-bit hash
(the block's tokens, its parent block's hash, a salt) and enter a hash ->
block index, so a new prompt reuses the longest prefix already in the pool.
A free block sits on exactly one of two FIFO lists: *uncached* (no hash; taken
first) and *cached* (hashed, still in the index; taken only when no uncached
block is left, which evicts it, least recently freed first). Freeing a
sequence releases its blocks last to first, so a prompt's tail is evicted
before its head. Forked sequences share every block; the first append into a
shared, partially filled last block copies it (copy-on-write) and reports the
(source, destination) pair the engine must copy.

The block hash and its definition, the errors and the invariants are `_kvpool_common.py`'s,
shared with the extension.
"""
from __future__ import annotations

from collections import deque

# The contract both implementations share; re-exported, so that this module's names are the
# extension's (the same test suite runs against both).
from postrain.ext._kvpool_common import (  # noqa: F401
    HASH_OFFSET, HASH_MULT, MASK64, MAX_NUM_BLOCKS, MAX_TOKEN_ID, InvalidArgumentError, InvalidBlockError,
    KVPoolError, OutOfBlocksError, SequenceExistsError, UnknownSequenceError, _check_out_width, _check_salt,
    _finish, _step, block_hash, check_state,
)


# --------------------------------------------------------------- sequences

class _Seq:
    """One sequence's state. Invariants (B = block_size_tokens):
    len(table) == -(-num_tokens // B); len(set(table)) == len(table);
    last_hash == chain hash of block table[num_tokens // B - 1] (0 if none or caching off);
    partial_state == content hash of the tokens in the partial last block (0 if none or caching off);
    stale: it lived through a reset_prefix_cache, so the blocks it fills are not indexed.
    """
    __slots__ = ("table", "num_tokens", "last_hash", "partial_state", "salt", "stale")

    def __init__(self, salt: int):
        self.table: list[int] = []
        self.num_tokens = 0
        self.last_hash = 0
        self.partial_state = 0
        self.salt = salt
        self.stale = False


class KVBlockPool:
    """Paged KV-cache block allocator (pure Python). See the module docstring."""

    implementation = "python"

    def __init__(self, num_blocks: int, block_size_tokens: int, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or not 1 <= num_blocks <= MAX_NUM_BLOCKS:
            raise InvalidArgumentError(f"num_blocks must be an int in [1, {MAX_NUM_BLOCKS}], "
                                       f"got {num_blocks!r}")
        if not isinstance(block_size_tokens, int) or not 1 <= block_size_tokens <= 1 << 20:
            raise InvalidArgumentError(f"block_size_tokens must be an int in [1, {1 << 20}], "
                                       f"got {block_size_tokens!r}; 16 is typical")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # ref_count[b] == sum(t.count(b) for t in tables); 0 iff b is on a free list.
        self._ref_count = [0] * num_blocks
        # block_hash[b] != 0 iff index[block_hash[b]] == b (b is in the prefix index).
        self._block_hash = [0] * num_blocks
        self._index: dict[int, int] = {}
        # ref_count[b] == 0 and block_hash[b] == 0 for b in free_uncached; FIFO.
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # ref_count[b] == 0 and block_hash[b] != 0 for b in free_cached; least recently freed first.
        self._free_cached: dict[int, None] = {}
        self._seqs: dict[object, _Seq] = {}
        # total_tokens == sum(s.num_tokens); total_table_blocks == sum(len(s.table)).
        self._total_tokens = 0
        self._total_table_blocks = 0
        self._prefix_hit_blocks = 0
        self._prefix_miss_blocks = 0
        self._num_evicted_blocks = 0
        self._num_cow_copies = 0

    # ------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id) -> int:
        return self._get(seq_id, "num_tokens").num_tokens

    def block_table(self, seq_id) -> list[int]:
        return list(self._get(seq_id, "block_table").table)

    def fill_block_table(self, seq_id, out) -> int:
        """Write the block table into out[:n] (a 1-D int32 buffer); return n."""
        table = self._get(seq_id, "fill_block_table").table
        _check_out_width(len(out), len(table), seq_id)
        out[:len(table)] = table
        return len(table)

    def fill_block_tables(self, seq_ids, out, pad: int = 0) -> None:
        """Row i of out (a 2-D int32 array) = block table of seq_ids[i], padded with `pad`."""
        if len(seq_ids) > len(out):
            raise InvalidArgumentError(f"out has {len(out)} rows for {len(seq_ids)} sequences; "
                                       f"give out at least one row per sequence")
        width = out.shape[1]
        for row, seq_id in enumerate(seq_ids):
            table = self._get(seq_id, "fill_block_tables").table
            _check_out_width(width, len(table), seq_id)
            out[row, :len(table)] = table
            out[row, len(table):] = pad

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a new sequence of num_tokens fits even with no prefix hit."""
        return -(-num_tokens // self.block_size_tokens) <= self.num_free_blocks

    def can_append(self, seq_id, num_new_tokens: int) -> bool:
        return self._blocks_to_append(self._get(seq_id, "can_append"), num_new_tokens) \
            <= self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[self._check_block(block_id)]

    def block_hash(self, block_id: int) -> int:
        """The block's chained hash if it is in the prefix index, else 0."""
        return self._block_hash[self._check_block(block_id)]

    def match_prefix(self, token_ids, salt: int = 0) -> int:
        """How many leading tokens allocate() would take from the cache now (read-only)."""
        tokens, count = self._tokens(token_ids)
        if tokens is None:
            return 0
        return len(self._lookup(tokens, _check_salt(salt))) * self.block_size_tokens

    def stats(self) -> dict:
        reserved = self._total_table_blocks * self.block_size_tokens
        lookups = self._prefix_hit_blocks + self._prefix_miss_blocks
        return {
            "num_blocks": self.num_blocks,
            "block_size_tokens": self.block_size_tokens,
            "num_used_blocks": self.num_blocks - self.num_free_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_cached_blocks": len(self._index),
            "num_cached_free_blocks": len(self._free_cached),
            "num_sequences": len(self._seqs),
            "num_tokens": self._total_tokens,
            "num_reserved_slots": reserved,
            "utilization": self._total_tokens / reserved if reserved else 0.0,
            "prefix_hit_blocks": self._prefix_hit_blocks,
            "prefix_miss_blocks": self._prefix_miss_blocks,
            "prefix_hit_rate": self._prefix_hit_blocks / lookups if lookups else 0.0,
            "num_evicted_blocks": self._num_evicted_blocks,
            "num_cow_copies": self._num_cow_copies,
        }

    # ---------------------------------------------------------- mutations

    def allocate(self, seq_id, token_ids, salt: int = 0) -> int:
        """Give a new sequence blocks for its prompt; return the number of leading tokens
        whose KV is already cached (a multiple of block_size_tokens, < len(token_ids))."""
        if seq_id in self._seqs:
            raise SequenceExistsError(f"allocate: sequence {seq_id!r} already has a block table; "
                                      f"free it first or use a new seq_id")
        salt = _check_salt(salt)
        tokens, count = self._tokens(token_ids)
        hits = self._lookup(tokens, salt) if tokens is not None else []
        num_revived = sum(1 for b, _ in hits if self._ref_count[b] == 0)
        num_needed = -(-count // self.block_size_tokens) - len(hits)
        if num_needed > self.num_free_blocks - num_revived:
            raise OutOfBlocksError(
                f"allocate: sequence {seq_id!r} needs {num_needed} new blocks, "
                f"{self.num_free_blocks - num_revived} are free; free or preempt sequences first")
        seq = _Seq(salt)
        for b, h in hits:
            if self._ref_count[b] == 0:
                del self._free_cached[b]
            self._ref_count[b] += 1
            seq.table.append(b)
            seq.last_hash = h
        num_cached = len(hits) * self.block_size_tokens
        seq.num_tokens = num_cached
        self._total_tokens += num_cached
        self._total_table_blocks += len(hits)
        if tokens is not None:
            self._prefix_hit_blocks += len(hits)
            self._prefix_miss_blocks += _max_hit_blocks(count, self.block_size_tokens) - len(hits)
        self._seqs[seq_id] = seq
        self._fill(seq, tokens, num_cached, count)
        return num_cached

    def append(self, seq_id, token_ids) -> list[tuple[int, int]]:
        """Append tokens; return the (src, dst) block copies the engine must do first."""
        seq = self._get(seq_id, "append")
        tokens, count = self._tokens(token_ids)
        if count == 0:
            return []
        num_needed = self._blocks_to_append(seq, count)
        if num_needed > self.num_free_blocks:
            raise OutOfBlocksError(f"append: sequence {seq_id!r} needs {num_needed} new blocks, "
                                   f"{self.num_free_blocks} are free; free or preempt sequences first")
        pairs = []
        if seq.num_tokens % self.block_size_tokens and self._ref_count[seq.table[-1]] > 1:
            pairs.append(self._copy_on_write(seq))
        self._fill(seq, tokens, 0, count)
        return pairs

    def _copy_on_write(self, seq: _Seq) -> tuple[int, int]:
        """Move seq off its shared partial last block onto a new one; the engine copies."""
        src = seq.table[-1]
        dst = self._pop_free()
        self._ref_count[src] -= 1
        seq.table[-1] = dst
        self._num_cow_copies += 1
        return src, dst

    def append_batch(self, seq_ids, token_ids) -> list[tuple[int, int]]:
        """One decoding step: append token_ids[i] to seq_ids[i] for every i, in order; return
        all block copies. Atomic: every id, token and the block need are checked first (the
        need is the sum of each sequence's need alone, a bound when forks share a block)."""
        if len(token_ids) != len(seq_ids):
            raise InvalidArgumentError(f"append_batch: {len(seq_ids)} sequences but {len(token_ids)} "
                                       f"tokens; pass one new token per sequence")
        seqs = [self._get(seq_id, "append_batch") for seq_id in seq_ids]
        if len(set(map(id, seqs))) != len(seqs):
            raise InvalidArgumentError("append_batch: a sequence id appears twice; "
                                       "append to each sequence once per step")
        tokens, _ = self._tokens(token_ids)
        num_needed = sum(self._blocks_to_append(seq, 1) for seq in seqs)
        if num_needed > self.num_free_blocks:
            raise OutOfBlocksError(f"append_batch: {len(seqs)} sequences need {num_needed} new "
                                   f"blocks, {self.num_free_blocks} are free; preempt sequences first")
        pairs = []
        for i, seq in enumerate(seqs):
            if seq.num_tokens % self.block_size_tokens and self._ref_count[seq.table[-1]] > 1:
                pairs.append(self._copy_on_write(seq))
            self._fill(seq, tokens, i, i + 1)
        return pairs

    def fork(self, parent_seq_id, child_seq_id) -> None:
        """The child shares every block of the parent (ref counts go up)."""
        parent = self._get(parent_seq_id, "fork")
        if child_seq_id in self._seqs:
            raise SequenceExistsError(f"fork: child sequence {child_seq_id!r} already has a block "
                                      f"table; free it first or use a new seq_id")
        child = _Seq(parent.salt)
        child.table = list(parent.table)
        child.num_tokens = parent.num_tokens
        child.last_hash = parent.last_hash
        child.partial_state = parent.partial_state
        child.stale = parent.stale
        for b in child.table:
            self._ref_count[b] += 1
        self._seqs[child_seq_id] = child
        self._total_tokens += child.num_tokens
        self._total_table_blocks += len(child.table)

    def free(self, seq_id) -> None:
        """Release the sequence's blocks, last to first; hashed ones stay cached."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(f"free: no sequence {seq_id!r} (never allocated, or "
                                       f"already freed: a double free); free each seq_id once")
        for b in reversed(seq.table):
            self._release(b)
        self._total_tokens -= seq.num_tokens
        self._total_table_blocks -= len(seq.table)

    def truncate(self, seq_id, token_ids) -> list[tuple[int, int]]:
        """Cut the sequence back to its first len(token_ids) tokens (e.g. drafted tokens that
        a verify pass rejected); return the (src, dst) block copy the engine must do first.

        token_ids are the tokens the sequence keeps (its first ones; a bare count with
        prefix caching off): they re-derive the hash state of the kept blocks. Whole blocks
        past the cut are released as `free` releases them (hashed ones stay cached: their
        contents still match their hash). The block the cut lands inside, if any, becomes
        this sequence's partial last block: it leaves the prefix index (its tail will be
        overwritten), or, when other tables share it, the sequence moves onto a copy of it
        (copy-on-write, as `append` does). Raises OutOfBlocksError, changing nothing, when
        that copy needs a block and none is free.
        """
        seq = self._get(seq_id, "truncate")
        tokens, count = self._tokens(token_ids)
        if count > seq.num_tokens:
            raise InvalidArgumentError(f"truncate: sequence {seq_id!r} has {seq.num_tokens} tokens, "
                                       f"cannot keep {count}; keep at most {seq.num_tokens}")
        if count == seq.num_tokens:
            return []
        B = self.block_size_tokens
        num_kept_blocks = -(-count // B)
        dropped = seq.table[num_kept_blocks:]
        cut_block = seq.table[num_kept_blocks - 1] if count % B else None
        copy = cut_block is not None and self._ref_count[cut_block] > 1
        if copy and self.num_free_blocks + sum(self._ref_count[b] == 1 for b in dropped) == 0:
            raise OutOfBlocksError(f"truncate: sequence {seq_id!r} needs a block to copy its shared "
                                   f"last block into, none is free; free or preempt sequences first")
        for b in reversed(dropped):
            self._release(b)
        del seq.table[num_kept_blocks:]
        self._total_table_blocks -= len(dropped)
        self._total_tokens -= seq.num_tokens - count
        num_full_before = seq.num_tokens // B
        seq.num_tokens = count
        pairs = []
        if copy:
            pairs.append(self._copy_on_write(seq))
        elif cut_block is not None and self._block_hash[cut_block]:
            del self._index[self._block_hash[cut_block]]
            self._block_hash[cut_block] = 0
        if tokens is not None:
            num_full = count // B
            if num_full < num_full_before:
                seq.last_hash = 0
                for i in range(num_full):
                    seq.last_hash = block_hash(seq.last_hash, tokens[i * B:(i + 1) * B], seq.salt)
            seq.partial_state = 0
            if count % B:
                seq.partial_state = HASH_OFFSET
                for t in tokens[num_full * B:count]:
                    seq.partial_state = _step(seq.partial_state, t)
        return pairs

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after a weight update); return how many. The live
        sequences become stale: the blocks they fill from now on hold KV that the cache's
        readers must not take (part of it came before the reset), so they are never indexed."""
        num_forgotten = len(self._index)
        for seq in self._seqs.values():
            seq.stale = True
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()
        self._index.clear()
        self._block_hash = [0] * self.num_blocks
        return num_forgotten

    # ------------------------------------------------------------ checks

    def debug_state(self) -> dict:
        """The whole state as plain data; equal for equal pools of either implementation."""
        return {
            "ref_count": list(self._ref_count),
            "block_hash": list(self._block_hash),
            "free_uncached": list(self._free_uncached),
            "free_cached": list(self._free_cached),
            "index": dict(self._index),
            "sequences": {sid: {"block_table": list(s.table), "num_tokens": s.num_tokens,
                                "last_hash": s.last_hash, "partial_state": s.partial_state,
                                "salt": s.salt, "stale": s.stale}
                          for sid, s in self._seqs.items()},
            "stats": self.stats(),
        }

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        check_state(self.debug_state(), self.block_size_tokens, self.enable_prefix_caching)

    # ---------------------------------------------------------- internals

    def _get(self, seq_id, op: str) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"{op}: no sequence {seq_id!r} (never allocated, or already "
                                       f"freed); allocate it first")
        return seq

    def _check_block(self, block_id) -> int:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(f"block id must be in [0, {self.num_blocks}), got {block_id!r}")
        return block_id

    def _tokens(self, token_ids):
        """(tokens or None, count). A bare int is a token count (prefix caching off only)."""
        if isinstance(token_ids, int):
            if self.enable_prefix_caching:
                raise InvalidArgumentError(f"a token count ({token_ids}) needs "
                                           f"enable_prefix_caching=False; pass the token ids")
            if token_ids < 0:
                raise InvalidArgumentError(f"token count must be >= 0, got {token_ids}")
            return None, token_ids
        if not self.enable_prefix_caching:
            return None, len(token_ids)
        tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        if tokens and (min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID):
            bad = next(t for t in tokens if not 0 <= t <= MAX_TOKEN_ID)
            raise InvalidArgumentError(f"token ids must be in [0, {MAX_TOKEN_ID}], got {bad}")
        return tokens, len(tokens)

    def _lookup(self, tokens: list[int], salt: int) -> list[tuple[int, int]]:
        """(block, hash) of the longest cached prefix, at most len(tokens) - 1 tokens long."""
        B = self.block_size_tokens
        hits = []
        parent = 0
        for i in range(min(_max_hit_blocks(len(tokens), B), self.num_blocks)):
            h = block_hash(parent, tokens[i * B:(i + 1) * B], salt)
            b = self._index.get(h)
            if b is None:
                break
            hits.append((b, h))
            parent = h
        return hits

    def _blocks_to_append(self, seq: _Seq, count: int) -> int:
        if count <= 0:
            return 0
        B = self.block_size_tokens
        cow = seq.num_tokens % B != 0 and self._ref_count[seq.table[-1]] > 1
        return -(-(seq.num_tokens + count) // B) - len(seq.table) + cow

    def _fill(self, seq: _Seq, tokens, pos: int, end: int) -> None:
        """Append tokens[pos:end] (or end - pos uncounted tokens) to seq's blocks."""
        B = self.block_size_tokens
        caching = tokens is not None
        while pos < end:
            offset = seq.num_tokens % B
            if offset == 0:
                seq.table.append(self._pop_free())
                self._total_table_blocks += 1
                state = HASH_OFFSET
            else:
                state = seq.partial_state
            m = min(B - offset, end - pos)
            if caching:
                for t in tokens[pos:pos + m]:
                    state = _step(state, t)
            seq.num_tokens += m
            self._total_tokens += m
            pos += m
            if seq.num_tokens % B == 0:
                if caching:
                    h = _finish(state, seq.last_hash, seq.salt)
                    seq.last_hash = h
                    if not seq.stale and h not in self._index:
                        self._index[h] = seq.table[-1]
                        self._block_hash[seq.table[-1]] = h
                seq.partial_state = 0
            elif caching:
                seq.partial_state = state

    def _release(self, b: int) -> None:
        """Drop one table's reference to block b; at 0 it goes to its free list's tail."""
        self._ref_count[b] -= 1
        if self._ref_count[b] == 0:
            if self._block_hash[b]:
                self._free_cached[b] = None
            else:
                self._free_uncached.append(b)

    def _pop_free(self) -> int:
        if self._free_uncached:
            b = self._free_uncached.popleft()
        else:
            b = next(iter(self._free_cached))
            del self._free_cached[b]
            del self._index[self._block_hash[b]]
            self._block_hash[b] = 0
            self._num_evicted_blocks += 1
        self._ref_count[b] = 1
        return b


def _max_hit_blocks(num_tokens: int, block_size_tokens: int) -> int:
    """The last prompt token is always recomputed (its logits start decoding)."""
    return (num_tokens - 1) // block_size_tokens if num_tokens > 0 else 0
