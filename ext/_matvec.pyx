# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled float32 matrix-vector product: out = weight @ x, weight (n_out, n_in) row-major.

A one-token engine step (batch-1 decode) multiplies one row by every linear weight of the model:
each weight byte is read once and used for one multiply-add, so the step is bound by memory
bandwidth. This kernel streams four weight rows at a time, two 8-float accumulators a row (the
vector `x` stays in L1), with less work per call than torch's float32 `linear` at one row
(docs/performance.md, "Limits": the measured figures).

The C is written with 8-float vectors (GCC's vector extensions); on x86-64 it is also built for
AVX2 + FMA and the first call picks that build where the CPU has both, as `_paged_decode` does.
Sums are float32 in another order than torch's: results differ from `torch.nn.functional.linear`
in the last bits (tests/actors/models/test_matvec.py bounds it against float64).

`actors/models/blocks.py`'s `OneRowMatvec` calls it for the projections it takes (one row,
float32, contiguous, on the CPU), after checking each tensor's dtype, device, layout and shape.
"""
from libc.stdint cimport int64_t

cdef extern from *:
    """
    #include <stdint.h>

    typedef float mv_v8 __attribute__((vector_size(32)));

    static inline __attribute__((always_inline)) mv_v8 mv_load(const float *p) { mv_v8 v; __builtin_memcpy(&v, p, sizeof v); return v; }
    static inline __attribute__((always_inline)) float mv_hsum(mv_v8 v) {
        return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
    }

    /* One row's dot product with x: 8 lanes while they last, then the scalar tail. */
    static inline __attribute__((always_inline)) float mv_dot(const float *w, const float *x, int64_t n) {
        mv_v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) acc += mv_load(w + i) * mv_load(x + i);
        float sum = mv_hsum(acc);
        for (; i < n; i++) sum += w[i] * x[i];
        return sum;
    }

    /* Four rows at a time, 16 columns an iteration (two accumulators a row); the rows and
       columns left over go through mv_dot and the scalar tail. */
    static inline __attribute__((always_inline)) void mv_body(const float *weight, const float *x, float *out,
                                                             int64_t n_out, int64_t n_in) {
        int64_t o = 0;
        for (; o + 4 <= n_out; o += 4) {
            const float *w0 = weight + o * n_in, *w1 = w0 + n_in, *w2 = w1 + n_in, *w3 = w2 + n_in;
            mv_v8 a0 = {0, 0, 0, 0, 0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            int64_t i = 0;
            for (; i + 16 <= n_in; i += 16) {
                const mv_v8 xa = mv_load(x + i), xb = mv_load(x + i + 8);
                a0 += mv_load(w0 + i) * xa; a1 += mv_load(w1 + i) * xa;
                a2 += mv_load(w2 + i) * xa; a3 += mv_load(w3 + i) * xa;
                b0 += mv_load(w0 + i + 8) * xb; b1 += mv_load(w1 + i + 8) * xb;
                b2 += mv_load(w2 + i + 8) * xb; b3 += mv_load(w3 + i + 8) * xb;
            }
            float s0 = mv_hsum(a0 + b0), s1 = mv_hsum(a1 + b1), s2 = mv_hsum(a2 + b2), s3 = mv_hsum(a3 + b3);
            if (i < n_in) {
                s0 += mv_dot(w0 + i, x + i, n_in - i); s1 += mv_dot(w1 + i, x + i, n_in - i);
                s2 += mv_dot(w2 + i, x + i, n_in - i); s3 += mv_dot(w3 + i, x + i, n_in - i);
            }
            out[o] = s0; out[o + 1] = s1; out[o + 2] = s2; out[o + 3] = s3;
        }
        for (; o < n_out; o++) out[o] = mv_dot(weight + o * n_in, x, n_in);
    }

    #define MV_ARGS const float *weight, const float *x, float *out, int64_t n_out, int64_t n_in
    #if defined(__x86_64__) && defined(__GNUC__)
    __attribute__((target("avx2,fma"))) static void mv_avx2(MV_ARGS) { mv_body(weight, x, out, n_out, n_in); }
    static int mv_has_avx2(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    #else
    static void mv_avx2(MV_ARGS) { mv_body(weight, x, out, n_out, n_in); }
    static int mv_has_avx2(void) { return 0; }
    #endif

    static void mv_matvec(MV_ARGS) {
        static int avx2 = -1;
        if (avx2 < 0) avx2 = mv_has_avx2();
        if (avx2) mv_avx2(weight, x, out, n_out, n_in);
        else mv_body(weight, x, out, n_out, n_in);
    }
    """
    void mv_matvec(const float *weight, const float *x, float *out, int64_t n_out, int64_t n_in) nogil


def matvec_at(size_t weight, size_t x, size_t out, Py_ssize_t n_out, Py_ssize_t n_in):
    """out[o] = sum_i weight[o, i] * x[i] (float32 sums), given the addresses of contiguous
    float32 buffers: weight of n_out x n_in floats (row-major), x of n_in, out of n_out.

    Unchecked past the sizes: the caller guarantees the buffers (`OneRowMatvec.project` checks
    the tensors' dtype, device, layout and shapes first). Addresses rather than memoryviews
    because a one-token step makes ~200 of these calls, and taking three buffers each cost more
    than the kernel saved (~40 us a call; ~20 us of checks and allocation are left)."""
    if n_out < 0 or n_in < 0:
        raise ValueError(f"sizes must be >= 0, got n_out={n_out}, n_in={n_in}")
    cdef float *result = <float *> out
    cdef Py_ssize_t o
    if n_in == 0:
        for o in range(n_out):
            result[o] = 0
        return
    with nogil:
        mv_matvec(<const float *> weight, <const float *> x, result, n_out, n_in)
