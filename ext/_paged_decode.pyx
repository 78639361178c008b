# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled decode attention over a paged float32 KV cache, read in place (no gather).

One query per sequence (a decode step): for sequence b and query head h = kv * G + g, the
output is softmax(scale * q . k_j) . v_j over the keys j < context_lens[b] (the query's own
position is context_lens[b] - 1), narrowed to the last `window` of them where window > 0, each
logit passed through softcap * tanh(logit / softcap) where softcap > 0. Key j of sequence b
lives in block block_tables[b, j // block_size] at offset j % block_size.

The kernel is C (below), per sequence: one pass over its keys, a token's row of every KV head
at a time (each key read once), scores all H query heads; a softmax per head (exp: Cephes'
polynomial, 8 lanes); a second pass over the values accumulates them. Sums are float32, as
SDPA's are on the CPU; the result differs from SDPA's in the last bits (its order of summation
is not SDPA's). The arithmetic is written with 8-float vectors (GCC's vector extensions); on
x86-64 the kernel is also built for AVX2 + FMA and the first call picks that build where the CPU
has both (`__builtin_cpu_supports`: `target_clones("arch=haswell")` dispatches on the CPU model
and took the plain build on an AMD EPYC).

`actors/generator/attention.py`'s `PagedDecodeBackend` calls it for the steps it takes (float32,
contiguous caches on the CPU, one new token a row); the memoryview types check the dtypes and
contiguity, and `paged_decode_attention` checks the shapes, context lengths and every block id a
sequence reads before any memory is read.
"""
from libc.stdint cimport int64_t

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>


    typedef float pd_v8 __attribute__((vector_size(32)));
    typedef int32_t pd_i8 __attribute__((vector_size(32)));

    static inline __attribute__((always_inline)) pd_v8 pd_load(const float *p) { pd_v8 v; __builtin_memcpy(&v, p, sizeof v); return v; }
    static inline __attribute__((always_inline)) void pd_store(float *p, pd_v8 v) { __builtin_memcpy(p, &v, sizeof v); }
    static inline __attribute__((always_inline)) pd_v8 pd_splat(float x) { return (pd_v8){x, x, x, x, x, x, x, x}; }
    static inline __attribute__((always_inline)) pd_v8 pd_select(pd_i8 mask, pd_v8 yes, pd_v8 no) {  /* lanes of mask: -1 or 0 */
        pd_i8 a, b;
        __builtin_memcpy(&a, &yes, sizeof a);
        __builtin_memcpy(&b, &no, sizeof b);
        a = (a & mask) | (b & ~mask);
        pd_v8 out;
        __builtin_memcpy(&out, &a, sizeof out);
        return out;
    }
    static inline __attribute__((always_inline)) float pd_hsum(pd_v8 v) {
        return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
    }

    /* exp of 8 floats, each <= 0 (a logit minus its row's maximum) or -inf: Cody-Waite reduction
       by ln 2 and Cephes' degree-6 polynomial for expf; below -87.3 (and -inf): 0. */
    static inline __attribute__((always_inline)) pd_v8 pd_exp(pd_v8 x) {
        const pd_v8 low = pd_splat(-87.3f);
        const pd_i8 gone = x < low;
        x = pd_select(gone, low, x);
        const pd_v8 fx = x * pd_splat(1.44269504088896341f) + pd_splat(0.5f);
        pd_i8 n = __builtin_convertvector(fx, pd_i8);            /* truncation toward 0 */
        n += __builtin_convertvector(n, pd_v8) > fx;             /* floor(fx) (true is -1): round(x / ln 2) */
        const pd_v8 nf = __builtin_convertvector(n, pd_v8);
        x = x - nf * pd_splat(0.693359375f) - nf * pd_splat(-2.12194440e-4f);
        const pd_v8 z = x * x;
        pd_v8 y = pd_splat(1.9875691500e-4f);
        y = y * x + pd_splat(1.3981999507e-3f);
        y = y * x + pd_splat(8.3334519073e-3f);
        y = y * x + pd_splat(4.1665795894e-2f);
        y = y * x + pd_splat(1.6666665459e-1f);
        y = y * x + pd_splat(5.0000001201e-1f);
        y = y * z + x + pd_splat(1.0f);
        const pd_i8 bits = (n + 127) << 23;                      /* 2^n */
        pd_v8 two_n;
        __builtin_memcpy(&two_n, &bits, sizeof two_n);
        return pd_select(gone, pd_splat(0.0f), y * two_n);
    }

    /* q, out: (B, H, D); caches: (num_blocks, block_size, Hkv, D); tables: (B, max_blocks).
       dim: a multiple of 8. scratch: H * (max(context_lens) + 8) floats. Each pass walks the
       sequence's keys (then values) in order, reading a token's row of all KV heads at once. */
    static inline __attribute__((always_inline)) void pd_attend_body(const float *q, const float *key_cache, const float *value_cache,
                          const int64_t *tables, const int64_t *context_lens, float *out,
                          int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                          float softcap, float *scratch) {
        const int64_t groups = heads / kv_heads, lanes = dim / 8, token_stride = kv_heads * dim;
        for (int64_t b = 0; b < batch; b++) {
            const int64_t end = context_lens[b];
            const int64_t start = (window > 0 && end > window) ? end - window : 0;
            const int64_t n = end - start, padded = (n + 7) / 8 * 8;
            const int64_t *table = tables + b * max_blocks;
            const float *qb = q + b * heads * dim;
            float *ob = out + b * heads * dim;
            /* logits: scratch[h * padded + i] for key start + i */
            for (int64_t j = start; j < end; j++) {
                const float *row = key_cache + (table[j / block_size] * block_size + j % block_size) * token_stride;
                for (int64_t kv = 0, h = 0; kv < kv_heads; kv++) {
                    const float *k = row + kv * dim;
                    for (int64_t g = 0; g < groups; g++, h++) {
                        const float *qh = qb + h * dim;
                        pd_v8 sum = pd_load(qh) * pd_load(k);
                        for (int64_t i = 1; i < lanes; i++) sum += pd_load(qh + 8 * i) * pd_load(k + 8 * i);
                        float logit = pd_hsum(sum) * scale;
                        if (softcap > 0) logit = tanhf(logit / softcap) * softcap;
                        scratch[h * padded + (j - start)] = logit;
                    }
                }
            }
            /* softmax weights, unnormalised; out cleared */
            for (int64_t h = 0; h < heads; h++) {
                float *w = scratch + h * padded;
                float top = -INFINITY;
                for (int64_t i = 0; i < n; i++) top = w[i] > top ? w[i] : top;
                for (int64_t i = n; i < padded; i++) w[i] = -INFINITY;
                for (int64_t i = 0; i < padded; i += 8) pd_store(w + i, pd_exp(pd_load(w + i) - pd_splat(top)));
                for (int64_t i = 0; i < lanes; i++) pd_store(ob + h * dim + 8 * i, pd_splat(0.0f));
            }
            /* out[h] = sum_j w[h, j] v_j */
            for (int64_t j = start; j < end; j++) {
                const float *row = value_cache + (table[j / block_size] * block_size + j % block_size) * token_stride;
                for (int64_t kv = 0, h = 0; kv < kv_heads; kv++) {
                    const float *v = row + kv * dim;
                    for (int64_t g = 0; g < groups; g++, h++) {
                        float *o = ob + h * dim;
                        const pd_v8 weight = pd_splat(scratch[h * padded + (j - start)]);
                        for (int64_t i = 0; i < lanes; i++) pd_store(o + 8 * i, pd_load(o + 8 * i) + weight * pd_load(v + 8 * i));
                    }
                }
            }
            for (int64_t h = 0; h < heads; h++) {
                const float *w = scratch + h * padded;
                pd_v8 total = pd_splat(0.0f);
                for (int64_t i = 0; i < padded; i += 8) total += pd_load(w + i);
                const pd_v8 inv = pd_splat(1.0f / pd_hsum(total));
                float *o = ob + h * dim;
                for (int64_t i = 0; i < lanes; i++) pd_store(o + 8 * i, pd_load(o + 8 * i) * inv);
            }
        }
    }

    #define PD_ARGS const float *q, const float *key_cache, const float *value_cache, \
        const int64_t *tables, const int64_t *context_lens, float *out, int64_t batch, int64_t heads, \
        int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks, float scale, \
        int64_t window, float softcap, float *scratch
    #define PD_CALL pd_attend_body(q, key_cache, value_cache, tables, context_lens, out, batch, heads, \
        kv_heads, dim, block_size, max_blocks, scale, window, softcap, scratch)

    /* The same body built for AVX2 and FMA, taken where the CPU has both (x86-64, GCC or clang). */
    #if defined(__x86_64__) && defined(__GNUC__)
    __attribute__((target("avx2,fma"))) static void pd_attend_avx2(PD_ARGS) { PD_CALL; }
    static int pd_has_avx2(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    #else
    static void pd_attend_avx2(PD_ARGS) { PD_CALL; }
    static int pd_has_avx2(void) { return 0; }
    #endif

    static void pd_attend(PD_ARGS) {
        static int avx2 = -1;
        if (avx2 < 0) avx2 = pd_has_avx2();
        if (avx2) pd_attend_avx2(q, key_cache, value_cache, tables, context_lens, out, batch, heads,
                                 kv_heads, dim, block_size, max_blocks, scale, window, softcap, scratch);
        else PD_CALL;
    }
    """
    void pd_attend(const float *q, const float *key_cache, const float *value_cache,
                   const int64_t *tables, const int64_t *context_lens, float *out,
                   int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                   int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                   float softcap, float *scratch) nogil

from libc.stdlib cimport malloc, free


def paged_decode_attention(const float[:, :, ::1] q, const float[:, :, :, ::1] key_cache,
                           const float[:, :, :, ::1] value_cache, const int64_t[:, ::1] block_tables,
                           const int64_t[::1] context_lens, float[:, :, ::1] out, double scale,
                           Py_ssize_t window=0, double softcap=0.0):
    """Writes into `out` (B, H, D) the attention of `q` (B, H, D), one query per sequence, over
    its cached keys and values (caches (num_blocks, block_size, Hkv, D), C-contiguous float32).
    window <= 0: every key; softcap <= 0: none. ValueError for shapes that do not agree, a context
    length outside [1, max_blocks * block_size] or a block id outside the cache."""
    cdef Py_ssize_t batch = q.shape[0], heads = q.shape[1], dim = q.shape[2]
    cdef Py_ssize_t num_blocks = key_cache.shape[0], block_size = key_cache.shape[1]
    cdef Py_ssize_t kv_heads = key_cache.shape[2], max_blocks = block_tables.shape[1]
    if (value_cache.shape[0] != num_blocks or value_cache.shape[1] != block_size or value_cache.shape[2] != kv_heads
            or key_cache.shape[3] != dim or value_cache.shape[3] != dim):
        raise ValueError(f"key cache ({num_blocks}, {block_size}, {kv_heads}, {key_cache.shape[3]}), value cache "
                         f"({value_cache.shape[0]}, {value_cache.shape[1]}, {value_cache.shape[2]}, "
                         f"{value_cache.shape[3]}) and head size {dim} do not agree")
    if dim % 8 or dim < 8:
        raise ValueError(f"head size {dim}: the kernel takes a multiple of 8")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    if (block_tables.shape[0] != batch or context_lens.shape[0] != batch or out.shape[0] != batch
            or out.shape[1] != heads or out.shape[2] != dim):
        raise ValueError(f"q ({batch}, {heads}, {dim}), block tables of {block_tables.shape[0]} rows, "
                         f"{context_lens.shape[0]} context lengths and out ({out.shape[0]}, {out.shape[1]}, "
                         f"{out.shape[2]}) do not agree")
    cdef Py_ssize_t b, i, longest = 0, end
    for b in range(batch):
        end = context_lens[b]
        if not 1 <= end <= max_blocks * block_size:
            raise ValueError(f"sequence {b}: context length {end} outside [1, {max_blocks * block_size}]")
        longest = max(longest, end)
        for i in range((end + block_size - 1) // block_size):
            if not 0 <= block_tables[b, i] < num_blocks:
                raise ValueError(f"sequence {b}: block id {block_tables[b, i]} outside the cache's {num_blocks}")
    if batch == 0:
        return
    cdef float *scratch = <float *> malloc(heads * (longest + 8) * sizeof(float))
    if scratch == NULL:
        raise MemoryError()
    try:
        with nogil:
            pd_attend(&q[0, 0, 0], &key_cache[0, 0, 0, 0], &value_cache[0, 0, 0, 0], &block_tables[0, 0],
                      &context_lens[0], &out[0, 0, 0], batch, heads, kv_heads, dim, block_size, max_blocks,
                      <float> scale, window, <float> softcap, scratch)
    finally:
        free(scratch)
