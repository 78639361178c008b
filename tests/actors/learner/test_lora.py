"""LoRA on the learner (actors/learner/lora.py): adapters train over a frozen base, export to PEFT and
to merged Hugging Face weights (with the PEFT adapter inside), and generators receive only the
adapters after the first full sync."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

from postrain.actors.learner import Learner, LearnerConfig, LearnerError
from postrain.actors.learner.lora import ADAPTER_FOLDER
from postrain.actors.weights.messages import weights_digest
from postrain.actors.models.loading import save_checkpoint
from postrain.actors.records import PublishReport, PublishRequest, TrainBatch, WeightPatch, WeightSync
from postrain.core import ActorSpec, RemoteError, Supervisor
from postrain.core.testing import async_test

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
LORA = {"rank": 4, "alpha": 8}


def batch(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(8, 264, (12,), generator=g) for _ in range(4)]
    return TrainBatch(token_ids=ids, loss_mask=[[0] * 4 + [1] * 8] * 4,
                      behavior_logprobs=[torch.full((12,), -5.5) for _ in range(4)],
                      policy_versions=[0] * 4, rewards=[1.0, 0.0, 0.0, 1.0], group_ids=[0, 0, 1, 1])


def lora_learner(**lora) -> Learner:
    return Learner(LearnerConfig(model=TINY, lr=1e-2, micro_batch_size=2, lora={**LORA, **lora}))


def test_adapters_train_and_the_base_does_not_change():
    learner = lora_learner()
    base = {k: v.clone() for k, v in learner.model.state_dict().items()}
    adapters = {k: v.clone() for k, v in learner.lora.adapters().items()}
    assert learner.state_dict().keys() == {k for k in base if k != "lm_head.weight"}
    assert weights_digest(learner.state_dict()) == weights_digest(
        {k: v for k, v in base.items() if k != "lm_head.weight"})          # B = 0: the policy starts as the base
    for step in range(2):
        learner.train_step(batch(step))
    assert all(p.grad is None for p in learner.model.parameters())        # frozen: no gradients
    assert all(not p.requires_grad for p in learner.model.parameters())
    assert all(torch.equal(v, base[k]) for k, v in learner.model.state_dict().items())
    after = learner.lora.adapters()
    assert all(not torch.equal(after[k], adapters[k]) for k in adapters)  # A and B both moved
    state = learner.optimizer.state_dict()["state"]
    assert len(state) == len(learner.params) == 2 * 7 * 2                # 7 linear layers x 2 layers, A and B
    trained = sum(p.numel() for p in learner.params)
    assert trained == sum(v.numel() for v in after.values()) < sum(v.numel() for v in base.values()) // 5
    merged = learner.state_dict()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])


def test_peft_folder_gives_the_policys_logits_and_merged_export_equals_it(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    learner = lora_learner(targets=["q_proj", "v_proj", "down_proj"])
    for step in range(2):
        learner.train_step(batch(step))
    save_checkpoint(learner.model, learner.tokenizer, tmp_path / "base")   # the model holds the base
    learner.lora.export_peft(tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    learner.export_hf(tmp_path / "merged")
    ids = torch.randint(8, 264, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = learner.model(ids)                                            # base + adapter hooks
        base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        base_logits = base.eval()(ids).logits
        with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        theirs = with_adapter(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                                   dtype=torch.float32).eval()(ids).logits
    assert float((ours - theirs).abs().max()) < 1e-4
    assert float((merged - theirs).abs().max()) < 1e-4
    assert float((ours - base_logits).abs().max()) > 1e-3                      # the adapters matter
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert weights_digest(exported) == weights_digest(learner.state_dict())   # bit for bit the merged weights
    assert all(torch.equal(v, learner.model.state_dict()[k]) for k, v in
               load_file(str(tmp_path / "base" / "model.safetensors")).items())   # export restored the base
    # the merged export (a run's policy/) holds the same adapter in adapter/, naming the learner's model
    beside = tmp_path / "merged" / ADAPTER_FOLDER
    assert (beside / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert json.loads((beside / "adapter_config.json").read_text()) == {
        **json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()), "base_model_name_or_path": None}


def test_checkpoint_keeps_the_adapters(tmp_path):
    learner = lora_learner()
    learner.train_step(batch(0))
    learner.save_checkpoint(tmp_path / "ckpt")
    resumed = lora_learner()
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert weights_digest(resumed.lora.adapters()) == weights_digest(learner.lora.adapters())
    learner.train_step(batch(1))
    resumed.train_step(batch(1))
    assert weights_digest(resumed.state_dict()) == weights_digest(learner.state_dict())


@pytest.mark.parametrize("lora, match", [
    ({"rank": 0}, "lora.rank must be an integer >= 1"),
    ({"alpha": -1}, "lora.alpha must be a number > 0"),
    ({"targets": "q_proj"}, "lora.targets must be a non-empty list"),
    ({"targets": ["lm_head"]}, "must not name lm_head"),
    ({"ranks": 4}, r"unknown lora option\(s\) \['ranks'\]"),
])
def test_bad_lora_options_are_named(lora, match):
    with pytest.raises(LearnerError, match=match):
        LearnerConfig(model=TINY, lora=lora)


def test_targets_that_match_no_layer_are_named():
    with pytest.raises(LearnerError, match=r"match no linear layer of this model; its layers: \['down_proj'"):
        lora_learner(targets=["qkv"])


def spec(name: str, cls: str, options: dict) -> ActorSpec:
    return ActorSpec(name=name, cls=cls, options=options, cpus=0.5, memory_mb=0, max_restarts=0)


@pytest.mark.slow
@async_test
async def test_generators_get_only_the_adapters_after_the_first_sync_and_hold_the_merged_weights():
    """A LoRA learner process and a real generator: the first publish carries the base and the
    adapters, later ones the adapters alone, and the generator holds the learner's merged weights
    bit for bit; a receiver without the base refuses adapters and is sent the whole weights."""
    async with Supervisor.open() as sup:
        learner = await sup.start(spec("learner", "postrain.actors.learner.actor:LearnerActor", {
            "model": "tiny", "learner": {"lr": 1e-2, "micro_batch_size": 2, "lora": LORA}}))
        gen = await sup.start(spec("gen0", "postrain.actors.generator:GeneratorActor",
                                   {"model": "tiny", "kv_cache_mb": 4}))

        async def publish(*targets) -> PublishReport:
            return PublishReport.from_wire(await learner.ask(
                "publish", PublishRequest(targets=list(targets)).to_wire(), timeout_s=120))

        async def assert_hold_learner_weights(*refs) -> None:
            want = WeightSync.from_wire(await learner.ask("get_weights"))
            for ref in refs:
                assert await ref.ask("digest") == {"version": want.version, "digest": weights_digest(want.weights)}

        first = await publish("gen0")
        assert first.num_bytes_sent > first.num_bytes               # the base and the adapters
        for step in range(2):
            await learner.ask("train", batch(step).to_wire(), timeout_s=120)
            later = await publish("gen0")
            await assert_hold_learner_weights(gen)
        assert later.version == 2 and later.num_bytes_sent < 0.2 * later.num_bytes   # the adapters alone

        # a receiver that never had the base refuses adapters (its digest check can't pass): sent whole
        other = await sup.start(spec("rx1", "postrain.actors.weights:WeightReceiverActor", {"model": "tiny"}))
        name = "model.layers.0.self_attn.q_proj.weight"
        adapters = WeightSync(2, {f"{name}.lora_A": torch.zeros(4, 192), f"{name}.lora_B": torch.zeros(192, 4)},
                              patch=WeightPatch("lora", "0" * 64, base_version=1, lora_scale=2.0))
        with pytest.raises(RemoteError, match="holds no LoRA base"):
            await other.ask("load_weights", adapters.to_wire())
        assert (await other.ask("digest"))["version"] == -1
        late = await publish("rx1")
        assert late.num_bytes_sent > late.num_bytes
        await assert_hold_learner_weights(other)


RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from safetensors.torch import save_file
    sys.path.insert(0, {test_dir!r})
    rank, init_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from test_learner_dp import CONFIG, batch, shard
    learner = Learner(LearnerConfig(**CONFIG, seed=rank, lora={{"rank": 4, "alpha": 8}}))   # rank 0's broadcast
    for step in range(2):
        learner.train_step(shard(batch(step), rank, 2))
    save_file({{k: v.contiguous() for k, v in learner.lora.adapters().items()}}, out + str(rank))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_lora_on_two_gloo_ranks_matches_one_process(tmp_path, rank_processes):
    """LoRA composes with data parallel: only the adapters are all-reduced, and two ranks on half
    a batch each end with one process's adapters (test_learner_dp.py's batches and tolerances)."""
    from safetensors.torch import load_file

    test_dir = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, test_dir)              # the tests are not a package (importlib import mode)
    from test_learner_dp import CONFIG, batch

    script = RANK.format(test_dir=test_dir)
    out = str(tmp_path / "rank")
    rank_processes([["-c", script, r, tmp_path / "init", out] for r in range(2)], 240)
    single = Learner(LearnerConfig(**CONFIG, seed=0, lora={"rank": 4, "alpha": 8}))
    for step in range(2):
        single.train_step(batch(step))
    for rank in range(2):
        got = load_file(out + str(rank))
        for name, tensor in single.lora.adapters().items():
            torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_adapter_syncs_in_bfloat16_rebuild_the_learners_merged_weights():
    """In-process: a planner publishing bfloat16 (`publish_dtype`) and a receiver holding float32
    weights: after the first sync (base + adapters) and an adapter sync, the receiver's weights in
    bfloat16 are the learner's published ones bit for bit."""
    from postrain.actors.weights.sync_plan import SyncPlanner
    from postrain.actors.weights.patch import WeightPatcher

    learner = lora_learner()
    planner, patcher = SyncPlanner("auto", learner.lora, dtype="bfloat16"), WeightPatcher()
    held: dict[str, torch.Tensor] = {}
    for step in range(3):
        plan = planner.prepare(learner.base_weights(), learner.policy_version)
        message = plan.message_for("gen0")
        assert (message.patch.base_version is None) == (step == 0)           # whole once, then adapters
        weights = patcher.resolve(message, message.weights, step - 1, lambda: held)
        held = {k: v.float() for k, v in weights.items()}                     # a float32 generator
        plan.sent("gen0", plan.message_for("gen0"))
        plan.finish()
        assert weights_digest({k: v.to(torch.bfloat16) for k, v in held.items()}) == plan.digest
        learner.train_step(batch(step))
