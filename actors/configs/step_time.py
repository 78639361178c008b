"""The time of one RL step, estimated: measured for this CPU, computed for a GPU from its peak figures.

    shape = StepShape(num_prompts=8, num_samples=64, sequence_tokens=256, sampled_tokens=16)
    rates = measure_cpu(config, shape, num_threads=1)      # a one-layer copy of the model, timed here
    cpu_estimate(config, shape, rates).describe()          # "this CPU (1 thread, measured): ~12 s a step ..."
    gpu_estimate(config, shape, GPUS["H100 SXM"]).describe()

Design note. A step is generation then training, and each is counted in FLOPs from the model's
shape (config.json): a token's forward is 2 FLOPs per parameter it multiplies (the decoder
layers' active parameters and the LM head) plus its attention over the context; a trained token
costs 3 forwards (forward and backward; 2 under LoRA, whose frozen base needs no weight
gradients) and one more for each extra forward (the decoupled objective's proximal policy, a KL
reference). Generation reads each prompt once and decodes `sampled_tokens` engine steps, each
one token of every sample; training reads each prompt once too (the learner's shared prefix)
and every sample's sampled tokens. The shape is the run's caps (every rollout single-turn, at
`max_total_tokens` with `max_new_tokens` sampled), so the figure is an upper bound: a task whose
prompts and answers are shorter takes less, in proportion to its tokens.

On this CPU the FLOPs go at the rate measured on a one-layer copy of the model (its own
architecture and widths, random weights, the learner's thread count): a forward and backward
over one sequence for training and prompts, a forward of one token per sample for a decode
step, so each phase's per-op overhead at its batch is in the figure; the engine's scheduling,
the messages and weight syncs are not. On a GPU (bfloat16) training and prompts go at MFU_TRAIN of the peak
and a decode step takes the longer of its FLOPs at that rate and reading the weights and the KV
cache at BANDWIDTH_SHARE of the memory bandwidth: an estimate from the data sheet, never run.
With max_staleness >= 1 generation and training overlap and a step takes the longer of the two.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from ..models.config import ModelConfig

MFU_TRAIN = 0.4          # share of a GPU's peak FLOP/s that training and prompt reading reach
BANDWIDTH_SHARE = 0.7    # share of a GPU's memory bandwidth that a decode step's reads reach
GPU_BYTES_PER_PARAM = 2  # bfloat16 weights and KV cache on a GPU
MEASURE_FLOPS = 8e9      # FLOPs of one timed CPU pass, about (0.1-0.5 s on a core); 32 to 128 tokens


@dataclass(frozen=True)
class StepShape:
    """What one RL step computes, from the run's options (caps: an upper bound)."""

    num_prompts: int             # prompts per step
    num_samples: int             # samples per step (prompts x group size)
    sequence_tokens: int         # tokens of one rollout at most (the environment's max_total_tokens)
    sampled_tokens: int          # tokens one sample decodes (max_new_tokens); the rest is its prompt
    lora: bool = False           # training computes no weight gradients of the base
    shared_prefix: bool = True   # training reads a prompt once for its samples (the learner's shared_prefix)
    extra_forwards: int = 0      # forwards beyond the trained one (decoupled proximal, KL reference)
    overlapped: bool = False     # max_staleness >= 1: the next step generates while this one trains

    @property
    def prompt_tokens(self) -> int:
        return max(0, self.sequence_tokens - self.sampled_tokens)

    @property
    def train_tokens(self) -> int:
        """Tokens a train step computes: each prompt once (shared prefix) or once per sample."""
        if not self.shared_prefix:
            return self.num_samples * self.sequence_tokens
        return self.num_prompts * self.prompt_tokens + self.num_samples * self.sampled_tokens


@dataclass(frozen=True)
class Gpu:
    """A GPU's data-sheet figures (dense bfloat16)."""

    peak_flops: float             # FLOP/s
    memory_bytes_per_s: float     # memory bandwidth


GPUS = {"H100 SXM": Gpu(989e12, 3.35e12), "A100 80GB SXM": Gpu(312e12, 2.04e12)}


@dataclass(frozen=True)
class CpuRates:
    """FLOP/s this CPU reached on a one-layer copy of the model (measure_cpu)."""

    train_flops: float            # forward and backward over a micro-batch
    decode_flops: float           # forward of one token per sample
    num_threads: int


@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one RL step's generation and training, and where."""

    where: str
    generate_s: float
    train_s: float
    overlapped: bool

    @property
    def step_s(self) -> float:
        return max(self.generate_s, self.train_s) if self.overlapped else self.generate_s + self.train_s

    def describe(self) -> str:
        how = "the longer of" if self.overlapped else "sum of"
        return (f"{self.where}: {_about(self.step_s)} a step ({how} generate {_about(self.generate_s)}, "
                f"train {_about(self.train_s)})")


def forward_flops(config: ModelConfig, context_tokens: float) -> float:
    """FLOPs of one token's forward: 2 per active parameter it multiplies (decoder layers, LM
    head) and 4 per query dimension and layer for each token of `context_tokens` it attends to."""
    matmul = config.num_layer_params(active=True) + config.vocab_size * config.hidden_size
    return 2.0 * matmul + 4.0 * config.num_layers * config.num_heads * config.head_dim * context_tokens


def step_flops(config: ModelConfig, shape: StepShape) -> tuple[float, float, float]:
    """(prompt FLOPs, decode FLOPs, train FLOPs) of one step (module docstring)."""
    length = shape.sequence_tokens
    prompt = shape.num_prompts * shape.prompt_tokens * forward_flops(config, shape.prompt_tokens / 2)
    decode = shape.num_samples * shape.sampled_tokens * forward_flops(config, length - shape.sampled_tokens / 2)
    passes = (2 if shape.lora else 3) + shape.extra_forwards
    train = passes * shape.train_tokens * forward_flops(config, length / 2)
    return prompt, decode, train


def cpu_estimate(config: ModelConfig, shape: StepShape, rates: CpuRates) -> StepEstimate:
    """The step at this CPU's measured rates."""
    prompt, decode, train = step_flops(config, shape)
    return StepEstimate(f"this CPU ({rates.num_threads} thread{'s' * (rates.num_threads > 1)}, measured)",
                        prompt / rates.train_flops + decode / rates.decode_flops, train / rates.train_flops,
                        shape.overlapped)


def gpu_estimate(config: ModelConfig, shape: StepShape, gpu: Gpu, name: str = "a GPU") -> StepEstimate:
    """The step on `gpu` from its peak figures (module docstring): an estimate, never measured."""
    prompt, decode, train = step_flops(config, shape)
    compute = gpu.peak_flops * MFU_TRAIN
    weights = (config.num_layer_params() + 2 * config.vocab_size * config.hidden_size) * GPU_BYTES_PER_PARAM
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * GPU_BYTES_PER_PARAM
    read = weights + shape.num_samples * shape.sequence_tokens / 2 * kv_per_token
    decode_step = max(decode / max(1, shape.sampled_tokens) / compute,
                      read / (gpu.memory_bytes_per_s * BANDWIDTH_SHARE))
    return StepEstimate(f"{name} (from its peak figures: an estimate, a floor)",
                        prompt / compute + shape.sampled_tokens * decode_step, train / compute, shape.overlapped)


def measure_cpu(config: ModelConfig, shape: StepShape, num_threads: int) -> CpuRates:
    """Time a one-layer copy of the model (random weights, float32) on `num_threads` threads: a
    forward and backward over 32 to 128 tokens of one sequence (fewer for wider layers), and a
    forward of one token for each of the step's samples (64 at most); each the best of 3 after a
    warm-up. Under a second for models up to about 1B parameters."""
    import torch

    from ..models import model_class

    layer = dataclasses.replace(config, num_layers=1, vocab_size=min(config.vocab_size, 256),
                                layer_types=config.layer_types[:1] if config.layer_types else None,
                                mlp_only_layers=())
    budget = int(MEASURE_FLOPS / (3 * forward_flops(layer, 64)))
    train_tokens = max(1, min(shape.sequence_tokens, 128, max(32, budget)))
    decode_batch = max(1, min(shape.num_samples, 64))
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        model = model_class(layer.architecture)(layer).init_weights(0)
        ids = torch.randint(0, layer.vocab_size, (1, train_tokens))
        train_s = _best_s(lambda: model(ids).float().sum().backward())
        decode_ids = torch.randint(0, layer.vocab_size, (decode_batch, 1))
        with torch.no_grad():
            decode_s = _best_s(lambda: model(decode_ids))
    finally:
        torch.set_num_threads(previous)
    return CpuRates(3 * train_tokens * forward_flops(layer, train_tokens / 2) / train_s,
                    decode_batch * forward_flops(layer, 1) / decode_s, num_threads)


def _best_s(run, repeats: int = 3) -> float:
    """The shortest of `repeats` timed calls of `run`, after one untimed."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return max(min(times), 1e-9)


def _about(value: float) -> str:
    """under 1 ms, ~41 ms, ~2.3 s, ~12 s, ~4.2 min, ~1.5 h."""
    if value >= 5400:
        return f"~{value / 3600:.1f} h"
    if value >= 90:
        return f"~{value / 60:.1f} min"
    if value >= 1:
        return f"~{value:.2g} s" if value < 10 else f"~{value:.0f} s"
    return f"~{value * 1000:.0f} ms" if value >= 1e-3 else "under 1 ms"
