"""The attention backend's per-layer options: a sliding window, a query scale and a logit soft cap
give, over the paged cache, what a naive softmax attention over the whole sequence gives; layers
with different windows in one step each get their own mask."""
from __future__ import annotations

import torch

from postrain.actors.generator.attention import GatherSdpaBackend
from postrain.actors.generator.kv_manager import new_kv_caches
from postrain.actors.generator.runner import paged_inputs
from postrain.actors.generator.scheduler import ScheduledSequence
from postrain.actors.models.blocks import group_mask, grouped_attention, window_mask
from postrain.actors.models.llama import ModelConfig

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
CONFIG = ModelConfig(vocab_size=16, hidden_size=HEADS * DIM, intermediate_size=16, num_layers=2,
                     num_heads=HEADS, num_kv_heads=KV_HEADS, max_position_embeddings=64)


def naive(q, k, v, window=None, scale=None, softcap=None):
    """q (T, H, D), k, v (T, Hkv, D) of one whole sequence -> (T, H, D), by the definitions."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * (scale or DIM ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(q.shape[0])
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[:, None] - pos[None, :] < window
    return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def test_paged_window_scale_and_softcap_equal_the_naive_attention_per_layer():
    gen = torch.Generator().manual_seed(0)
    n = 13                                           # prefill 9, then 4 decode steps
    q, k, v = (torch.randn(n, h, DIM, generator=gen) * 2 for h in (HEADS, KV_HEADS, KV_HEADS))
    options = [dict(window=3, scale=0.2, softcap=2.0), dict(window=None, scale=None, softcap=None)]
    caches = new_kv_caches(CONFIG, 8, BLOCK, torch.float32)
    backend = GatherSdpaBackend()
    for start, end in [(0, 9)] + [(i, i + 1) for i in range(9, n)]:
        row = ScheduledSequence(0, tuple([1] * (end - start)), start, (5, 2, 7, 0))
        _, metadata = paged_inputs((row,), BLOCK)
        step = backend.bind(metadata, caches)
        for layer, opts in enumerate(options):       # two windows in one step
            out = step.attend(layer, q[None, start:end], k[None, start:end], v[None, start:end], **opts)
            torch.testing.assert_close(out[0], naive(q[:end], k[:end], v[:end], **opts)[start:end],
                                       atol=1e-5, rtol=1e-5)


def test_training_mask_with_window_equals_the_naive_attention():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(10, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    pos = torch.arange(10)[None]
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    for window, softcap in [(4, None), (4, 1.5), (1, None)]:
        mask = group_mask(window_mask(causal, pos, pos, window), HEADS // KV_HEADS)
        out = grouped_attention(q[None], k[None], v[None], mask, softcap=softcap).reshape(10, HEADS, DIM)
        torch.testing.assert_close(out, naive(q, k, v, window=window, softcap=softcap), atol=1e-5, rtol=1e-5)


def test_rows_of_different_lengths_gather_only_their_windows_blocks():
    """Two sequences in scattered blocks, a padded prefill then decode steps: a sliding layer's
    output equals the naive windowed attention per row (rows needing fewer blocks than others,
    padding columns), and it gathers fewer blocks than the tables hold."""
    gen = torch.Generator().manual_seed(2)
    lengths, decode = [11, 3], 6
    total = [n + decode for n in lengths]
    q, k, v = ([torch.randn(n, h, DIM, generator=gen) for n in total] for h in (HEADS, KV_HEADS, KV_HEADS))
    tables = [(5, 2, 7, 9, 11), (3, 6, 1, 0, 4)]
    caches = new_kv_caches(CONFIG, 12, BLOCK, torch.float32)
    steps = [[(0, n) for n in lengths]] + [[(n + i, n + i + 1) for n in lengths] for i in range(decode)]
    for step in steps:
        rows = tuple(ScheduledSequence(b, tuple([1] * (end - start)), start, tables[b])
                     for b, (start, end) in enumerate(step))
        _, metadata = paged_inputs(rows, BLOCK)
        width = metadata.positions.shape[1]

        def pad(ts):
            return torch.stack([torch.cat([t[s:e], t.new_zeros(width - (e - s), *t.shape[1:])]) for t, (s, e) in zip(ts, step)])

        attended = GatherSdpaBackend().bind(metadata, caches)
        for layer, window in enumerate((5, None)):
            out = attended.attend(layer, pad(q), pad(k), pad(v), window=window)
            assert not out.isnan().any()
            for b, (start, end) in enumerate(step):
                want = naive(q[b][:end], k[b][:end], v[b][:end], window=window)[start:end]
                torch.testing.assert_close(out[b, :end - start], want, atol=1e-5, rtol=1e-5)
        if step[0][0] >= 12:                         # the long row's window spans 2 of its 5 blocks
            assert attended._views[5][0].numel() < attended._views[None][0].numel()
