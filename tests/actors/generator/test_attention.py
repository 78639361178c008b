"""The attention-backend seam: the CPU backend equals plain causal SDPA, and the runner's paged
metadata puts every new token in a slot of its own blocks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from postrain.actors.generator.attention import GatherSdpaBackend, PagedMetadata
from postrain.actors.generator.kv_manager import new_kv_caches
from postrain.actors.generator.runner import paged_inputs
from postrain.actors.generator.scheduler import ScheduledSequence
from postrain.actors.models.llama import ModelConfig

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
CONFIG = ModelConfig(vocab_size=16, hidden_size=HEADS * DIM, intermediate_size=16, num_layers=2,
                     num_heads=HEADS, num_kv_heads=KV_HEADS, max_position_embeddings=64)


def causal_sdpa(q, k, v):
    """Reference: q (T, H, D), k, v (T, Hkv, D) of one whole sequence -> (T, H, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)


def test_gather_sdpa_equals_causal_sdpa_over_prefill_then_decode():
    """Two sequences in scattered blocks: a padded prefill of both, then two decode steps; each
    step's output for the new tokens equals causal SDPA over the whole sequence so far."""
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 3]
    total = [n + 2 for n in lengths]
    q = [torch.randn(n, HEADS, DIM, generator=gen) for n in total]
    k = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in total]
    v = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in total]
    tables = [(5, 2, 7), (3, 6, 1)]
    caches = new_kv_caches(CONFIG, 8, BLOCK, torch.float32)
    backend = GatherSdpaBackend()
    steps = [[(0, n) for n in lengths], [(n, n + 1) for n in lengths], [(n + 1, n + 2) for n in lengths]]
    for step in steps:
        rows = tuple(ScheduledSequence(b, tuple([1] * (end - start)), start, tables[b])
                     for b, (start, end) in enumerate(step))
        _, metadata = paged_inputs(rows, BLOCK)
        width = metadata.positions.shape[1]

        def pad(ts):
            return torch.stack([F.pad(t[s:e], (0, 0, 0, 0, 0, width - (e - s))) for t, (s, e) in zip(ts, step)])

        attended = backend.bind(metadata, caches)
        for layer in range(CONFIG.num_layers):
            out = attended.attend(layer, pad(q), pad(k), pad(v))        # (B, T, H, D)
            for b, (start, end) in enumerate(step):
                want = causal_sdpa(q[b][:end], k[b][:end], v[b][:end])[start:end]
                torch.testing.assert_close(out[b, :end - start], want, atol=1e-5, rtol=1e-5)


def test_paged_metadata_puts_each_new_token_in_its_own_blocks():
    rows = (ScheduledSequence(0, (1, 2, 3, 4, 5), 3, (4, 0, 9)),     # positions 3..7
            ScheduledSequence(1, (6,), 9, (2, 8, 5)))                # one decode token at position 9
    input_ids, meta = paged_inputs(rows, BLOCK)
    assert input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 0, 0, 0, 0]]
    assert meta.positions.tolist() == [[3, 4, 5, 6, 7], [9, 0, 0, 0, 0]]
    assert meta.slot_mapping.tolist() == [[4 * 4 + 3, 0, 1, 2, 3], [5 * 4 + 1, -1, -1, -1, -1]]
    assert meta.context_lens.tolist() == [8, 10] and meta.num_padding == 4
    assert meta.block_tables.tolist() == [[4, 0, 9], [2, 8, 5]]
    counted = PagedMetadata(meta.positions, meta.slot_mapping, meta.block_tables, meta.context_lens)
    assert counted.num_padding == 4
