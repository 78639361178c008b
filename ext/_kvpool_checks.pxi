# The whole state as plain data and the invariant checks on it (debug_state, check_invariants);
# included by _kvpool.pyx.

cdef dict _debug_state(KVBlockPool pool):
    """The whole state as plain data; equal for equal pools of either implementation."""
    cdef int32_t b
    cdef uint64_t i
    index = {}
    for i in range(pool.index_mask + 1):
        if pool.index[i] != KVP_NIL:
            index[pool.blocks[pool.index[i]].block_hash] = pool.index[i]
    sequences = {}
    cdef _Seq s
    for sid, obj in pool.seqs.items():
        s = <_Seq>obj
        sequences[sid] = {"block_table": [s.table[j] for j in range(s.num_table_blocks)],
                          "num_tokens": s.num_tokens, "last_hash": s.last_hash,
                          "partial_state": s.partial_state, "salt": s.salt, "stale": bool(s.stale)}
    return {
        "ref_count": [_ref(pool.blocks, b) for b in range(pool.num_blocks)],
        "block_hash": [pool.blocks[b].block_hash for b in range(pool.num_blocks)],
        "free_uncached": _walk(pool.blocks, &pool.free_uncached, pool.num_blocks),
        "free_cached": _walk(pool.blocks, &pool.free_cached, pool.num_blocks),
        "index": index,
        "sequences": sequences,
        "stats": pool.stats(),
    }

cdef _check_invariants(KVBlockPool pool):
    """Raise AssertionError naming the first broken invariant (C links, index, then state)."""
    cdef int32_t b
    state = _debug_state(pool)  # _walk checks the list links
    for b in range(pool.num_blocks):
        if pool.blocks[b].block_hash and _index_find(pool, pool.blocks[b].block_hash) != b:
            raise AssertionError(f"kvpool invariant broken: hashed block {b} unreachable in the index")
    if pool.num_indexed != len(state["index"]):
        raise AssertionError("kvpool invariant broken: num_indexed == occupied index slots")
    check_state(state, pool.block_size_tokens, pool.enable_prefix_caching)
