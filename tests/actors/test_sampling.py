"""The sampler draws from softmax(logits / T) truncated by top-k / top-p; it reports the documented
logprob."""
from __future__ import annotations

import collections

import pytest
import torch

from postrain.actors.sampling import SamplingParams, sample_rows

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
