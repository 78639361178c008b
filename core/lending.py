"""The head's side of elastic cores: who works now, and the re-pinning that follows (core/elastic.py).

    reply = await head.call(WORK, WorkRequest("learner", busy=True))
    # WorkReply(elastic=True, transfers=[CoreTransfer("lend", [1], giver, taker)],
    #           holdings={name: CoreHolding(cpu_ids, num_threads, parked)})

A driver (the one that hands out work) says when an actor starts and stops having work. The
lender runs the pure rule (`elastic.plan`) and enacts its plan with the kernel's `_cores`
message: every revoke is acknowledged before the first grant is sent, so the reply to a
"busy" means the actor holds its cores and no other actor computes on them. One change at a
time (a lock), in arrival order. An actor that is not elastic is answered WorkReply(elastic=False)
and nothing moves. Each transfer is a line in the head's log; the driver writes the reply's
transfers as metrics rows.

A restarted actor starts pinned to what it holds now (`affinity`), so a restart never puts
two actors on one core. An actor that cannot be re-pinned (it died meanwhile: its restart
re-pins it) leaves the holding as planned; the error is logged, not raised.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import anyio

from . import elastic
from .control import Cores
from .messages import MessageKind
from .record import Record, codec

log = logging.getLogger("postrain.core")

Pin = Callable[[str, Cores], Awaitable[object]]  # send actor NAME the kernel's `_cores`; returns its reply


@dataclass(frozen=True, slots=True)
class WorkRequest(Record):
    """The head's `work` message: `actor` starts (busy) or stops (not busy) having work."""

    actor: str
    busy: bool


@dataclass(frozen=True, slots=True)
class CoreTransfer(Record):
    """Cores that changed holder (elastic.Transfer on the wire): `lend`, `return` or `move`."""

    action: str
    cpu_ids: list[int]
    giver: str
    taker: str


@dataclass(frozen=True, slots=True)
class CoreHolding(Record):
    """What an actor re-pinned holds now: its cores, its threads, and whether it is parked."""

    cpu_ids: list[int]
    num_threads: int
    parked: bool


@dataclass(frozen=True, slots=True)
class WorkReply(Record):
    """The reply to `work`: whether the actor is elastic, the transfers made and, per actor
    re-pinned, what it holds now."""

    elastic: bool
    transfers: list[CoreTransfer] = field(default_factory=list, metadata=codec(
        lambda transfers: [t.to_wire() for t in transfers],
        lambda items: [CoreTransfer.from_wire(item) for item in items]))
    holdings: dict[str, CoreHolding] = field(default_factory=dict, metadata=codec(
        lambda holdings: {name: h.to_wire() for name, h in holdings.items()},
        lambda items: {name: CoreHolding.from_wire(item) for name, item in items.items()}))


# A driver tells its head which actors start and stop having work (Actor.drives_work).
WORK = MessageKind("work", WorkRequest, WorkReply)


class CoreLender:
    """The holding of the elastic actors and the busy set; `set_busy` moves cores."""

    def __init__(self, homes: Callable[[], dict[str, elastic.Home]], pin: Pin):
        self._homes = homes            # the elastic actors placed now (their homes), read at each change
        self._pin = pin
        self.busy: frozenset[str] = frozenset()
        self.held: dict[str, frozenset[int]] = {}   # invariant: elastic.check_holdings after each change
        self._lock = anyio.Lock()

    def holding(self, actor: str, home: elastic.Home) -> elastic.Holding:
        """What `actor` holds now (its home before any change)."""
        return elastic.Holding(actor, self.held.get(actor, home.cpu_ids), home)

    async def set_busy(self, actor: str, busy: bool) -> WorkReply:
        """Note that `actor` has work (busy) or none, move cores by the rule, reply (module doc).
        Cancelled: not atomic; the pins sent so far stay, and `held` records the plan as done
        (the next change plans from it)."""
        async with self._lock:
            homes = self._homes()
            if actor not in homes:
                return WorkReply(elastic=False)
            elastic.check_homes(homes)
            self.busy = (self.busy | {actor}) if busy else (self.busy - {actor})
            held = {name: self.held.get(name, home.cpu_ids) for name, home in homes.items()}
            step = elastic.plan(homes, held, self.busy & set(homes))
            self.held = dict(step.held)
            for transfer in step.transfers:
                log.info("%s", transfer.describe())
            for phase in (step.revokes, step.grants):  # every revoke acknowledged before any grant
                async with anyio.create_task_group() as tg:
                    for holding in phase:
                        tg.start_soon(self._repin, holding)
            return WorkReply(elastic=True,
                             transfers=[CoreTransfer(t.action, list(t.cpu_ids), t.giver, t.taker)
                                        for t in step.transfers],
                             holdings={h.actor: CoreHolding(list(h.affinity), h.num_threads, h.parked)
                                       for h in (*step.revokes, *step.grants)})

    async def _repin(self, holding: elastic.Holding) -> None:
        """Send one `_cores`. Cancelled: the actor may or may not be re-pinned."""
        try:
            await self._pin(holding.actor, Cores(list(holding.affinity), holding.num_threads))
        except Exception as exc:  # noqa: BLE001 - a dead actor is re-pinned by its restart
            log.warning("elastic cores: could not re-pin %s to %s: %s", holding.actor,
                        list(holding.affinity), exc)

