"""The GPU path's parts that run without a GPU: device selection, the scheduler's
CUDA_VISIBLE_DEVICES in a real actor process (a faked inventory), the clear refusal of a device
the process cannot see, the device check's no-GPU line, and its GPU run config."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
import torch

from postrain.actors.models.device import DeviceError, resolve_device
from postrain.bench.device import gpu_run_config
from postrain.cli.config import parse_up_config
from postrain.core import ActorSpec, ActorStartError, Supervisor
from postrain.core.scheduler import GpuInfo, Inventory, Scheduler
from postrain.core.testing import async_test, to_toml


def test_auto_is_the_cpu_where_no_gpu_is_visible_and_cpu_is_always_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_and_cuda_are_the_first_visible_gpu_where_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("CUDA:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="sees 2 GPU"):
        resolve_device("cuda:2")


def test_a_gpu_the_process_cannot_see_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(DeviceError, match="sees no CUDA GPU.*CUDA_VISIBLE_DEVICES=''.*gpus = 1"):
        resolve_device("cuda")
    with pytest.raises(DeviceError, match="'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("tpu")


@async_test
async def test_an_actor_sees_exactly_the_gpus_it_was_placed_on():
    inventory = Inventory(cpu_ids=(0, 1), memory_mb=8000, gpus=(GpuInfo(0, "H200", 143000),
                                                               GpuInfo(1, "H200", 143000)))
    names = ["CUDA_VISIBLE_DEVICES"]
    async with Supervisor.open(scheduler=Scheduler(inventory)) as sup:
        first = await sup.start(ActorSpec(name="a", cls="postrain.core.testing:EchoActor", cpus=0.1, gpus=1))
        second = await sup.start(ActorSpec(name="b", cls="postrain.core.testing:EchoActor", cpus=0.1, gpus=1))
        cpu_only = await sup.start(ActorSpec(name="c", cls="postrain.core.testing:EchoActor", cpus=0.1))
        seen = [await ref.ask("environ", names) for ref in (first, second, cpu_only)]
    assert seen == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": ""}]


@async_test
async def test_a_generator_asked_for_cuda_without_a_gpu_fails_to_start_with_the_fix():
    spec = ActorSpec(name="gen", cls="postrain.actors.generator:GeneratorActor", cpus=0.5,
                     options={"model": "tiny", "device": "cuda"}, max_restarts=0)
    async with Supervisor.open() as sup:
        with pytest.raises(ActorStartError, match="sees no CUDA GPU") as caught:
            await sup.start(spec)
    assert "gpus = 1" in str(caught.value)


def test_the_device_check_says_in_one_line_that_there_is_no_gpu_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "postrain.cli", "bench", "device", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["skipped"].startswith("no GPU check")


@pytest.mark.parametrize("num_gpus,on_gpu", [(1, {"learner"}), (2, {"learner", "generator"})])
def test_the_device_checks_run_puts_the_learner_and_generator_on_gpus_and_validates(num_gpus, on_gpu):
    config = gpu_run_config(num_gpus, quick=True)
    assert {a["name"] for a in config["actors"] if a.get("gpus")} == on_gpu
    parsed = parse_up_config(tomllib.loads(to_toml(config)))     # the file it writes validates
    assert {spec.name for spec in parsed.actors if spec.gpus == 1} == on_gpu


def test_bfloat16_autocast_keeps_float32_weights_and_trains_the_same_step_within_its_rounding():
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.bench.learner import rollout_batch

    tiny = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    batch = rollout_batch(4, 48, tiny["vocab_size"])
    plain = Learner(LearnerConfig(model=tiny, device="cpu", lr=1e-4, micro_batch_size=2))
    mixed = Learner(LearnerConfig(model=tiny, device="cpu", lr=1e-4, micro_batch_size=2, autocast_dtype="bfloat16"))
    exact_logp, rounded_logp = torch.cat(plain.compute_logprobs(batch)), torch.cat(mixed.compute_logprobs(batch))
    assert not torch.equal(exact_logp, rounded_logp)                    # the forward did run in bfloat16
    assert torch.allclose(exact_logp, rounded_logp, atol=0.1)
    exact, rounded = plain.train_step(batch), mixed.train_step(batch)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert rounded["pg_loss"] == pytest.approx(exact["pg_loss"], rel=0.05, abs=1e-3)


def test_learner_device_options_are_checked_naming_the_choices():
    from postrain.actors.learner.batch import LearnerError
    from postrain.actors.learner.config import LearnerConfig

    with pytest.raises(LearnerError, match="autocast_dtype must be"):
        LearnerConfig(autocast_dtype="int8")
    with pytest.raises(LearnerError, match="rl_ops_backend must be one of"):
        LearnerConfig(rl_ops_backend="triton")
