# The contract of the compiled paged KV-cache block allocator (_kvpool.pyx).
#
# Behaviour is defined by the pure-Python twin, postrain/ext/_kvpool_py.py: every
# public method here returns exactly what the twin returns. Other Cython code may
# `cimport postrain.ext._kvpool` and use the C-level state below read-only.
cimport cython
from libc.stdint cimport int32_t, int64_t, uint64_t

# Sentinels of the int32 block links.
cdef enum:
    KVP_NIL = -1    # no block: end of a free list, an empty index slot
    KVP_USED = -2   # BlockMeta.next_or_used of a block held by at least one table
    KVP_INLINE_BLOCKS = 16  # a _Seq holds this many block ids without a separate allocation

# One block's metadata: 16 bytes, in one C array of num_blocks records.
# A tagged union: next_or_used == KVP_USED marks a used block, whose ref_count is
# ref_or_prev; otherwise the block is free and (ref_or_prev, next_or_used) are its
# (previous, next) neighbours on its free list. Invariants:
#   (next_or_used == KVP_USED) == (ref_count(b) > 0)
#   block_hash != 0  iff  the prefix index maps block_hash to this block
#   a free block with block_hash != 0 is on free_cached, one with 0 on free_uncached
cdef struct BlockMeta:
    uint64_t block_hash
    int32_t ref_or_prev
    int32_t next_or_used

# A doubly linked FIFO list threaded through BlockMeta: pop at head, push at tail.
# length == number of blocks reachable from head; head == KVP_NIL iff length == 0.
cdef struct FreeList:
    int32_t head
    int32_t tail
    int32_t length


@cython.final
cdef class _Seq:
    # One sequence. Invariants (B = block_size_tokens):
    #   num_table_blocks == ceil(num_tokens / B) <= capacity; table[:num_table_blocks] distinct
    #   last_hash == chain hash of table[num_tokens // B - 1] (0 if none or caching off)
    #   partial_state == content hash of the partial last block's tokens (0 if none or caching off)
    #   stale: it lived through a reset_prefix_cache, so the blocks it fills are not indexed
    cdef int32_t* table           # == inline_table until the table outgrows it, then malloc'ed
    cdef int32_t inline_table[KVP_INLINE_BLOCKS]
    cdef int32_t num_table_blocks
    cdef int32_t capacity
    cdef int64_t num_tokens
    cdef uint64_t last_hash
    cdef uint64_t partial_state
    cdef uint64_t salt
    cdef bint stale
    cdef uint64_t batch_stamp     # == the pool's batch_counter while an append_batch holds it


@cython.final
cdef class KVBlockPool:
    cdef readonly int32_t num_blocks
    cdef readonly int32_t block_size_tokens
    cdef readonly bint enable_prefix_caching

    cdef BlockMeta* blocks          # [num_blocks]
    cdef FreeList free_uncached     # free, never hashed or evicted: taken first
    cdef FreeList free_cached       # free, still hashed: least recently freed first
    # Open-addressing hash index, linear probing, backward-shift deletion.
    # index[i] is a block id or KVP_NIL; len == index_mask + 1 >= 2 * num_blocks.
    # For each hashed block b, probing from block_hash & index_mask reaches b
    # before any KVP_NIL slot.
    cdef int32_t* index
    cdef uint64_t index_mask
    cdef int32_t num_indexed        # == number of blocks with block_hash != 0
    cdef dict seqs                  # seq_id -> _Seq
    cdef int32_t* scratch_tokens    # token ids of the current call, validated
    cdef Py_ssize_t scratch_capacity
    cdef int32_t* scratch_hits      # [num_blocks]: prefix-hit blocks of the current allocate
    cdef uint64_t* scratch_hashes   # [num_blocks]: their hashes
    # total_tokens == sum(s.num_tokens); total_table_blocks == sum(s.num_table_blocks)
    cdef int64_t total_tokens
    cdef int64_t total_table_blocks
    cdef int64_t prefix_hit_blocks
    cdef int64_t prefix_miss_blocks
    cdef int64_t num_evicted_blocks
    cdef int64_t num_cow_copies
    cdef uint64_t batch_counter     # bumped by every append_batch (duplicate-id check)

    cdef int _fill(self, _Seq seq, const int32_t* tokens, Py_ssize_t pos, Py_ssize_t end) except -1
    cdef tuple _copy_on_write(self, _Seq seq)
    cdef int32_t _pop_free(self) except -1
    cdef void _release(self, int32_t b) noexcept
    cdef _Seq _get(self, object seq_id, str op)
