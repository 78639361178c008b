// A CPU harness over the kernels' element math, for tests on machines without a GPU.
//
// It includes every kernel source and drives the same POSTRAIN_HD functions the kernels call,
// emulating each kernel's thread layout (per-thread strided accumulation, then the same tree
// reduction), so tests/ext/test_cuda_kernels.py can compare the CUDA code's arithmetic with
// the torch references on a CPU. Built there with `nvcc -shared`; not used at run time.
#include "group_advantages.cu"
#include "logprobs.cu"
#include "policy_loss.cu"

extern "C" void host_group_advantages(const float* components, const float* weights,
                                      const float* lengths, float* rewards, float* advantages,
                                      int* zero_variance, int num_components, long long n,
                                      int group_size, int mode, float eps, int has_overlong,
                                      float max_len, float buffer_len, float factor) {
    for (int g = 0; g < n / group_size; ++g)
        group_advantages_one(g, components, weights, lengths, rewards, advantages, zero_variance,
                             num_components, n, group_size, mode, eps, has_overlong, max_len,
                             buffer_len, factor);
}

extern "C" void host_policy_loss_forward(const float* logp, const float* old_logp,
                                         const float* behavior_logp, const float* ref_logp,
                                         const float* advantages, const float* mask, float* dloss,
                                         float* row_stats, int B, int T, float clip_low,
                                         float clip_high, float dual_clip, float behavior_cap,
                                         float kl_coef, int has_behavior, int has_ref,
                                         int kl_kind) {
    PolicyParams p = {clip_low, clip_high, dual_clip, behavior_cap, kl_coef,
                      has_behavior, has_ref, kl_kind};
    static float partial[NUM_ROW_STATS][POLICY_BLOCK];
    for (long long row = 0; row < B; ++row) {
        for (int tid = 0; tid < POLICY_BLOCK; ++tid) {
            float acc[NUM_ROW_STATS] = {0};
            for (int t = tid; t < T; t += POLICY_BLOCK) {
                long long i = row * T + t;
                TokenOut o = policy_token(logp[i], old_logp[i], has_behavior ? behavior_logp[i] : 0.0f,
                                          has_ref ? ref_logp[i] : 0.0f, advantages[i], p);
                dloss[i] = o.dloss;
                accumulate_token(acc, o, mask[i]);
            }
            for (int k = 0; k < NUM_ROW_STATS; ++k) partial[k][tid] = acc[k];
        }
        for (int stride = POLICY_BLOCK / 2; stride > 0; stride >>= 1)
            for (int tid = 0; tid < stride; ++tid)
                for (int k = 0; k < NUM_ROW_STATS; ++k) partial[k][tid] += partial[k][tid + stride];
        for (int k = 0; k < NUM_ROW_STATS; ++k) row_stats[row * NUM_ROW_STATS + k] = partial[k][0];
    }
}

template <typename T>
static void host_logprob_forward(const T* logits, const long long* targets, float* logp,
                                 float* lse_out, float* entropy, int rows, int V,
                                 float inv_temperature) {
    static LseState part[LOGPROB_BLOCK];
    for (long long row = 0; row < rows; ++row) {
        long long base = row * V;
        for (int tid = 0; tid < LOGPROB_BLOCK; ++tid) {
            LseState acc = {-postrain_inf(), 0.0f, 0.0f};
            for (int j = tid; j < V; j += LOGPROB_BLOCK)
                acc = lse_push(acc, load_val(logits, base + j) * inv_temperature);
            part[tid] = acc;
        }
        for (int stride = LOGPROB_BLOCK / 2; stride > 0; stride >>= 1)
            for (int tid = 0; tid < stride; ++tid) part[tid] = lse_merge(part[tid], part[tid + stride]);
        float lse = part[0].m + logf(part[0].s);
        lse_out[row] = lse;
        entropy[row] = lse - part[0].t / part[0].s;
        long long target = targets[row];
        logp[row] = (target >= 0 && target < V)
                        ? load_val(logits, base + target) * inv_temperature - lse
                        : bits_to_float(0x7fc00000u);
    }
}

template <typename T>
static void host_logprob_backward(const T* logits, const long long* targets, const float* lse,
                                  const float* entropy, const float* grad_logp,
                                  const float* grad_entropy, T* grad_logits, int rows, int V,
                                  float inv_temperature, int has_entropy_grad) {
    for (long long row = 0; row < rows; ++row) {
        float ge = has_entropy_grad ? grad_entropy[row] : 0.0f;
        for (long long j = 0; j < V; ++j) {
            float x = load_val(logits, row * V + j) * inv_temperature;
            float g = logprob_grad(x, j, targets[row], lse[row], entropy[row], grad_logp[row], ge,
                                   has_entropy_grad);
            store_val(grad_logits, row * V + j, g * inv_temperature);
        }
    }
}

extern "C" void host_logprob_forward_f32(const float* logits, const long long* targets, float* logp,
                                         float* lse, float* entropy, int rows, int V,
                                         float inv_temperature) {
    host_logprob_forward<float>(logits, targets, logp, lse, entropy, rows, V, inv_temperature);
}

extern "C" void host_logprob_forward_bf16(const unsigned short* logits, const long long* targets,
                                          float* logp, float* lse, float* entropy, int rows, int V,
                                          float inv_temperature) {
    host_logprob_forward<unsigned short>(logits, targets, logp, lse, entropy, rows, V,
                                         inv_temperature);
}

extern "C" void host_logprob_backward_f32(const float* logits, const long long* targets,
                                          const float* lse, const float* entropy,
                                          const float* grad_logp, const float* grad_entropy,
                                          float* grad_logits, int rows, int V,
                                          float inv_temperature, int has_entropy_grad) {
    host_logprob_backward<float>(logits, targets, lse, entropy, grad_logp, grad_entropy,
                                 grad_logits, rows, V, inv_temperature, has_entropy_grad);
}

extern "C" void host_logprob_backward_bf16(const unsigned short* logits, const long long* targets,
                                           const float* lse, const float* entropy,
                                           const float* grad_logp, const float* grad_entropy,
                                           unsigned short* grad_logits, int rows, int V,
                                           float inv_temperature, int has_entropy_grad) {
    host_logprob_backward<unsigned short>(logits, targets, lse, entropy, grad_logp, grad_entropy,
                                          grad_logits, rows, V, inv_temperature, has_entropy_grad);
}
