"""The one-row matrix-vector kernel (ext/_matvec.pyx) and `OneRowMatvec`, the generator's
projections of one-token steps: their results against float64 and torch's `linear`, what they
hand back to torch, and an engine's batch-1 decode with and without them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.blocks import OneRowMatvec
from postrain.actors.models.exact import ExactLinear
from postrain.actors.models.llama import build_model
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.ext._matvec import matvec_at


def float64_error_bound(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A float32 sum of n products is within ~n * eps * sum |w x| of the exact sum."""
    n = weight.shape[1]
    return 2 * n * torch.finfo(torch.float32).eps * (weight.double().abs() @ x.double().abs())


@pytest.mark.parametrize("n_out, n_in", [(1, 1), (3, 5), (4, 16), (7, 17), (5, 24), (1001, 583), (49, 1536)])
def test_the_kernel_is_within_float32_rounding_of_float64_for_every_row_and_column_tail(n_out, n_in):
    generator = torch.Generator().manual_seed(n_out * 1000 + n_in)
    linear = nn.Linear(n_in, n_out, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n_out, n_in, generator=generator))
    weight, x = linear.weight.detach(), torch.randn(n_in, generator=generator)
    with torch.inference_mode():
        out = OneRowMatvec().project(linear, x[None])[0]
    exact = weight.double() @ x.double()
    assert bool(((out.double() - exact).abs() <= float64_error_bound(weight, x)).all())
    torch_error = (torch.nn.functional.linear(x, weight).double() - exact).abs().max()
    assert float((out.double() - exact).abs().max()) <= max(4 * float(torch_error), 1e-6)


def test_negative_sizes_are_refused_and_an_empty_row_gives_zeros():
    out = torch.full((4,), 7.0)
    with pytest.raises(ValueError, match="sizes must be >= 0, got n_out=-1, n_in=8"):
        matvec_at(0, 0, out.data_ptr(), -1, 8)
    assert (out == 7.0).all()
    matvec_at(0, 0, out.data_ptr(), 4, 0)
    assert (out == 0.0).all()


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_goes_through_the_kernel_with_its_bias_and_keeps_its_shape(bias):
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=bias)
    x = torch.randn(1, 1, 40)
    with torch.inference_mode():
        out = OneRowMatvec().project(linear, x)
        expected = linear(x)
    assert out.shape == (1, 1, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    kernel_only = torch.empty(24)
    matvec_at(linear.weight.data_ptr(), x.data_ptr(), kernel_only.data_ptr(), 24, 40)
    if bias:
        kernel_only += linear.bias.detach()
    assert torch.equal(out.reshape(-1), kernel_only)                  # the kernel's bits, not torch's
    strided = torch.randn(1, 80)[:, ::2]                              # one row, not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(OneRowMatvec().project(linear, strided), linear(strided), atol=1e-5, rtol=0)


def test_every_other_projection_is_the_modules_own_call_bit_for_bit():
    """More than one row, bfloat16, a non-contiguous weight and a subclass of Linear (the exact
    engine's `ExactLinear`) are module(x) exactly."""
    torch.manual_seed(1)
    path = OneRowMatvec()
    linear = nn.Linear(32, 16)
    cases = [(linear, torch.randn(2, 32)), (linear, torch.randn(1, 3, 32))]
    half = nn.Linear(32, 16).to(torch.bfloat16)
    cases.append((half, torch.randn(1, 32, dtype=torch.bfloat16)))
    strided = nn.Linear(32, 16)
    strided.weight = nn.Parameter(torch.randn(32, 16).T)                # (16, 32), not contiguous
    cases.append((strided, torch.randn(1, 32)))
    exact = nn.Linear(32, 16)
    exact.__class__ = ExactLinear
    cases.append((exact, torch.randn(1, 32)))
    with torch.inference_mode():
        for module, x in cases:
            assert torch.equal(path.project(module, x), module(x))


def test_an_engine_on_the_cpu_decodes_one_sequence_with_the_kernel_and_the_same_greedy_tokens():
    """The default CPU engine's batch-1 decode steps go through the kernel; without it (an exact
    engine's path, or float16 copies) nothing changes: the same greedy tokens, logprobs within
    float32 rounding of the model's own forward."""
    tokenizer = byte_tokenizer()
    model = build_model("tiny").init_weights(seed=5).eval()
    engine = Engine(model, tokenizer, num_blocks=64, block_size_tokens=4)
    assert isinstance(engine._projection, OneRowMatvec)
    assert not isinstance(Engine(model, tokenizer, num_blocks=8, weight_precision="float16")._projection,
                          OneRowMatvec)
    calls = []
    real = OneRowMatvec.project

    def counting(self, module, x):
        calls.append(x.numel() == module.in_features)
        return real(self, module, x)

    prompt = tokenizer.encode("What is 12 + 30?")
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    OneRowMatvec.project = counting                              # type: ignore[method-assign]
    try:
        ours = engine.generate([prompt], params)[0].outputs[0]
    finally:
        OneRowMatvec.project = real                              # type: ignore[method-assign]
    assert sum(calls) > 0 and not all(calls)                     # decode steps took it; the prefill did not
    with torch.no_grad():
        ids = torch.tensor([prompt + ours.token_ids])
        logp = torch.log_softmax(model(ids)[0, len(prompt) - 1:-1], -1)
    assert ours.token_ids == logp.argmax(-1).tolist()
    expected = logp.gather(1, torch.tensor(ours.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(ours.logprobs), expected, atol=1e-4, rtol=0)
