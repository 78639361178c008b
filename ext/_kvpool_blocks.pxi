# Block records and block tables: the free lists threaded through BlockMeta, reference
# counts, a sequence's table growth; included by _kvpool.pyx. Invariants: _kvpool.pxd.

cdef inline void _list_push_tail(BlockMeta* blocks, FreeList* fl, int32_t b) noexcept nogil:
    blocks[b].ref_or_prev = fl.tail
    blocks[b].next_or_used = KVP_NIL
    if fl.tail != KVP_NIL:
        blocks[fl.tail].next_or_used = b
    else:
        fl.head = b
    fl.tail = b
    fl.length += 1


cdef inline void _list_unlink(BlockMeta* blocks, FreeList* fl, int32_t b) noexcept nogil:
    cdef int32_t prev = blocks[b].ref_or_prev
    cdef int32_t nxt = blocks[b].next_or_used
    if prev != KVP_NIL:
        blocks[prev].next_or_used = nxt
    else:
        fl.head = nxt
    if nxt != KVP_NIL:
        blocks[nxt].ref_or_prev = prev
    else:
        fl.tail = prev
    fl.length -= 1


cdef inline void _mark_used(BlockMeta* blocks, int32_t b, int32_t ref_count) noexcept nogil:
    blocks[b].ref_or_prev = ref_count
    blocks[b].next_or_used = KVP_USED


cdef inline int32_t _ref(BlockMeta* blocks, int32_t b) noexcept nogil:
    return blocks[b].ref_or_prev if blocks[b].next_or_used == KVP_USED else 0


cdef inline int _seq_reserve(_Seq seq, Py_ssize_t n) except -1:
    if n <= seq.capacity:
        return 0
    return _seq_grow(seq, n)


cdef int _seq_grow(_Seq seq, Py_ssize_t n) except -1:
    cdef Py_ssize_t cap = max(n, 2 * <Py_ssize_t>seq.capacity)
    cdef int32_t* p
    if seq.table == seq.inline_table:
        p = <int32_t*>malloc(cap * sizeof(int32_t))
        if p != NULL:
            memcpy(p, seq.inline_table, seq.num_table_blocks * sizeof(int32_t))
    else:
        p = <int32_t*>realloc(seq.table, cap * sizeof(int32_t))
    if p == NULL:
        raise MemoryError()
    seq.table = p
    seq.capacity = <int32_t>cap
    return 0


cdef int64_t _blocks_to_append(KVBlockPool pool, _Seq seq, int64_t count) except -1:
    if count <= 0:
        return 0
    cdef int64_t B = pool.block_size_tokens
    cdef bint cow = seq.num_tokens % B != 0 and \
        pool.blocks[seq.table[seq.num_table_blocks - 1]].ref_or_prev > 1
    return (seq.num_tokens + count + B - 1) // B - seq.num_table_blocks + cow


cdef list _walk(BlockMeta* blocks, FreeList* fl, int32_t num_blocks):
    """The list's blocks head to tail, checking the links on the way."""
    out = []
    cdef int32_t b = fl.head, prev = KVP_NIL
    while b != KVP_NIL:
        if len(out) > num_blocks or blocks[b].next_or_used == KVP_USED or blocks[b].ref_or_prev != prev:
            raise AssertionError(f"kvpool invariant broken: free list link at block {b}")
        out.append(b)
        prev = b
        b = blocks[b].next_or_used
    if prev != fl.tail or len(out) != fl.length:
        raise AssertionError("kvpool invariant broken: free list tail/length")
    return out
