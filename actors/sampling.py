"""Sampling parameters and the per-row sampler of the generator engine.

The logprob the engine reports for a sampled token y is

    logprob(y) = log_softmax(logits / T)[y],   T = temperature if temperature > 0 else 1,

computed in float32 from the model's raw logits, BEFORE top-k / top-p truncation.
That is exactly what the learner computes when it rescores the token
(`postrain.ext.token_logprobs(logits, targets, temperature=T)`), so the gap
between the two measures train-inference mismatch and nothing else. With the RL
defaults (temperature 1, top_p 1, top_k 0) it is also exactly the distribution
the token was drawn from. With truncation on, the drawn-from distribution is the
truncated renormalised one; a learner that wants that behaviour distribution must
apply the same truncation (the usual RL recipe keeps truncation off).

Each sequence owns a `torch.Generator`; with `seed` set, its samples depend only
on (seed, sample index, logits), not on what else shares the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SamplingParamsError(ValueError):
    """A sampling parameter outside its range."""


@dataclass
class SamplingParams:
    """How to sample one request. Applies per request; n samples share the prompt."""

    n: int = 1                                   # samples per prompt (GRPO group size)
    temperature: float = 1.0                     # 0 = greedy (argmax)
    top_p: float = 1.0                           # nucleus mass kept, in (0, 1]; 1 = off
    top_k: int = 0                               # keep the k most likely tokens; 0 = off
    seed: int | None = None                      # per-request seed; sample i uses seed + i
    max_new_tokens: int = 64                     # generated tokens at most, per sample
    stop: list[str] = field(default_factory=list)             # stop strings (text is cut before them)
    stop_token_ids: list[int] = field(default_factory=list)   # extra stop ids (kept in token_ids)
    ignore_eos: bool = False                     # True = do not stop on the tokenizer's EOS ids

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            (self.n >= 1, "n", self.n, ">= 1"),
            (self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 = off)"),
            (self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise SamplingParamsError(f"{name} must be {rule}, got {value!r}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty, got ''")

    @property
    def logprob_temperature(self) -> float:
        """The T of the reported logprobs: the sampling temperature, 1 for greedy."""
        return self.temperature if self.temperature > 0 else 1.0


def make_generator(seed: int | None, sample_index: int, fallback: torch.Generator) -> torch.Generator:
    """The sequence's private RNG: seeded from (seed, sample_index), or drawn from `fallback`."""
    if seed is None:
        seed_value = int(torch.randint(0, 2**62, (1,), generator=fallback))
    else:
        seed_value = (seed * 1_000_003 + sample_index) % (2**63)
    return torch.Generator().manual_seed(seed_value)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """Sample one token per row of logits (B, V); return (token ids, logprobs as documented above).

    Drawing is by inverse CDF: one uniform u per row from the row's own generator, then
    the first token whose cumulative probability (float64) exceeds u * total. All rows
    share one vectorised exp and cumsum (`torch.multinomial` row by row is far slower
    on a 50k vocabulary).
    """
    z = logits.float().cpu()
    temps = torch.tensor([p.logprob_temperature for p in params])
    z = z / temps[:, None]                                                    # (B, V)
    log_norm = torch.logsumexp(z, dim=-1)                                     # (B,)
    greedy = [p.temperature == 0 for p in params]
    tokens = z.argmax(-1)
    sampled_rows = [row for row, g in enumerate(greedy) if not g]
    if sampled_rows:
        scores = z[sampled_rows]
        for i, row in enumerate(sampled_rows):
            if params[row].top_k > 0 or params[row].top_p < 1.0:
                _truncate_(scores[i], params[row])
        cdf = torch.exp(scores - scores.max(-1, keepdim=True).values).double().cumsum_(-1)
        uniforms = torch.cat([torch.rand(1, generator=generators[row], dtype=torch.float64)
                              for row in sampled_rows])
        drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
        tokens[sampled_rows] = drawn.clamp_(max=z.shape[1] - 1)
    logprobs = z.gather(1, tokens[:, None]).squeeze(1) - log_norm
    return tokens.tolist(), logprobs.tolist()


def _truncate_(logprobs: torch.Tensor, p: SamplingParams) -> None:
    """In place: -inf outside the top-k, then outside the top-p nucleus. logprobs (V,)."""
    k = min(p.top_k, logprobs.numel()) if p.top_k > 0 else logprobs.numel()
    values, indices = torch.topk(logprobs, k)                                 # sorted, descending
    keep = torch.zeros(logprobs.numel(), dtype=torch.bool)
    if p.top_p < 1.0:
        probs = torch.softmax(values, dim=0)
        before = probs.cumsum(0) - probs           # mass strictly above each token
        indices = indices[before < p.top_p]        # keeps at least the top token
    keep[indices] = True
    logprobs.masked_fill_(~keep, float("-inf"))
