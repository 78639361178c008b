"""The reference receiver of weight syncs: what a generator does with `publish`, without an engine.

    spec = ActorSpec(name="gen0", cls="postrain.actors.weight_receiver:WeightReceiverActor",
                     options={"model": "tiny"})

Tests and `postrain bench` use it to measure and check syncs on their own.
"""
from __future__ import annotations

import torch
from pydantic import Field

from postrain.core import Actor, Options, handler

from .learner.publish import weights_digest
from .records import WeightsChannel, WeightsDigest, WeightSync, WeightSyncReply
from .weight_assembly import SealedWeights, SyncAssembler
from .weight_patch import WeightPatcher


class WeightReceiverOptions(Options):
    model: str | dict | None = Field(None, description="load the weights into this model (a load_model "
                                     "spec or ModelConfig fields); none: just keep them")


class WeightReceiverActor(Actor):
    """The reference receiving side of `publish`: loads weights into a model (options.model: a
    load_model spec or ModelConfig fields) or, without a model, just keeps them.

    Rule: versions never go back; a lower version is an error naming both. Chunked syncs
    (bodies with "chunk" / "num_chunks") are applied when the last chunk arrives (chunks of
    one sync arrive in order on one connection and are handled one at a time), as the
    generator does (postrain.actors.weight_assembly)."""

    Options = WeightReceiverOptions
    needs_bulk_key = True         # opens sealed weights from another node (core/identity.py)

    async def setup(self):
        """Build the model, if any. Does not wait (cancel-safe)."""
        self.model = None
        if self.options.model is not None:
            from .models.loading import build_policy
            self.model, _ = build_policy(self.options.model, 0, torch.float32, "cpu")
        self.version = -1
        self.weights: dict[str, torch.Tensor] = {}
        self._chunks = SyncAssembler()   # the chunked sync in progress, if any
        self._patches = WeightPatcher()  # LoRA adapters and deltas -> whole weights (weight_patch.py)
        self._sealed = SealedWeights(self.node.keys, self.address)

    async def teardown(self):
        """Close the sealed channel, if open. Does not wait."""
        self._sealed.close()

    @handler("weights_channel", request=None, reply=WeightsChannel)
    async def weights_channel(self, body: None) -> WeightsChannel:
        """The address of the sealed channel for weights from another node (opened now if not yet).
        Does not wait (cancel-safe)."""
        return WeightsChannel(address=self._sealed.address())

    @handler("load_weights", request=WeightSync, reply=WeightSyncReply)
    async def load_weights(self, sync: WeightSync) -> WeightSyncReply:
        """Take a sync (or one chunk of it). A sealed chunk waits for its pieces (cancelled: see
        SealedWeights.fill, nothing applied); otherwise it does not wait (atomic)."""
        if sync.sealed is not None:
            sync = await self._sealed.fill(sync, self._chunks, self.version)
        weights = self._chunks.take(sync, self.version)
        if weights is None:
            return WeightSyncReply(version=self.version, complete=False)
        weights = self._patches.resolve(sync, weights, self.version, self._held)
        self._apply(weights, sync.version)
        return WeightSyncReply(version=sync.version, complete=True)

    def _apply(self, weights: dict, version: int) -> None:
        from .models.loading import load_state_dict_checked

        if self.model is not None:
            load_state_dict_checked(self.model, weights, source=f"weights v{version}")
        else:
            self.weights = dict(weights)
        self.version = version

    def _held(self) -> dict:
        """The weights held now ({name: tensor}, no tied duplicate)."""
        if self.model is None:
            return self.weights
        return {k: v for k, v in self.model.state_dict().items()
                if not (self.model.config.tie_word_embeddings and k == "lm_head.weight")}

    @handler("digest", request=None, reply=WeightsDigest)
    async def digest(self, body: None) -> WeightsDigest:
        """A digest of the weights held. Does not wait (cancel-safe)."""
        return WeightsDigest(version=self.version, digest=weights_digest(self._held()))
