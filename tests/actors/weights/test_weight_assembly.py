"""Chunked weight syncs: the assembler's rules, and real publishes to a generator on "another
node" (under a second supervisor, bound to tcp beyond loopback: chunks over CurveZMQ, their
bytes on its sealed channel) beside one on the learner's node (/dev/shm); a forged piece on the
sealed channel leaves the receiver with the weights it held, a receiver started again (a new
channel) gets the next publish whole, and the run's key is in no log."""
from __future__ import annotations

import base64
import os
import signal

import anyio
import pytest
import torch
import zmq

from postrain.actors.weights.messages import sealed_sync, weight_chunks, weight_messages, weights_digest
from postrain.actors.orchestrator.ledger import SampleLedger
from postrain.actors.orchestrator.train_step import TrainStep
from postrain.actors.records import TrainBatch, WeightSync
from postrain.actors.learner.recovery import LearnerKeeper
from postrain.actors.weights.assembly import SyncAssembler
from postrain.core import ActorSpec, CurveKeys, RemoteError, Supervisor
from postrain.core.metrics import MetricsWriter, read_metrics
from postrain.core.sealed import PIECE_BYTES, SealedSender, new_run_key, piece_plan
from postrain.core.testing import async_test

TINY = "tiny"   # the built-in tiny model: learner and generators share it
HOST = "0.0.0.0"        # every address of this machine: beyond loopback


def chunks(version: int, names: str, num_chunks: int | None = None) -> list[WeightSync]:
    """One sync of `version`: a chunk per letter of `names` (each a one-tensor chunk)."""
    n = num_chunks or len(names)
    return [WeightSync(version, {name: torch.full((2,), float(version))}, chunk=i, num_chunks=n)
            for i, name in enumerate(names)]


def test_a_chunked_sync_is_whole_only_with_its_last_chunk():
    assembler = SyncAssembler()
    first, second, third = chunks(1, "abc")
    assert assembler.take(first, held_version=0) is None
    assert assembler.take(second, held_version=0) is None
    weights = assembler.take(third, held_version=0)
    assert sorted(weights) == ["a", "b", "c"] and assembler.pending == {} and assembler.num_dropped == 0
    whole = {"a": torch.zeros(2)}
    assert assembler.take(WeightSync(2, whole), held_version=1) is whole


def test_a_newer_sync_drops_the_one_in_progress_and_its_late_chunks_are_refused():
    assembler = SyncAssembler()
    old = chunks(1, "abc")
    assembler.take(old[0], held_version=0)
    assembler.take(old[1], held_version=0)
    new = chunks(2, "abc")
    assert assembler.take(new[0], held_version=0) is None
    assert assembler.num_dropped == 1 and assembler.pending_version == 2
    with pytest.raises(ValueError, match="a sync of version 2 is in progress, got 1"):
        assembler.take(old[2], held_version=0)
    with pytest.raises(ValueError, match="chunk 2 of 3 of version 2 arrived out of order"):
        assembler.take(new[2], held_version=0)
    assembler.take(new[1], held_version=0)
    weights = assembler.take(new[2], held_version=0)
    assert all(float(t[0]) == 2.0 for t in weights.values()) and sorted(weights) == ["a", "b", "c"]


def test_versions_never_go_back_and_a_retried_sync_starts_again_at_chunk_0():
    assembler = SyncAssembler()
    with pytest.raises(ValueError, match="this actor holds 3, got 2"):
        assembler.take(chunks(2, "ab")[0], held_version=3)
    with pytest.raises(ValueError, match="arrived out of order .no sync in progress"):
        assembler.take(chunks(4, "ab")[1], held_version=3)
    retried = chunks(4, "ab")
    assembler.take(retried[0], held_version=3)
    assembler.take(retried[0], held_version=3)           # the same sync again from its start
    assert assembler.num_dropped == 1
    assert sorted(assembler.take(retried[1], held_version=3)) == ["a", "b"]


def spec(name: str, cls: str, options: dict, bind: str = "ipc") -> ActorSpec:
    return ActorSpec(name=name, cls=cls, options=options, cpus=0.5, memory_mb=0, max_restarts=0, bind=bind)


def rollouts(num: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(8, 264, (12,), generator=g) for _ in range(num)]
    return {"token_ids": ids, "loss_mask": [[0] * 4 + [1] * 8] * num,
            "behavior_logprobs": [torch.full((12,), -5.5) for _ in range(num)],
            "policy_versions": [0] * num, "rewards": [1.0, 0.0, 0.0, 1.0], "group_ids": [0, 0, 1, 1]}


GENERATOR = "postrain.actors.generator:GeneratorActor"
GREEDY = {"prompt_ids": [10, 20, 30, 40], "sampling": {"temperature": 0.0, "max_new_tokens": 12}}


@async_test
async def test_generators_here_and_on_another_host_hold_the_same_weights_and_drop_interrupted_syncs(tmp_path):
    keys = CurveKeys.generate()
    async with Supervisor.open(keys=keys) as sup, Supervisor.open(keys=keys) as other_node:
        learner = await sup.start(spec("learner", "postrain.actors.learner:LearnerActor",
                                       {"model": TINY, "learner": {"lr": 3e-2, "micro_batch_size": 2}},
                                       bind=f"tcp://{HOST}:0"))
        near = await sup.start(spec("near", GENERATOR, {"model": TINY, "kv_cache_mb": 4,
                                                        "speculative": {"method": "ngram", "min_ngram": 1}},
                                    bind=f"tcp://{HOST}:0"))    # tcp, but the learner's node: /dev/shm
        far = await other_node.start(spec("far", GENERATOR, {"model": TINY, "kv_cache_mb": 4},
                                          bind=f"tcp://{HOST}:0"))
        sup.add_peers({"far": far.address})      # as the node agents tell each other (core/ray_nodes.py)
        other_node.expect(["learner"])           # far knows the learner's key (core/identity.py)

        async def lookup(name):
            return sup.ref(name)
        ledger = SampleLedger()
        keeper = LearnerKeeper(learner, ["near", "far"], lookup, ledger, emit=print, chunk_mb=1.0)
        await keeper.attach()
        await keeper.step(TrainBatch.from_wire(rollouts()))
        before = await near.ask("generate", GREEDY)          # drafts: speculation figures in the sync row
        report = await TrainStep(keeper, ledger, MetricsWriter(tmp_path, tensorboard=False),
                                 report_figures=lambda figures: None, samples_per_prompt=2,
                                 num_steps=1).publish()
        near_stats = await near.ask("stats")
        # near: one message through /dev/shm; far: chunks of at most 1 MiB, their bytes sealed
        weights = (await learner.ask("get_weights"))["weights"]
        assert report.version == 1 and report.num_messages == 1 + len(weight_chunks(weights, 1.0)) > 3
        for generator in (near, far):
            assert (await generator.ask("stats"))["policy_version"] == 1
        here, there = await near.ask("generate", GREEDY), await far.ask("generate", GREEDY)
        assert here["samples"][0]["token_ids"] == there["samples"][0]["token_ids"]
        # near verifies drafts (a forward of several tokens a row), far decodes one token a row: the
        # same weights give the same logprobs up to float32 rounding of those shapes (~1e-6)
        assert here["samples"][0]["logprobs"] == pytest.approx(there["samples"][0]["logprobs"], abs=1e-5)
        assert set(there["samples"][0]["policy_versions"]) == {1}
        row = read_metrics(tmp_path, "sync")[-1]
        assert row["version"] == 1 and row["sync_s_near"] > 0 and row["sync_s_far"] > 0
        assert row["num_messages"] == report.num_messages and row["num_bytes"] == report.num_bytes
        assert row["num_bytes_sent"] == report.num_bytes_sent == 2 * report.num_bytes   # whole, to both
        assert near_stats["num_drafted_tokens"] > 0 and len(before["samples"][0]["token_ids"]) == 12
        for figure in ("acceptance_rate", "tokens_per_verify_step", "draft_time_share"):
            assert row[f"{figure}_near"] == pytest.approx(near_stats[figure], abs=1e-4)
            assert f"{figure}_far" not in row                   # far does not speculate

        # a sync interrupted by a newer one is dropped whole, and its late chunks are refused
        interrupted, newer = weight_messages(weights, 2, 1.0), weight_messages(weights, 3, 1.0)
        for message in interrupted[:2]:
            assert await far.ask("load_weights", message.to_wire()) == {"version": 1, "complete": False}
        assert (await far.ask("stats"))["policy_version"] == 1     # nothing applied from a part
        for message in newer:
            reply = await far.ask("load_weights", message.to_wire())
        assert reply["version"] == 3
        with pytest.raises(RemoteError, match="must not go back: this actor holds 3, got 2"):
            await far.ask("load_weights", interrupted[2].to_wire())
        assert set((await far.ask("generate", GREEDY))["samples"][0]["policy_versions"]) == {3}



RECEIVER = "postrain.actors.weights:WeightReceiverActor"


@async_test
async def test_a_forged_sealed_piece_is_refused_and_the_receiver_keeps_its_weights_and_no_log_holds_the_key(
        tmp_path):
    keys = CurveKeys.generate()
    logs = tmp_path / "logs"
    logs.mkdir()
    async with Supervisor.open(keys=keys, log_dir=str(logs)) as sup, \
            Supervisor.open(keys=keys, log_dir=str(logs)) as other_node:
        learner = await sup.start(spec("learner", "postrain.actors.learner:LearnerActor",
                                       {"model": TINY}, bind=f"tcp://{HOST}:0"))
        far = await other_node.start(spec("far", RECEIVER, {}, bind=f"tcp://{HOST}:0").model_copy(
            update={"max_restarts": 1}))
        sup.add_peers({"far": far.address})
        other_node.expect(["learner"])           # far knows the learner's key (core/identity.py)
        await learner.ask("publish", {"targets": ["far"], "chunk_mb": 1.0})
        weights = (await learner.ask("get_weights"))["weights"]
        held = await far.ask("digest")
        assert held == {"version": 0, "digest": weights_digest(weights)}        # bit for bit

        # A sync whose pieces a stranger forges (the right header, not sealed with the run's key)
        channel = (await far.ask("weights_channel"))["address"]
        messages, streams = sealed_sync(weights, 1, 1.0, "learner", PIECE_BYTES, timeout_s=10)
        forger = SealedSender(new_run_key())
        await far.tell("load_weights", messages[0].to_wire())
        assert forger.send(streams[0][0], streams[0][1], {channel: None}, timeout_s=10) == {}
        for message in messages[1:-1]:                   # the sync's later chunks find it dropped
            await far.tell("load_weights", message.to_wire())
        with pytest.raises(RemoteError, match="dropped after a refused or missing piece"):
            await far.ask("load_weights", messages[-1].to_wire())
        assert await far.ask("digest") == held                             # nothing half-loaded

        # junk from a stranger on the channel costs the next sync nothing
        stranger = zmq.Context.instance().socket(zmq.PUSH)
        stranger.connect(channel)
        stranger.send_multipart([b"junk", b"\0" * 64])
        reply = await learner.ask("publish", {"targets": ["far"], "chunk_mb": 1.0})
        assert reply["num_messages"] == len(weight_chunks(weights, 1.0))
        assert await far.ask("digest") == held
        stranger.close(linger=0)
        forger.close()

        # started again (same address, a new channel), it gets the next publish whole
        os.kill(other_node.records["far"].pid, signal.SIGKILL)
        with anyio.fail_after(60):
            while other_node.records["far"].restarts < 1 or other_node.records["far"].state != "running":
                await anyio.sleep(0.1)
        await learner.ask("publish", {"targets": ["far"], "chunk_mb": 1.0})
        assert await far.ask("digest") == held
    far_log = (logs / "far.log").read_text()
    assert "refused a piece on the sealed channel from 127.0.0.1: piece 0 of chunk 0 of version 1 from " \
           "learner does not authenticate" in far_log and "not a sealed piece" in far_log
    every_log = b"".join(path.read_bytes() for path in logs.iterdir())
    key = keys.bulk_key
    for form in (key, key.hex().encode(), repr(key).encode(), base64.b64encode(key)):
        assert form not in every_log


@async_test
async def test_one_publish_seals_once_for_two_receivers_on_other_nodes_and_a_failed_target_stops_neither():
    keys = CurveKeys.generate()
    async with Supervisor.open(keys=keys) as sup, Supervisor.open(keys=keys) as node_b, \
            Supervisor.open(keys=keys) as node_c:
        learner = await sup.start(spec("learner", "postrain.actors.learner:LearnerActor",
                                       {"model": TINY}, bind=f"tcp://{HOST}:0"))
        far_b = await node_b.start(spec("far_b", RECEIVER, {}, bind=f"tcp://{HOST}:0"))
        far_c = await node_c.start(spec("far_c", RECEIVER, {}, bind=f"tcp://{HOST}:0"))
        sup.add_peers({"far_b": far_b.address, "far_c": far_c.address})
        for node in (node_b, node_c):
            node.expect(["learner"])             # they know the learner's key (core/identity.py)
        with pytest.raises(RemoteError, match="failed for 1 of 3 targets .the others hold it.: ghost: "):
            await learner.ask("publish", {"targets": ["far_b", "ghost", "far_c"], "chunk_mb": 1.0})
        weights = (await learner.ask("get_weights"))["weights"]
        for receiver in (far_b, far_c):                                         # bit for bit, both
            assert await receiver.ask("digest") == {"version": 0, "digest": weights_digest(weights)}
        _, streams = sealed_sync(weights, 0, 1.0, "learner", PIECE_BYTES, timeout_s=10)
        one_sync = sum(len(piece_plan([len(b) for b in buffers], PIECE_BYTES)) for _, buffers in streams)
        assert (await learner.ask("stats"))["num_pieces_sealed"] == one_sync > len(streams)   # not 2x
        reply = await learner.ask("publish", {"targets": ["far_b", "far_c"], "chunk_mb": 1.0})
        assert sorted(reply["sync_s"]) == ["far_b", "far_c"] and reply["num_messages"] == 2 * len(streams)
        assert (await learner.ask("stats"))["num_pieces_sealed"] == 2 * one_sync
