// Shared helpers of postrain's CUDA kernels. Each .cu file includes this one header; the CuPy
// loader (postrain.ext.cupy_ops) inlines it before handing the source to NVRTC, and the nvcc
// test compiles every .cu with this folder on the include path.
//
// Element math lives in POSTRAIN_HD (host + device) functions so the same code can be checked
// on a CPU (tests/ext/test_cuda_kernels.py builds a host harness with nvcc).
#pragma once

#define POSTRAIN_HD __host__ __device__ __forceinline__

// Bit casts through a union: valid in device code, host code and NVRTC alike.
POSTRAIN_HD float bits_to_float(unsigned int u) {
    union { unsigned int u; float f; } c;
    c.u = u;
    return c.f;
}
POSTRAIN_HD unsigned int float_to_bits(float f) {
    union { unsigned int u; float f; } c;
    c.f = f;
    return c.u;
}
POSTRAIN_HD float postrain_inf() { return bits_to_float(0x7f800000u); }
POSTRAIN_HD float postrain_clampf(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }

// bfloat16 stored as its 16 raw bits: the upper half of an IEEE float32.
POSTRAIN_HD float load_val(const float* p, long long i) { return p[i]; }
POSTRAIN_HD float load_val(const unsigned short* p, long long i) {
    return bits_to_float(((unsigned int)p[i]) << 16);
}
POSTRAIN_HD void store_val(float* p, long long i, float v) { p[i] = v; }
POSTRAIN_HD void store_val(unsigned short* p, long long i, float v) {
    unsigned int u = float_to_bits(v);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) {  // NaN stays a quiet NaN
        p[i] = (unsigned short)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even (as torch does)
    p[i] = (unsigned short)(u >> 16);
}
