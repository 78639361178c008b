# Token ids into the pool's scratch buffer, validated (a list, any 1-D integer buffer, or a
# bare count with prefix caching off); included by _kvpool.pyx.

cdef Py_ssize_t _load_tokens(KVBlockPool pool, object token_ids, int32_t** out) except -2:
    """Return the token count; *out = validated int32 token ids, NULL for a bare count
    or with prefix caching off (then the values are never read)."""
    out[0] = NULL
    if isinstance(token_ids, int):
        if pool.enable_prefix_caching:
            raise InvalidArgumentError(f"a token count ({token_ids}) needs "
                                       f"enable_prefix_caching=False; pass the token ids")
        if (<Py_ssize_t>token_ids) < 0:
            raise InvalidArgumentError(f"token count must be >= 0, got {token_ids}")
        return token_ids
    if not pool.enable_prefix_caching:
        return len(token_ids)
    cdef Py_ssize_t n
    if type(token_ids) is list:
        n = _load_list(pool, <list>token_ids)
    elif PyObject_CheckBuffer(token_ids):
        n = _load_buffer(pool, token_ids)
    else:
        n = _load_list(pool, list(token_ids))
    out[0] = pool.scratch_tokens
    return n


cdef inline void _reserve_scratch(KVBlockPool pool, Py_ssize_t n) except *:
    if n <= pool.scratch_capacity:
        return
    cdef int32_t* p = <int32_t*>realloc(pool.scratch_tokens, n * sizeof(int32_t))
    if p == NULL:
        raise MemoryError()
    pool.scratch_tokens = p
    pool.scratch_capacity = n


cdef Py_ssize_t _load_list(KVBlockPool pool, list tokens) except -1:
    cdef Py_ssize_t n = len(tokens), i
    _reserve_scratch(pool, n)
    cdef int32_t* dst = pool.scratch_tokens
    cdef int64_t v
    for i in range(n):
        v = tokens[i]
        if v < 0 or v > C_MAX_TOKEN_ID:
            raise InvalidArgumentError(f"token ids must be in [0, {MAX_TOKEN_ID}], got {v}")
        dst[i] = <int32_t>v
    return n


cdef inline int64_t _read_int(void* buf, Py_ssize_t i, Py_ssize_t itemsize, char code) noexcept nogil:
    """Element i of a buffer of format code; -1 for an unsigned value beyond int64."""
    if itemsize == 8:
        if code == b"Q" or code == b"L":
            return -1 if (<uint64_t*>buf)[i] > <uint64_t>C_MAX_TOKEN_ID else <int64_t>(<uint64_t*>buf)[i]
        return (<int64_t*>buf)[i]
    if itemsize == 4:
        return (<uint32_t*>buf)[i] if code == b"I" or code == b"L" else (<int32_t*>buf)[i]
    if itemsize == 2:
        return (<uint16_t*>buf)[i] if code == b"H" else (<int16_t*>buf)[i]
    return (<uint8_t*>buf)[i] if code == b"B" else (<int8_t*>buf)[i]


cdef Py_ssize_t _load_buffer(KVBlockPool pool, object obj) except -1:
    """Copy a 1-D integer buffer (numpy array, array.array) into scratch, validated."""
    cdef Py_buffer view
    PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
    cdef Py_ssize_t n, i
    cdef const char* fmt
    cdef char code
    cdef int32_t* dst
    cdef int32_t acc32 = 0
    cdef uint64_t acc64 = 0
    cdef int64_t v
    cdef bint bad
    try:
        fmt = <const char*>"B"          # no format means unsigned bytes
        if view.format != NULL:
            fmt = view.format
        if fmt[0] == b"@" or fmt[0] == b"=" or fmt[0] == b"<":
            fmt += 1
        code = fmt[0]
        if view.ndim != 1 or fmt[1] != 0 or code == 0 or code not in b"bhilqBHILQ":
            raise InvalidArgumentError(f"token ids must be a 1-D integer array, got format "
                                       f"{view.format!r} with {view.ndim} dims")
        n = view.shape[0]
        _reserve_scratch(pool, n)
        dst = pool.scratch_tokens
        if view.itemsize == 4 and (code == b"i" or code == b"l"):
            memcpy(dst, view.buf, n * sizeof(int32_t))
            for i in range(n):
                acc32 |= dst[i]          # the sign bit survives iff some id is negative
            bad = acc32 < 0
        elif view.itemsize == 8 and (code == b"q" or code == b"l"):
            for i in range(n):
                acc64 |= <uint64_t>(<int64_t*>view.buf)[i]
                dst[i] = <int32_t>(<int64_t*>view.buf)[i]
            bad = acc64 > <uint64_t>C_MAX_TOKEN_ID
        else:
            bad = False
            for i in range(n):
                v = _read_int(view.buf, i, view.itemsize, code)
                if v < 0 or v > C_MAX_TOKEN_ID:
                    bad = True
                    break
                dst[i] = <int32_t>v
        if bad:
            first = next(int(t) for t in obj if not 0 <= int(t) <= MAX_TOKEN_ID)
            raise InvalidArgumentError(f"token ids must be in [0, {MAX_TOKEN_ID}], got {first}")
        return n
    finally:
        PyBuffer_Release(&view)
