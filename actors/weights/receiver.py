"""WeightReceiver: the receiving end of the weight-sync protocol, one per receiving actor.

    receiver = WeightReceiver(node.keys, inbox_address)
    weights = await receiver.receive(sync, held_version, held_weights)   # None: chunks still to come
    WeightsChannel(address=receiver.channel_address())                   # a learner on another node asks
    WeightsDigest(version=v, digest=weights_digest(held_weights()))      # what the learner checks

Design note. A sync reaches a receiver in one of three shapes and leaves it as one whole
state dict (or an error that changes nothing): one message through /dev/shm (a learner on this
host), chunks whose bytes come on the receiver's sealed channel (a learner on another node:
`SealedWeights`, assembly.py), and a patch on what the receiver holds (LoRA adapters, or the
elements that changed: `WeightPatcher`, patch.py), checked by the digest of the weights it
must produce. The generator and the reference receiver (reference_actor.py) both receive
through this class, so the protocol's receiving rules are written once: versions never go
back, a sync is applied whole or not at all, a patch that cannot give the learner's weights is
refused (the learner then sends them whole).
"""
from __future__ import annotations

from typing import Callable

import anyio
import torch

from ..records import WeightSync
from .assembly import SealedWeights, SyncAssembler
from .patch import WeightPatcher


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's weights as a sync carries them: {HF name: tensor}, no tied lm_head duplicate."""
    tied = model.config.tie_word_embeddings  # type: ignore[union-attr]  # torch: the model's own attribute
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


class WeightReceiver:
    """The chunk assembler, the sealed channel and the patcher of one receiving actor."""

    def __init__(self, keys, inbox_address: str):
        self.chunks = SyncAssembler()      # the chunked sync in progress, if any
        self.patches = WeightPatcher()     # LoRA adapters and deltas -> whole weights
        self.sealed = SealedWeights(keys, inbox_address)

    def channel_address(self) -> str:
        """The sealed channel's address (bound on first call)."""
        return self.sealed.address()

    async def receive(self, sync: WeightSync, held_version: int,
                      held_weights: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        """The whole weights `sync` brings, or None while a chunked sync waits for its later
        chunks. `held_weights()`: the weights held now (what a patch applies to). Raises
        ValueError for a chunk out of order or below `held_version`, PatchRefused for a patch
        that cannot give the learner's weights; nothing changes then. Cancelled: a sealed
        receive or a patch in its thread runs to its end; nothing is applied."""
        if sync.sealed is not None:
            sync = await self.sealed.fill(sync, self.chunks, held_version)
        weights = self.chunks.take(sync, held_version)
        if weights is None:
            return None
        return await anyio.to_thread.run_sync(self.patches.resolve, sync, weights, held_version, held_weights)

    def close(self) -> None:
        """Close the sealed channel, if open."""
        self.sealed.close()
