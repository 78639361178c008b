"""The head's balancer: reads the actors' heartbeat loads and rebalances the run.

Design note. The balancer is a pure decision function and a thin loop. `decide(figures,
memory, config)` takes one snapshot of the run (each pool actor's queued and running work,
its workers and reserved cores, the cores still free, each actor's backpressure) plus what it
remembers from earlier snapshots (how many ticks a backlog has lasted, since when a pool has
been idle), and returns decisions with the figures that caused them. The loop
(`Balancer.tick`) gathers the figures from the supervisor's records, enacts the decisions (the
scheduler reserves or frees the cores first, then the actor is told), and writes every
decision to the head's log and a metrics row of kind "balance". So the rules are unit-tested
without processes (tests/cli/test_balancer.py), and a decision that cannot be enacted (no
free cores, the actor refused) is logged as such, never silently dropped.

It knows no role: it reads only the generic figures of `postrain.core.Load`.

Rules:
- **Pool workers.** A pool actor (one whose load reports `workers`; it handles the kernel's
  RESIZE message) with at least `grow_when_queued` pieces of work waiting on
  `grow_after_ticks` consecutive ticks gets one more worker, up to `max_workers`. Each worker
  beyond the ones it started with costs `worker_cpus` cores on top of its spec's `cpus`; when
  the scheduler has not that much free, the decision is `refuse_grow` (logged once per
  backlog). A pool with nothing queued and a worker to spare for `shrink_after_idle_s` loses
  one worker, never going below `min_workers`; the cores its extra workers held go back to
  the pool of cores.
- **Backpressure.** An actor that holds back new work reports why in its load's
  `backpressure` ("" when it does not). The balancer logs each change of that state with the
  actor's own figures; the holding back itself stays with the actor, which knows its rule.

Figures come from heartbeats, so they lag by up to one heartbeat interval; after a resize the
loop uses the actor's reply, not the older heartbeat, for its worker count.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import anyio

from postrain.core.load import RESIZE, ResizeRequest

log = logging.getLogger("postrain.core")
_EPS = 1e-9


@dataclass(frozen=True)
class PoolFigures:
    """One pool actor as the head sees it."""

    name: str
    incarnation: int
    queued: int            # work waiting for a worker
    running: int           # work executing
    workers: int           # workers now
    reserved_cpus: float   # cores the scheduler holds for it now
    spec_cpus: float       # cores its spec asked for (covers the workers it started with)


@dataclass(frozen=True)
class BackpressureFigures:
    """One actor that reports whether it holds back new work (`backpressure` in its load)."""

    name: str
    backpressure: str      # why it holds back new work; "" when it does not
    figures: dict          # its own figures, logged with each change


@dataclass(frozen=True)
class Figures:
    time_s: float          # monotonic clock of the snapshot
    free_cpus: float       # cores the scheduler has not reserved
    pools: tuple[PoolFigures, ...] = ()
    backpressure: tuple[BackpressureFigures, ...] = ()


@dataclass(frozen=True)
class Decision:
    """action: grow | shrink | refuse_grow | backpressure (and grow_failed, shrink_failed once
    enacted). For the pool actions `num_workers` and `cpus` are the targets; `reason` says why
    in words and `figures` holds the numbers that caused it."""

    action: str
    actor: str
    reason: str
    num_workers: int | None = None
    cpus: float | None = None
    figures: dict = field(default_factory=dict)

    def describe(self) -> str:
        target = f" -> {self.num_workers} workers, {self.cpus:.2f} cores" if self.num_workers else ""
        numbers = ", ".join(f"{k}={v}" for k, v in self.figures.items())
        return f"balancer: {self.action} {self.actor}{target}: {self.reason} ({numbers})"


@dataclass(frozen=True)
class PoolMemory:
    incarnation: int
    base_workers: int           # workers it started with (its spec's cpus cover these)
    busy_ticks: int = 0         # consecutive ticks with a backlog
    idle_since_s: float | None = None
    refused: bool = False       # a grow was refused during the current backlog


@dataclass(frozen=True)
class Memory:
    pools: dict = field(default_factory=dict)          # name -> PoolMemory
    backpressure: dict = field(default_factory=dict)   # name -> last reported state


def pool_cpus(spec_cpus: float, base_workers: int, num_workers: int, worker_cpus: float) -> float:
    """Cores a pool with `num_workers` workers holds: its spec's, plus worker_cpus per extra."""
    return spec_cpus + worker_cpus * max(0, num_workers - base_workers)


def decide(figures: Figures, memory: Memory, config) -> tuple[list[Decision], Memory]:
    """The decisions for one snapshot and the memory for the next. Pure: no clocks, no I/O.
    `config` has the BalancerSection fields."""
    decisions: list[Decision] = []
    pools = {}
    free_cpus = figures.free_cpus
    for pool in figures.pools:
        mem = memory.pools.get(pool.name)
        if mem is None or mem.incarnation != pool.incarnation:  # first sight, or restarted afresh
            mem = PoolMemory(pool.incarnation, base_workers=pool.workers)
        decision, mem = _decide_pool(pool, mem, figures.time_s, free_cpus, config)
        if decision is not None:
            decisions.append(decision)
            if decision.action == "grow":
                assert decision.cpus is not None  # a grow or shrink carries its targets (_decide_pool)
                free_cpus -= decision.cpus - pool.reserved_cpus
        pools[pool.name] = mem
    backpressure = dict(memory.backpressure)
    for actor in figures.backpressure:
        before = backpressure.get(actor.name, "")
        if actor.backpressure != before:
            reason = (f"holds back new work: {actor.backpressure}" if actor.backpressure
                      else f"takes new work again (held back by {before})")
            decisions.append(Decision("backpressure", actor.name, reason,
                                      figures={"state": actor.backpressure, **actor.figures}))
        backpressure[actor.name] = actor.backpressure
    return decisions, Memory(pools, backpressure)


def _decide_pool(pool: PoolFigures, mem: PoolMemory, now_s: float, free_cpus: float,
                 config) -> tuple[Decision | None, PoolMemory]:
    numbers = {"queued": pool.queued, "running": pool.running, "workers": pool.workers,
               "free_cpus": round(free_cpus, 3)}
    backlog = pool.queued >= config.grow_when_queued
    busy_ticks = mem.busy_ticks + 1 if backlog else 0
    refused = mem.refused and backlog
    spare = pool.queued == 0 and pool.running < pool.workers
    idle_since = (mem.idle_since_s if mem.idle_since_s is not None else now_s) if spare else None
    mem = dataclasses.replace(mem, busy_ticks=busy_ticks, idle_since_s=idle_since, refused=refused)
    if busy_ticks >= config.grow_after_ticks and pool.workers < config.max_workers:
        target = pool.workers + 1
        cpus = pool_cpus(pool.spec_cpus, mem.base_workers, target, config.worker_cpus)
        reason = f"{pool.queued} queued for {busy_ticks} ticks"
        if cpus - pool.reserved_cpus > free_cpus + _EPS:
            if refused:
                return None, mem
            return (Decision("refuse_grow", pool.name, reason + f"; {cpus - pool.reserved_cpus:.2f} more "
                             f"cores needed, {free_cpus:.2f} free", target, cpus, numbers),
                    dataclasses.replace(mem, refused=True))
        return (Decision("grow", pool.name, reason, target, cpus, numbers),
                dataclasses.replace(mem, busy_ticks=0))
    if (idle_since is not None and now_s - idle_since >= config.shrink_after_idle_s
            and pool.workers > config.min_workers):
        target = pool.workers - 1
        cpus = pool_cpus(pool.spec_cpus, mem.base_workers, target, config.worker_cpus)
        reason = f"nothing queued and a worker spare for {now_s - idle_since:.0f} s"
        return (Decision("shrink", pool.name, reason, target, cpus, numbers),
                dataclasses.replace(mem, idle_since_s=now_s))
    return None, mem


class Balancer:
    """The loop on the head: gather figures, decide, enact, log. `run()` until cancelled."""

    def __init__(self, supervisor, config, run_folder: str | Path | None = None,
                 emit: Callable[[str], None] | None = None):
        self.supervisor = supervisor
        self.config = config
        self.memory = Memory()
        self.emit = emit or (lambda line: log.info("%s", line))
        self.decisions: list[Decision] = []   # every decision so far, in order (tests, status)
        self._known_workers: dict[str, tuple[int, int]] = {}  # name -> (incarnation, workers)
        self._metrics = None
        if run_folder is not None:
            from postrain.core.metrics import MetricsWriter
            self._metrics = MetricsWriter(run_folder, tensorboard=False, skip_rows_when_full=True)

    async def run(self) -> None:
        """Tick every interval_s until cancelled. Cancelled between ticks: nothing is left
        half done; while an actor is being resized: see `_resize`. The metrics file is closed."""
        try:
            while True:
                await anyio.sleep(self.config.interval_s)
                await self.tick()
        finally:
            if self._metrics is not None:
                self._metrics.close()

    def figures(self) -> Figures:
        pools, backpressure = [], []
        scheduler = self.supervisor.scheduler
        for name, record in self.supervisor.records.items():
            load = record.load
            if record.state != "running" or load is None:
                continue
            if load.is_pool:
                workers = load.workers
                known = self._known_workers.get(name)
                if known is not None and known[0] == record.incarnation:
                    workers = known[1]
                pools.append(PoolFigures(name, record.incarnation, load.queued or 0, load.running or 0,
                                         workers, scheduler.reserved_cpus(name), record.spec.cpus))
            if load.backpressure is not None:
                backpressure.append(BackpressureFigures(name, load.backpressure, dict(load.figures)))
        return Figures(time.monotonic(), scheduler.free_cpus(), tuple(pools), tuple(backpressure))

    async def tick(self) -> list[Decision]:
        """One snapshot: decide, then enact each decision in order. Cancelled: the memory has
        moved on; decisions not yet enacted are dropped unlogged (the next tick decides afresh)."""
        decisions, self.memory = decide(self.figures(), self.memory, self.config)
        done = []
        for decision in decisions:
            done.append(await self._enact(decision))
        return done

    async def _enact(self, decision: Decision) -> Decision:
        """Resize (grow, shrink), then record and log the outcome. Cancelled during a resize:
        see `_resize`; the decision is not recorded."""
        if decision.action in ("grow", "shrink"):
            try:
                await self._resize(decision)
            except Exception as exc:  # noqa: BLE001 - a refused reservation or resize is the outcome
                decision = dataclasses.replace(decision, action=f"{decision.action}_failed",
                                               reason=f"{decision.reason}; not done: {exc}")
        self.decisions.append(decision)
        self.emit(decision.describe())
        if self._metrics is not None:
            self._metrics.log("balance", action=decision.action, actor=decision.actor,
                              reason=decision.reason, num_workers=decision.num_workers,
                              cpus=decision.cpus, **{k: v for k, v in decision.figures.items()
                                                     if isinstance(v, (int, float, str, bool))
                                                     and k not in _ROW_FIELDS})
        return decision

    async def _resize(self, decision: Decision) -> None:
        """Grow: reserve the cores, then tell the actor (undo the reservation if it fails).
        Shrink: tell the actor, then free the cores. Cancelled while the actor resizes: not
        atomic; a grow's reservation is undone though the actor may still finish growing (its
        next heartbeat shows it), and a shrink keeps its cores reserved."""
        # a grow or shrink carries its targets (_decide_pool)
        assert decision.num_workers is not None and decision.cpus is not None, decision
        scheduler = self.supervisor.scheduler
        record = self.supervisor.records[decision.actor]
        before = scheduler.reserved_cpus(decision.actor)
        grow = decision.action == "grow"
        if grow:
            record.placement = scheduler.resize(decision.actor, decision.cpus)
        try:
            request = ResizeRequest(decision.num_workers, list(record.placement.cpu_ids))
            reply = await self.supervisor.ref(decision.actor).call(RESIZE, request, timeout_s=120)
        except BaseException:
            if grow:
                record.placement = scheduler.resize(decision.actor, before)
            raise
        self._known_workers[decision.actor] = (record.incarnation, reply.num_workers)
        if not grow:
            record.placement = scheduler.resize(decision.actor, decision.cpus)


_ROW_FIELDS = frozenset({"kind", "time", "action", "actor", "reason", "num_workers", "cpus"})  # a balance row's own
