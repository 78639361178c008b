"""The RL step's time estimate (actors/configs/step_time.py): its FLOPs against the real model's
weights, the GPU figures' arithmetic, and the CPU measurement on one-layer copies of real models."""
import dataclasses

import pytest
import torch

from postrain.actors.configs.step_time import (
    GPUS, MFU_TRAIN, CpuRates, StepEstimate, StepShape, cpu_estimate, forward_flops, gpu_estimate, measure_cpu,
    step_flops,
)
from postrain.actors.models import model_class
from postrain.actors.models.config import BUILTIN_CONFIGS, ModelConfig

TINY = BUILTIN_CONFIGS["tiny"]
MOE = ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, qk_norm=True, architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32)
QWEN3_8B = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                       num_kv_heads=8, head_dim=128, qk_norm=True, architecture="qwen3")


@pytest.mark.parametrize("config", [TINY, MOE], ids=["llama", "qwen3_moe"])
def test_a_tokens_forward_is_two_flops_per_weight_it_multiplies(config):
    """The linear weights of the real model (a MoE token: its top-k experts and the router), without attention."""
    model = model_class(config.architecture)(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(p.numel() for name, p in model.named_parameters() if "experts" in name)
    active = linear + experts * config.num_experts_per_tok // max(1, config.num_experts)
    assert forward_flops(config, 0) == pytest.approx(2 * active, rel=0.01)
    attention = 4 * config.num_layers * config.num_heads * config.head_dim       # a FLOP per query dim and key
    assert forward_flops(config, 100) - forward_flops(config, 0) == 100 * attention


def test_a_step_reads_each_prompt_once_decodes_the_samples_and_trains_on_both():
    shape = StepShape(num_prompts=2, num_samples=8, sequence_tokens=100, sampled_tokens=20, extra_forwards=1)
    prompt, decode, train = step_flops(TINY, shape)
    assert prompt == 2 * 80 * forward_flops(TINY, 40)
    assert decode == 8 * 20 * forward_flops(TINY, 90)
    assert train == 4 * (2 * 80 + 8 * 20) * forward_flops(TINY, 50)     # forward, backward, a proximal forward
    lora = step_flops(TINY, dataclasses.replace(shape, lora=True, extra_forwards=0))[2]
    assert lora == 2 * (2 * 80 + 8 * 20) * forward_flops(TINY, 50)
    unshared = step_flops(TINY, dataclasses.replace(shape, shared_prefix=False))[2]
    assert unshared == 4 * 8 * 100 * forward_flops(TINY, 50)


def test_overlapped_generation_and_training_take_the_longer_of_the_two():
    assert StepEstimate("x", 2.0, 3.0, overlapped=False).step_s == 5.0
    assert StepEstimate("x", 2.0, 3.0, overlapped=True).step_s == 3.0
    assert StepEstimate("x", 0.0004, 150.0, True).describe() == (
        "x: ~2.5 min a step (the longer of generate under 1 ms, train ~2.5 min)")


def test_a_gpu_trains_at_a_share_of_its_peak_and_decodes_at_its_memory_bandwidth():
    shape = StepShape(num_prompts=8, num_samples=64, sequence_tokens=1024, sampled_tokens=512)
    h100 = gpu_estimate(QWEN3_8B, shape, GPUS["H100 SXM"], "H100 SXM")
    prompt, decode, train = step_flops(QWEN3_8B, shape)
    assert h100.train_s == pytest.approx(train / (989e12 * MFU_TRAIN))
    weights_s = 2 * (QWEN3_8B.num_layer_params() + 2 * QWEN3_8B.vocab_size * QWEN3_8B.hidden_size) / (3.35e12 * 0.7)
    assert h100.generate_s > 512 * weights_s                      # each decode step reads the weights at least
    a100 = gpu_estimate(QWEN3_8B, shape, GPUS["A100 80GB SXM"])
    assert a100.step_s > h100.step_s and "an estimate" in h100.describe()


@pytest.mark.parametrize("config", [TINY, MOE, ModelConfig(
    vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    architecture="gemma3_text", sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=16, tie_word_embeddings=True)], ids=["llama", "qwen3_moe", "gemma3_text"])
def test_this_cpu_is_measured_on_a_one_layer_copy_of_the_model(config):
    shape = StepShape(num_prompts=2, num_samples=8, sequence_tokens=64, sampled_tokens=16)
    rates = measure_cpu(config, shape, num_threads=1)
    assert rates.num_threads == 1 and rates.train_flops > 1e7 and rates.decode_flops > 1e6
    estimate = cpu_estimate(config, shape, rates)
    assert estimate.where == "this CPU (1 thread, measured)" and 0 < estimate.step_s < 60
    prompt, decode, train = step_flops(config, shape)
    assert estimate.train_s == pytest.approx(train / rates.train_flops)
    assert cpu_estimate(config, shape, CpuRates(2 * rates.train_flops, 2 * rates.decode_flops, 1)).step_s == \
        pytest.approx(estimate.step_s / 2)
