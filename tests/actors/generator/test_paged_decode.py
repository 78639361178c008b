"""The CPU default backend: decode steps attend with the compiled kernel that reads the paged
cache in place (`postrain.ext._paged_decode`); its outputs equal the gather + SDPA backend's and a
float64 reference to float32 rounding, for every option a layer passes; every other step takes
the gather; a bad table or shape is refused before any memory is read."""
from __future__ import annotations

import pytest
import torch

from postrain.actors.generator.attention import (
    GatherSdpaBackend, GatherSdpaStep, PagedDecodeBackend, PagedDecodeStep, PagedMetadata, default_backend,
)
from postrain.actors.generator.engine import Engine
from postrain.actors.generator.kv_dtype import kv_dtype_spec
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.llama import build_model
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.ext._paged_decode import paged_decode_attention

BLOCK, NUM_BLOCKS = 4, 48


def decode_step(lengths, heads, kv_heads, dim, seed=0, num_layers=1):
    """Random float32 caches, scattered block tables, and one new token per sequence at the end
    of its context: (metadata, caches, q, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(NUM_BLOCKS, BLOCK, kv_heads, dim, generator=gen),
               torch.randn(NUM_BLOCKS, BLOCK, kv_heads, dim, generator=gen)) for _ in range(num_layers)]
    width = max(-(-n // BLOCK) for n in lengths)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:len(lengths) * width].view(len(lengths), width)
    context = torch.tensor(lengths)
    positions = (context - 1)[:, None]
    slots = tables.gather(1, positions // BLOCK) * BLOCK + positions % BLOCK
    q = torch.randn(len(lengths), 1, heads, dim, generator=gen) * 3
    k = torch.randn(len(lengths), 1, kv_heads, dim, generator=gen)
    v = torch.randn(len(lengths), 1, kv_heads, dim, generator=gen)
    return PagedMetadata(positions, slots, tables, context), caches, q, k, v


def float64_attention(caches, metadata, q, *, window=None, scale=None, softcap=None):
    """Each sequence's one query over its cached keys, in float64, from the tables."""
    key_cache, value_cache = caches[0]
    batch, _, heads, dim = q.shape
    groups = heads // key_cache.shape[2]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b, end in enumerate(metadata.context_lens.tolist()):
        keys = torch.arange(max(0, end - window) if window else 0, end)
        blocks, offsets = metadata.block_tables[b, keys // BLOCK], keys % BLOCK
        k, v = key_cache[blocks, offsets].double(), value_cache[blocks, offsets].double()
        for h in range(heads):
            logits = k[:, h // groups] @ q[b, 0, h].double() * (dim ** -0.5 if scale is None else scale)
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            out[b, h] = torch.softmax(logits, 0) @ v[:, h // groups]
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 8), (6, 2, 16), (9, 3, 64)])
@pytest.mark.parametrize("options", [{}, {"window": 5}, {"scale": 0.3}, {"softcap": 2.0}])
def test_the_kernel_equals_gather_sdpa_and_float64(heads, kv_heads, dim, options):
    """Contexts of one token, a block's end, a block's start and several blocks; the step's own
    key written first (the query sees itself)."""
    lengths = [1, 4, 5, 13, 23, 9]
    metadata, caches, q, k, v = decode_step(lengths, heads, kv_heads, dim)
    ours_step = PagedDecodeBackend().bind(metadata, caches)
    assert isinstance(ours_step, PagedDecodeStep)
    ours = ours_step.attend(0, q, k, v, **options)
    want = float64_attention(caches, metadata, q, **options)
    gathered = GatherSdpaBackend().bind(metadata, caches).attend(0, q, k, v, **options)   # writes the same slots
    torch.testing.assert_close(ours.reshape(want.shape), gathered.reshape(want.shape), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ours.reshape(want.shape).double(), want, atol=2e-5, rtol=1e-5)
    assert (ours.double().reshape(want.shape) - want).abs().max() <= \
        (gathered.double().reshape(want.shape) - want).abs().max() * 4 + 1e-6


def test_each_layer_writes_its_own_cache_before_it_reads():
    metadata, caches, q, k, v = decode_step([6, 11], 4, 2, 8, num_layers=2)
    step = PagedDecodeBackend().bind(metadata, caches)
    for layer in range(2):
        out = step.attend(layer, q, k * (layer + 1), v * (layer + 1))
        slots = metadata.slot_mapping.reshape(-1)
        flat_keys = caches[layer][0].view(-1, 2, 8)
        torch.testing.assert_close(flat_keys[slots], (k * (layer + 1)).reshape(2, 2, 8))
        torch.testing.assert_close(out.reshape(2, 4, 8).double(),
                                   float64_attention(caches[layer:layer + 1], metadata, q), atol=2e-5, rtol=1e-5)


def test_steps_the_kernel_does_not_take_bind_the_gather():
    metadata, caches, *_ = decode_step([5, 9], 4, 2, 8)
    assert isinstance(PagedDecodeBackend().bind(metadata, caches), PagedDecodeStep)
    prefill = PagedMetadata(torch.tensor([[3, 4]]), torch.tensor([[3, 4]]), torch.tensor([[0, 1]]), torch.tensor([5]))
    padded = PagedMetadata(torch.tensor([[4], [0]]), torch.tensor([[4], [-1]]), torch.tensor([[0, 1], [2, 0]]),
                           torch.tensor([5, 1]))
    both_ways = PagedMetadata(metadata.positions, metadata.slot_mapping, metadata.block_tables,
                              metadata.context_lens, horizons=metadata.positions + 1)
    for other in (prefill, padded, both_ways):
        assert type(PagedDecodeBackend().bind(other, caches)) is GatherSdpaStep
    int8 = kv_dtype_spec("int8")
    int8 = [(int8.empty((NUM_BLOCKS, BLOCK, 2, 8), keys=True), int8.empty((NUM_BLOCKS, BLOCK, 2, 8)))]
    bf16 = [(cache.bfloat16(), value.bfloat16()) for cache, value in caches]
    for other_caches in (int8, bf16):
        assert type(PagedDecodeBackend().bind(metadata, other_caches)) is GatherSdpaStep
    assert isinstance(default_backend(), PagedDecodeBackend)


def test_a_layer_whose_queries_are_not_float32_takes_the_gather():
    metadata, caches, q, k, v = decode_step([5, 9], 4, 2, 8)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()          # a bfloat16 model over a float32 cache
    ours = PagedDecodeBackend().bind(metadata, caches).attend(0, q, k, v)
    theirs = GatherSdpaBackend().bind(metadata, caches).attend(0, q, k, v)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)


def test_bad_tables_and_shapes_are_refused_before_any_read():
    metadata, caches, q, *_ = decode_step([5, 9], 4, 2, 8)
    key_cache, value_cache = (c.numpy() for c in caches[0])
    q3, out = q.reshape(2, 4, 8).numpy(), torch.empty(2, 4, 8).numpy()
    tables, lens = metadata.block_tables.numpy().copy(), metadata.context_lens.numpy().copy()

    def call(tables=tables, lens=lens, q3=q3, value_cache=value_cache):
        paged_decode_attention(q3, key_cache, value_cache, tables, lens, out, 0.5)

    call()
    bad_block = tables.copy()
    bad_block[1, 2] = NUM_BLOCKS
    with pytest.raises(ValueError, match="block id 48 outside the cache's 48"):
        call(tables=bad_block)
    bad_block[1, 2] = -1
    with pytest.raises(ValueError, match="block id -1"):
        call(tables=bad_block)
    for length in (0, tables.shape[1] * BLOCK + 1):
        with pytest.raises(ValueError, match="context length"):
            call(lens=lens * 0 + length)
    with pytest.raises(ValueError, match="do not share"):
        call(q3=torch.empty(2, 3, 8).numpy())
    with pytest.raises(ValueError, match="do not agree"):
        call(value_cache=value_cache[:, :, :1].copy())
    with pytest.raises(ValueError, match="multiple of 8"):
        paged_decode_attention(torch.empty(2, 4, 4).numpy(), key_cache[..., :4].copy(), value_cache[..., :4].copy(),
                               tables, lens, torch.empty(2, 4, 4).numpy(), 0.5)


def test_an_engine_decodes_the_same_greedy_tokens_with_either_backend():
    """The default (the kernel for decode steps) against gather + SDPA on every step: the same
    greedy tokens, logprobs within float32 rounding."""
    tokenizer = byte_tokenizer()
    model = build_model("tiny").init_weights(seed=3).eval()
    prompts = [tokenizer.encode(text) for text in ("What is 12 + 30?", "print(7 * 8)", "a")]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    outputs = []
    for backend in (None, GatherSdpaBackend()):
        engine = Engine(model, tokenizer, num_blocks=64, block_size_tokens=4, attention_backend=backend)
        assert isinstance(engine.runner.backend, PagedDecodeBackend if backend is None else GatherSdpaBackend)
        outputs.append([request.outputs[0] for request in engine.generate(prompts, params)])
    for ours, theirs in zip(*outputs):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)
