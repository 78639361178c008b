"""Putting chunked weight syncs back together, on the receiving side of `publish`.

A sync of policy version v is one `load_weights` message, or (to a generator on another
host: `publish` with chunk_mb) `num_chunks` messages of whole tensors, sent in order on one
connection without waiting (all but the last as tells; the receiver handles them one at a
time, in arrival order; the last one's reply confirms the sync). `SyncAssembler.take` keeps
the chunks of the sync in progress and hands back the whole state dict with its last chunk.

Rules (tests/actors/test_weight_assembly.py):
- versions never go back: a message below the version held, or below the sync in progress,
  is refused naming both;
- a newer sync (its chunk 0, or a whole message) drops the one in progress: the chunks
  received so far are discarded, counted in `num_dropped`, and never applied;
- chunk 0 of the version in progress starts it again (a publish retried after a failure);
- any other chunk must be the next one of the sync in progress, else it is refused
  (a missing chunk must not leave a state dict with holes).
"""
from __future__ import annotations

from .records import WeightSync


class SyncAssembler:
    """The chunks of one weight sync in progress.

    Invariants: (pending_version is None) == (next_chunk == 0) == (not pending);
    0 <= next_chunk < num_chunks while a sync is in progress."""

    def __init__(self):
        self.pending: dict = {}                 # the tensors of chunks 0..next_chunk - 1
        self.pending_version: int | None = None
        self.next_chunk = 0
        self.num_chunks = 0
        self.num_dropped = 0                    # syncs dropped unfinished for a newer one

    def take(self, sync: WeightSync, held_version: int) -> dict | None:
        """The whole weights of `sync.version` when `sync` completes it, else None (the chunk
        is kept). Raises ValueError for a version that goes back or a chunk out of order."""
        version = sync.version
        if version < held_version:
            raise ValueError(f"policy version must not go back: this actor holds {held_version}, got "
                             f"{version}; publish the learner's latest weights")
        if self.pending_version is not None and version < self.pending_version:
            raise ValueError(f"policy version must not go back: a sync of version {self.pending_version} "
                             f"is in progress, got {version}; publish the learner's latest weights")
        if sync.chunk is None or sync.chunk == 0:
            self._drop()
            if sync.chunk is None:
                return sync.weights
            self.pending_version, self.num_chunks = version, sync.num_chunks
        elif (version, sync.chunk, sync.num_chunks) != (self.pending_version, self.next_chunk, self.num_chunks):
            held = (f"chunks 0..{self.next_chunk - 1} of {self.num_chunks} of version {self.pending_version}"
                    if self.pending_version is not None else "no sync in progress")
            raise ValueError(f"chunk {sync.chunk} of {sync.num_chunks} of version {version} arrived out of "
                             f"order ({held}); chunks go in order from 0: publish again")
        self.pending.update(sync.weights)
        self.next_chunk += 1
        if self.next_chunk < self.num_chunks:
            return None
        weights = self.pending
        self.pending, self.pending_version, self.next_chunk, self.num_chunks = {}, None, 0, 0
        return weights

    def _drop(self) -> None:
        """Forget the sync in progress (a newer one, or the same one again, starts)."""
        if self.pending_version is not None:
            self.num_dropped += 1
        self.pending, self.pending_version, self.next_chunk, self.num_chunks = {}, None, 0, 0
