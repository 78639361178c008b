# The prefix index: open addressing over int32 block ids, linear probing, backward-shift
# deletion, and the longest cached prefix of a token run; included by _kvpool.pyx.

cdef int32_t _lookup(KVBlockPool pool, const int32_t* tokens, Py_ssize_t count, uint64_t salt) noexcept:
    """Fill scratch_hits/scratch_hashes with the longest cached prefix (at most
    count - 1 tokens: the last prompt token is always recomputed); return its blocks."""
    cdef int64_t B = pool.block_size_tokens
    cdef int64_t max_hits = (count - 1) // B if count > 0 else 0
    if max_hits > pool.num_blocks:
        max_hits = pool.num_blocks
    cdef uint64_t parent = 0, h
    cdef uint64_t content[4]
    cdef int32_t i = 0, k, num, b
    while i < max_hits:
        num = 4 if i + 4 <= max_hits else 1
        if num == 4:
            kvp_content4(tokens + i * B, B, content)
        else:
            content[0] = kvp_content(KVP_HASH_OFFSET, tokens + i * B, B)
        for k in range(num):
            h = kvp_finish(content[k], parent, salt)
            b = _index_find(pool, h)
            if b == KVP_NIL:
                return i
            pool.scratch_hits[i] = b
            pool.scratch_hashes[i] = h
            parent = h
            i += 1
    return <int32_t>max_hits


cdef inline int32_t _index_find(KVBlockPool pool, uint64_t h) noexcept nogil:
    cdef uint64_t i = h & pool.index_mask
    cdef int32_t b
    while True:
        b = pool.index[i]
        if b == KVP_NIL or pool.blocks[b].block_hash == h:
            return b
        i = (i + 1) & pool.index_mask

cdef inline void _index_insert(KVBlockPool pool, int32_t b, uint64_t h) noexcept nogil:
    cdef uint64_t i = h & pool.index_mask
    while pool.index[i] != KVP_NIL:
        i = (i + 1) & pool.index_mask
    pool.index[i] = b
    pool.blocks[b].block_hash = h
    pool.num_indexed += 1

cdef void _index_remove(KVBlockPool pool, int32_t b) noexcept nogil:
    """Delete b's slot with backward shift: later entries of the run whose probe path
    covers the hole move into it, so lookups never need tombstones."""
    cdef uint64_t mask = pool.index_mask
    cdef uint64_t i = pool.blocks[b].block_hash & mask, j, home
    cdef int32_t c
    while pool.index[i] != b:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        c = pool.index[j]
        if c == KVP_NIL:
            break
        home = pool.blocks[c].block_hash & mask
        if ((j - home) & mask) >= ((j - i) & mask):
            pool.index[i] = c
            i = j
    pool.index[i] = KVP_NIL
    pool.blocks[b].block_hash = 0
    pool.num_indexed -= 1
