"""The learner as a real actor process: train a step, checkpoint, publish weights to a receiver."""
from __future__ import annotations

import torch

from postrain.actors.weights.messages import weight_messages, weights_digest
from postrain.actors.records import (CheckpointLoaded, CheckpointSaved, LearnerStats, LoadCheckpoint,
                                     PublishReport, PublishRequest, SaveCheckpoint, TrainBatch, WeightSync)
from postrain.core import ActorSpec, RemoteError, Supervisor
from postrain.core.testing import async_test

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def spec(name: str, cls: str, options: dict) -> ActorSpec:
    # start_timeout_s: a hang guard. Beside a SmolLM2 run (load 4 on 2 cores) the learner's import
    # once went 60 s without a heartbeat reaching the head (the default limit).
    return ActorSpec(name=name, cls=cls, options=options, cpus=0.5, memory_mb=0, max_restarts=0,
                     start_timeout_s=600)


def rollouts(num: int = 4) -> dict:
    """A TrainBatch's wire dict: four samples in two groups, rewards for the learner's advantages."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(8, 264, (12,), generator=g) for _ in range(num)]
    return TrainBatch(token_ids=ids, loss_mask=[[0] * 4 + [1] * 8] * num,
                      behavior_logprobs=[torch.full((12,), -5.5) for _ in range(num)],
                      policy_versions=[0] * num, rewards=[1.0, 0.0, 0.0, 1.0], group_ids=[0, 0, 1, 1]).to_wire()


@async_test
async def test_learner_actor_trains_checkpoints_and_publishes(tmp_path):
    async with Supervisor.open() as sup:
        learner = await sup.start(spec("learner", "postrain.actors.learner.actor:LearnerActor",
                                       {"model": TINY, "learner": {"lr": 1e-3, "micro_batch_size": 2}}))
        receiver = await sup.start(spec("gen0", "postrain.actors.weights:WeightReceiverActor", {"model": TINY}))
        metrics = await learner.ask("train", rollouts(), timeout_s=120)
        assert metrics["policy_version"] == 1 and metrics["num_tokens"] == 32
        assert {"loss", "kl", "entropy", "grad_norm", "logprob_gap_mean", "clip_frac_low"} <= set(metrics)

        published = PublishReport.from_wire(
            await learner.ask("publish", PublishRequest(targets=["gen0"]).to_wire(), timeout_s=120))
        assert published.version == 1 and published.sync_s["gen0"] > 0
        got = WeightSync.from_wire(await learner.ask("get_weights"))
        assert got.version == 1
        held = await receiver.ask("digest")
        assert held == {"version": 1, "digest": weights_digest(got.weights)}
        assert published.num_bytes == sum(t.numel() * 4 for t in got.weights.values())
        stats = LearnerStats.from_wire(await learner.ask("stats"))
        assert (stats.step, stats.policy_version, stats.last_publish) == (1, 1, published)

        await learner.ask("train", rollouts(), timeout_s=120)   # version 2: chunk_mb is for other hosts,
        published = PublishReport.from_wire(await learner.ask(
            "publish", PublishRequest(targets=["gen0"], chunk_mb=0.05).to_wire(), timeout_s=120))
        assert published.version == 2 and published.num_messages == 1   # so one message here
        got = WeightSync.from_wire(await learner.ask("get_weights"))
        assert await receiver.ask("digest") == {"version": 2, "digest": weights_digest(got.weights)}

        saved = CheckpointSaved.from_wire(await learner.ask(
            "save_checkpoint", SaveCheckpoint(path=str(tmp_path / "c1"), extra={"cursor": 4}).to_wire()))
        assert saved.policy_version == 2
        await learner.ask("train", rollouts(), timeout_s=120)
        restored = CheckpointLoaded.from_wire(
            await learner.ask("load_checkpoint", LoadCheckpoint(path=saved.path).to_wire()))
        assert restored == CheckpointLoaded(step=2, policy_version=2, extra={"cursor": 4})
        try:   # a receiver refuses an older version, by name
            await receiver.ask("load_weights", WeightSync(version=1, weights=got.weights).to_wire())
            raise AssertionError("an older version was accepted")
        except RemoteError as exc:
            assert "must not go back" in str(exc)


def test_weight_messages_split_whole_tensors_under_the_chunk_size():
    weights = {f"w{i}": torch.zeros(256 * (i + 1)) for i in range(6)}     # 1, 2, ..., 6 KiB
    messages = weight_messages(weights, 3, chunk_mb=6 / 1024)
    assert [sorted(m.weights) for m in messages] == [["w0", "w1", "w2"], ["w3"], ["w4"], ["w5"]]
    assert {(m.version, m.num_chunks) for m in messages} == {(3, 4)}
    assert [m.chunk for m in messages] == list(range(4))
    assert [m.to_wire() for m in weight_messages(weights, 3)] == [{"version": 3, "weights": weights}]
