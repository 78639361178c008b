"""CuPy fused kernels for the RL ops, on torch CUDA tensors shared zero-copy through DLPack.

Callers do not import this module: they call `compute_advantages`, `policy_loss` and
`token_logprobs` / `token_logprobs_from_hidden`, which dispatch here for CUDA tensors where
CuPy imports (backend="auto"), and run the torch reference otherwise. backend="cupy" forces
this path and raises `RLOpsError` where it cannot run; backend="torch" forces the reference.

The CUDA sources live in `cuda_kernels/*.cu` (one kernel family per file, `extern "C"`
names, element math in host+device functions). They are compiled here with NVRTC through
`cupy.RawModule` on first use (cached per process), after inlining `common.cuh`. Kernels run
on torch's current CUDA stream, so they order correctly with the surrounding torch ops.
Outputs are allocated by torch (its caching allocator) and handed to CuPy as views.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from .rl_ops_errors import RLOpsError

KERNEL_DIR = Path(__file__).resolve().parent / "cuda_kernels"
BACKENDS = ("auto", "torch", "cupy")
_KL_KIND_IDS = {"k1": 1, "k2": 2, "k3": 3}
_ADV_MODE_IDS = {"grpo": 0, "dr_grpo": 1, "rloo": 2}
_POLICY_BLOCK = 256
_LOGPROB_BLOCK = 256
_ELEMENTWISE_BLOCK = 256


@functools.lru_cache(maxsize=1)
def cupy_module():
    """The `cupy` module, or None where it does not import (no CuPy, no CUDA driver)."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    return cupy


def cupy_available() -> bool:
    return cupy_module() is not None


def use_cupy(backend: str, device: torch.device) -> bool:
    """The dispatch rule: True where this module should run the op for tensors on `device`."""
    if backend not in BACKENDS:
        raise RLOpsError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    can = device.type == "cuda" and cupy_available()
    if backend == "cupy" and not can:
        raise RLOpsError(f"backend='cupy' needs CUDA tensors and an importable cupy, got device="
                         f"{device} and cupy {'present' if cupy_available() else 'missing'}; "
                         "install the 'gpu' extra or use backend='auto'")
    return can


def kernel_source(name: str) -> str:
    """The NVRTC-ready source of cuda_kernels/NAME.cu, with common.cuh inlined."""
    common = (KERNEL_DIR / "common.cuh").read_text().replace("#pragma once", "")
    return (KERNEL_DIR / f"{name}.cu").read_text().replace('#include "common.cuh"', common)


@functools.lru_cache(maxsize=None)
def _module(name: str, device_index: int):
    cupy = cupy_module()
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=kernel_source(name), options=("--std=c++14",))


def _kernel(name: str, function: str, device: torch.device):
    return _module(name, device.index if device.index is not None else torch.cuda.current_device()
                   ).get_function(function)


def _cp(t: torch.Tensor):
    """A CuPy view of a contiguous torch CUDA tensor (bf16 travels as its raw 16 bits)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cupy_module().from_dlpack(t.detach())


def _launch(kernel, device: torch.device, grid: int, block: int, args: tuple) -> None:
    cupy = cupy_module()
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        kernel((max(grid, 1),), (block,), args)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


# ---------------------------------------------------------------- advantages


def group_advantages_fused(stacked, w, group_size: int, num_groups: int, *, mode: str, eps: float,
                           response_lengths=None, overlong=None):
    """The kernel of `advantages.compute_advantages` (one thread per group), on inputs that
    module has checked: stacked (K, N) reward components and w (K,) their weights
    (`advantages._stack_components`), N = num_groups * group_size; response_lengths (N,) where
    `overlong` (an OverlongPenalty) is given. Returns (rewards (N,), advantages (N,),
    zero_var (num_groups,) int32: 1 for a group whose rewards are all equal)."""
    import numpy as np

    num_components, n = stacked.shape
    device = stacked.device
    lengths = stacked[0] if overlong is None else _f32(response_lengths.to(device))
    rewards = torch.empty(n, dtype=torch.float32, device=device)
    advantages = torch.empty_like(rewards)
    zero_var = torch.empty(num_groups, dtype=torch.int32, device=device)
    max_len, buffer_len, factor = ((0.0, 1.0, 0.0) if overlong is None else
                                   (overlong.max_response_len_tokens, overlong.buffer_len_tokens,
                                    overlong.penalty_factor))
    args = (_cp(stacked.contiguous()), _cp(w), _cp(lengths), _cp(rewards), _cp(advantages),
            _cp(zero_var), np.int32(num_components), np.int64(n), np.int32(group_size),
            np.int32(_ADV_MODE_IDS[mode]), np.float32(eps), np.int32(overlong is not None),
            np.float32(max_len), np.float32(buffer_len), np.float32(factor))
    kernel = _kernel("group_advantages", "group_advantages", device)
    _launch(kernel, device, (num_groups + 127) // 128, 128, args)
    return rewards, advantages, zero_var


# ---------------------------------------------------------------- policy loss


class _FusedPolicyLoss(torch.autograd.Function):
    """logp (B, T) -> scalar loss; saves dloss/dlogp per token for the elementwise backward."""

    @staticmethod
    def forward(ctx, logp, dloss, row_stats, mask, weights):
        ctx.save_for_backward(dloss, mask, weights)
        return (row_stats[:, 0] * weights).sum()

    @staticmethod
    def backward(ctx, grad_out):
        dloss, mask, weights = ctx.saved_tensors
        grad = torch.empty_like(dloss)
        n, t = dloss.numel(), dloss.shape[1]
        kernel = _kernel("policy_loss", "policy_loss_backward", dloss.device)
        import numpy as np

        _launch(kernel, dloss.device, (n + _ELEMENTWISE_BLOCK - 1) // _ELEMENTWISE_BLOCK,
                _ELEMENTWISE_BLOCK, (_cp(dloss), _cp(mask), _cp(weights), _cp(_f32(grad_out).reshape(1)),
                                     _cp(grad), np.int64(n), np.int32(t)))
        return grad, None, None, None, None


def policy_loss_fused(logp, old_logp, adv, mask, config, weights, num_row_stats: int, *,
                      behavior_logp=None, ref_logp=None):
    """The per-token work of `rl_ops_loss.policy_loss_reference` in one fused kernel, on inputs
    that module has checked: adv (B, T) the advantages per token (`rl_ops_loss.check_inputs`),
    weights (B, T) each token's weight in the aggregate (`rl_ops_loss.row_weights`).

    Returns (scalar loss differentiable in logp, row stats (B, num_row_stats)).
    """
    import numpy as np

    b, t = logp.shape
    device = logp.device
    lp, old, m = _f32(logp), _f32(old_logp), _f32(mask)
    beh = lp if behavior_logp is None else _f32(behavior_logp)
    ref = lp if ref_logp is None else _f32(ref_logp)
    dloss = torch.empty_like(lp)
    stats = torch.empty(b, num_row_stats, dtype=torch.float32, device=device)
    args = (_cp(lp), _cp(old), _cp(beh), _cp(ref), _cp(adv), _cp(m), _cp(dloss), _cp(stats), np.int32(t),
            np.float32(config.clip_low), np.float32(config.clip_high),
            np.float32(config.dual_clip or 0.0), np.float32(config.behavior_weight_cap or 0.0),
            np.float32(config.kl_coef), np.int32(behavior_logp is not None),
            np.int32(ref_logp is not None), np.int32(_KL_KIND_IDS[config.kl_kind]))
    _launch(_kernel("policy_loss", "policy_loss_forward", device), device, b, _POLICY_BLOCK, args)
    loss = _FusedPolicyLoss.apply(logp if logp.dtype == torch.float32 else logp.float(), dloss, stats,
                                  m, weights.contiguous())
    return loss, stats


# ---------------------------------------------------------------- logprobs


def logprob_kernel_supports(z: torch.Tensor) -> bool:
    """The logprob kernels read fp32 and bf16 rows of contiguous logits."""
    return z.dtype in (torch.float32, torch.bfloat16) and z.dim() == 2


def logprob_gather(z: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(logp, logsumexp, entropy) of softmax(z / temperature) rows; z (C, V) -> three (C,) fp32."""
    import numpy as np

    z = z.contiguous()
    rows, vocab = z.shape
    out = torch.empty(3, rows, dtype=torch.float32, device=z.device)
    suffix = "bf16" if z.dtype == torch.bfloat16 else "f32"
    kernel = _kernel("logprobs", f"logprob_forward_{suffix}", z.device)
    _launch(kernel, z.device, rows, _LOGPROB_BLOCK,
            (_cp(z), _cp(targets.to(torch.int64).contiguous()), _cp(out[0]), _cp(out[1]), _cp(out[2]),
             np.int32(vocab), np.float32(1.0 / temperature)))
    return out[0], out[1], out[2]


def logprob_gather_backward(z, targets, lse, entropy, grad_logp, grad_entropy, temperature: float):
    """d loss / d z (C, V) in z's dtype, from the forward's logsumexp and entropy."""
    import numpy as np

    z = z.contiguous()
    rows, vocab = z.shape
    grad = torch.empty_like(z)
    gl = _f32(grad_logp)
    ge = gl if grad_entropy is None else _f32(grad_entropy)
    suffix = "bf16" if z.dtype == torch.bfloat16 else "f32"
    kernel = _kernel("logprobs", f"logprob_backward_{suffix}", z.device)
    _launch(kernel, z.device, rows, _LOGPROB_BLOCK,
            (_cp(z), _cp(targets.to(torch.int64).contiguous()), _cp(_f32(lse)), _cp(_f32(entropy)),
             _cp(gl), _cp(ge), _cp(grad), np.int32(vocab), np.float32(1.0 / temperature),
             np.int32(grad_entropy is not None)))
    return grad
