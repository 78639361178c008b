// Log-softmax + gather + entropy of one chunk of logits, forward and backward, without any
// (rows x vocab) fp32 temporary (postrain.ext.logprobs is the torch reference; the formulas
// are in its docstring).
//
// One block per row. Each thread keeps an online triple over its stride of the vocabulary:
// m = max z, s = sum exp(z - m), t = sum exp(z - m) * z; triples merge exactly (rescale both
// to the larger max), so a tree reduction gives logsumexp = m + log s and
// entropy = logsumexp - t / s in a single read of the logits. Backward re-reads the row once
// and writes the gradient in the logits' dtype.
#include "common.cuh"

#define LOGPROB_BLOCK 256

struct LseState {
    float m, s, t;
};

POSTRAIN_HD LseState lse_push(LseState a, float x) {
    if (x == -postrain_inf()) return a;  // p = 0: contributes nothing (and avoids 0 * inf)
    if (x > a.m) {
        float scale = expf(a.m - x);  // a.m may be -inf: scale = 0
        a.s = a.s * scale + 1.0f;
        a.t = a.t * scale + x;
        a.m = x;
    } else {
        float e = expf(x - a.m);
        a.s += e;
        a.t += e * x;
    }
    return a;
}

POSTRAIN_HD LseState lse_merge(LseState a, LseState b) {
    if (a.m == -postrain_inf()) return b;
    if (b.m == -postrain_inf()) return a;
    float m = fmaxf(a.m, b.m);
    float ea = expf(a.m - m), eb = expf(b.m - m);
    LseState out = {m, a.s * ea + b.s * eb, a.t * ea + b.t * eb};
    return out;
}

POSTRAIN_HD float logprob_grad(float x, long long j, long long target, float lse, float entropy,
                               float grad_logp, float grad_entropy, int has_entropy_grad) {
    float lp = x - lse;
    float p = expf(lp);
    float g = -p * grad_logp;
    if (j == target) g += grad_logp;
    if (has_entropy_grad && p > 0.0f) g -= p * (lp + entropy) * grad_entropy;
    return g;
}

template <typename T>
__device__ void logprob_forward_row(const T* logits, const long long* targets, float* logp,
                                    float* lse_out, float* entropy, int V, float inv_temperature) {
    __shared__ float sm[LOGPROB_BLOCK], ss[LOGPROB_BLOCK], st[LOGPROB_BLOCK];
    long long row = blockIdx.x;
    long long base = row * V;
    LseState acc = {-postrain_inf(), 0.0f, 0.0f};
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        acc = lse_push(acc, load_val(logits, base + j) * inv_temperature);
    sm[threadIdx.x] = acc.m;
    ss[threadIdx.x] = acc.s;
    st[threadIdx.x] = acc.t;
    __syncthreads();
    for (int stride = LOGPROB_BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            LseState a = {sm[threadIdx.x], ss[threadIdx.x], st[threadIdx.x]};
            LseState b = {sm[threadIdx.x + stride], ss[threadIdx.x + stride], st[threadIdx.x + stride]};
            LseState c = lse_merge(a, b);
            sm[threadIdx.x] = c.m;
            ss[threadIdx.x] = c.s;
            st[threadIdx.x] = c.t;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float lse = sm[0] + logf(ss[0]);
        lse_out[row] = lse;
        entropy[row] = lse - st[0] / ss[0];
        long long target = targets[row];
        // an out-of-range id reads nothing and yields NaN (torch's gather would raise)
        logp[row] = (target >= 0 && target < V)
                        ? load_val(logits, base + target) * inv_temperature - lse
                        : bits_to_float(0x7fc00000u);
    }
}

template <typename T>
__device__ void logprob_backward_row(const T* logits, const long long* targets, const float* lse,
                                     const float* entropy, const float* grad_logp,
                                     const float* grad_entropy, T* grad_logits, int V,
                                     float inv_temperature, int has_entropy_grad) {
    long long row = blockIdx.x;
    long long base = row * V;
    float l = lse[row], h = entropy[row], gl = grad_logp[row];
    float ge = has_entropy_grad ? grad_entropy[row] : 0.0f;
    long long target = targets[row];
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float x = load_val(logits, base + j) * inv_temperature;
        float g = logprob_grad(x, j, target, l, h, gl, ge, has_entropy_grad);
        store_val(grad_logits, base + j, g * inv_temperature);
    }
}

// grid = (rows,), block = (LOGPROB_BLOCK,). logits (rows, V) contiguous; outputs (rows,) fp32.
extern "C" __global__ void logprob_forward_f32(const float* logits, const long long* targets,
                                               float* logp, float* lse, float* entropy, int V,
                                               float inv_temperature) {
    logprob_forward_row<float>(logits, targets, logp, lse, entropy, V, inv_temperature);
}

extern "C" __global__ void logprob_forward_bf16(const unsigned short* logits,
                                                const long long* targets, float* logp, float* lse,
                                                float* entropy, int V, float inv_temperature) {
    logprob_forward_row<unsigned short>(logits, targets, logp, lse, entropy, V, inv_temperature);
}

// grad_entropy may alias grad_logp when has_entropy_grad == 0.
extern "C" __global__ void logprob_backward_f32(const float* logits, const long long* targets,
                                                const float* lse, const float* entropy,
                                                const float* grad_logp, const float* grad_entropy,
                                                float* grad_logits, int V, float inv_temperature,
                                                int has_entropy_grad) {
    logprob_backward_row<float>(logits, targets, lse, entropy, grad_logp, grad_entropy,
                                grad_logits, V, inv_temperature, has_entropy_grad);
}

extern "C" __global__ void logprob_backward_bf16(const unsigned short* logits,
                                                 const long long* targets, const float* lse,
                                                 const float* entropy, const float* grad_logp,
                                                 const float* grad_entropy,
                                                 unsigned short* grad_logits, int V,
                                                 float inv_temperature, int has_entropy_grad) {
    logprob_backward_row<unsigned short>(logits, targets, lse, entropy, grad_logp, grad_entropy,
                                         grad_logits, V, inv_temperature, has_entropy_grad);
}
