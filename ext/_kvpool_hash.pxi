# The chained block hash (C, shared by the allocator and `block_hash`); included by _kvpool.pyx.

cdef enum:
    C_MAX_TOKEN_ID = 2147483647

cdef extern from *:
    """
    #include <stdint.h>
    #define KVP_HASH_OFFSET 0xCBF29CE484222325ULL
    #define KVP_HASH_MULT 0x9E3779B97F4A7C15ULL
    static inline uint64_t kvp_step(uint64_t h, uint64_t v) {
        h = (h ^ v) * KVP_HASH_MULT;
        return h ^ (h >> 29);
    }
    static inline uint64_t kvp_content(uint64_t h, const int32_t* t, int64_t n) {
        for (int64_t i = 0; i < n; i++) h = kvp_step(h, (uint64_t)t[i]);
        return h;
    }
    /* Content hashes of four consecutive blocks at once: four independent multiply
       chains keep the multiplier busy instead of waiting on one chain's latency. */
    static inline void kvp_content4(const int32_t* t, int64_t n, uint64_t* out) {
        uint64_t a = KVP_HASH_OFFSET, b = KVP_HASH_OFFSET, c = KVP_HASH_OFFSET, d = KVP_HASH_OFFSET;
        const int32_t *tb = t + n, *tc = t + 2 * n, *td = t + 3 * n;
        for (int64_t i = 0; i < n; i++) {
            a = kvp_step(a, (uint64_t)t[i]);
            b = kvp_step(b, (uint64_t)tb[i]);
            c = kvp_step(c, (uint64_t)tc[i]);
            d = kvp_step(d, (uint64_t)td[i]);
        }
        out[0] = a; out[1] = b; out[2] = c; out[3] = d;
    }
    static inline uint64_t kvp_finish(uint64_t content, uint64_t parent, uint64_t salt) {
        uint64_t h = kvp_step(kvp_step(content, parent), salt);
        h ^= h >> 30; h *= 0xBF58476D1CE4E5B9ULL;
        h ^= h >> 27; h *= 0x94D049BB133111EBULL;
        h ^= h >> 31;
        return h ? h : 1;
    }
    """
    uint64_t KVP_HASH_OFFSET
    uint64_t kvp_step(uint64_t h, uint64_t v) noexcept nogil
    uint64_t kvp_content(uint64_t h, const int32_t* t, int64_t n) noexcept nogil
    void kvp_content4(const int32_t* t, int64_t n, uint64_t* out) noexcept nogil
    uint64_t kvp_finish(uint64_t content, uint64_t parent, uint64_t salt) noexcept nogil


def block_hash(parent_hash, token_ids, salt=0):
    """The chained hash of one full block (same value as the twin's block_hash)."""
    cdef uint64_t content = KVP_HASH_OFFSET
    cdef int64_t t
    for obj in token_ids:
        t = obj
        if t < 0 or t > C_MAX_TOKEN_ID:
            raise InvalidArgumentError(f"token ids must be in [0, {MAX_TOKEN_ID}], got {t}")
        content = kvp_step(content, <uint64_t>t)
    return kvp_finish(content, <uint64_t>parent_hash, _c_salt(salt))


cdef inline uint64_t _c_salt(object salt) except? 0:
    if type(salt) is int:
        try:
            return <uint64_t>salt
        except OverflowError:
            pass
    return <uint64_t>_check_salt(salt)  # raises the typed error (or accepts an int subclass)
