"""The learner's `weight_transport` (actors/weights/transport.py): "sealed" sends every target the
sealed chunks, also on one host, and they hold the weights "auto" gives (bit for bit); "message"
sends every target one message, here and on another node, patches included; an unknown choice is
refused when the config loads, naming the choices."""
from __future__ import annotations

import pytest
import torch

from postrain.actors.records import PublishReport, PublishRequest
from postrain.actors.weights import weight_transport
from postrain.actors.weights.messages import weight_chunks, weights_digest
from postrain.core import ActorSpec, ConfigError, CurveKeys, RemoteError, Supervisor, parse_config, resolve_options
from postrain.core.testing import async_test
from train_batches import small_batch  # tests/actors/train_batches.py

LEARNER = "postrain.actors.learner:LearnerActor"
RECEIVER = "postrain.actors.weights:WeightReceiverActor"
LOOPBACK = "tcp://127.0.0.1:0"      # tcp, yet this host: "auto" sends by message
BEYOND = "tcp://0.0.0.0:0"          # every address of this machine: beyond loopback


def spec(name: str, cls: str, options: dict, bind: str = "ipc") -> ActorSpec:
    return ActorSpec(name=name, cls=cls, options=options, cpus=0.5, memory_mb=0, max_restarts=0, bind=bind)


async def publish(learner, targets: list[str], chunk_mb: float | None = None) -> PublishReport:
    request = PublishRequest(targets=targets, chunk_mb=chunk_mb)
    return PublishReport.from_wire(await learner.ask("publish", request.to_wire(), timeout_s=120))


@pytest.mark.slow
@pytest.mark.variants     # sealed sends across nodes: test_weight_assembly.py
@async_test
async def test_sealed_on_one_host_delivers_the_weights_auto_delivers():
    async with Supervisor.open(keys=CurveKeys.generate()) as sup:
        sealed = await sup.start(spec("sealed", LEARNER, {"model": "tiny", "weight_transport": "sealed"}))
        auto = await sup.start(spec("auto", LEARNER, {"model": "tiny"}))                   # the default
        by_sealed = await sup.start(spec("by_sealed", RECEIVER, {}, bind=LOOPBACK))
        by_auto = await sup.start(spec("by_auto", RECEIVER, {}))                       # ipc: no channel

        report = await publish(auto, ["by_auto"], chunk_mb=1.0)
        assert report.num_messages == 1 and (await auto.ask("stats"))["num_pieces_sealed"] == 0   # /dev/shm
        weights = (await auto.ask("get_weights"))["weights"]
        assert weights_digest((await sealed.ask("get_weights"))["weights"]) == weights_digest(weights)

        # "sealed" on this host: chunks on by_sealed's channel; by_auto, bound to ipc, has none
        with pytest.raises(RemoteError, match=r"failed for 1 of 2 targets .the others hold it.: by_auto: .*"
                                              r"bind it to tcp, or publish to it by message"):
            await publish(sealed, ["by_sealed", "by_auto"], chunk_mb=1.0)
        report = await publish(sealed, ["by_sealed"], chunk_mb=1.0)
        assert report.num_messages == len(weight_chunks(weights, 1.0)) > 1
        assert report.num_bytes_sent == report.num_bytes
        assert (await sealed.ask("stats"))["num_pieces_sealed"] > 0
        held = {"version": 0, "digest": weights_digest(weights)}
        assert await by_sealed.ask("digest") == held == await by_auto.ask("digest")       # bit for bit


@pytest.mark.slow
@pytest.mark.variants
@async_test
async def test_message_sends_one_message_to_every_target_here_and_on_another_node_patches_included():
    keys = CurveKeys.generate()
    async with Supervisor.open(keys=keys) as sup, Supervisor.open(keys=keys) as other_node:
        learner = await sup.start(spec("learner", LEARNER, {
            "model": "tiny", "weight_transport": "message", "weight_sync": "delta", "publish_dtype": "bfloat16",
            "learner": {"lr": 1e-6, "micro_batch_size": 2}}, bind=BEYOND))
        near = await sup.start(spec("near", RECEIVER, {}))
        far = await other_node.start(spec("far", RECEIVER, {}, bind=BEYOND))
        sup.add_peers({"far": far.address})      # as the node agents tell each other (core/ray_nodes.py)
        other_node.expect(["learner"])           # far knows the learner's key (core/identity.py)

        first = await publish(learner, ["near", "far"], chunk_mb=1.0)          # chunk_mb: not for messages
        assert first.num_messages == 2 and first.num_bytes_sent == 2 * first.num_bytes    # whole, to each
        await learner.ask("train", small_batch(), timeout_s=120)
        second = await publish(learner, ["near", "far"])
        assert second.num_messages == 2 and 0 < second.num_bytes_sent < second.num_bytes  # two deltas
        assert (await learner.ask("stats"))["num_pieces_sealed"] == 0
        weights = (await learner.ask("get_weights"))["weights"]
        held = {"version": 1, "digest": weights_digest({k: v.to(torch.bfloat16) for k, v in weights.items()})}
        for receiver in (near, far):
            assert await receiver.ask("digest") == held


def test_an_unknown_weight_transport_is_refused_when_the_config_loads_naming_the_choices():
    run = parse_config({"actors": [{"name": "learner", "cls": LEARNER, "options": {"weight_transport": "nccl"}}]})
    with pytest.raises(ConfigError) as info:
        resolve_options(run)
    assert str(info.value).splitlines()[1:] == [
        "  actors.0(learner).options.weight_transport = 'nccl': Input should be 'auto', 'message' or 'sealed'"]
    with pytest.raises(ValueError, match=r"weight_transport must be one of \('auto', 'message', 'sealed'\), "
                                         "got 'nccl'"):
        weight_transport("nccl", "learner", keys=None)
