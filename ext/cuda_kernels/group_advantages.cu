// Reward shaping + group-relative advantages in one kernel (postrain.ext.advantages is the
// torch reference; the formulas are in its docstring).
//
// One thread per group: groups are small (2..64 samples) and contiguous, so a thread reads
// its group's K reward components, shapes them, and writes rewards, advantages and a
// zero-variance flag. Two passes over the group (mean, then squared deviations) keep the
// variance exact where a one-pass formula would cancel.
#include "common.cuh"

#define ADV_MODE_GRPO 0
#define ADV_MODE_DR_GRPO 1
#define ADV_MODE_RLOO 2

POSTRAIN_HD float overlong_penalty(float length, float max_len, float buffer_len, float factor) {
    float soft_start = max_len - buffer_len;
    if (length <= soft_start) return 0.0f;
    if (length > max_len) return -factor;
    return (soft_start - length) / buffer_len * factor;
}

POSTRAIN_HD float shaped_reward(const float* components, const float* weights, const float* lengths,
                                long long i, int num_components, long long n, int has_overlong,
                                float max_len, float buffer_len, float factor) {
    float r = 0.0f;
    for (int k = 0; k < num_components; ++k) r += weights[k] * components[(long long)k * n + i];
    if (has_overlong) r += overlong_penalty(lengths[i], max_len, buffer_len, factor);
    return r;
}

// rewards/advantages (n,), zero_variance (n / group_size,) int32. lengths may alias any array
// when has_overlong == 0.
POSTRAIN_HD void group_advantages_one(int g, const float* components, const float* weights,
                                      const float* lengths, float* rewards, float* advantages,
                                      int* zero_variance, int num_components, long long n,
                                      int group_size, int mode, float eps, int has_overlong,
                                      float max_len, float buffer_len, float factor) {
    long long base = (long long)g * group_size;
    float sum = 0.0f, lo = postrain_inf(), hi = -postrain_inf();
    for (int j = 0; j < group_size; ++j) {
        float r = shaped_reward(components, weights, lengths, base + j, num_components, n,
                                has_overlong, max_len, buffer_len, factor);
        rewards[base + j] = r;
        sum += r;
        lo = fminf(lo, r);
        hi = fmaxf(hi, r);
    }
    float mean = sum / group_size;
    float sq = 0.0f;
    for (int j = 0; j < group_size; ++j) {
        float d = rewards[base + j] - mean;
        sq += d * d;
    }
    float std_unbiased = sqrtf(sq / (group_size - 1));
    for (int j = 0; j < group_size; ++j) {
        // equal rewards: exactly 0, not the mean's rounding error over std + eps
        float centred = (lo == hi) ? 0.0f : rewards[base + j] - mean;
        float a = centred;
        if (mode == ADV_MODE_GRPO) a = centred / (std_unbiased + eps);
        else if (mode == ADV_MODE_RLOO) a = centred * ((float)group_size / (float)(group_size - 1));
        advantages[base + j] = a;
    }
    zero_variance[g] = (lo == hi) ? 1 : 0;
}

extern "C" __global__ void group_advantages(const float* __restrict__ components,
                                            const float* __restrict__ weights,
                                            const float* __restrict__ lengths,
                                            float* __restrict__ rewards,
                                            float* __restrict__ advantages,
                                            int* __restrict__ zero_variance, int num_components,
                                            long long n, int group_size, int mode, float eps,
                                            int has_overlong, float max_len, float buffer_len,
                                            float factor) {
    int g = blockIdx.x * blockDim.x + threadIdx.x;
    if ((long long)g >= n / group_size) return;
    group_advantages_one(g, components, weights, lengths, rewards, advantages, zero_variance,
                         num_components, n, group_size, mode, eps, has_overlong, max_len,
                         buffer_len, factor);
}
