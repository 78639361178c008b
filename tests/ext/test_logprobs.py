"""Chunked token logprobs: values by hand, parity with the naive path, gradients, peak memory."""
from __future__ import annotations

import math

import pytest
import torch

from postrain.ext.logprobs import naive_token_logprobs, token_logprobs, token_logprobs_from_hidden
from postrain.ext.rl_ops import RLOpsError


def test_logprob_and_entropy_by_hand():
    # softmax([0, log 3]) = (1/4, 3/4)
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    logp, entropy = token_logprobs(logits, torch.tensor([1, 0]), return_entropy=True, backend="torch")
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75), math.log(0.25)]))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy, torch.tensor([h, h]))


def test_gradient_by_hand():
    # d logp(y) / d z = onehot(y) - p; d entropy / d z = -p (log p + H)
    logits = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    logp, entropy = token_logprobs(logits, torch.tensor([1]), return_entropy=True, backend="torch")
    logp.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.25, 0.25]]))
    logits.grad = None
    _, entropy = token_logprobs(logits, torch.tensor([1]), return_entropy=True, backend="torch")
    entropy.sum().backward()
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    expected = [-p * (math.log(p) + h) for p in (0.25, 0.75)]
    torch.testing.assert_close(logits.grad, torch.tensor([expected]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_naive_values_and_gradients(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 13, 50, generator=g).requires_grad_(True)  # (B, T, V), 39 tokens, chunk 8
    targets = torch.randint(50, (3, 13), generator=g)
    logp, ent = token_logprobs(logits, targets, temperature=temperature, chunk_size_tokens=8,
                               return_entropy=True, backend="torch")
    (logp.sum() + 0.3 * ent.sum()).backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref_logp, ref_ent = naive_token_logprobs(logits, targets, temperature, return_entropy=True)
    (ref_logp.sum() + 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(logp, ref_logp, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(grad, logits.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [4, 32])           # 18 tokens: five chunks; one (its logits kept)
def test_from_hidden_matches_naive_in_both_inputs(dtype, chunk):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 16, generator=g, dtype=dtype).requires_grad_(True)
    weight = torch.randn(40, 16, generator=g, dtype=dtype).requires_grad_(True)
    targets = torch.randint(40, (2, 9), generator=g)
    logp, ent = token_logprobs_from_hidden(hidden, weight, targets, chunk_size_tokens=chunk,
                                           return_entropy=True, temperature=0.9, backend="torch")
    loss = (logp * torch.linspace(0, 1, 9, dtype=dtype)).sum().add(ent.sum())
    loss.backward(retain_graph=True)
    grads = hidden.grad.clone(), weight.grad.clone()
    loss.backward()                                   # a second backward recomputes what it freed
    torch.testing.assert_close((hidden.grad, weight.grad), (2 * grads[0], 2 * grads[1]))
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = naive_token_logprobs(hidden @ weight.t(), targets, 0.9, return_entropy=True)
    (ref_logp * torch.linspace(0, 1, 9, dtype=dtype)).sum().add(ref_ent.sum()).backward()
    torch.testing.assert_close(logp, ref_logp.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-5, rtol=1e-5)


def test_bf16_logits_stay_bf16_and_match():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(20, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(64, (20,), generator=g)
    logp = token_logprobs(logits, targets, chunk_size_tokens=6, backend="torch")
    logp.sum().backward()
    assert logp.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    ref = naive_token_logprobs(logits.detach().float(), targets)
    torch.testing.assert_close(logp, ref)


def test_masked_out_vocab_entries_do_not_poison_entropy():
    logits = torch.tensor([[0.0, float("-inf"), 0.0]], requires_grad=True)
    logp, ent = token_logprobs(logits, torch.tensor([0]), return_entropy=True, backend="torch")
    torch.testing.assert_close(ent, torch.tensor([math.log(2.0)]))
    (logp + ent).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_errors_name_the_rule():
    with pytest.raises(RLOpsError, match="targets must have shape"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, dtype=torch.long))
    with pytest.raises(RLOpsError, match="temperature > 0"):
        token_logprobs(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(RLOpsError, match="weight must be \\(V, H\\)"):
        token_logprobs_from_hidden(torch.zeros(2, 4), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long))


def test_peak_memory_of_32k_vocab_is_under_a_quarter_of_naive():
    """Forward + backward of 1024 tokens x 32768 vocab (full fp32 logits: 128 MiB) with the default
    chunks of 128 tokens (16 MiB blocks), each path in a fresh process with its peak-RSS mark reset
    just before the step (bench/rl_ops.py): the chunked path's memory follows the chunk, not N."""
    from postrain.bench.rl_ops import measure_peak_mb

    shape = dict(num_tokens=1024, vocab=32768, hidden=64, chunk_size_tokens=128)
    naive = measure_peak_mb("naive", **shape)
    chunked = measure_peak_mb("chunked", **shape)
    assert naive > 128, f"the naive path must hold at least the full logits, measured {naive:.1f} MiB"
    assert chunked < naive / 4, f"chunked {chunked:.1f} MiB vs naive {naive:.1f} MiB"


def test_from_hidden_with_no_tokens_is_empty_and_still_backpropagates():
    """A context-parallel rank whose slice holds no trained token scores none, and its backward
    still reaches the hidden states (its ring's attention backward must run)."""
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    logp, entropy = token_logprobs_from_hidden(hidden, weight, torch.zeros(0, dtype=torch.long),
                                               return_entropy=True)
    (logp.sum() + entropy.sum()).backward()
    assert logp.shape == entropy.shape == (0,)
    assert hidden.grad.shape == (0, 8) and torch.equal(weight.grad, torch.zeros(16, 8))
