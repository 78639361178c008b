"""Who has work now, told to the head so that elastic cores follow it (core/elastic.py).

    async with work.busy("learner"):          # the learner holds its cores (and any it may
        await keeper.step(batch)              # borrow) before the step starts

The orchestrator hands out all the work of a run, so it knows exactly when each actor has
some: the learner during the warm start and each train step, the generators while any
rollout (training or evaluation) is in flight. `busy` counts nested and concurrent uses per
actor; the head hears only the changes (first use: busy; last: idle), and a "busy" returns
only once the head has re-pinned the cores (an owner gets its cores back before its work
starts). Every move of cores the head reports is a debug line in the orchestrator's log (its
info lines are the run's progress) and a "cores" row of metrics.jsonl. An actor the head says
is not elastic is not signalled again; without a head (an orchestrator run alone) nothing is
sent.
"""
from __future__ import annotations

import collections
import logging
from contextlib import asynccontextmanager

import anyio

from postrain.core.lending import WORK, WorkRequest

log = logging.getLogger("postrain.orchestrator")


class WorkSignal:
    """Counts work per actor and tells the head each change between none and some."""

    def __init__(self, head, metrics):
        self.head = head                 # ActorRef to the head, or None
        self.metrics = metrics           # MetricsWriter of the run folder
        self.num_moves = 0               # cores moved so far (transfers the head reported)
        self._count: collections.Counter[str] = collections.Counter()  # invariant: values >= 0
        self._not_elastic: set[str] = set()
        self._lock = anyio.Lock()        # one change at a time, in order

    @asynccontextmanager
    async def busy(self, *actors: str):
        """The body runs while `actors` count as busy. Cancelled: the counts are restored
        (shielded), so a cancelled piece of work never leaves an actor marked busy."""
        await self._change(actors, +1)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self._change(actors, -1)

    async def _change(self, actors, delta: int) -> None:
        """Cancelled: see `busy` (its exit is shielded); on entry, the counts may have moved."""
        async with self._lock:
            for actor in actors:
                before = self._count[actor]
                self._count[actor] += delta
                assert self._count[actor] >= 0, (actor, self._count[actor])
                if (before == 0) != (self._count[actor] == 0) and self.head is not None \
                        and actor not in self._not_elastic:
                    await self._tell(actor, busy=self._count[actor] > 0)

    async def _tell(self, actor: str, busy: bool) -> None:
        """One change to the head. A head that does not answer costs speed, not the run: the
        cores stay where they are (a warning says so). Cancelled: the head may or may not move
        the cores."""
        try:
            reply = await self.head.call(WORK, WorkRequest(actor, busy), timeout_s=60)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("cores: the head did not take %s %s work (%s); its cores stay where they are",
                        actor, "having" if busy else "ending", exc)
            return
        if not reply.elastic:
            self._not_elastic.add(actor)
            return
        for transfer in reply.transfers:
            self.num_moves += 1
            taker = reply.holdings.get(transfer.taker)
            threads = taker.num_threads if taker is not None else None
            log.debug("cores %s %s: %s -> %s (%s %s work); %s now has %s threads", transfer.action,
                      transfer.cpu_ids, transfer.giver, transfer.taker, actor,
                      "has" if busy else "ends its", transfer.taker, threads)
            self.metrics.log("cores", **transfer.to_wire(), because=actor, busy=busy, taker_threads=threads)
