"""SealedTransport: a publish's whole weights as chunks whose bytes travel sealed, once for all targets.

    transport = SealedTransport("learner", node.keys)   # weight_transport = "sealed" (or "auto", far)
    delivered = await transport.deliver(plan, {"gen1": ref}, request, errors)

Design note. The bytes of one version are sealed once (AES-256-GCM pieces, core/sealed.py) and
the same sealed pieces go to every target's sealed channel, so a publish to n targets costs one
seal, not n. Each target first names its channel (`weights_channel`, asked every sync: a
target started again has a new one), then gets the version as chunks of at most
`request.chunk_mb` MiB of whole tensors (None: one chunk), each a `load_weights` message that
names its tensors (`SealedChunk`); their bytes come on the channel, and the receiver applies
the version when its last chunk is whole (assembly.py). Always the whole weights, never a
patch. It works wherever the target runs, on another node or on this host, for a target
bound to tcp whose process has the run's bulk key.
"""
from __future__ import annotations

import threading
import time

from typing import TYPE_CHECKING

import anyio

from ..records import LOAD_WEIGHTS, WEIGHTS_CHANNEL, PublishRequest
from .messages import sealed_sync
from .sync_plan import PublishPlan
from .transport import Delivery

if TYPE_CHECKING:
    from postrain.core.sealed import SealedSender


class SealedTransport:
    """The sealed sender of one learner and the channels its targets named.

    Invariants: `channel_addresses[name]` is the sealed channel `name` named at its last sync;
    `sender` is None until a target first names its channel."""

    def __init__(self, sender_name: str, keys):
        self.sender_name = sender_name
        self.keys = keys                        # the run's CurveKeys: their bulk_key seals the pieces
        self.sender: SealedSender | None = None   # the SealedSender, once needed
        self.channel_addresses: dict[str, str] = {}   # target name -> its sealed channel's last address

    @property
    def num_pieces_sealed(self) -> int:
        return self.sender.num_pieces_sealed if self.sender is not None else 0

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    async def deliver(self, plan: PublishPlan, targets: dict, request: PublishRequest,
                      errors: dict[str, Exception]) -> dict[str, Delivery]:
        """WeightTransport.deliver: ask every target its channel, then send the sync to those that
        answered. Cancelled: the sending thread stops within 0.1 s; the targets drop the sync."""
        channels = await self._ask_channels(targets, request.timeout_s, errors)
        if not channels:
            return {}
        self._open(channels)
        return await self._send(channels, plan, request.chunk_mb, request.timeout_s, errors)

    @staticmethod
    async def _ask_channels(targets: dict, timeout_s: float, errors: dict[str, Exception]) -> dict[str, tuple]:
        """{name: (its reference, its sealed channel's address)} of the targets that named one."""
        channels: dict[str, tuple] = {}

        async def ask(name: str, target) -> None:
            try:
                channels[name] = (target, (await target.call(WEIGHTS_CHANNEL, timeout_s=timeout_s)).address)
            except Exception as exc:
                errors[name] = exc

        async with anyio.create_task_group() as tg:
            for name, target in targets.items():
                tg.start_soon(ask, name, target)
        return channels

    def _open(self, channels: dict[str, tuple]) -> None:
        """The sender made (once), and the channels a target left (it started again) forgotten."""
        from postrain.core.sealed import SealedSender

        if self.sender is None:
            self.sender = SealedSender(self.keys.bulk_key)
        for name, (_, address) in channels.items():
            old = self.channel_addresses.get(name)
            if old is not None and old != address:
                self.sender.forget(old)
            self.channel_addresses[name] = address

    async def _send(self, far: dict[str, tuple], plan: PublishPlan, chunk_mb: float | None, timeout_s: float,
                    errors: dict[str, Exception]) -> dict[str, Delivery]:
        """One sync to the targets of `far` (name -> (reference, channel address)); the targets
        that took it whole. The others go in `errors`. The chunks go in order on each target's
        Curve connection, every one but the last as a tell, so the link never idles waiting for
        a reply (a target handles them one at a time in arrival order); their bytes are sealed
        once, piece by piece, in one worker thread and the same sealed pieces go to every
        target's channel while ZeroMQ sends the last (core/sealed.py). A target's last reply
        confirms its whole sync; a chunk refused or lost leaves its last one refused: an error,
        never a part applied (assembly.py). A target whose pieces fail is cut off (its
        confirmation cancelled), one whose confirmation fails stops getting pieces; the others
        go on."""
        sender = self.sender
        assert sender is not None, "deliver opens the sender (_open) before it sends"
        messages, streams = sealed_sync(plan.weights, plan.version, chunk_mb, self.sender_name,
                                        sender.piece_bytes, timeout_s)
        abandon = {name: threading.Event() for name in far}
        scopes = {name: anyio.CancelScope() for name in far}
        done: dict[str, Delivery] = {}

        def send_all() -> dict[str, Exception]:
            names_of = {address: name for name, (_, address) in far.items()}
            failed: dict[str, Exception] = {}
            for stream, buffers in streams:
                live: dict[str, threading.Event | None] = {
                    address: abandon[name] for address, name in names_of.items() if name not in failed}
                if not live:
                    break
                for address, exc in sender.send(stream, buffers, live, timeout_s).items():
                    failed[names_of[address]] = exc
            return failed

        async def send_pieces() -> None:
            for name, exc in (await anyio.to_thread.run_sync(send_all)).items():
                errors.setdefault(name, exc)
                scopes[name].cancel()

        async def confirm(name: str, target) -> None:
            with scopes[name]:
                try:
                    for message in messages[:-1]:
                        await target.send(LOAD_WEIGHTS, message, timeout_s=timeout_s)
                    await target.call(LOAD_WEIGHTS, messages[-1], timeout_s=timeout_s)
                    done[name] = Delivery(num_messages=len(messages), done_at=time.perf_counter(), message=None)
                except Exception as exc:
                    errors.setdefault(name, exc)
                    abandon[name].set()
                except BaseException:         # cancelled: its pieces stop too
                    abandon[name].set()
                    raise

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_pieces)
            for name, (target, _) in far.items():
                tg.start_soon(confirm, name, target)
        return {name: delivery for name, delivery in done.items() if name not in errors}
