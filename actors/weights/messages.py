"""The sending side of a weight sync: a state dict as `load_weights` messages, chunks, sealed pieces.

    messages = weight_messages(weights, version=3, chunk_mb=64)   # WeightSync records, in order
    digest = weights_digest(weights)                               # what a receiver checks

The receiving side is receiver.py; the contract is in actors/learner/actor.py.
"""
from __future__ import annotations

import hashlib

import torch

from ..records import SealedChunk, WeightSync


def weight_messages(weights: dict[str, torch.Tensor], version: int, chunk_mb: float | None = None
                    ) -> list[WeightSync]:
    """The `load_weights` records of one sync: one message, or chunks of whole tensors of at most
    chunk_mb MiB each (a larger tensor travels alone) tagged "chunk" i of "num_chunks"."""
    if not chunk_mb:
        return [WeightSync(version, weights)]
    parts = weight_chunks(weights, chunk_mb)
    return [WeightSync(version, part, chunk=i, num_chunks=len(parts))
            for i, part in enumerate(parts)]


def weight_chunks(weights: dict[str, torch.Tensor], chunk_mb: float | None) -> list[dict]:
    """The weights cut into chunks of whole tensors of at most chunk_mb MiB each (a larger tensor
    travels alone); None: one chunk."""
    if chunk_mb is not None and chunk_mb <= 0:
        raise ValueError(f"chunk_mb must be > 0 or None, got {chunk_mb}")
    parts: list[dict[str, torch.Tensor]]
    limit, parts, size = (chunk_mb or float("inf")) * 2**20, [{}], 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if parts[-1] and size + nbytes > limit:
            parts.append({})
            size = 0
        parts[-1][name] = tensor
        size += nbytes
    return parts


def sealed_sync(weights: dict[str, torch.Tensor], version: int, chunk_mb: float | None, sender: str,
                piece_bytes: int, timeout_s: float) -> tuple[list[WeightSync], list]:
    """One sync to a target on another node: its `load_weights` records (chunks naming their
    tensors, which travel sealed) and, per chunk, (Stream, [byte view of each tensor])."""
    from postrain.core.sealed import Stream, new_sync_id

    parts, sync_id = weight_chunks(weights, chunk_mb), new_sync_id()
    messages, streams = [], []
    for i, part in enumerate(parts):
        tensors = [t.detach().contiguous() for t in part.values()]
        layout = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                  for name, t in zip(part, tensors)]
        sealed = SealedChunk(sender, sync_id, layout, piece_bytes, timeout_s)
        messages.append(WeightSync(version, {}, chunk=i, num_chunks=len(parts), sealed=sealed))
        streams.append((Stream(sender, version, sync_id, i),
                        [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in tensors]))
    return messages, streams


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a state dict (sorted by name)."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            # the buffer itself, no copy (type ignore: numpy's stub has __buffer__ on Python 3.12+ only)
            digest.update(t.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return digest.hexdigest()
