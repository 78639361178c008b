"""Sizing derived from the model: what `postrain up` fills in where a run config leaves it unset
(or writes "auto"), and the time of one RL step.

    sizing = size_run(config)          # a loaded UpConfig: its unset fields are filled in, in place
    print("\\n".join(sizing.lines()))   # one line per sized actor: the value and what it came from

The rules, one function each (tests/actors/configs/test_sizing.py tests each), read the model's
config.json (parameters, layers, KV heads, head_dim), the run's options and this machine:

    kv_cache_mb (generator)      KV bytes a token (2 x layers x KV heads x head_dim x kv_dtype's bytes)
                                 x max_num_seqs x the longest rollout (the environments' max_total_tokens,
                                 else the model's context); at most a quarter of this machine's memory
                                 (on a GPU: 90% of its memory less the weights); at least 16 MiB
    memory_mb (generator)        BASE_MB + its float32 weights (x 1.5 with float16 copies) + its KV
                                 cache when on the CPU
    kv_cache_mb, memory_mb (scorer)
                                 the generator's rules, from the scorer's own model (a teacher, a judge,
                                 a reward model may differ from the policy) and the longest rollout (the
                                 environments' max_total_tokens, else the scorer model's context); a
                                 reward model (serves = "reward") has no KV cache: BASE_MB + its weights
    memory_mb (learner)          BASE_MB + the model state: weights, gradients and AdamW's two moments,
                                 4 copies of a parameter in the learner's dtype (16 bytes in float32);
                                 under LoRA the frozen base once and 16 bytes an adapter parameter; one
                                 more copy of the weights for a KL reference; / ranks under FSDP
                                 + activations: micro_batch_size x the longest rollout x layers x
                                 4 x (8 x (hidden + query width) + 6 x intermediate) bytes (one layer's
                                 and every layer's input under activation checkpointing). On a GPU:
                                 BASE_MB + the float32 weights (they pass through host memory)
    start_timeout_s (generator, learner, scorer: they load the weights)
                                 60 + 30 per GiB of the model's float32 weights
    heartbeat_timeout_s (head)   3 x the RL step estimated on this CPU, within [30, 600] s (the loop
                                 of an actor starved of the GIL by a long step is not hung)

Memory is rounded up to 64 MiB, start timeouts to the nearest 10 s, heartbeat timeouts up to
10 s. BASE_MB is a Python process with torch and the actor runtime. The figures are placement
accounting and limits of silence, so they err large: the activation rule was fitted on
forward-backward passes of Llama- and Qwen3-shaped layers here (25-190 KB a token and layer,
within 15%). A field the config sets is kept as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from postrain.core.actor import import_actor_class
from postrain.core.options import validate_options
from postrain.core.scheduler import Inventory

from ..env.actor import EnvironmentOptions
from ..generator.actor import GeneratorOptions
from ..generator.kv_dtype import kv_dtype_spec
from ..learner.actor import LearnerOptions
from ..learner.config import LearnerConfig
from ..learner.lora import LoraConfig, lora_config
from ..models.config import ModelConfig
from ..models.spec import model_config
from ..orchestrator.options import OrchestratorOptions
from ..scorer.actor import ScorerOptions
from .run_config import UpConfig
from .step_time import GPUS, CpuRates, StepEstimate, StepShape, cpu_estimate, gpu_estimate, measure_cpu

MIB = 1 << 20
BASE_MB = 512                 # an actor process: Python, torch, the runtime (250-350 MiB measured here)
MIN_KV_CACHE_MB = 16
START_TIMEOUT_S = 60.0        # and START_S_PER_GIB per GiB of float32 weights
START_S_PER_GIB = 30.0
MIN_HEARTBEAT_TIMEOUT_S = 30.0
MAX_HEARTBEAT_TIMEOUT_S = 600.0   # a hang is found within 10 minutes, however long a step is
HEARTBEAT_STEPS = 3           # heartbeat_timeout_s covers this many estimated steps


@dataclass(frozen=True)
class Derived:
    """One field's value and where it came from ("set" where the config gives it)."""

    name: str
    value: float
    basis: str

    def describe(self) -> str:
        return f"{self.name} {self.value:g} ({self.basis})"


@dataclass
class RunSizing:
    """What `size_run` derived, per actor and for the head, and the step's estimates."""

    model: str
    actors: dict[str, list[Derived]] = field(default_factory=dict)
    head: list[Derived] = field(default_factory=list)
    estimates: list[StepEstimate] = field(default_factory=list)

    def lines(self) -> list[str]:
        """One line per sized actor, one for the head, one per estimate."""
        lines = [f"{name}: " + ", ".join(d.describe() for d in fields) for name, fields in self.actors.items()]
        lines += ["head: " + ", ".join(d.describe() for d in self.head)] if self.head else []
        return lines + [f"RL step at the caps: {estimate.describe()}" for estimate in self.estimates]


# ----------------------------------------------------------------------------- the rules

def kv_cache_mb(config: ModelConfig, kv_dtype: str, num_seqs: int, sequence_tokens: int,
                budget_mb: float) -> Derived:
    """The generator's KV cache: every sequence of its batch at the longest rollout, within budget."""
    per_token = kv_dtype_spec(kv_dtype).bytes_per_token(config)
    wanted = per_token * num_seqs * sequence_tokens / MIB
    value = max(MIN_KV_CACHE_MB, math.ceil(min(wanted, budget_mb)))
    cut = f", cut to {budget_mb:.0f} MiB of memory" if wanted > budget_mb else ""
    return Derived("kv_cache_mb", value, f"{per_token / 1024:.3g} KiB a token x {num_seqs} sequences x "
                   f"{sequence_tokens} tokens{cut}")


def generator_memory_mb(weights_mb: float, kv_mb_on_host: float, float16_copies: bool) -> Derived:
    """Host memory of a generator: the process, its weights (and their float16 copies), a CPU KV cache."""
    weights = weights_mb * (1.5 if float16_copies else 1.0)
    kv = f" + KV {kv_mb_on_host:.0f} MiB" if kv_mb_on_host else ""
    return Derived("memory_mb", _round_mb(BASE_MB + weights + kv_mb_on_host),
                   f"{BASE_MB} + weights {weights:.0f} MiB{kv}")


def learner_memory_mb(config: ModelConfig, learner: LearnerConfig, sequence_tokens: int, world_size: int,
                      on_gpu: bool) -> Derived:
    """Host memory of one learner rank: the process, the model state and the activations."""
    params = config.num_params
    if on_gpu:
        return Derived("memory_mb", _round_mb(BASE_MB + 4 * params / MIB), f"{BASE_MB} + float32 weights "
                       f"{4 * params / MIB:.0f} MiB on their way to the GPU")
    dtype_bytes = 2 if learner.dtype in ("bfloat16", "float16") else 4
    lora = lora_config(learner.lora)
    state: float = dtype_bytes * params + 16 * lora_params(config, lora) if lora else 4 * dtype_bytes * params
    state += dtype_bytes * params if learner.reference_model is not None else 0
    state /= world_size if learner.strategy == "fsdp" else 1
    h, q = config.hidden_size, config.num_heads * config.head_dim
    per_layer = 4 * (8 * (h + q) + 6 * config.intermediate_size)
    tokens = learner.micro_batch_size * sequence_tokens
    if learner.activation_checkpointing:
        activations = tokens * (per_layer + config.num_layers * 4 * h)
    else:
        activations = tokens * config.num_layers * per_layer
    return Derived("memory_mb", _round_mb(BASE_MB + (state + activations) / MIB),
                   f"{BASE_MB} + model state {state / MIB:.0f} MiB + activations {activations / MIB:.0f} MiB "
                   f"({learner.micro_batch_size} x {sequence_tokens} tokens)")


def lora_params(config: ModelConfig, lora: LoraConfig) -> int:
    """Adapter parameters of `lora` on every layer's targeted projections."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    per_layer = sum(lora.rank * sum(shapes[t]) for t in lora.targets if t in shapes)
    return config.num_layers * per_layer


def start_timeout_s(weights_gib: float) -> Derived:
    """Silence allowed before READY for an actor that reads the model: more for a larger one."""
    value = max(START_TIMEOUT_S, round(START_TIMEOUT_S + START_S_PER_GIB * weights_gib, -1))
    return Derived("start_timeout_s", value, f"{START_TIMEOUT_S:g} + {START_S_PER_GIB:g} s/GiB x "
                   f"{weights_gib:.2f} GiB of weights")


def heartbeat_timeout_s(step_s: float, heartbeat_interval_s: float) -> Derived:
    """Silence after which an actor is hung: a few of the steps estimated on this CPU."""
    wanted = min(MAX_HEARTBEAT_TIMEOUT_S, HEARTBEAT_STEPS * step_s)
    value = _round_up(max(MIN_HEARTBEAT_TIMEOUT_S, wanted, 3 * heartbeat_interval_s), 10)
    step = f"{step_s:.2g}" if step_s < 10 else f"{step_s:.0f}"
    return Derived("heartbeat_timeout_s", value, f"{HEARTBEAT_STEPS} x {step} s a step on this CPU, within "
                   f"[{MIN_HEARTBEAT_TIMEOUT_S:g}, {MAX_HEARTBEAT_TIMEOUT_S:g}]")


# ----------------------------------------------------------------------------- the run

def size_run(config: UpConfig, machine: Inventory | None = None, measure=measure_cpu) -> RunSizing | None:
    """Fill in, in place, the fields of `config` that it leaves unset and a rule derives; what was
    derived and the step's estimates. None for a run without a generator or learner (no model to
    size from). `measure(model_config, shape, num_threads) -> CpuRates` times this CPU."""
    options = {spec.name: validate_options(import_actor_class(spec.cls), spec.options) for spec in config.actors}
    holders = [o for o in options.values() if isinstance(o, (GeneratorOptions, LearnerOptions))]
    if not holders:
        return None
    machine = machine or Inventory.detect()
    model = model_config(holders[0].model)
    rollout_tokens = max([o.max_total_tokens for o in options.values() if isinstance(o, EnvironmentOptions)],
                         default=None)
    sequence_tokens = rollout_tokens or model.max_position_embeddings
    sizing = RunSizing(model=holders[0].model if isinstance(holders[0].model, str) else "ModelConfig fields")
    weights_mb = 4 * model.num_params / MIB
    for spec in config.actors:
        if isinstance(scorer := options[spec.name], ScorerOptions):   # its own model, not the policy's
            own = model_config(scorer.model)
            derived = _size_actor(spec, scorer, own, rollout_tokens or own.max_position_embeddings,
                                  4 * own.num_params / MIB, machine)
        else:
            derived = _size_actor(spec, options[spec.name], model, sequence_tokens, weights_mb, machine)
        if derived:
            sizing.actors[spec.name] = derived
    sizing.estimates = _estimates(config, options, model, sequence_tokens, measure)
    if sizing.estimates:
        sizing.head = [_head_timeout(config, sizing.estimates[0].step_s)]
    return sizing


def _size_actor(spec, options, model: ModelConfig, sequence_tokens: int, weights_mb: float,
                machine: Inventory) -> list[Derived]:
    """The sized fields of one actor, unset ones derived and filled in."""
    derived = []
    if isinstance(options, (GeneratorOptions, ScorerOptions)):   # a model on the generator's engine
        on_gpu = spec.gpus > 0 or options.device.startswith("cuda")
        kv_on_host = 0.0
        if not (isinstance(options, ScorerOptions) and options.serves == "reward"):   # a reward model: no cache
            if "kv_cache_mb" in options.model_fields_set:
                kv = Derived("kv_cache_mb", options.kv_cache_mb, "set")
            else:
                budget = (0.9 * machine.gpus[0].memory_mb - weights_mb if on_gpu and machine.gpus
                          else machine.memory_mb / 4)
                kv = kv_cache_mb(model, options.kv_dtype, options.max_num_seqs, sequence_tokens, budget)
                spec.options = {**spec.options, "kv_cache_mb": kv.value}
            derived.append(kv)
            kv_on_host = 0 if on_gpu else kv.value
        float16 = isinstance(options, GeneratorOptions) and options.weight_precision == "float16"
        derived.append(_fill(spec, generator_memory_mb(weights_mb, kv_on_host, float16)))
    elif isinstance(options, LearnerOptions):
        learner = LearnerConfig.from_dict({**options.learner, "model": options.model})
        on_gpu = spec.gpus > 0 or learner.device.startswith("cuda")
        world_size = spec.rendezvous.world_size if spec.rendezvous is not None else 1
        derived.append(_fill(spec, learner_memory_mb(model, learner, sequence_tokens, world_size, on_gpu)))
    if derived:   # it loads the model's weights
        derived.append(_fill(spec, start_timeout_s(weights_mb / 1024)))
    return derived


def _fill(spec, derived: Derived) -> Derived:
    """Set `derived` on the spec where the config left its field unset; else what the config says."""
    if derived.name in spec.model_fields_set:
        return Derived(derived.name, getattr(spec, derived.name), "set")
    setattr(spec, derived.name, type(getattr(spec, derived.name))(derived.value))
    return derived


def _head_timeout(config: UpConfig, step_s: float) -> Derived:
    """The head's heartbeat_timeout_s, derived unless set."""
    head = config.head
    if "heartbeat_timeout_s" in head.model_fields_set:
        return Derived("heartbeat_timeout_s", head.heartbeat_timeout_s, "set")
    derived = heartbeat_timeout_s(step_s, head.heartbeat_interval_s)
    head.heartbeat_timeout_s = derived.value
    return derived


def _estimates(config: UpConfig, options: dict, model: ModelConfig, sequence_tokens: int,
               measure) -> list[StepEstimate]:
    """The RL step on this CPU (measured, at the learner's threads) and on each GPU of GPUS; none
    without an orchestrator and a learner."""
    learners = [(spec, o) for spec in config.actors if isinstance(o := options[spec.name], LearnerOptions)]
    drivers = [o for o in options.values() if isinstance(o, OrchestratorOptions)]
    if not learners or not drivers:
        return []
    (spec, learner_options), driver = learners[0], drivers[0]
    learner = LearnerConfig.from_dict({**learner_options.learner, "model": learner_options.model})
    shape = StepShape(num_prompts=driver.prompts_per_step,
                      num_samples=driver.prompts_per_step * driver.samples_per_prompt,
                      sequence_tokens=sequence_tokens,
                      sampled_tokens=min(driver.sampling.max_new_tokens, sequence_tokens),
                      lora=learner.lora is not None, shared_prefix=learner.shared_prefix,
                      extra_forwards=((learner.objective == "decoupled") + (learner.reference_model is not None)
                                      + (learner.teacher_model is not None)),
                      overlapped=driver.max_staleness > 0)
    rates: CpuRates = measure(model, shape, max(1, math.floor(spec.cpus)))
    gpus = [gpu_estimate(model, shape, gpu, name) for name, gpu in GPUS.items()]
    return [cpu_estimate(model, shape, rates), *gpus]


def _round_mb(value: float) -> int:
    return int(_round_up(value, 64))


def _round_up(value: float, unit: float) -> float:
    return float(math.ceil(value / unit) * unit)
