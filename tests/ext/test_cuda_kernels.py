"""The CUDA kernels: every source compiles with nvcc; their arithmetic equals the torch references.

Three layers, each skipped only where its tool is missing:
- nvcc compiles the exact source CuPy hands to NVRTC, for every file in ext/cuda_kernels/;
- a host harness (cuda_kernels/host_harness.cu, built here with nvcc) runs the kernels' own
  element math and reductions on the CPU, emulating their thread layout, against the references;
- on a GPU with CuPy, the public ops with backend="cupy" against backend="torch".
"""
from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import pytest
import torch

from postrain.ext import cupy_ops
from postrain.ext.advantages import OverlongPenalty, compute_advantages, compute_advantages_reference
from postrain.ext.logprobs import _chunk_grad, _chunk_stats, token_logprobs, token_logprobs_from_hidden
from postrain.ext.rl_ops_loss import (ROW_STATS, PolicyLossConfig, per_token_loss, policy_loss,
                                      row_stats_reference)

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and cupy_ops.cupy_available()),
                               reason="needs a CUDA GPU and cupy")
SOURCES = sorted(p.stem for p in cupy_ops.KERNEL_DIR.glob("*.cu"))


def test_every_kernel_file_is_found():
    assert {"group_advantages", "policy_loss", "logprobs", "host_harness"} <= set(SOURCES)


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_nvcc_compiles_the_source_cupy_compiles(name, tmp_path):
    src = tmp_path / f"{name}.cu"
    src.write_text(cupy_ops.kernel_source(name))
    out = subprocess.run([NVCC, "-c", "-o", str(tmp_path / "out.o"), "-I", str(cupy_ops.KERNEL_DIR),
                          str(src)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------ host harness

@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not installed")
    lib = tmp_path_factory.mktemp("harness") / "libharness.so"
    out = subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", "-o", str(lib), "-I",
                          str(cupy_ops.KERNEL_DIR), str(cupy_ops.KERNEL_DIR / "host_harness.cu")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    h = ctypes.CDLL(str(lib))
    P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    h.host_group_advantages.argtypes = [P] * 6 + [I, L, I, I, F, I, F, F, F]
    h.host_policy_loss_forward.argtypes = [P] * 8 + [I, I, F, F, F, F, F, I, I, I]
    for suffix in ("f32", "bf16"):
        getattr(h, f"host_logprob_forward_{suffix}").argtypes = [P] * 5 + [I, I, F]
        getattr(h, f"host_logprob_backward_{suffix}").argtypes = [P] * 7 + [I, I, F, I]
    return h


def ptr(t: torch.Tensor):
    assert t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("with_overlong", [False, True])
def test_harness_group_advantages_equal_reference(harness, mode, with_overlong):
    g = torch.Generator().manual_seed(0)
    group_size, n = 4, 24
    comps = {"a": torch.randint(0, 2, (n,), generator=g).float(), "b": torch.rand(n, generator=g)}
    comps["a"][:4] = 1.0
    comps["b"][:4] = 0.5  # group 0 has zero variance
    weights = {"a": 1.0, "b": 0.3}
    lengths = torch.randint(0, 130, (n,), generator=g).float()
    lengths[:4] = 100.0
    pen = OverlongPenalty(120, 30, 0.5) if with_overlong else None
    ref = compute_advantages_reference(comps, weights, group_size, mode=mode, response_lengths=lengths,
                                       overlong=pen)
    stacked = torch.stack([comps["a"], comps["b"]]).contiguous()
    w = torch.tensor([1.0, 0.3])
    rewards, adv = torch.empty(n), torch.empty(n)
    zero_var = torch.empty(n // group_size, dtype=torch.int32)
    harness.host_group_advantages(ptr(stacked), ptr(w), ptr(lengths), ptr(rewards), ptr(adv), ptr(zero_var),
                                  2, n, group_size, {"grpo": 0, "dr_grpo": 1, "rloo": 2}[mode], 1e-6,
                                  int(with_overlong), 120.0, 30.0, 0.5)
    torch.testing.assert_close(rewards, ref.rewards)
    torch.testing.assert_close(adv, ref.advantages, atol=1e-5, rtol=1e-5)
    assert int(zero_var.sum()) == ref.num_zero_variance_groups >= 1


def _policy_inputs(b=5, t=300):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + torch.randn(b, t, generator=g) * 0.6
    logp[0, :6] = old[0, :6] + torch.tensor([1.5, 0.5, 0.5, 4.0, 2.0, 1.1]).log()  # the hand cases
    logp[0, 6] = old[0, 6]  # ratio exactly 1: pg1 == pg2 (a tie)
    adv = torch.randn(b, t, generator=g)
    adv[0, :6] = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 2.0])
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    mask[-1] = 0.0
    behavior = old + torch.randn(b, t, generator=g) * 0.5
    ref = logp.detach() + torch.randn(b, t, generator=g) * 0.3
    return logp, old, adv, mask, behavior, ref


@pytest.mark.parametrize("config, use_behavior, use_ref", [
    (PolicyLossConfig(), False, False),
    (PolicyLossConfig(dual_clip=None, clip_high=0.2), False, False),
    (PolicyLossConfig(behavior_weight_cap=1.3), True, False),
    (PolicyLossConfig(kl_coef=0.1, kl_kind="k1"), False, True),
    (PolicyLossConfig(kl_coef=0.05, kl_kind="k2"), True, True),
    (PolicyLossConfig(kl_coef=0.2, kl_kind="k3", agg_mode="seq-mean-token-mean"), True, True),
])
def test_harness_policy_loss_equals_reference_values_and_gradients(harness, config, use_behavior, use_ref):
    logp, old, adv, mask, behavior, ref = _policy_inputs()
    beh, rf = (behavior if use_behavior else None), (ref if use_ref else None)
    lp = logp.clone().requires_grad_(True)
    loss_tok, pieces = per_token_loss(lp, old, adv, config, behavior_logp=beh, ref_logp=rf)
    loss_tok.sum().backward()  # tokens are independent: this is dl_bt / dlogp_bt
    want_stats = row_stats_reference(loss_tok, pieces, mask)
    b, t = logp.shape
    dloss, stats = torch.empty(b, t), torch.empty(b, len(ROW_STATS))
    harness.host_policy_loss_forward(
        ptr(logp), ptr(old), ptr(behavior), ptr(ref), ptr(adv), ptr(mask), ptr(dloss), ptr(stats), b, t,
        config.clip_low, config.clip_high, config.dual_clip or 0.0, config.behavior_weight_cap or 0.0,
        config.kl_coef, int(use_behavior), int(use_ref), {"k1": 1, "k2": 2, "k3": 3}[config.kl_kind])
    torch.testing.assert_close(dloss, lp.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats, want_stats, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_harness_logprob_gather_equals_reference(harness, dtype, temperature):
    g = torch.Generator().manual_seed(5)
    rows, vocab = 7, 1000
    z = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    z[1, 10:20] = float("-inf")
    targets = torch.randint(vocab, (rows,), generator=g)
    targets[1] = 3
    want = _chunk_stats(z, targets, temperature, "torch")
    got = [torch.empty(rows) for _ in range(3)]
    suffix = "bf16" if dtype == torch.bfloat16 else "f32"
    raw = z.view(torch.int16) if dtype == torch.bfloat16 else z
    getattr(harness, f"host_logprob_forward_{suffix}")(ptr(raw), ptr(targets), *map(ptr, got), rows, vocab,
                                                       1.0 / temperature)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    gl, ge = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    zs = z.float() / temperature
    want_grad = _chunk_grad(zs, targets, want[1], want[2], gl, ge) / temperature
    grad = torch.empty_like(z)
    graw = grad.view(torch.int16) if dtype == torch.bfloat16 else grad
    getattr(harness, f"host_logprob_backward_{suffix}")(ptr(raw), ptr(targets), ptr(want[1]), ptr(want[2]),
                                                        ptr(gl), ptr(ge), ptr(graw), rows, vocab,
                                                        1.0 / temperature, 1)
    if dtype == torch.bfloat16:  # the kernel rounds to nearest even, as torch's cast does
        torch.testing.assert_close(grad, want_grad.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-4)
    assert math.isfinite(float(grad.float().abs().sum()))


# ------------------------------------------------------------------ GPU parity

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_gpu_compute_advantages_matches_torch(mode):
    g = torch.Generator().manual_seed(0)
    comps = {"a": torch.randint(0, 2, (64,), generator=g).float().cuda(),
             "b": torch.rand(64, generator=g).cuda()}
    lengths = torch.randint(0, 130, (64,), generator=g).cuda()
    pen = OverlongPenalty(120, 30)
    kw = dict(mode=mode, response_lengths=lengths, overlong=pen)
    ours = compute_advantages(comps, {"b": 0.3}, 8, backend="cupy", **kw)
    ref = compute_advantages(comps, {"b": 0.3}, 8, backend="torch", **kw)
    torch.testing.assert_close(ours.advantages, ref.advantages, atol=1e-5, rtol=1e-5)
    assert ours.num_zero_variance_groups == ref.num_zero_variance_groups
    assert torch.equal(ours.keep_samples, ref.keep_samples)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
def test_gpu_policy_loss_matches_torch(agg_mode):
    logp, old, adv, mask, behavior, ref = (x.cuda() for x in _policy_inputs())
    cfg = PolicyLossConfig(agg_mode=agg_mode, kl_coef=0.1, behavior_weight_cap=2.0)
    results = {}
    for backend in ("cupy", "torch"):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(lp, old, adv, mask, cfg, behavior_logp=behavior, ref_logp=ref,
                                    backend=backend)
        loss.backward()
        results[backend] = (loss.detach(), lp.grad, metrics)
    torch.testing.assert_close(results["cupy"][0], results["torch"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["cupy"][1], results["torch"][1], atol=1e-6, rtol=1e-5)
    for key, value in results["torch"][2].items():
        assert results["cupy"][2][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_logprobs_match_torch(dtype):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(300, 64, generator=g).to("cuda", dtype).requires_grad_(True)
    weight = (torch.randn(5000, 64, generator=g) * 0.1).to("cuda", dtype).requires_grad_(True)
    targets = torch.randint(5000, (300,), generator=g).cuda()
    out = {}
    for backend in ("cupy", "torch"):
        logp, ent = token_logprobs_from_hidden(hidden, weight, targets, chunk_size_tokens=128,
                                               temperature=0.8, return_entropy=True, backend=backend)
        (logp.sum() + 0.1 * ent.sum()).backward()
        out[backend] = (logp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float())
        hidden.grad = weight.grad = None
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for a, b in zip(out["cupy"], out["torch"]):
        torch.testing.assert_close(a, b, **tol)
    logits = (hidden.detach() @ weight.detach().t()).requires_grad_(True)
    lp_c = token_logprobs(logits, targets, backend="cupy")
    lp_t = token_logprobs(logits, targets, backend="torch")
    torch.testing.assert_close(lp_c, lp_t, **tol)
