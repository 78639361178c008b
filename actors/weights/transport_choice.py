"""Which WeightTransport runs: the learner's `weight_transport`, and under "auto" each target's host.

    transport = weight_transport("auto", learner_name, node.keys)   # a WeightTransport (transport.py)

The choices (`WEIGHT_TRANSPORTS`):
- "message" (message_transport.py): one `load_weights` message per target, the plan's patch
  where it has one; the wire moves its tensors through /dev/shm where the two ends share a
  host, inline otherwise;
- "sealed" (sealed_transport.py): the whole weights as chunks, sealed once for every target and
  sent on each target's sealed channel (core/sealed.py), wherever the target runs: on one host
  it tests and benches the cluster path;
- "auto" (`ByHostTransport`, the default): targets on this host by message, the others sealed.
"""
from __future__ import annotations

from typing import Literal, get_args

import anyio

from ..records import PublishRequest
from .message_transport import MessageTransport
from .sealed_transport import SealedTransport
from .sync_plan import PublishPlan
from .transport import Delivery, WeightTransport

WeightTransportChoice = Literal["auto", "message", "sealed"]   # the learner actor's `weight_transport` option
WEIGHT_TRANSPORTS: tuple[str, ...] = get_args(WeightTransportChoice)


class ByHostTransport:
    """"auto": the targets on this host (`ActorRef.same_host`: by node identity or address) by
    `near`, the others by `far`, both at once."""

    def __init__(self, near: WeightTransport, far: WeightTransport):
        self.near = near
        self.far = far

    @property
    def num_pieces_sealed(self) -> int:
        return self.near.num_pieces_sealed + self.far.num_pieces_sealed

    async def deliver(self, plan: PublishPlan, targets: dict, request: PublishRequest,
                      errors: dict[str, Exception]) -> dict[str, Delivery]:
        """WeightTransport.deliver: the near targets and the far ones concurrently."""
        delivered: dict[str, Delivery] = {}

        async def deliver_by(transport: WeightTransport, chosen: dict) -> None:
            if chosen:
                delivered.update(await transport.deliver(plan, chosen, request, errors))

        async with anyio.create_task_group() as tg:
            tg.start_soon(deliver_by, self.near, {n: t for n, t in targets.items() if t.same_host})
            tg.start_soon(deliver_by, self.far, {n: t for n, t in targets.items() if not t.same_host})
        return delivered

    def close(self) -> None:
        self.near.close()
        self.far.close()


def weight_transport(choice: str, sender_name: str, keys) -> WeightTransport:
    """The transport `choice` names (one of WEIGHT_TRANSPORTS; the learner actor's
    `weight_transport` option) for the actor `sender_name` with the run's CurveKeys `keys`
    (their bulk_key seals the pieces a sealed transport sends)."""
    if choice == "message":
        return MessageTransport()
    if choice == "sealed":
        return SealedTransport(sender_name, keys)
    if choice == "auto":
        return ByHostTransport(MessageTransport(), SealedTransport(sender_name, keys))
    raise ValueError(f"weight_transport must be one of {WEIGHT_TRANSPORTS}, got {choice!r}")
