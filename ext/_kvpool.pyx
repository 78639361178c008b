# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled paged KV-cache block allocator; the contract is `_kvpool.pxd`.

Same API and behaviour as the pure-Python twin `_kvpool_py.py`, whose module
docstring holds the design note (the hash definition, the errors and the invariant
checker both share are `_kvpool_common.py`'s); keep the two in step
(the stateful test in tests/ext/test_kvpool_stateful.py runs them side by side).
All per-block state lives in one C array of 16-byte `BlockMeta` records; the
prefix index is an open-addressing table of int32 block ids; free lists are
threaded through the records. Python objects appear only per sequence (the
seq_id -> _Seq dict) and in return values.

This file holds the pool's API and its allocation paths; the parts it includes hold the block
hash (`_kvpool_hash.pxi`), the free lists and block tables (`_kvpool_blocks.pxi`), the prefix
index (`_kvpool_index.pxi`), token loading (`_kvpool_tokens.pxi`) and the state dump and
invariant checks (`_kvpool_checks.pxi`).
"""
cimport cython
from cpython.buffer cimport PyObject_CheckBuffer, PyObject_GetBuffer, PyBuffer_Release, \
    PyBUF_FORMAT, PyBUF_C_CONTIGUOUS
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy

from postrain.ext._kvpool_common import (
    InvalidArgumentError, InvalidBlockError, OutOfBlocksError, SequenceExistsError,
    UnknownSequenceError, MAX_NUM_BLOCKS, MAX_TOKEN_ID, check_state, _check_salt, _check_out_width,
)

include "_kvpool_hash.pxi"
include "_kvpool_blocks.pxi"


@cython.freelist(256)
cdef class _Seq:
    def __cinit__(self):
        self.table = self.inline_table
        self.capacity = KVP_INLINE_BLOCKS

    def __dealloc__(self):
        if self.table != self.inline_table:
            free(self.table)


@cython.final
cdef class KVBlockPool:
    """Paged KV-cache block allocator (compiled). See postrain.ext.kvpool."""

    implementation = "compiled"

    def __cinit__(self, num_blocks, block_size_tokens, enable_prefix_caching=True):
        if not isinstance(num_blocks, int) or not 1 <= num_blocks <= MAX_NUM_BLOCKS:
            raise InvalidArgumentError(f"num_blocks must be an int in [1, {MAX_NUM_BLOCKS}], "
                                       f"got {num_blocks!r}")
        if not isinstance(block_size_tokens, int) or not 1 <= block_size_tokens <= 1 << 20:
            raise InvalidArgumentError(f"block_size_tokens must be an int in [1, {1 << 20}], "
                                       f"got {block_size_tokens!r}; 16 is typical")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.enable_prefix_caching = bool(enable_prefix_caching)
        cdef uint64_t size = 8
        while size < 2 * <uint64_t>num_blocks:
            size *= 2
        self.index_mask = size - 1
        self.blocks = <BlockMeta*>malloc(num_blocks * sizeof(BlockMeta))
        self.index = <int32_t*>malloc(size * sizeof(int32_t))
        self.scratch_hits = <int32_t*>malloc(num_blocks * sizeof(int32_t))
        self.scratch_hashes = <uint64_t*>malloc(num_blocks * sizeof(uint64_t))
        self.scratch_capacity = 1024
        self.scratch_tokens = <int32_t*>malloc(self.scratch_capacity * sizeof(int32_t))
        if (self.blocks == NULL or self.index == NULL or self.scratch_hits == NULL
                or self.scratch_hashes == NULL or self.scratch_tokens == NULL):
            raise MemoryError()
        cdef uint64_t i
        for i in range(size):
            self.index[i] = KVP_NIL
        self.free_uncached.head = self.free_uncached.tail = KVP_NIL
        self.free_cached.head = self.free_cached.tail = KVP_NIL
        self.free_uncached.length = self.free_cached.length = 0
        cdef int32_t b
        for b in range(num_blocks):
            self.blocks[b].block_hash = 0
            _list_push_tail(self.blocks, &self.free_uncached, b)
        self.seqs = {}

    def __dealloc__(self):
        free(self.blocks)
        free(self.index)
        free(self.scratch_hits)
        free(self.scratch_hashes)
        free(self.scratch_tokens)

    # ------------------------------------------------------------ queries

    @property
    def num_free_blocks(self):
        return self.free_uncached.length + self.free_cached.length

    def __len__(self):
        return len(self.seqs)

    def __contains__(self, seq_id):
        return seq_id in self.seqs

    def num_tokens(self, seq_id):
        return self._get(seq_id, "num_tokens").num_tokens

    def block_table(self, seq_id):
        cdef _Seq seq = self._get(seq_id, "block_table")
        return [seq.table[i] for i in range(seq.num_table_blocks)]

    def fill_block_table(self, seq_id, int32_t[::1] out):
        """Write the block table into out[:n] (a 1-D C-contiguous int32 array); return n."""
        cdef _Seq seq = self._get(seq_id, "fill_block_table")
        _check_out_width(out.shape[0], seq.num_table_blocks, seq_id)
        if seq.num_table_blocks:
            memcpy(&out[0], seq.table, seq.num_table_blocks * sizeof(int32_t))
        return seq.num_table_blocks

    def fill_block_tables(self, seq_ids, int32_t[:, ::1] out, int32_t pad=0):
        """Row i of out (2-D C-contiguous int32) = block table of seq_ids[i], padded with `pad`."""
        cdef Py_ssize_t row = 0, j, width = out.shape[1]
        cdef _Seq seq
        if len(seq_ids) > out.shape[0]:
            raise InvalidArgumentError(f"out has {out.shape[0]} rows for {len(seq_ids)} sequences; "
                                       f"give out at least one row per sequence")
        for seq_id in seq_ids:
            seq = self._get(seq_id, "fill_block_tables")
            if seq.num_table_blocks > width:
                _check_out_width(width, seq.num_table_blocks, seq_id)
            for j in range(seq.num_table_blocks):
                out[row, j] = seq.table[j]
            for j in range(seq.num_table_blocks, width):
                out[row, j] = pad
            row += 1

    def can_allocate(self, num_tokens):
        cdef int64_t B = self.block_size_tokens
        return (<int64_t>num_tokens + B - 1) // B <= self.free_uncached.length + self.free_cached.length

    def can_append(self, seq_id, num_new_tokens):
        cdef _Seq seq = self._get(seq_id, "can_append")
        return _blocks_to_append(self, seq, num_new_tokens) <= \
            self.free_uncached.length + self.free_cached.length

    def ref_count(self, block_id):
        return _ref(self.blocks, self._check_block(block_id))

    def block_hash(self, block_id):
        """The block's chained hash if it is in the prefix index, else 0."""
        return self.blocks[self._check_block(block_id)].block_hash

    def match_prefix(self, token_ids, salt=0):
        """How many leading tokens allocate() would take from the cache now (read-only)."""
        cdef uint64_t c_salt = _c_salt(salt)
        cdef int32_t* toks
        cdef Py_ssize_t count = _load_tokens(self, token_ids, &toks)
        if toks == NULL:
            return 0
        return _lookup(self, toks, count, c_salt) * self.block_size_tokens

    def stats(self):
        cdef int64_t num_free = self.free_uncached.length + self.free_cached.length
        cdef int64_t reserved = self.total_table_blocks * self.block_size_tokens
        cdef int64_t lookups = self.prefix_hit_blocks + self.prefix_miss_blocks
        return {
            "num_blocks": self.num_blocks,
            "block_size_tokens": self.block_size_tokens,
            "num_used_blocks": self.num_blocks - num_free,
            "num_free_blocks": num_free,
            "num_cached_blocks": self.num_indexed,
            "num_cached_free_blocks": self.free_cached.length,
            "num_sequences": len(self.seqs),
            "num_tokens": self.total_tokens,
            "num_reserved_slots": reserved,
            "utilization": self.total_tokens / <double>reserved if reserved else 0.0,
            "prefix_hit_blocks": self.prefix_hit_blocks,
            "prefix_miss_blocks": self.prefix_miss_blocks,
            "prefix_hit_rate": self.prefix_hit_blocks / <double>lookups if lookups else 0.0,
            "num_evicted_blocks": self.num_evicted_blocks,
            "num_cow_copies": self.num_cow_copies,
        }

    # ---------------------------------------------------------- mutations

    def allocate(self, seq_id, token_ids, salt=0):
        """Give a new sequence blocks for its prompt; return the number of leading tokens
        whose KV is already cached (a multiple of block_size_tokens, < len(token_ids))."""
        if seq_id in self.seqs:
            raise SequenceExistsError(f"allocate: sequence {seq_id!r} already has a block table; "
                                      f"free it first or use a new seq_id")
        cdef uint64_t c_salt = _c_salt(salt)
        cdef int32_t* toks
        cdef Py_ssize_t count = _load_tokens(self, token_ids, &toks)
        cdef int64_t B = self.block_size_tokens
        cdef int32_t num_hits = 0, num_revived = 0, i, b
        if toks != NULL:
            num_hits = _lookup(self, toks, count, c_salt)
            for i in range(num_hits):
                if self.blocks[self.scratch_hits[i]].next_or_used != KVP_USED:
                    num_revived += 1
        cdef int64_t num_needed = (count + B - 1) // B - num_hits
        cdef int64_t num_free = self.free_uncached.length + self.free_cached.length - num_revived
        if num_needed > num_free:
            raise OutOfBlocksError(f"allocate: sequence {seq_id!r} needs {num_needed} new blocks, "
                                   f"{num_free} are free; free or preempt sequences first")
        cdef _Seq seq = _Seq.__new__(_Seq)
        seq.salt = c_salt
        _seq_reserve(seq, num_needed + num_hits)
        for i in range(num_hits):
            b = self.scratch_hits[i]
            if self.blocks[b].next_or_used == KVP_USED:
                self.blocks[b].ref_or_prev += 1
            else:
                _list_unlink(self.blocks, &self.free_cached, b)
                _mark_used(self.blocks, b, 1)
            seq.table[i] = b
        seq.num_table_blocks = num_hits
        seq.num_tokens = num_hits * B
        seq.last_hash = self.scratch_hashes[num_hits - 1] if num_hits else 0
        self.total_tokens += seq.num_tokens
        self.total_table_blocks += num_hits
        if toks != NULL:
            self.prefix_hit_blocks += num_hits
            self.prefix_miss_blocks += ((count - 1) // B if count > 0 else 0) - num_hits
        self.seqs[seq_id] = seq
        self._fill(seq, toks, seq.num_tokens, count)
        return num_hits * B

    def append(self, seq_id, token_ids):
        """Append tokens; return the (src, dst) block copies the engine must do first."""
        cdef _Seq seq = self._get(seq_id, "append")
        cdef int32_t* toks
        cdef Py_ssize_t count = _load_tokens(self, token_ids, &toks)
        if count == 0:
            return []
        cdef int64_t num_needed = _blocks_to_append(self, seq, count)
        cdef int64_t num_free = self.free_uncached.length + self.free_cached.length
        if num_needed > num_free:
            raise OutOfBlocksError(f"append: sequence {seq_id!r} needs {num_needed} new blocks, "
                                   f"{num_free} are free; free or preempt sequences first")
        _seq_reserve(seq, seq.num_table_blocks + num_needed)
        pairs = []
        if seq.num_tokens % self.block_size_tokens and \
                self.blocks[seq.table[seq.num_table_blocks - 1]].ref_or_prev > 1:
            pairs.append(self._copy_on_write(seq))
        self._fill(seq, toks, 0, count)
        return pairs

    def append_batch(self, seq_ids, token_ids):
        """One decoding step: append token_ids[i] to seq_ids[i] for every i, in order; return
        all block copies. Atomic: every id, token and the block need are checked first (the
        need is the sum of each sequence's need alone, a bound when forks share a block)."""
        cdef Py_ssize_t n = len(seq_ids), i
        if len(token_ids) != n:
            raise InvalidArgumentError(f"append_batch: {n} sequences but {len(token_ids)} "
                                       f"tokens; pass one new token per sequence")
        cdef list seqs = [self._get(seq_id, "append_batch") for seq_id in seq_ids]
        cdef _Seq seq
        self.batch_counter += 1
        for i in range(n):
            seq = <_Seq>seqs[i]
            if seq.batch_stamp == self.batch_counter:
                raise InvalidArgumentError("append_batch: a sequence id appears twice; "
                                           "append to each sequence once per step")
            seq.batch_stamp = self.batch_counter
        cdef int32_t* toks
        _load_tokens(self, token_ids, &toks)
        cdef int64_t num_needed = 0
        for i in range(n):
            num_needed += _blocks_to_append(self, <_Seq>seqs[i], 1)
        cdef int64_t num_free = self.free_uncached.length + self.free_cached.length
        if num_needed > num_free:
            raise OutOfBlocksError(f"append_batch: {n} sequences need {num_needed} new "
                                   f"blocks, {num_free} are free; preempt sequences first")
        pairs = []
        for i in range(n):
            seq = <_Seq>seqs[i]
            _seq_reserve(seq, seq.num_table_blocks + 1)
        for i in range(n):
            seq = <_Seq>seqs[i]
            if seq.num_tokens % self.block_size_tokens and \
                    self.blocks[seq.table[seq.num_table_blocks - 1]].ref_or_prev > 1:
                pairs.append(self._copy_on_write(seq))
            self._fill(seq, toks, i, i + 1)
        return pairs

    cdef tuple _copy_on_write(self, _Seq seq):
        """Move seq off its shared partial last block onto a new one; the engine copies."""
        cdef int32_t last = seq.num_table_blocks - 1
        cdef int32_t src = seq.table[last]
        cdef int32_t dst = self._pop_free()
        self.blocks[src].ref_or_prev -= 1
        seq.table[last] = dst
        self.num_cow_copies += 1
        return (src, dst)

    def fork(self, parent_seq_id, child_seq_id):
        """The child shares every block of the parent (ref counts go up)."""
        cdef _Seq parent = self._get(parent_seq_id, "fork")
        if child_seq_id in self.seqs:
            raise SequenceExistsError(f"fork: child sequence {child_seq_id!r} already has a block "
                                      f"table; free it first or use a new seq_id")
        cdef _Seq child = _Seq.__new__(_Seq)
        _seq_reserve(child, parent.num_table_blocks)
        cdef int32_t i
        for i in range(parent.num_table_blocks):
            child.table[i] = parent.table[i]
            self.blocks[parent.table[i]].ref_or_prev += 1
        child.num_table_blocks = parent.num_table_blocks
        child.num_tokens = parent.num_tokens
        child.last_hash = parent.last_hash
        child.partial_state = parent.partial_state
        child.salt = parent.salt
        child.stale = parent.stale
        self.seqs[child_seq_id] = child
        self.total_tokens += child.num_tokens
        self.total_table_blocks += child.num_table_blocks

    def free(self, seq_id):
        """Release the sequence's blocks, last to first; hashed ones stay cached."""
        cdef object obj = self.seqs.pop(seq_id, None)
        if obj is None:
            raise UnknownSequenceError(f"free: no sequence {seq_id!r} (never allocated, or "
                                       f"already freed: a double free); free each seq_id once")
        cdef _Seq seq = <_Seq>obj
        cdef int32_t i
        for i in range(seq.num_table_blocks - 1, -1, -1):
            self._release(seq.table[i])
        self.total_tokens -= seq.num_tokens
        self.total_table_blocks -= seq.num_table_blocks

    def truncate(self, seq_id, token_ids):
        """Cut the sequence back to its first len(token_ids) tokens; return the (src, dst) block
        copy the engine must do first. Same contract as the twin's truncate."""
        cdef _Seq seq = self._get(seq_id, "truncate")
        cdef int32_t* toks
        cdef Py_ssize_t count = _load_tokens(self, token_ids, &toks)
        if count > seq.num_tokens:
            raise InvalidArgumentError(f"truncate: sequence {seq_id!r} has {seq.num_tokens} tokens, "
                                       f"cannot keep {count}; keep at most {seq.num_tokens}")
        if count == seq.num_tokens:
            return []
        cdef int64_t B = self.block_size_tokens
        cdef int32_t num_kept = <int32_t>((count + B - 1) // B), i, num_releasable = 0
        cdef int32_t cut_block = seq.table[num_kept - 1] if count % B else KVP_NIL
        cdef bint copy = cut_block != KVP_NIL and self.blocks[cut_block].ref_or_prev > 1
        for i in range(num_kept, seq.num_table_blocks):
            num_releasable += self.blocks[seq.table[i]].ref_or_prev == 1
        if copy and self.free_uncached.length + self.free_cached.length + num_releasable == 0:
            raise OutOfBlocksError(f"truncate: sequence {seq_id!r} needs a block to copy its shared "
                                   f"last block into, none is free; free or preempt sequences first")
        for i in range(seq.num_table_blocks - 1, num_kept - 1, -1):
            self._release(seq.table[i])
        self.total_table_blocks -= seq.num_table_blocks - num_kept
        seq.num_table_blocks = num_kept
        self.total_tokens -= seq.num_tokens - count
        cdef int64_t num_full_before = seq.num_tokens // B, num_full = count // B
        seq.num_tokens = count
        pairs = []
        if copy:
            pairs.append(self._copy_on_write(seq))
        elif cut_block != KVP_NIL and self.blocks[cut_block].block_hash:
            _index_remove(self, cut_block)
        if toks != NULL:
            if num_full < num_full_before:
                seq.last_hash = 0
                for i in range(num_full):
                    seq.last_hash = kvp_finish(kvp_content(KVP_HASH_OFFSET, toks + i * B, B),
                                               seq.last_hash, seq.salt)
            seq.partial_state = 0
            if count % B:
                seq.partial_state = kvp_content(KVP_HASH_OFFSET, toks + num_full * B, count - num_full * B)
        return pairs

    def reset_prefix_cache(self):
        """Forget every cached hash (e.g. after a weight update); return how many. The live
        sequences become stale: the blocks they fill from now on hold KV that the cache's
        readers must not take (part of it came before the reset), so they are never indexed."""
        cdef int32_t num_forgotten = self.num_indexed, b
        for obj in self.seqs.values():
            (<_Seq>obj).stale = True
        while self.free_cached.head != KVP_NIL:
            b = self.free_cached.head
            _list_unlink(self.blocks, &self.free_cached, b)
            _list_push_tail(self.blocks, &self.free_uncached, b)
        for b in range(self.num_blocks):
            self.blocks[b].block_hash = 0
        cdef uint64_t i
        for i in range(self.index_mask + 1):
            self.index[i] = KVP_NIL
        self.num_indexed = 0
        return num_forgotten

    # ------------------------------------------------------------ checks

    def debug_state(self):
        """The whole state as plain data; equal for equal pools of either implementation."""
        return _debug_state(self)

    def check_invariants(self):
        """Raise AssertionError naming the first broken invariant (C links, index, then state)."""
        _check_invariants(self)

    # ---------------------------------------------------------- internals

    cdef _Seq _get(self, object seq_id, str op):
        cdef object obj = self.seqs.get(seq_id)
        if obj is None:
            raise UnknownSequenceError(f"{op}: no sequence {seq_id!r} (never allocated, or already "
                                       f"freed); allocate it first")
        return <_Seq>obj

    def _check_block(self, block_id):
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(f"block id must be in [0, {self.num_blocks}), got {block_id!r}")
        return block_id

    cdef int _fill(self, _Seq seq, const int32_t* tokens, Py_ssize_t pos, Py_ssize_t end) except -1:
        """Append tokens[pos:end] (or end - pos uncounted tokens) to seq's blocks; the
        caller has checked that enough blocks are free and reserved seq.table."""
        cdef int64_t B = self.block_size_tokens, m
        cdef int64_t offset = seq.num_tokens % B  # fill of the last block, 0 = none or full
        cdef uint64_t state = seq.partial_state, h
        seq.num_tokens += end - pos
        self.total_tokens += end - pos
        if tokens == NULL:  # no hashing: just the new blocks
            m = (offset + end - pos + B - 1) // B - (1 if offset else 0)
            while m > 0:
                seq.table[seq.num_table_blocks] = self._pop_free()
                seq.num_table_blocks += 1
                m -= 1
            self.total_table_blocks += (offset + end - pos + B - 1) // B - (1 if offset else 0)
            return 0
        while pos < end:
            if offset == 0:
                seq.table[seq.num_table_blocks] = self._pop_free()
                seq.num_table_blocks += 1
                self.total_table_blocks += 1
                state = KVP_HASH_OFFSET
            m = B - offset
            if end - pos < m:
                m = end - pos
            state = kvp_content(state, tokens + pos, m)
            pos += m
            offset += m
            if offset == B:
                h = kvp_finish(state, seq.last_hash, seq.salt)
                seq.last_hash = h
                if not seq.stale and _index_find(self, h) == KVP_NIL:
                    _index_insert(self, seq.table[seq.num_table_blocks - 1], h)
                offset = 0
                state = 0
        seq.partial_state = state
        return 0

    cdef int32_t _pop_free(self) except -1:
        cdef int32_t b
        if self.free_uncached.head != KVP_NIL:
            b = self.free_uncached.head
            _list_unlink(self.blocks, &self.free_uncached, b)
        elif self.free_cached.head != KVP_NIL:
            b = self.free_cached.head
            _list_unlink(self.blocks, &self.free_cached, b)
            _index_remove(self, b)
            self.num_evicted_blocks += 1
        else:
            raise AssertionError("kvpool internal error: no free block after the capacity check")
        _mark_used(self.blocks, b, 1)
        return b

    cdef void _release(self, int32_t b) noexcept:
        if self.blocks[b].ref_or_prev > 1:
            self.blocks[b].ref_or_prev -= 1
        elif self.blocks[b].block_hash:
            _list_push_tail(self.blocks, &self.free_cached, b)
        else:
            _list_push_tail(self.blocks, &self.free_uncached, b)


include "_kvpool_index.pxi"
include "_kvpool_tokens.pxi"
include "_kvpool_checks.pxi"
