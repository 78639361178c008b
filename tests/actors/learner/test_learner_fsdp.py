"""The sharded learner (strategy "fsdp", FSDP2 over gloo) in real processes: 2 ranks end with
the same weights as one process on the whole batch; each rank holds about half of the
parameters, gradients and optimizer state (measured on its tensors); a DCP checkpoint written
at 2 ranks resumes at 1 with identical weights and AdamW moments; publishes gathered from the
shards (full, delta, LoRA) reach a receiver with the learner's digest. 4 ranks (and 2 -> 4
resumes) run under `pytest -m arch_matrix tests/actors/learner/test_learner_fsdp.py`."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.weights.messages import weights_digest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/actors: fsdp_ranks
from fsdp_ranks import STEPS, batch, config  # noqa: E402

RANKS_SCRIPT = Path(__file__).resolve().parents[1] / "fsdp_ranks.py"
DEFAULT_VARIANTS = ["prefix", "plain_ac", "lora", "exact"]


def run_ranks(rank_processes, world: int, out: Path, variants: list[str], mode: str = "") -> Path:
    """WORLD real processes of one gloo group running fsdp_ranks.py; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    args = [",".join(variants)] + ([mode] if mode else [])
    rank_processes([[RANKS_SCRIPT, r, world, out / "init", out, *args] for r in range(world)])
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, rank_processes):
    return run_ranks(rank_processes, 2, tmp_path_factory.mktemp("fsdp2"), DEFAULT_VARIANTS, "save")


@pytest.fixture(scope="module")
def one_process():
    """{variant: (the Learner after STEPS steps on the whole batches in this process, its last loss)}."""
    torch.set_num_threads(1)
    return {variant: trained(variant, STEPS) for variant in DEFAULT_VARIANTS}


def trained(variant: str, steps: int) -> tuple[Learner, float]:
    learner = Learner(LearnerConfig(**config(variant), seed=0))
    metrics = [learner.train_step(batch(step)) for step in range(steps)]
    return learner, metrics[-1]["loss"]


def assert_same_weights(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("variant", DEFAULT_VARIANTS)
def test_two_fsdp_ranks_match_one_process(two_ranks, one_process, variant):
    single, single_loss = one_process[variant]
    assert_same_weights(load_file(str(two_ranks / f"{variant}.safetensors")), single.state_dict())
    loss = json.loads((two_ranks / f"{variant}.rank0.json").read_text())["loss"]
    assert loss == pytest.approx(single_loss, abs=1e-6)


def test_each_fsdp_rank_holds_half_of_the_state(two_ranks, one_process):
    whole, _ = one_process["prefix"]
    full = {"params": sum(p.numel() * 4 for p in whole.model.parameters()),
            "optimizer": sum(v.numel() * v.element_size() for s in whole.optimizer.state.values() for v in s.values())}
    full["grads"] = full["params"]
    ranks = [json.loads((two_ranks / f"prefix.rank{r}.json").read_text()) for r in range(2)]
    for held in ranks:
        for kind in ("params", "grads", "optimizer"):
            assert held[kind] == pytest.approx(full[kind] / 2, rel=0.05), kind
    assert sum(h["params"] for h in ranks) == full["params"]     # a partition: nothing held twice


def test_lora_under_fsdp_trains_only_the_adapters(two_ranks, one_process):
    held = json.loads((two_ranks / "lora.rank0.json").read_text())
    learner, _ = one_process["lora"]
    adapters = sum(p.numel() * 4 for p in learner.lora.parameters())
    assert held["grads"] == adapters          # whole adapters on each rank, no base gradient
    assert held["params"] < sum(p.numel() * 4 for p in learner.model.parameters())   # the base is sharded


@pytest.mark.parametrize("variant", ["prefix", "lora"])
def test_publish_from_shards_gives_the_generator_the_learners_weights(two_ranks, variant):
    """A full sync, then a patch (delta: changed elements; LoRA: the adapters alone), each resolved
    by a receiver as a generator does: its digest equals the learner's gathered weights'."""
    report = json.loads((two_ranks / f"{variant}.publish.json").read_text())
    full, patch = report["rounds"]
    assert not full["patch"] and patch["patch"]
    assert full["digest_ok"] and patch["digest_ok"] and report["export_ok"]
    if variant == "lora":
        assert patch["bytes"] < full["bytes"] / 10


def test_dcp_checkpoint_from_two_ranks_resumes_at_one(two_ranks):
    state = json.loads((two_ranks / "ckpt" / "state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == STEPS and state["extra"] == {"variant": "prefix"}
    assert sorted(p.name for p in (two_ranks / "ckpt" / "dcp").iterdir()) == [".metadata", "__0_0.distcp",
                                                                             "__1_0.distcp"]
    assert not [p for p in two_ranks.iterdir() if p.name.startswith(".ckpt.")]   # swapped in, nothing left
    resumed = Learner(LearnerConfig(**config("prefix"), seed=7))      # other initial weights
    assert resumed.load_checkpoint(two_ranks / "ckpt") == {"variant": "prefix"}
    assert resumed.step == resumed.policy_version == STEPS
    saved = load_file(str(two_ranks / "prefix.safetensors"))
    assert weights_digest(resumed.state_dict()) == weights_digest(saved)      # bit for bit
    moments = load_file(str(two_ranks / "prefix.moments.safetensors"))
    state = resumed.optimizer.state_dict()["state"]
    assert len(moments) == 3 * len(state)
    for index, entry in state.items():
        for name, value in entry.items():
            want = moments[f"{index}.{name}"]
            assert torch.equal(value.reshape(want.shape), want), (index, name)
    # and it trains on as the two ranks would have: one more step equals an unbroken one-process run's
    resumed.train_step(batch(STEPS))
    assert_same_weights(resumed.state_dict(), trained("prefix", STEPS + 1)[0].state_dict())


@pytest.mark.arch_matrix
def test_four_fsdp_ranks_match_one_process_and_resume_from_two(two_ranks, tmp_path, rank_processes):
    variants = ["prefix", "plain", "prefix_ac", "plain_ac"]
    four = run_ranks(rank_processes, 4, tmp_path / "four", variants)
    for variant in variants:
        learner, _ = trained(variant, STEPS)
        assert_same_weights(load_file(str(four / f"{variant}.safetensors")), learner.state_dict())
        held = json.loads((four / f"{variant}.rank1.json").read_text())
        full = sum(p.numel() * 4 for p in learner.model.parameters())
        assert held["params"] == pytest.approx(full / 4, rel=0.1) and held["grads"] == pytest.approx(full / 4, rel=0.1)
    resumed = run_ranks(rank_processes, 4, tmp_path / "resumed", ["prefix"], f"resume={two_ranks / 'ckpt'}")
    want_weights = weights_digest(load_file(str(two_ranks / "prefix.safetensors")))
    want = load_file(str(two_ranks / "prefix.moments.safetensors"))
    for name in ("prefix", "prefix_ingroup"):      # loaded before the group formed (resume_from), and inside it
        assert weights_digest(load_file(str(resumed / f"{name}.safetensors"))) == want_weights, name
        got = load_file(str(resumed / f"{name}.moments.safetensors"))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name


def test_the_learner_options_name_a_bad_strategy():
    from pydantic import ValidationError

    from postrain.actors.learner.actor import LearnerOptions
    from postrain.actors.learner.batch import LearnerError

    with pytest.raises(LearnerError, match=r"strategy must be one of \('ddp', 'fsdp'\), got 'zero'"):
        LearnerConfig(strategy="zero")
    with pytest.raises(ValidationError, match="strategy must be one of"):
        LearnerOptions(learner={"strategy": "zero"})
    options = LearnerOptions(learner={"strategy": "fsdp", "activation_checkpointing": True})
    assert options.learner_config().strategy == "fsdp"        # at ranks = 1: one whole model, as ddp
    assert LearnerConfig().strategy == "ddp"


@pytest.mark.slow
@pytest.mark.parametrize("context_parallel", [pytest.param(1, marks=pytest.mark.variants), 2])  # 1: pytest -m variants
def test_a_learner_actor_of_two_fsdp_ranks_trains_publishes_saves_and_exports(tmp_path, context_parallel):
    """The learner actor with ranks = 2 and strategy "fsdp", as `postrain up` starts it: a train
    step on both ranks, then get_weights, export_hf and save_checkpoint, which every rank runs
    (their weights are gathered from the shards); with context_parallel = 2 the two ranks are
    one ring, each scoring half of every sequence."""
    import anyio

    from postrain.actors.learner.state import checkpoint_info
    from postrain.actors.records import WeightSync
    from postrain.core.config import complete_rendezvous, parse_config
    from postrain.core.supervisor import Supervisor
    from postrain.core.transport import free_tcp_port

    learner_options = {k: v for k, v in config("prefix").items() if k != "model"}
    learner_options["context_parallel"] = context_parallel
    config_ = parse_config({"actors": [{
        "name": "learner", "cls": "postrain.actors.learner:LearnerActor", "ranks": 2, "cpus": 1, "memory_mb": 64,
        "options": {"model": config("prefix")["model"], "learner": learner_options, "group_timeout_s": 60}}]})
    complete_rendezvous(config_.actors, lambda name: ("127.0.0.1", free_tcp_port("127.0.0.1")))

    async def run():
        async with Supervisor.open(log_dir=str(tmp_path)) as supervisor:
            for spec in config_.actors:
                await supervisor.start(spec)
            learner = supervisor.ref("learner")
            metrics = await learner.ask("train", batch(0).to_wire(), timeout_s=120)
            weights = WeightSync.from_wire(await learner.ask("get_weights", None, timeout_s=120))
            await learner.ask("export_hf", {"path": str(tmp_path / "hf")}, timeout_s=120)
            await learner.ask("save_checkpoint", {"path": str(tmp_path / "ckpt")}, timeout_s=120)
            return metrics, weights

    metrics, weights = anyio.run(run, backend="trio")
    single, _ = trained("prefix", 1)
    assert metrics["policy_version"] == 1 and weights.version == 1
    assert_same_weights(weights.weights, single.state_dict())
    assert_same_weights(load_file(str(tmp_path / "hf" / "model.safetensors")), single.state_dict())
    assert checkpoint_info(tmp_path / "ckpt") == {"step": 1, "policy_version": 1}
    assert sorted(p.name for p in (tmp_path / "ckpt" / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_exact_under_fsdp_scores_the_generators_logprobs_bit_for_bit(two_ranks):
    """`exact = true` on a sharded learner: each rank's recomputed logprobs of an exact engine's
    samples (on the gathered weights after 3 steps) equal the recorded ones; the step's gap is 0."""
    for rank in range(2):
        result = json.loads((two_ranks / f"exact.exact.rank{rank}.json").read_text())
        assert result == {"gap": 0.0, "step_gap": 0.0}
