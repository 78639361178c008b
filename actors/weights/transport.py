"""WeightTransport: the interface of every way one publish's version reaches its targets.

    delivered = await transport.deliver(plan, {"gen0": ref}, request, errors)   # {name: Delivery}

Design note. The publisher (publisher.py) decides what every target should hold and reports
the outcome; a transport only moves the version there and says who confirmed it (`Delivery`),
so the publisher never knows which one runs. The implementations: MessageTransport
(message_transport.py), SealedTransport (sealed_transport.py), and ByHostTransport, each
target by its host (transport_choice.py, which builds the one the learner's
`weight_transport` names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..records import PublishRequest, WeightSync
from .sync_plan import PublishPlan


@dataclass(frozen=True)
class Delivery:
    """One target's confirmed delivery of a publish's version.

    Invariant: num_messages >= 1 (tests/actors/weights/test_weight_transport.py). `message` is
    the one message the target took and confirmed (a patch, or the whole weights: the planner
    remembers its version, so the next sync may be a patch on it); None when it took the plan's
    whole weights another way, holding nothing a patch builds on (the planner forgets it)."""

    num_messages: int          # load_weights messages sent to it
    done_at: float             # time.perf_counter() at its confirmation
    message: WeightSync | None

    def __post_init__(self):
        assert self.num_messages >= 1, self


class WeightTransport(Protocol):
    """A way to move a publish's version to its targets (module docstring)."""

    @property
    def num_pieces_sealed(self) -> int:
        """Pieces sealed so far (core/sealed.py); 0 for a transport that seals none."""
        ...

    async def deliver(self, plan: PublishPlan, targets: dict, request: PublishRequest,
                      errors: dict[str, Exception]) -> dict[str, Delivery]:
        """Move `plan`'s version to every target (`targets`: name -> its ActorRef), concurrently,
        under `request`'s timeout_s (and chunk_mb, where the transport chunks). Returns the targets
        that confirmed it; every other target is in `errors` with why, and one failing stops no
        other. Cancelled: targets that already confirmed hold the version; the others may or may
        not, and none holds a part of it."""
        ...

    def close(self) -> None:
        """Release what the transport holds open (sockets, threads); it is not used again."""
        ...
