"""The KV manager: cache tensors that always hold what the allocator's tables say."""
from __future__ import annotations

import torch

from postrain.actors.generator.kv_manager import KVManager
from postrain.actors.models.llama import ModelConfig, build_model

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_layers=3, num_heads=2,
                     num_kv_heads=1, max_position_embeddings=64)


def make_kv(num_blocks=8, caching=True, dtype=torch.float32) -> KVManager:
    model = build_model(CONFIG).to(dtype)
    return KVManager.for_model(model, block_size_tokens=4, num_blocks=num_blocks,
                               enable_prefix_caching=caching)


def test_one_cache_pair_per_layer_in_the_models_dtype():
    kv = make_kv(dtype=torch.bfloat16)
    assert len(kv.kv_caches) == CONFIG.num_layers
    for key_cache, value_cache in kv.kv_caches:
        assert key_cache.shape == value_cache.shape == (8, 4, CONFIG.num_kv_heads, CONFIG.head_dim)
        assert key_cache.dtype == torch.bfloat16
    sized = KVManager.for_model(build_model(CONFIG), block_size_tokens=4, kv_cache_mb=1)
    bytes_per_block = 2 * CONFIG.num_layers * 4 * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    assert sized.num_blocks == 2**20 // bytes_per_block


def test_forks_share_blocks_and_copy_on_write_copies_every_layer():
    kv = make_kv(caching=False)
    assert kv.allocate(0, [1, 2, 3, 4, 5, 6]) == 0              # 1 full block + a partial one
    kv.fork(0, 1)
    assert kv.block_table(1) == kv.block_table(0) and kv.num_free_blocks == 6
    partial = kv.block_table(0)[1]
    for layer, (key_cache, value_cache) in enumerate(kv.kv_caches):
        key_cache[partial].fill_(layer + 1.0)
        value_cache[partial].fill_(-(layer + 1.0))
    kv.append(1, [7])                                            # the child writes into the shared block
    copy = kv.block_table(1)[1]
    assert copy != partial and kv.block_table(1)[0] == kv.block_table(0)[0]
    for layer, (key_cache, value_cache) in enumerate(kv.kv_caches):
        assert torch.equal(key_cache[copy], key_cache[partial])
        assert torch.equal(value_cache[copy], value_cache[partial])
    kv.free(0)
    kv.free(1)
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_cache_hits_and_reset():
    kv = make_kv()
    prompt = list(range(1, 10))                                  # 2 full blocks + 1 token
    assert kv.allocate(0, prompt) == 0
    kv.free(0)
    assert kv.allocate(1, prompt) == 8                           # the full blocks come back cached
    kv.free(1)
    kv.reset_prefix_cache()
    assert kv.allocate(2, prompt) == 0


def test_utilization_counts_a_shared_block_once():
    kv = make_kv(caching=False)
    kv.allocate(0, [1, 2, 3, 4, 5, 6])
    kv.fork(0, 1)
    assert kv.utilization([0, 1]) == 6 / 8
    assert kv.utilization([]) == 0.0
