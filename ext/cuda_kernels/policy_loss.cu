// The per-token GRPO-family policy loss in one pass, forward and backward (postrain.ext.rl_ops_loss
// is the torch reference; the formulas are in its docstring).
//
// Design: every aggregation mode is loss = sum_{b,t} W_b * m_bt * l_bt with W_b a function of
// the mask only. So the forward kernel (one block per sequence row) computes l_bt and its
// derivative dl_bt/dlogp_bt per token, and block-reduces per-row partial sums (ROW_STATS in
// rl_ops_loss.py, same order as the slots below); the host turns the row sums into the loss
// with W_b. The backward kernel is then elementwise: grad_bt = g * W_b * m_bt * dl_bt.
#include "common.cuh"

#define POLICY_BLOCK 256
#define NUM_ROW_STATS 9
#define LOG_RATIO_CLAMP 20.0f
#define K3_LOG_RATIO_CLAMP 20.0f
#define KL_K1 1
#define KL_K2 2
#define KL_K3 3

struct PolicyParams {
    float clip_low, clip_high;
    float dual_clip;            // <= 0: off
    float behavior_cap;         // <= 0: no cap
    float kl_coef;
    int has_behavior, has_ref, kl_kind;
};

struct TokenOut {
    float loss, dloss, pg, kl, ratio, weight;
    int clip_low, clip_high, clip_dual;
};

// KL estimate and its derivative in logp, x = ref - logp.
POSTRAIN_HD void kl_term(float logp, float ref, int kind, float* kl, float* dkl) {
    float x = ref - logp;
    if (kind == KL_K1) {
        *kl = -x;
        *dkl = 1.0f;
    } else if (kind == KL_K2) {
        *kl = 0.5f * x * x;
        *dkl = -x;
    } else {
        float xc = postrain_clampf(x, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP);
        float e = expf(xc);
        *kl = e - xc - 1.0f;
        *dkl = (x >= -K3_LOG_RATIO_CLAMP && x <= K3_LOG_RATIO_CLAMP) ? -(e - 1.0f) : 0.0f;
    }
}

// Gradients follow torch's rules at ties (maximum/minimum split the gradient in halves,
// clamp passes it on the closed interval) so the kernel equals the reference's autograd.
POSTRAIN_HD TokenOut policy_token(float logp, float old_logp, float behavior_logp, float ref_logp,
                                  float adv, PolicyParams p) {
    TokenOut o;
    float lr = logp - old_logp;
    float dlr = (lr >= -LOG_RATIO_CLAMP && lr <= LOG_RATIO_CLAMP) ? 1.0f : 0.0f;
    float r = expf(postrain_clampf(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP));
    float lo = 1.0f - p.clip_low, hi = 1.0f + p.clip_high;
    float pg1 = -adv * r;
    float pg2 = -adv * postrain_clampf(r, lo, hi);
    int in_range = (r >= lo && r <= hi);
    float pg, dpg_dr;  // dpg_dr: derivative of pg in the ratio
    if (pg1 > pg2) {
        pg = pg1;
        dpg_dr = -adv;
    } else if (pg1 < pg2) {
        pg = pg2;
        dpg_dr = in_range ? -adv : 0.0f;
    } else {
        pg = pg1;
        dpg_dr = 0.5f * -adv + (in_range ? 0.5f * -adv : 0.0f);
    }
    o.clip_dual = 0;
    if (p.dual_clip > 0.0f && adv < 0.0f) {
        float pg3 = -adv * p.dual_clip;
        if (pg3 < pg) {
            pg = pg3;
            dpg_dr = 0.0f;
            o.clip_dual = 1;
        } else if (pg3 == pg) {
            dpg_dr *= 0.5f;
        }
    }
    float w = 1.0f;
    if (p.has_behavior) {
        w = expf(postrain_clampf(old_logp - behavior_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP));
        if (p.behavior_cap > 0.0f) w = fminf(w, p.behavior_cap);
        pg *= w;
        dpg_dr *= w;
    }
    float kl = 0.0f, dkl = 0.0f;
    if (p.has_ref) kl_term(logp, ref_logp, p.kl_kind, &kl, &dkl);
    o.pg = pg;
    o.kl = kl;
    o.loss = pg + p.kl_coef * kl;
    o.dloss = dpg_dr * r * dlr + p.kl_coef * dkl;
    o.ratio = r;
    o.weight = w;
    o.clip_low = (adv < 0.0f && r < lo);
    o.clip_high = (adv > 0.0f && r > hi);
    return o;
}

// Slot order = ROW_STATS: loss, pg, kl, num_tokens, clip_low, clip_high, clip_dual, ratio,
// behavior_weight; every slot is a sum over the row's masked tokens.
POSTRAIN_HD void accumulate_token(float* acc, TokenOut o, float m) {
    acc[0] += o.loss * m;
    acc[1] += o.pg * m;
    acc[2] += o.kl * m;
    acc[3] += m;
    acc[4] += o.clip_low * m;
    acc[5] += o.clip_high * m;
    acc[6] += o.clip_dual * m;
    acc[7] += o.ratio * m;
    acc[8] += o.weight * m;
}

// grid = (B,), block = (POLICY_BLOCK,). behavior_logp / ref_logp may alias logp when their
// flags are 0. dloss: (B, T) derivative per token; row_stats: (B, NUM_ROW_STATS).
extern "C" __global__ void policy_loss_forward(
    const float* __restrict__ logp, const float* __restrict__ old_logp,
    const float* __restrict__ behavior_logp, const float* __restrict__ ref_logp,
    const float* __restrict__ advantages, const float* __restrict__ mask,
    float* __restrict__ dloss, float* __restrict__ row_stats, int T, float clip_low,
    float clip_high, float dual_clip, float behavior_cap, float kl_coef, int has_behavior,
    int has_ref, int kl_kind) {
    PolicyParams p = {clip_low, clip_high, dual_clip, behavior_cap, kl_coef,
                      has_behavior, has_ref, kl_kind};
    __shared__ float partial[NUM_ROW_STATS][POLICY_BLOCK];
    float acc[NUM_ROW_STATS];
    for (int k = 0; k < NUM_ROW_STATS; ++k) acc[k] = 0.0f;
    long long row = blockIdx.x;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        long long i = row * T + t;
        TokenOut o = policy_token(logp[i], old_logp[i], has_behavior ? behavior_logp[i] : 0.0f,
                                  has_ref ? ref_logp[i] : 0.0f, advantages[i], p);
        dloss[i] = o.dloss;
        accumulate_token(acc, o, mask[i]);
    }
    for (int k = 0; k < NUM_ROW_STATS; ++k) partial[k][threadIdx.x] = acc[k];
    __syncthreads();
    for (int stride = POLICY_BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            for (int k = 0; k < NUM_ROW_STATS; ++k)
                partial[k][threadIdx.x] += partial[k][threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x < NUM_ROW_STATS) row_stats[row * NUM_ROW_STATS + threadIdx.x] = partial[threadIdx.x][0];
}

// Elementwise over B*T: grad_logp = grad_out[0] * W_b * m_bt * dloss_bt.
extern "C" __global__ void policy_loss_backward(const float* __restrict__ dloss,
                                                const float* __restrict__ mask,
                                                const float* __restrict__ row_weight,
                                                const float* __restrict__ grad_out,
                                                float* __restrict__ grad_logp,
                                                long long n, int T) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    grad_logp[i] = grad_out[0] * row_weight[i / T] * mask[i] * dloss[i];
}
