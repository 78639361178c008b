"""The sizing `postrain up` derives from the model (actors/configs/sizing.py): one test per rule, then
a whole run config: unset and "auto" fields filled in, set ones kept, and lines that say why."""
import pytest

from postrain.actors.configs.run_config import parse_up_config
from postrain.actors.configs.sizing import (
    BASE_MB, MIB, generator_memory_mb, heartbeat_timeout_s, kv_cache_mb, learner_memory_mb, lora_params, size_run,
    start_timeout_s,
)
from postrain.actors.configs.step_time import CpuRates
from postrain.actors.learner.config import LearnerConfig
from postrain.actors.learner.lora import lora_config
from postrain.actors.models.config import BUILTIN_CONFIGS, ModelConfig
from postrain.core.scheduler import GpuInfo, Inventory

TINY = BUILTIN_CONFIGS["tiny"]          # 4 layers, 6 KV heads of 32: 6 KiB a float32 token
QWEN3_0_6B = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                         num_kv_heads=8, head_dim=128, tie_word_embeddings=True, qk_norm=True, architecture="qwen3",
                         max_position_embeddings=40960)


def test_the_kv_cache_holds_every_sequence_at_the_longest_rollout_within_its_budget():
    derived = kv_cache_mb(TINY, "float32", num_seqs=32, sequence_tokens=1024, budget_mb=10_000)
    assert derived.value == 192 and "6 KiB a token x 32 sequences x 1024 tokens" in derived.basis
    assert kv_cache_mb(TINY, "bfloat16", 32, 1024, 10_000).value == 96          # half the bytes a token
    cut = kv_cache_mb(QWEN3_0_6B, "float32", 64, 4096, budget_mb=2000)            # 56 GiB wanted
    assert cut.value == 2000 and "cut to 2000 MiB" in cut.basis
    assert kv_cache_mb(TINY, "float32", 1, 8, 10_000).value == 16                 # the floor


def test_a_generator_holds_its_process_weights_and_a_cpu_kv_cache():
    assert generator_memory_mb(1000, 300, float16_copies=False).value == 1856    # 512 + 1300, up to 64 MiB
    assert generator_memory_mb(1000, 300, float16_copies=True).value == 2368     # + 500 of float16 copies
    assert generator_memory_mb(1000, 0, float16_copies=False).value == 1536      # the KV cache on a GPU


def test_a_learner_holds_16_bytes_a_parameter_or_the_base_and_16_an_adapter_under_lora_and_activations():
    config = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=4, max_position_embeddings=64)
    tokens = 8 * 64
    activations = tokens * config.num_layers * 4 * (8 * (256 + 256) + 6 * 512)
    full = learner_memory_mb(config, LearnerConfig(), 64, world_size=1, on_gpu=False)
    expected = BASE_MB + (16 * config.num_params + activations) / MIB
    assert full.value == pytest.approx(expected, abs=64) and full.value % 64 == 0 and full.value >= expected
    lora = LearnerConfig(lora={"rank": 8})
    adapters = lora_params(config, lora_config(lora.lora))
    assert learner_memory_mb(config, lora, 64, 1, False).value >= BASE_MB + (
        4 * config.num_params + 16 * adapters + activations) / MIB
    sharded = learner_memory_mb(config, LearnerConfig(strategy="fsdp"), 64, world_size=4, on_gpu=False)
    assert f"model state {16 * config.num_params / 4 / MIB:.0f} MiB" in sharded.basis    # 16 P / 4 ranks
    reference = learner_memory_mb(config, LearnerConfig(reference_model="initial"), 64, 1, False)
    assert f"model state {20 * config.num_params / MIB:.0f} MiB" in reference.basis     # and its copy
    checkpointed = learner_memory_mb(config, LearnerConfig(activation_checkpointing=True), 64, 1, False)
    one_layer = tokens * (4 * (8 * (256 + 256) + 6 * 512) + config.num_layers * 4 * 256)   # and every layer's input
    assert f"activations {one_layer / MIB:.0f} MiB" in checkpointed.basis and one_layer < activations
    on_gpu = learner_memory_mb(config, LearnerConfig(), 64, 1, on_gpu=True)
    assert on_gpu.value == BASE_MB + 64 and "on their way to the GPU" in on_gpu.basis


def test_lora_params_counts_the_adapters_the_learner_makes():
    from postrain.actors.learner.learner import Learner

    learner = Learner({"model": "tiny", "lora": {"rank": 4, "targets": ["q_proj", "v_proj", "down_proj"]}})
    made = sum(tensor.numel() for tensor in learner.lora.adapters().values())
    assert lora_params(TINY, lora_config({"rank": 4, "targets": ["q_proj", "v_proj", "down_proj"]})) == made


def test_the_start_timeout_grows_with_the_weights():
    assert start_timeout_s(0.01).value == 60
    assert start_timeout_s(2.2).value == 130             # 60 + 66, to the nearest 10 s (Qwen3-0.6B in float32)
    assert start_timeout_s(30).value == 960


def test_the_heartbeat_timeout_covers_three_estimated_steps():
    assert heartbeat_timeout_s(2.0, 1.0).value == 30
    assert heartbeat_timeout_s(41.0, 1.0).value == 130   # 123, up to 10 s
    assert heartbeat_timeout_s(1.0, 15.0).value == 50    # above twice the interval, as the head requires
    assert heartbeat_timeout_s(2500.0, 1.0).value == 600   # a hang is found within 10 minutes


def run_config(**generator) -> dict:
    spec = {"cpus": 0.25}
    return {"run": {"name": "s", "driver": "orchestrator"},
            "shared": {"model": "tiny", "task": "arithmetic"},
            "actors": [
                {"name": "generator", "cls": "postrain.actors.generator:GeneratorActor", **spec, **generator},
                {"name": "learner", "cls": "postrain.actors.learner:LearnerActor", **spec, "memory_mb": 1024},
                {"name": "env", "cls": "postrain.actors.env:EnvironmentActor", **spec,
                 "options": {"max_total_tokens": 128}},
                {"name": "orchestrator", "cls": "postrain.actors.orchestrator:OrchestratorActor", **spec,
                 "options": {"prompts_per_step": 2, "samples_per_prompt": 4}}]}


def fixed_rates(config, shape, num_threads):
    return CpuRates(train_flops=1e9, decode_flops=1e9, num_threads=num_threads)


def test_a_run_gets_the_unset_fields_derived_and_keeps_the_set_ones():
    config = parse_up_config(run_config(memory_mb="auto", options={"max_num_seqs": 8}))
    machine = Inventory(cpu_ids=(0, 1), memory_mb=16_000)
    sizing = size_run(config, machine, measure=fixed_rates)
    generator, learner = config.actors[0], config.actors[1]
    assert generator.options["kv_cache_mb"] == 16     # 6 KiB x 8 x 128 = 6 MiB, the floor
    assert generator.memory_mb == 576 and learner.memory_mb == 1024
    assert config.head.heartbeat_timeout_s == sizing.head[0].value >= 30
    lines = sizing.lines()
    assert lines[0].startswith("generator: kv_cache_mb 16 (6 KiB a token x 8 sequences x 128 tokens), memory_mb 576")
    assert lines[1].startswith("learner: memory_mb 1024 (set), start_timeout_s 60")
    assert not any(line.startswith(("env", "orchestrator")) for line in lines)     # they read no weights
    assert [line.split(":")[1].split("(")[0].strip() for line in lines if line.startswith("RL step")] == [
        "this CPU", "H100 SXM", "A100 80GB SXM"]


def test_a_set_value_is_kept_and_a_gpu_generator_sizes_its_cache_from_the_gpu():
    config = parse_up_config(run_config(gpus=1, options={"kv_cache_mb": 100, "max_num_seqs": 8}))
    machine = Inventory(cpu_ids=(0, 1), memory_mb=16_000, gpus=(GpuInfo(0, "H100", 80_000),))
    sizing = size_run(config, machine, measure=fixed_rates)
    assert config.actors[0].options["kv_cache_mb"] == 100 and "kv_cache_mb 100 (set)" in sizing.lines()[0]
    assert config.actors[0].memory_mb == 576            # no KV cache in host memory
    config = parse_up_config(run_config(gpus=1, options={"max_num_seqs": 8}))
    size_run(config, machine, measure=fixed_rates)
    assert config.actors[0].options["kv_cache_mb"] == 16


def test_a_run_without_a_model_is_not_sized():
    from postrain.core.testing import counting_run_config
    import tomllib
    config = parse_up_config(tomllib.loads(counting_run_config("runs")))
    assert size_run(config, Inventory((0,), 1000), measure=fixed_rates) is None
    assert config.actors[0].memory_mb == 0 and config.head.heartbeat_timeout_s == 30


def test_a_scorer_is_sized_from_its_own_model_as_a_generator_is(tmp_path):
    """A judge of another model than the policy ("small": 8 KiB a token) gets its cache from its own
    model; a set cache is kept; a reward model gets no cache, only its process and weights."""
    from model_folders import reward_folder, tiny_policy_folder   # tests/actors/

    rm = reward_folder(tiny_policy_folder(tmp_path / "policy"), tmp_path / "rm")
    config = run_config(options={"max_num_seqs": 8})
    config["actors"][2]["options"]["scorers"] = ["judge", "teacher", "rm"]
    scorer = {"cls": "postrain.actors.scorer:ScorerActor", "cpus": 0.25}
    config["actors"] += [
        {"name": "judge", **scorer, "options": {"model": "small", "serves": "generate", "kv_cache_mb": "auto"}},
        {"name": "teacher", **scorer, "memory_mb": 1024, "options": {"model": "tiny", "kv_cache_mb": 40}},
        {"name": "rm", **scorer, "options": {"model": str(rm), "serves": "reward"}}]
    config = parse_up_config(config)
    sizing = size_run(config, Inventory(cpu_ids=(0, 1), memory_mb=16_000), measure=fixed_rates)
    judge, teacher, rm_spec = config.actors[4:]
    small = BUILTIN_CONFIGS["small"]
    assert judge.options["kv_cache_mb"] == 32          # 8 KiB x 32 sequences (its max_num_seqs) x 128 tokens
    assert judge.memory_mb == generator_memory_mb(4 * small.num_params / MIB, 32, False).value
    assert teacher.options["kv_cache_mb"] == 40 and teacher.memory_mb == 1024
    assert "kv_cache_mb" not in rm_spec.options and rm_spec.memory_mb == generator_memory_mb(
        4 * TINY.num_params / MIB, 0, False).value
    lines = {line.split(":")[0]: line for line in sizing.lines()}
    assert lines["judge"].startswith("judge: kv_cache_mb 32 (8 KiB a token x 32 sequences x 128 tokens)")
    assert lines["teacher"].startswith("teacher: kv_cache_mb 40 (set), memory_mb 1024 (set), start_timeout_s 60")
    assert lines["rm"].startswith("rm: memory_mb ") and "kv_cache_mb" not in lines["rm"]
