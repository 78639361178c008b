"""The head's balancer: reads the actors' heartbeat loads and rebalances the run.

Design note. The balancer is a pure decision function and a thin loop. `decide(figures,
memory, config)` takes one snapshot of the run (each sandbox actor's queued and running tool
calls, its workers and reserved cores, the cores still free, each driver's admission state)
plus what it remembers from earlier snapshots (how many ticks a backlog has lasted, since
when a sandbox has been idle), and returns decisions with the figures that caused them. The
loop (`Balancer.tick`) gathers the figures from the supervisor's records, enacts the
decisions (the scheduler reserves or frees the cores first, then the actor is told), and
writes every decision to the head's log and a metrics row of kind "balance". So the rules are
unit-tested without processes (tests/core/test_balancer.py), and a decision that cannot be
enacted (no free cores, the actor refused) is logged as such, never silently dropped.

Rules:
- **Sandbox workers.** A sandbox actor (one whose load has `sandbox_workers`) with at least
  `grow_when_queued` tool calls waiting on `grow_after_ticks` consecutive ticks gets one more
  warm worker, up to `max_sandbox_workers`. Each worker beyond the ones it started with costs
  `sandbox_worker_cpus` cores on top of its spec's `cpus`; when the scheduler has not that
  much free, the decision is `refuse_grow` (logged once per backlog). A sandbox with nothing
  queued and a worker to spare for `shrink_after_idle_s` loses one worker, never going below
  `min_sandbox_workers`; the cores its extra workers held go back to the pool.
- **Backpressure.** The orchestrator admits batches only within `max_staleness` and its
  rollout-buffer bound, and reports `backpressure` ("none", "staleness", "buffer_full") in
  its load with the buffer and learner figures. The balancer logs each change of that state
  with the figures; admission itself stays with the orchestrator, which knows the versions.

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

log = logging.getLogger("postrain.core")
_EPS = 1e-9


@dataclass(frozen=True)
class SandboxFigures:
    """One sandbox actor as the head sees it."""

    name: str
    incarnation: int
    queued: int            # tool calls waiting for a worker
    running: int           # tool calls executing
    workers: int           # warm workers now
    reserved_cpus: float   # cores the scheduler holds for it now
    spec_cpus: float       # cores its spec asked for (covers the workers it started with)


@dataclass(frozen=True)
class DriverFigures:
    """One actor that reports an admission state (`backpressure` in its load)."""

    name: str
    backpressure: str      # "none" | "staleness" | "buffer_full"
    figures: dict          # the rest of its load: buffer, in-flight rollouts, learner idle time


@dataclass(frozen=True)
class Figures:
    time_s: float          # monotonic clock of the snapshot
    free_cpus: float       # cores the scheduler has not reserved
    sandboxes: tuple[SandboxFigures, ...] = ()
    drivers: tuple[DriverFigures, ...] = ()


@dataclass(frozen=True)
class Decision:
    """action: grow_sandbox | shrink_sandbox | refuse_grow | backpressure. For the sandbox
    actions `num_workers` and `cpus` are the targets; `reason` says why in words and
    `figures` holds the numbers that caused it."""

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
class SandboxMemory:
    incarnation: int
    base_workers: int           # workers it started with (its spec's cpus cover these)
    busy_ticks: int = 0         # consecutive ticks with a backlog
    idle_since_s: float | None = None
    refused: bool = False       # a grow was refused during the current backlog


@dataclass(frozen=True)
class Memory:
    sandboxes: dict = field(default_factory=dict)      # name -> SandboxMemory
    backpressure: dict = field(default_factory=dict)   # name -> last reported state


def sandbox_cpus(spec_cpus: float, base_workers: int, num_workers: int, worker_cpus: float) -> float:
    """Cores a sandbox with `num_workers` workers holds: its spec's, plus worker_cpus per extra."""
    return spec_cpus + worker_cpus * max(0, num_workers - base_workers)


def decide(figures: Figures, memory: Memory, config) -> tuple[list[Decision], Memory]:
    """The decisions for one snapshot and the memory for the next. Pure: no clocks, no I/O.
    `config` has the BalancerSection fields."""
    decisions: list[Decision] = []
    sandboxes = {}
    free_cpus = figures.free_cpus
    for sb in figures.sandboxes:
        mem = memory.sandboxes.get(sb.name)
        if mem is None or mem.incarnation != sb.incarnation:  # first sight, or restarted afresh
            mem = SandboxMemory(sb.incarnation, base_workers=sb.workers)
        decision, mem = _decide_sandbox(sb, mem, figures.time_s, free_cpus, config)
        if decision is not None:
            decisions.append(decision)
            if decision.action == "grow_sandbox":
                free_cpus -= decision.cpus - sb.reserved_cpus
        sandboxes[sb.name] = mem
    backpressure = dict(memory.backpressure)
    for driver in figures.drivers:
        before = backpressure.get(driver.name, "none")
        if driver.backpressure != before:
            reason = ("admission paused: " + driver.backpressure if driver.backpressure != "none"
                      else f"admission resumed (was {before})")
            decisions.append(Decision("backpressure", driver.name, reason,
                                      figures={"state": driver.backpressure, **driver.figures}))
        backpressure[driver.name] = driver.backpressure
    return decisions, Memory(sandboxes, backpressure)


def _decide_sandbox(sb: SandboxFigures, mem: SandboxMemory, now_s: float, free_cpus: float,
                    config) -> tuple[Decision | None, SandboxMemory]:
    numbers = {"queued": sb.queued, "running": sb.running, "workers": sb.workers,
               "free_cpus": round(free_cpus, 3)}
    backlog = sb.queued >= config.grow_when_queued
    busy_ticks = mem.busy_ticks + 1 if backlog else 0
    refused = mem.refused and backlog
    spare = sb.queued == 0 and sb.running < sb.workers
    idle_since = (mem.idle_since_s if mem.idle_since_s is not None else now_s) if spare else None
    mem = dataclasses.replace(mem, busy_ticks=busy_ticks, idle_since_s=idle_since, refused=refused)
    if busy_ticks >= config.grow_after_ticks and sb.workers < config.max_sandbox_workers:
        target = sb.workers + 1
        cpus = sandbox_cpus(sb.spec_cpus, mem.base_workers, target, config.sandbox_worker_cpus)
        reason = f"{sb.queued} tool calls queued for {busy_ticks} ticks"
        if cpus - sb.reserved_cpus > free_cpus + _EPS:
            if refused:
                return None, mem
            return (Decision("refuse_grow", sb.name, reason + f"; {cpus - sb.reserved_cpus:.2f} more "
                             f"cores needed, {free_cpus:.2f} free", target, cpus, numbers),
                    dataclasses.replace(mem, refused=True))
        return (Decision("grow_sandbox", sb.name, reason, target, cpus, numbers),
                dataclasses.replace(mem, busy_ticks=0))
    if (idle_since is not None and now_s - idle_since >= config.shrink_after_idle_s
            and sb.workers > config.min_sandbox_workers):
        target = sb.workers - 1
        cpus = sandbox_cpus(sb.spec_cpus, mem.base_workers, target, config.sandbox_worker_cpus)
        reason = f"nothing queued and a worker spare for {now_s - idle_since:.0f} s"
        return (Decision("shrink_sandbox", sb.name, reason, target, cpus, numbers),
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
            self._metrics = MetricsWriter(run_folder, tensorboard=False)

    async def run(self) -> None:
        """Cancelled: stops between ticks or while an actor is being resized (the actor
        finishes its resize; the reservation already matches the decision)."""
        try:
            while True:
                await anyio.sleep(self.config.interval_s)
                await self.tick()
        finally:
            if self._metrics is not None:
                self._metrics.close()

    def figures(self) -> Figures:
        sandboxes, drivers = [], []
        scheduler = self.supervisor.scheduler
        for name, record in self.supervisor.records.items():
            load = record.load or {}
            if record.state != "running" or not load:
                continue
            if "sandbox_workers" in load:
                workers = int(load["sandbox_workers"])
                known = self._known_workers.get(name)
                if known is not None and known[0] == record.incarnation:
                    workers = known[1]
                sandboxes.append(SandboxFigures(name, record.incarnation, int(load.get("sandbox_queued", 0)),
                                                int(load.get("sandbox_running", 0)), workers,
                                                scheduler.reserved_cpus(name), record.spec.cpus))
            if "backpressure" in load:
                drivers.append(DriverFigures(name, str(load["backpressure"]),
                                             {k: v for k, v in load.items() if k in _DRIVER_FIGURES}))
        return Figures(time.monotonic(), scheduler.free_cpus(), tuple(sandboxes), tuple(drivers))

    async def tick(self) -> list[Decision]:
        decisions, self.memory = decide(self.figures(), self.memory, self.config)
        done = []
        for decision in decisions:
            done.append(await self._enact(decision))
        return done

    async def _enact(self, decision: Decision) -> Decision:
        if decision.action in ("grow_sandbox", "shrink_sandbox"):
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
                                                     if isinstance(v, (int, float, str, bool))})
        return decision

    async def _resize(self, decision: Decision) -> None:
        """Grow: reserve the cores, then tell the actor (undo the reservation if it fails).
        Shrink: tell the actor, then free the cores."""
        scheduler = self.supervisor.scheduler
        record = self.supervisor.records[decision.actor]
        before = scheduler.reserved_cpus(decision.actor)
        grow = decision.action == "grow_sandbox"
        if grow:
            record.placement = scheduler.resize(decision.actor, decision.cpus)
        try:
            reply = await self.supervisor.ref(decision.actor).ask(
                "resize", {"num_workers": decision.num_workers, "cpu_ids": list(record.placement.cpu_ids)},
                timeout_s=120)
        except BaseException:
            if grow:
                record.placement = scheduler.resize(decision.actor, before)
            raise
        self._known_workers[decision.actor] = (record.incarnation, int(reply["num_workers"]))
        if not grow:
            record.placement = scheduler.resize(decision.actor, decision.cpus)


# Load figures of a driver that explain its admission state (logged with each change).
_DRIVER_FIGURES = ("buffer_batches", "buffer_samples", "rollouts_in_flight", "prompts_waiting",
                   "learner_idle_s", "learner_busy_s", "num_trained", "max_staleness")
