"""The sampler draws from softmax(logits / T) truncated by top-k / top-p; it reports the documented
logprob."""
from __future__ import annotations

import collections

import pytest
import torch

from postrain.actors.generator.sampling import SamplingParams, sample_rows

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])


def _frequencies(params: SamplingParams, draws: int = 20000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rows = LOGITS.expand(draws, -1)
    tokens, _ = sample_rows(rows, [params] * draws, [gen] * draws)
    counts = collections.Counter(tokens)
    return torch.tensor([counts[i] / draws for i in range(LOGITS.shape[1])])


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(), torch.softmax(LOGITS[0], 0)),
    (SamplingParams(temperature=0.5), torch.softmax(LOGITS[0] / 0.5, 0)),
    (SamplingParams(top_k=2), torch.tensor([0.7311, 0.2689, 0, 0, 0])),
    (SamplingParams(top_p=0.7), torch.tensor([0.7311, 0.2689, 0, 0, 0])),   # 0.563 < 0.7 <= 0.77
])
def test_empirical_distribution(params, expected):
    torch.testing.assert_close(_frequencies(params), expected, atol=0.015, rtol=0)


def test_logprob_is_tempered_log_softmax_before_truncation():
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.7, top_k=2)
    tokens, logprobs = sample_rows(LOGITS, [params], [gen])
    expected = torch.log_softmax(LOGITS[0] / 0.7, 0)[tokens[0]]
    assert logprobs[0] == pytest.approx(float(expected), abs=1e-6)
    greedy_tokens, greedy_logprobs = sample_rows(LOGITS, [SamplingParams(temperature=0)], [gen])
    assert greedy_tokens == [0]
    assert greedy_logprobs[0] == pytest.approx(float(torch.log_softmax(LOGITS[0], 0)[0]), abs=1e-6)


def test_two_level_draw_crosses_chunks_and_padding():
    """A vocabulary that is not a whole number of chunks, with the mass on tokens at chunk edges."""
    vocab = 700                                       # 3 chunks of 256, the last one padded
    logits = torch.full((1, vocab), -30.0)
    favoured = [3, 255, 256, 699]
    logits[0, favoured] = torch.tensor([1.0, 0.0, 0.5, 1.5])
    expected = torch.softmax(logits[0], 0)[favoured]
    draws = 20000
    gen = torch.Generator().manual_seed(5)
    tokens, logprobs = sample_rows(logits.expand(draws, -1), [SamplingParams()] * draws, [gen] * draws)
    counts = collections.Counter(tokens)
    assert set(counts) <= set(favoured)
    torch.testing.assert_close(torch.tensor([counts[t] / draws for t in favoured]), expected, atol=0.015, rtol=0)
    token = tokens[0]
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], 0)[token]), abs=1e-5)


def test_greedy_sampled_and_truncated_rows_in_one_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 1000, generator=gen) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=1), SamplingParams()]
    tokens, logprobs = sample_rows(logits, params, [torch.Generator().manual_seed(i) for i in range(3)])
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(logits[1].argmax())
    for row, temperature in enumerate([1.0, 0.8, 1.0]):
        expected = torch.log_softmax(logits[row] / temperature, 0)[tokens[row]]
        assert logprobs[row] == pytest.approx(float(expected), abs=1e-5)
