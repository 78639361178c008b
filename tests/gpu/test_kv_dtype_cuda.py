"""The quantized KV caches on CUDA against the same caches on the CPU. Marked `gpu`: they skip
(with the reason) where torch sees no CUDA GPU.

Codes, scales and the key rotation live on the GPU (float8 decodes with torch's native cast
there, through a table on the CPU); greedy tokens and logprobs match the CPU engine of the
same kv_dtype up to float rounding, which one 8-bit code may amplify: the first tokens are
compared exactly, logprobs within 5e-3 while the two agree.
"""
from __future__ import annotations

import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.kv_dtype import QuantizedKVCache
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.loading import build_policy

pytestmark = pytest.mark.gpu

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "float8_e4m3"])
def test_a_quantized_cache_on_cuda_matches_the_cpu_one(kv_dtype):
    cpu_model, tokenizer = build_policy(TINY, 0, torch.float32, "cpu")
    gpu_model, _ = build_policy(TINY, 0, torch.float32, "cuda")
    gpu_model.load_state_dict(cpu_model.state_dict())
    prompts = [tokenizer.encode(t) for t in ["2+3=", "def add(a, b):", "Count: one, two,"]]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    on_cpu = Engine(cpu_model, tokenizer, num_blocks=64, kv_dtype=kv_dtype).generate(prompts, params)
    gpu_engine = Engine(gpu_model, tokenizer, num_blocks=64, kv_dtype=kv_dtype)
    key_cache = gpu_engine.kv_caches[0][0]
    assert key_cache.is_cuda
    if isinstance(key_cache, QuantizedKVCache):
        assert key_cache.scales.is_cuda and key_cache.rotation.is_cuda
    on_gpu = gpu_engine.generate(prompts, params)
    for a, b in zip(on_cpu, on_gpu):
        ours, theirs = a.outputs[0], b.outputs[0]
        assert ours.token_ids[:4] == theirs.token_ids[:4]
        same = next((i for i, (x, y) in enumerate(zip(ours.token_ids, theirs.token_ids)) if x != y),
                    len(ours.token_ids))
        assert torch.allclose(torch.tensor(ours.logprobs[:same]), torch.tensor(theirs.logprobs[:same]), atol=5e-3)
