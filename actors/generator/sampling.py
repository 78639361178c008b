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

import torch

# SamplingParams crosses between roles (the orchestrator's rollouts, the generator's requests),
# so it is defined with the other messages (torch-free) and re-exported here.
from ..records import SamplingParams, SamplingParamsError  # noqa: F401


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
    the first token whose cumulative probability exceeds u * total. The CDF is never
    materialised over the whole vocabulary: sums of fixed chunks of exp(z - max),
    accumulated in float64 across chunks, locate the chunk that holds u * total, and only
    that chunk is accumulated (float64). Every row costs four passes over its logits (max,
    subtract, exp, chunk sums) however large the vocabulary; `torch.multinomial` row by
    row is far slower.
    """
    z = logits.float().cpu()
    temps = [p.logprob_temperature for p in params]
    if any(t != 1.0 for t in temps):
        z = z / torch.tensor(temps)[:, None]                                   # (B, V)
    row_max = z.amax(-1)                                                      # (B,)
    chunk = min(_CHUNK, z.shape[1])
    weights = _shifted_exp(z, row_max, chunk)                                 # (B, chunk * num_chunks)
    chunk_sums = weights.view(z.shape[0], -1, chunk).sum(-1).double()         # (B, num_chunks)
    log_norm = row_max.double() + chunk_sums.sum(-1).log()                    # logsumexp(z), (B,)
    tokens = torch.zeros(z.shape[0], dtype=torch.long)
    greedy_rows = [row for row, p in enumerate(params) if p.temperature == 0]
    if greedy_rows:
        tokens[greedy_rows] = z[greedy_rows].argmax(-1)                       # the first argmax
    sampled_rows = [row for row, p in enumerate(params) if p.temperature != 0]
    if sampled_rows:
        truncated = [row for row in sampled_rows if params[row].top_k > 0 or params[row].top_p < 1.0]
        for row in truncated:
            weights[row, :z.shape[1]].masked_fill_(~_kept_tokens(z[row], params[row]), 0.0)
        if truncated:
            chunk_sums[truncated] = weights[truncated].view(len(truncated), -1, chunk).sum(-1).double()
        uniforms = torch.cat([torch.rand(1, generator=generators[row], dtype=torch.float64)
                              for row in sampled_rows])
        rows = torch.tensor(sampled_rows)
        drawn = _inverse_cdf(weights, chunk_sums, rows, uniforms, chunk)
        tokens[rows] = drawn.clamp_(max=z.shape[1] - 1)
    logprobs = z.gather(1, tokens[:, None]).squeeze(1).double() - log_norm
    return tokens.tolist(), logprobs.tolist()


def verify_rows(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                generators: list[torch.Generator]) -> list[tuple[list[int], list[float]]]:
    """Speculative sampling of a batch: for each sequence b, which of drafts[b] to keep and one
    token more, with their logprobs (as `sample_rows` defines them).

    logits (B, T, V), T >= 1 + len(drafts[b]): row b, column i scores the position of
    drafts[b][i] (column len(drafts[b]), the position after every draft). Temperature scaling
    and log_softmax run once over the batch; `verify_drafts` decides each sequence.
    """
    z = logits.float().cpu()
    temps = torch.tensor([p.logprob_temperature for p in params])
    if bool((temps != 1.0).any()):
        z = z / temps[:, None, None]                                         # (B, T, V)
    log_probs = torch.log_softmax(z.double(), dim=-1)                        # (B, T, V)
    return [verify_drafts(z[b, :len(d) + 1], log_probs[b, :len(d) + 1], d, p, g)
            for b, (d, p, g) in enumerate(zip(drafts, params, generators))]


def verify_drafts(z: torch.Tensor, log_probs: torch.Tensor, drafts: list[int], params: SamplingParams,
                  generator: torch.Generator) -> tuple[list[int], list[float]]:
    """One sequence's verify rule. z (k + 1, V) float32 logits over the temperature; log_probs
    its log_softmax (float64); row i scores the position of drafts[i], row k the one after.

    The drafts are point masses (q(x) = 1 for the drafted x), so the rule of speculative
    sampling, accept x with probability min(1, p(x) / q(x)) and on rejection draw from the
    residual max(0, p - q) renormalised, becomes: accept x with probability p(x); on
    rejection draw from p with x's mass removed. Each emitted token is then distributed as p,
    the distribution `sample_rows` draws from (temperature, top-k and top-p included): a
    position emits x either by acceptance (p(x)) or by a rejection of the draft d != x
    followed by x from the residual ((1 - p(d)) * p(x) / (1 - p(d))). Greedy (temperature 0)
    accepts a draft iff it is the argmax and emits the argmax at the first mismatch: the
    tokens of plain greedy decoding.
    """
    tokens: list[int] = []
    for row in range(len(drafts) + 1):
        draft = drafts[row] if row < len(drafts) else None
        if params.temperature == 0:
            best = int(z[row].argmax())                                      # the first argmax
            tokens.append(best)
            if best != draft:
                break
            continue
        probs = _target_probs(z[row], log_probs[row], params)                # (V,) float64
        if draft is not None and float(torch.rand(1, generator=generator, dtype=torch.float64)) < probs[draft]:
            tokens.append(draft)
            continue
        if draft is not None:
            probs[draft] = 0.0                                               # the residual
        tokens.append(_draw(probs, generator))
        break
    logprobs = [float(log_probs[row, token]) for row, token in enumerate(tokens)]
    return tokens, logprobs


def _target_probs(z: torch.Tensor, log_probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(V,) float64: the distribution `sample_rows` draws a sampled row from (truncation
    applied, renormalised). z (V,) float32 scaled logits; log_probs (V,) its log_softmax."""
    probs = log_probs.exp()
    if params.top_k > 0 or params.top_p < 1.0:
        probs.masked_fill_(~_kept_tokens(z, params), 0.0)
    return probs.div_(probs.sum())


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token by inverse CDF from (V,) float64 weights >= 0 (not necessarily normalised)."""
    cum = probs.cumsum(0)
    target = torch.rand(1, generator=generator, dtype=torch.float64) * cum[-1]
    token = int(torch.searchsorted(cum, target, right=True))
    while probs[min(token, probs.numel() - 1)] == 0.0 and token > 0:        # rounding at the edge
        token -= 1
    return min(token, probs.numel() - 1)


_CHUNK = 256      # tokens per chunk of the two-level inverse CDF (fewer for a smaller vocabulary)


def _shifted_exp(z: torch.Tensor, row_max: torch.Tensor, chunk: int) -> torch.Tensor:
    """exp(z - row_max) (B, V) in a buffer padded with zeros to whole chunks: (B, chunk * num_chunks)."""
    batch, vocab = z.shape
    padded = -(-vocab // chunk) * chunk
    weights = torch.empty(batch, padded, dtype=z.dtype)
    if padded > vocab:
        weights[:, vocab:] = 0.0
    body = weights[:, :vocab]
    torch.sub(z, row_max[:, None], out=body)
    body.exp_()
    return weights


def _inverse_cdf(weights: torch.Tensor, chunk_sums: torch.Tensor, rows: torch.Tensor,
                 uniforms: torch.Tensor, size: int) -> torch.Tensor:
    """For each of `rows`, the first index whose cumulative weight exceeds u * total.

    weights (B, size * num_chunks) float32 >= 0; chunk_sums (B, num_chunks) float64; rows (R,)
    long; uniforms (R,) float64 in [0, 1). Returns (R,) long token ids.
    """
    cum = chunk_sums[rows].cumsum(-1)                                         # (R, num_chunks)
    target = uniforms * cum[:, -1]                                            # (R,)
    chunk = torch.searchsorted(cum, target[:, None], right=True).squeeze(1).clamp_(max=cum.shape[1] - 1)
    before = torch.where(chunk > 0, cum.gather(1, (chunk - 1).clamp(min=0)[:, None]).squeeze(1),
                         torch.zeros_like(target))                            # mass of earlier chunks
    inside = weights.view(weights.shape[0], -1, size)[rows, chunk].double().cumsum_(-1)  # (R, size)
    # Where u * total falls inside its chunk, as a fraction of the chunk's mass, so that the
    # chunk's own cumulative sum decides (rounding between the two sums cannot push it out).
    fraction = ((target - before) / chunk_sums[rows, chunk]).clamp_(0.0, 1.0 - 2.0**-52)
    offset = torch.searchsorted(inside, (fraction * inside[:, -1])[:, None], right=True).squeeze(1)
    return chunk * size + offset.clamp_(max=size - 1)


def _kept_tokens(logprobs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(V,) bool: the top-k tokens, then of those the top-p nucleus. logprobs (V,)."""
    k = min(p.top_k, logprobs.numel()) if p.top_k > 0 else logprobs.numel()
    values, indices = torch.topk(logprobs, k)                                 # sorted, descending
    keep = torch.zeros(logprobs.numel(), dtype=torch.bool)
    if p.top_p < 1.0:
        probs = torch.softmax(values, dim=0)
        before = probs.cumsum(0) - probs           # mass strictly above each token
        indices = indices[before < p.top_p]        # keeps at least the top token
    keep[indices] = True
    return keep
