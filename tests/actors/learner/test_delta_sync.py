"""Delta weight syncs (`weight_sync = "delta"`, actors/weights/sync_plan.py, actors/weights/patch.py): after
the first full sync only the changed elements travel, checked by a digest; a receiver that missed a
version is sent the whole weights; a corrupted delta is refused and the weights held stay."""
from __future__ import annotations

import pytest
import torch

from postrain.actors.weights.messages import weights_digest
from postrain.actors.records import PublishReport, PublishRequest, WeightPatch, WeightSync
from postrain.actors.weights.patch import PatchRefused, WeightPatcher, apply_delta, encode_delta
from postrain.core import ActorSpec, RemoteError, Supervisor
from postrain.core.testing import async_test
from train_batches import small_batch  # tests/actors/train_batches.py


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(1000, generator=g), "c": torch.randn(8, generator=g)}


def test_a_delta_carries_only_the_changed_elements_in_the_smaller_encoding():
    old = weights()
    new = {k: v.clone() for k, v in old.items()}
    new["a"][3, 4] += 1.0                     # one element: index + value
    new["b"][::2] += 1.0                      # half: a bitmask + values
    new["c"][:] = -new["c"]                   # all of a small tensor: whole
    delta, num_changed = encode_delta(old, new)
    assert num_changed == 1 + 500 + 8
    assert set(delta) == {"a#idx", "a#val", "b#mask", "b#val", "c"}
    assert delta["a#idx"].tolist() == [3 * 32 + 4] and delta["b#mask"].numel() == 125
    applied = apply_delta(old, delta)
    assert weights_digest(applied) == weights_digest(new)
    assert applied["a"] is not old["a"] and torch.equal(old["a"], weights()["a"])   # held weights untouched
    old["c"][0] = 0.0
    signed = {k: v.clone() for k, v in old.items()}
    signed["c"][0] = -0.0                     # equal as floats, not as bits: it travels
    signed["b"][7] = torch.nan
    assert encode_delta(old, signed)[1] == 2 and encode_delta(old, old) == ({}, 0)


def sync_of(delta: dict, digest: str, base_version: int, version: int) -> WeightSync:
    return WeightSync(version, delta, patch=WeightPatch("delta", digest, base_version=base_version))


def test_a_corrupted_delta_or_one_on_another_version_is_refused():
    old = weights()
    new = {k: v.clone() for k, v in old.items()}
    new["b"][::3] += 1.0
    delta, _ = encode_delta(old, new)
    patcher = WeightPatcher()
    good = sync_of(delta, weights_digest(new), 3, 4)
    assert weights_digest(patcher.resolve(good, delta, 3, lambda: old)) == weights_digest(new)
    corrupted = dict(delta, **{"b#val": delta["b#val"].clone()})
    corrupted["b#val"][0] += 1e-3
    with pytest.raises(PatchRefused, match="digest .* the learner's are"):
        patcher.resolve(sync_of(corrupted, weights_digest(new), 3, 4), corrupted, 3, lambda: old)
    with pytest.raises(PatchRefused, match="holds version 2: publish a full sync"):
        patcher.resolve(good, delta, 2, lambda: old)
    with pytest.raises(PatchRefused, match="must be in the dtype the learner publishes"):
        patcher.resolve(good, delta, 3, lambda: {k: v.double() for k, v in old.items()})


def spec(name: str, cls: str, options: dict) -> ActorSpec:
    return ActorSpec(name=name, cls=cls, options=options, cpus=0.5, memory_mb=0, max_restarts=0)


@pytest.mark.slow
@async_test
async def test_delta_syncs_keep_receivers_bit_exact_and_one_that_missed_a_version_gets_a_full_sync():
    async with Supervisor.open() as sup:
        learner = await sup.start(spec("learner", "postrain.actors.learner.actor:LearnerActor", {
            "model": "tiny", "weight_sync": "delta", "publish_dtype": "bfloat16",
            "learner": {"lr": 1e-6, "micro_batch_size": 2}}))
        receivers = {   # gen0, a real generator, takes deltas; gen1, the reference receiver, misses one
            "gen0": await sup.start(spec("gen0", "postrain.actors.generator:GeneratorActor",
                                         {"model": "tiny", "kv_cache_mb": 4})),
            "gen1": await sup.start(spec("gen1", "postrain.actors.weights:WeightReceiverActor",
                                         {"model": "tiny"}))}

        async def publish(*targets) -> PublishReport:
            return PublishReport.from_wire(await learner.ask(
                "publish", PublishRequest(targets=list(targets)).to_wire(), timeout_s=120))

        async def learner_weights() -> WeightSync:
            return WeightSync.from_wire(await learner.ask("get_weights"))

        first = await publish("gen0", "gen1")
        assert first.num_bytes_sent == 2 * first.num_bytes                     # whole (bfloat16), to each
        assert first.num_bytes == sum(t.numel() * 2 for t in (await learner_weights()).weights.values())
        await learner.ask("train", small_batch(0), timeout_s=120)
        second = await publish("gen0")                                          # gen1 misses version 1
        assert 0 < second.num_bytes_sent < 0.5 * second.num_bytes    # most updates round away in bfloat16
        await learner.ask("train", small_batch(1), timeout_s=120)
        third = await publish("gen0", "gen1")
        delta_bytes = third.num_bytes_sent - third.num_bytes                   # gen1: whole; gen0: a delta
        assert 0 < delta_bytes < 0.5 * third.num_bytes
        want = {k: v.to(torch.bfloat16) for k, v in (await learner_weights()).weights.items()}
        held = weights_digest({k: v.float() for k, v in want.items()})        # receivers run float32 models
        for ref in receivers.values():
            assert await ref.ask("digest") == {"version": 2, "digest": held}

        # a corrupted delta is refused by its digest; the receiver keeps version 2
        changed = {name: t.clone() for name, t in want.items()}
        changed["model.norm.weight"][0] += 1.0
        delta, _ = encode_delta(want, changed)
        delta["model.norm.weight#val"] += 1.0
        bad = WeightSync(3, delta, patch=WeightPatch("delta", weights_digest(changed), base_version=2, dtype="bfloat16"))
        with pytest.raises(RemoteError, match="refused, publish a full sync"):
            await receivers["gen0"].ask("load_weights", bad.to_wire())
        assert await receivers["gen0"].ask("digest") == {"version": 2, "digest": held}
