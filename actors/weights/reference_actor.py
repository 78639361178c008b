"""The reference receiver of weight syncs: what a generator does with `publish`, without an engine.

    spec = ActorSpec(name="gen0", cls="postrain.actors.weights:WeightReceiverActor",
                     options={"model": "tiny"})

Tests and `postrain bench` use it to measure and check syncs on their own.
"""
from __future__ import annotations

import torch
from pydantic import Field

from postrain.core import Actor, Options, handler

from ..records import (LOAD_WEIGHTS, WEIGHTS_CHANNEL, WEIGHTS_DIGEST, WeightsChannel, WeightsDigest,
                       WeightSync, WeightSyncReply)
from .messages import weights_digest
from .receiver import WeightReceiver, model_weights


class WeightReceiverOptions(Options):
    model: str | dict | None = Field(None, description="load the weights into this model (a load_model "
                                     "spec or ModelConfig fields); none: just keep them")


class WeightReceiverActor(Actor):
    """The reference receiving side of `publish`: loads weights into a model (options.model: a
    load_model spec or ModelConfig fields) or, without a model, just keeps them.

    Rule: versions never go back; a lower version is an error naming both. Chunked syncs
    (bodies with "chunk" / "num_chunks") are applied when the last chunk arrives (chunks of
    one sync arrive in order on one connection and are handled one at a time), as the
    generator does (postrain.actors.weights.assembly)."""

    Options = WeightReceiverOptions
    needs_bulk_key = True         # opens sealed weights from another node (core/identity.py)

    async def setup(self):
        """Build the model, if any. Does not wait (cancel-safe)."""
        self.model = None
        if self.options.model is not None:
            from ..models.loading import build_policy
            self.model, _ = build_policy(self.options.model, 0, torch.float32, "cpu")
        self.version = -1
        self.weights: dict[str, torch.Tensor] = {}
        self.receiver = WeightReceiver(self.node.keys, self.address)

    async def teardown(self):
        """Close the sealed channel, if open. Does not wait."""
        self.receiver.close()

    @handler(WEIGHTS_CHANNEL)
    async def weights_channel(self, body: None) -> WeightsChannel:
        """The address of the sealed channel for weights from another node (opened now if not yet).
        Does not wait (cancel-safe)."""
        return WeightsChannel(address=self.receiver.channel_address())

    @handler(LOAD_WEIGHTS)
    async def load_weights(self, sync: WeightSync) -> WeightSyncReply:
        """Take a sync (or one chunk of it): WeightReceiver.receive, then load it. Cancelled:
        nothing applied (see WeightReceiver.receive)."""
        weights = await self.receiver.receive(sync, self.version, self._held)
        if weights is None:
            return WeightSyncReply(version=self.version, complete=False)
        self._apply(weights, sync.version)
        return WeightSyncReply(version=sync.version, complete=True)

    def _apply(self, weights: dict, version: int) -> None:
        from ..models.loading import load_state_dict_checked

        if self.model is not None:
            load_state_dict_checked(self.model, weights, source=f"weights v{version}")
        else:
            self.weights = dict(weights)
        self.version = version

    def _held(self) -> dict:
        """The weights held now ({name: tensor}, no tied duplicate)."""
        return self.weights if self.model is None else model_weights(self.model)

    @handler(WEIGHTS_DIGEST)
    async def digest(self, body: None) -> WeightsDigest:
        """A digest of the weights held. Does not wait (cancel-safe)."""
        return WeightsDigest(version=self.version, digest=weights_digest(self._held()))
