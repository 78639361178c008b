"""Putting chunked weight syncs back together, on the receiving side of `publish`.

A sync of policy version v is one `load_weights` message, or (to a generator on another
host: `publish` with chunk_mb) `num_chunks` messages of whole tensors, sent in order on one
connection without waiting (all but the last as tells; the receiver handles them one at a
time, in arrival order; the last one's reply confirms the sync). `SyncAssembler.take` keeps
the chunks of the sync in progress and hands back the whole state dict with its last chunk.

Rules (tests/actors/weights/test_weight_assembly.py):
- versions never go back: a message below the version held, or below the sync in progress,
  is refused naming both;
- a newer sync (its chunk 0, or a whole message) drops the one in progress: the chunks
  received so far are discarded, counted in `num_dropped`, and never applied;
- chunk 0 of the version in progress starts it again (a publish retried after a failure);
- any other chunk must be the next one of the sync in progress, else it is refused
  (a missing chunk must not leave a state dict with holes).

From a learner on another node each chunk's tensors come on the receiver's sealed channel
(core/sealed.py), not in the message: `SealedWeights.fill` receives them into fresh tensors
before the chunk is taken. A chunk whose pieces are refused (or do not come in time) fails,
drops the sync in progress whole, and the sync's later chunks are refused: the receiver keeps
the weights it held. Same-node targets use the channel only under a learner's
`weight_transport = "sealed"` (else they get /dev/shm), and nothing of it is imported until a
learner asks for it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from ..records import WeightSync

if TYPE_CHECKING:
    from postrain.core.sealed import SealedReceiver

_ALIGN_BYTES = 64       # each tensor's offset in a chunk's buffer


class SyncAssembler:
    """The chunks of one weight sync in progress.

    Invariants: (pending_version is None) == (next_chunk == 0) == (not pending);
    0 <= next_chunk < num_chunks while a sync is in progress."""

    def __init__(self):
        self.pending: dict = {}                 # the tensors of chunks 0..next_chunk - 1
        self.pending_version: int | None = None
        self.next_chunk = 0
        self.num_chunks = 0
        self.num_dropped = 0                    # syncs dropped unfinished (a newer one, a failed chunk)

    def take(self, sync: WeightSync, held_version: int) -> dict | None:
        """The whole weights of `sync.version` when `sync` completes it, else None (the chunk
        is kept). Raises ValueError for a version that goes back or a chunk out of order."""
        self.check(sync, held_version)
        if sync.chunk is None or sync.chunk == 0:
            self.drop()
            if sync.chunk is None:
                return sync.weights
            self.pending_version, self.num_chunks = sync.version, sync.num_chunks
        self.pending.update(sync.weights)
        self.next_chunk += 1
        if self.next_chunk < self.num_chunks:
            return None
        weights = self.pending
        self.pending, self.pending_version, self.next_chunk, self.num_chunks = {}, None, 0, 0
        return weights

    def check(self, sync: WeightSync, held_version: int) -> None:
        """ValueError when `take` would refuse `sync` (a version that goes back, a chunk out of
        order); changes nothing."""
        version = sync.version
        if version < held_version:
            raise ValueError(f"policy version must not go back: this actor holds {held_version}, got "
                             f"{version}; publish the learner's latest weights")
        if self.pending_version is not None and version < self.pending_version:
            raise ValueError(f"policy version must not go back: a sync of version {self.pending_version} "
                             f"is in progress, got {version}; publish the learner's latest weights")
        expected = (self.pending_version, self.next_chunk, self.num_chunks)
        if sync.chunk not in (None, 0) and (version, sync.chunk, sync.num_chunks) != expected:
            held = (f"chunks 0..{self.next_chunk - 1} of {self.num_chunks} of version {self.pending_version}"
                    if self.pending_version is not None else "no sync in progress")
            raise ValueError(f"chunk {sync.chunk} of {sync.num_chunks} of version {version} arrived out of "
                             f"order ({held}); chunks go in order from 0: publish again")

    def drop(self) -> None:
        """Forget the sync in progress (a newer one, or the same one again, starts; or one of its
        chunks failed)."""
        if self.pending_version is not None:
            self.num_dropped += 1
        self.pending, self.pending_version, self.next_chunk, self.num_chunks = {}, None, 0, 0


class SealedWeights:
    """One actor's end of sealed weight syncs: the channel (core/sealed.py) is bound on the host
    of the actor's inbox when a learner first asks for its `address` (one on another node, or
    any under `weight_transport = "sealed"`).
    `keys`: the run's CurveKeys (their bulk_key seals the pieces). Invariant: `_receiver` is
    None until `address` is first called."""

    def __init__(self, keys, inbox_address: str):
        self._keys = keys
        self._inbox_address = inbox_address
        self._receiver: SealedReceiver | None = None

    def address(self) -> str:
        if self._receiver is None:
            from postrain.core.sealed import SealedReceiver
            if not self._inbox_address.startswith("tcp://") or self._keys is None or not self._keys.bulk_key:
                raise ValueError("sealed weights come only to an actor bound to tcp with the run's keys "
                                 "(a cluster run); bind it to tcp, or publish to it by message (the "
                                 "learner's weight_transport 'auto' or 'message')")
            host = self._inbox_address.removeprefix("tcp://").rsplit(":", 1)[0]
            self._receiver = SealedReceiver(self._keys.bulk_key, host)
        return self._receiver.address

    async def fill(self, sync: WeightSync, assembler: SyncAssembler, held_version: int) -> WeightSync:
        """`sync` (a sealed chunk) with its tensors received from the channel. Raises ValueError
        for a chunk the assembler refuses or whose sync was dropped, SealedStreamError for a
        piece refused or late (the sync in progress is then dropped whole). Cancelled: the
        receive runs to its end (or its timeout) in its thread; nothing is applied."""
        from postrain.core.sealed import SealedStreamError, Stream

        sealed, receiver = sync.sealed, self._receiver
        # the caller fills sealed chunks alone, and a sealed chunk has its chunk index (WeightSync._check)
        assert sealed is not None and sync.chunk is not None, "fill takes a sealed chunk"
        if receiver is None:
            raise ValueError("a sealed chunk came before this actor's sealed channel was opened "
                             "(ask `weights_channel` first)")
        if sealed.sync_id in receiver.dropped:
            assembler.drop()
            raise ValueError(f"chunk {sync.chunk} of version {sync.version} belongs to a sync dropped after "
                             "a refused or missing piece (see this actor's log); publish again")
        try:
            assembler.check(sync, held_version)
        except ValueError:
            receiver.dropped.append(sealed.sync_id)   # its pieces are skipped, quietly
            raise
        weights, buffers = empty_chunk(sealed.layout)
        stream = Stream(sealed.sender, sync.version, sealed.sync_id, sync.chunk)
        try:
            await anyio.to_thread.run_sync(receiver.receive, stream, buffers, sealed.timeout_s)
        except SealedStreamError:
            assembler.drop()
            raise
        return WeightSync(sync.version, weights, chunk=sync.chunk, num_chunks=sync.num_chunks)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


def empty_chunk(layout: list) -> tuple[dict, list]:
    """({name: tensor}, [writable byte view of each]) for a chunk's layout: one buffer for the
    chunk (numpy's, which asks for huge pages: opening pieces into fresh small pages ran at a
    third of the speed), each tensor a view of it at a 64-byte aligned offset."""
    import numpy as np
    import torch

    dtypes: list[Any] = [getattr(torch, dtype, None) for _, dtype, _ in layout]   # torch dtypes, checked next
    for (name, dtype, _), torch_dtype in zip(layout, dtypes):
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"tensor {name!r} of a sealed chunk has dtype {dtype!r}, which is not a torch "
                             "dtype")
    sizes = [int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=d).element_size()
             for (_, _, shape), d in zip(layout, dtypes)]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // _ALIGN_BYTES) * _ALIGN_BYTES
    buffer = np.empty(end, dtype=np.uint8)
    weights, views = {}, []
    for (name, _, shape), torch_dtype, offset, size in zip(layout, dtypes, offsets, sizes):
        part = buffer[offset:offset + size]
        weights[name] = torch.frombuffer(part, dtype=torch_dtype).view(shape) if size else \
            torch.empty(shape, dtype=torch_dtype)
        views.append(memoryview(part))  # type: ignore[arg-type]  # numpy's stub has __buffer__ on 3.12+ only
    return weights, views
