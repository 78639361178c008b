"""Actor processes: spawn one, wait for its READY, watch it, restart it, stop it, kill it.

Design note. Each actor has one watcher task that owns its process for its
whole life: it spawns an incarnation, waits for READY, then waits for the
process to exit, and on an exit it did not ask for, restarts it after a
backoff that doubles each time, until `max_restarts`. Every decision is an
`ActorEvent` with the reason (exit code, signal name, the actor's own
traceback when it reported one, "hung" when its heartbeats stopped), so
"why did it die" always has an answer.

Before READY the same budget applies to faults from outside: a start killed
by a signal (the OOM killer during a model load, an operator) or gone silent
for `start_timeout_s` (a silence limit, not a total: the actor heartbeats from
a thread while its setup runs, core/runtime.py) is started again; a start that
fails by itself (an exit code, a traceback: a bad import path, a model file
that does not load) fails at once, since a retry would fail the same way.

Nothing outlives a run. Each actor leads its own process group, and the
supervisor kills the group (not only the actor) when it kills, and once more
after every exit, so an actor's children (nsjail workers) end with it. Every
actor gets the run's tag (`run_tag`), which names the shared-memory files it
and its children write (core/shm.py); after every exit, at start and at the
end, the supervisor removes the run's files whose writer is gone
(`shm.sweep_shm`). `postrain.core.testing.leftovers(run_tag)` lists what a
run left behind.

Spawned ahead. `spawn_ahead` starts an actor's process before its turn: it imports its class
(torch, a model library: seconds of CPU) and waits (core/runtime.py `turn`); `start` later opens
the turn. A run's actors are spawned ahead at once and started in order (Supervisor.start_in_order),
so the imports overlap while every setup still begins after the actors before it are READY. Until
its turn a record is not in `records`: lookups, heartbeats and the hung check do not see it.

`ActorProcesses` is the supervisor's (core/supervisor.py) keeper of these processes; what the
actors tell the head (READY, heartbeats, their tracebacks) the supervisor's handlers write into
the same `ActorRecord`s.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from typing import Any, Callable

import anyio

from .actor_ref import ActorRef
from .config import ActorSpec
from .control import STOP
from .errors import ActorStartError
from .load import Load
from .node import Node
from .runtime import run_actor_process
from .scheduler import Placement, Scheduler
from .shm import RUN_TAG_ENV, remove_shm_of, sweep_shm

log = logging.getLogger("postrain.core")
_spawn = multiprocessing.get_context("spawn")


@dataclass
class ActorEvent:
    time: float
    name: str
    event: str     # started | exited | restarting | gave_up | hung | stopped
    detail: str = ""


@dataclass
class ActorRecord:
    """The supervisor's view of one actor.

    state: starting -> running -> ([hung ->] restarting -> running)* -> stopped | failed.
    Invariant: state == "running" implies process is alive and READY came
    from `incarnation`."""

    spec: ActorSpec
    placement: Placement
    address: str
    state: str = "starting"
    incarnation: int = 0
    restarts: int = 0
    process: Any = None
    pid: int | None = None
    last_heartbeat: float = 0.0
    load: Load | None = None       # the last heartbeat's, decoded; None until the first
    crash_traceback: str = ""
    last_exit: str = ""
    note: str = ""                 # what its heartbeats say it is doing ("setup", "loading ...")
    ready: anyio.Event = field(default_factory=anyio.Event)
    exited: anyio.Event = field(default_factory=anyio.Event)
    stop_requested: bool = False
    turn: Any = None               # spawned ahead: the Event (multiprocessing's) that starts its setup


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class ActorProcesses:
    """The processes of one supervisor's actors, by name (`records`), and every decision about
    them (`events`). The supervisor places an actor and hands over its record (`start`); from
    then on this keeper spawns, watches, restarts and stops it.

    node: the head's Node (its task group runs the watchers); head_fields(record): the spawn
    spec's fields that the head decides (its address, the keys, the cores an elastic actor holds
    now); ref(name): the head's reference to an actor (STOP goes through it)."""

    def __init__(self, node: Node, scheduler: Scheduler, *, run_tag: str, log_dir: str | None,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 head_fields: Callable[[ActorRecord], dict[str, Any]], ref: Callable[[str], ActorRef]):
        self.node = node
        self.scheduler = scheduler
        self.run_tag = run_tag
        self.log_dir = log_dir  # each actor's stdout and stderr go to log_dir/NAME.log
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._head_fields = head_fields
        self._ref = ref
        self.records: dict[str, ActorRecord] = {}
        self.events: list[ActorEvent] = []
        self._event_added = anyio.Event()

    def spawn_ahead(self, record: ActorRecord) -> None:
        """Spawn the placed actor of `record` now, held after its import until `start(record)`.
        Not in `records` until then; a record never started is ended with `discard`."""
        record.turn = _spawn.Event()
        self._spawn(record)

    def discard(self, record: ActorRecord) -> None:
        """Kill a record spawned ahead that will not be started (a start before it failed or was
        cancelled) and release its placement. Idempotent."""
        if record.state == "starting":
            record.stop_requested = True
            self._kill(record)
            record.state = "failed"
            self.scheduler.release(record.spec.name)

    async def start(self, record: ActorRecord) -> None:
        """Start the placed actor of `record` (or open the turn of one spawned ahead) and return
        once it is READY; its watcher then owns it. Raises ActorStartError (with the actor's
        traceback). Cancelled, or failed: the process is killed, the record is "failed" and its
        placement released."""
        self.records[record.spec.name] = record
        try:
            await self._start_within_budget(record)
        except BaseException:
            record.stop_requested = True
            self._kill(record)
            record.state = "failed"
            self.scheduler.release(record.spec.name)
            raise
        self.node.spawn(self._watch, record)

    async def _start_within_budget(self, record: ActorRecord) -> None:
        """Spawn until READY: a start killed by a signal or gone silent is spawned again after
        the restart backoff while `max_restarts` allows; a start that failed by itself raises
        at once. Raises ActorStartError. Cancelled: the incarnation being started is left
        running; the caller kills it (`start` does)."""
        spec = record.spec
        ahead = record.process is not None   # spawned ahead: its turn comes now
        while True:
            if ahead:
                ahead = False
                record.last_heartbeat = time.monotonic()  # its silence counts from its turn
                record.turn.set()
            else:
                self._spawn(record)
            try:
                await self._await_ready(record)
                return
            except ActorStartError as exc:
                from_outside = _fault_from_outside(record)  # read before the kill sets an exit code
                self._kill(record)
                await _wait_exit(record)
                if not from_outside or record.restarts >= spec.max_restarts:
                    raise
                delay = spec.restart_backoff_s * (2 ** record.restarts)
                record.restarts += 1
                record.state = "restarting"
                record.last_exit = exc.reason
                self._add_event(spec.name, "exited", exc.reason)
                self._add_event(spec.name, "restarting", f"restart {record.restarts} in {delay:g} s "
                                "(before READY)")
                await anyio.sleep(delay)

    def kill_all(self) -> None:
        """SIGKILL every actor's process group now, with no stop message and no restart (a node
        agent whose node is gone: core/ray_nodes.py)."""
        for record in self.records.values():
            record.stop_requested = True
            self._kill(record)

    def log_path(self, name: str) -> str | None:
        """The file actor `name`'s stdout and stderr go to (None: the head's own)."""
        return os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None

    async def stop(self, name: str) -> None:
        """STOP message, a bounded wait, then SIGKILL. Idempotent. Cancelled: the actor may be
        left running with stop_requested set (not restarted); a later `stop` finishes the job."""
        record = self.records[name]
        if record.state in ("stopped", "failed") and not _alive(record):
            return
        record.stop_requested = True
        if _alive(record):
            with anyio.move_on_after(record.spec.stop_timeout_s):
                try:
                    await self._ref(name).call(STOP, timeout_s=record.spec.stop_timeout_s)
                except Exception:
                    pass
                await _wait_exit(record)
            if _alive(record):
                log.warning("actor %s did not stop within %s s; killing it", name, record.spec.stop_timeout_s)
                self._kill(record)
                await _wait_exit(record)
        record.state = "stopped"
        self.scheduler.release(name)
        self._add_event(name, "stopped", describe_exit(record.process.exitcode if record.process else None))

    async def shutdown(self) -> None:
        """Stop every actor at once (at most 30 s), then SIGKILL whatever lives (its process
        group), wait for the exits (at most 5 s) and remove the run's shared memory. Cancelled:
        the actors not yet stopped are left running, unkilled; `open` runs it shielded."""
        with anyio.move_on_after(30):
            async with anyio.create_task_group() as tg:
                for name in list(self.records):
                    tg.start_soon(self.stop, name)
        for record in self.records.values():
            self._kill(record)
        with anyio.move_on_after(5):  # each exit kills its group and sweeps (_note_exit)
            for record in self.records.values():
                if record.process is not None:
                    await _wait_exit(record)
        sweep_shm(self.run_tag)

    def kill(self, name: str) -> None:
        """SIGKILL an actor as a crash would (tests, chaos); the supervisor restarts it."""
        self._kill(self.records[name])

    async def wait_for_event(self, name: str, event: str, timeout_s: float = 30.0) -> ActorEvent:
        """Wait until an event `event` for actor `name` is recorded (counting from now).
        Cancelled: nothing changes (it only reads the event list)."""
        start = len(self.events)
        with anyio.fail_after(timeout_s):
            while True:
                for item in self.events[start:]:
                    if item.name == name and item.event == event:
                        return item
                start = len(self.events)
                await self._event_added.wait()

    async def wait_running(self, name: str, timeout_s: float = 30.0, min_restarts: int = 0) -> None:
        """Wait until actor `name` is running after at least `min_restarts` restarts.
        Cancelled: nothing changes (it only reads the record)."""
        record = self.records[name]
        with anyio.fail_after(timeout_s):
            while record.state != "running" or record.restarts < min_restarts:
                await self._event_added.wait()

    def _spawn(self, record: ActorRecord) -> None:
        record.incarnation += 1
        record.ready = anyio.Event()
        record.exited = anyio.Event()
        record.crash_traceback = ""
        spec = record.spec
        payload = {"name": spec.name, "cls": spec.cls, "options": spec.options, "address": record.address,
                   "head_pid": os.getpid(), "incarnation": record.incarnation,
                   "cpu_ids": list(record.placement.cpu_ids), "num_threads": record.placement.num_threads,
                   "heartbeat_interval_s": self.heartbeat_interval_s, "run_tag": self.run_tag,
                   "log_path": self.log_path(spec.name),
                   "rendezvous": spec.rendezvous.model_dump() if spec.rendezvous is not None else None}
        payload.update(self._head_fields(record))
        # Inherited by the spawned child only. The run tag is in the child's environment from its
        # first instruction, so that /proc/PID/environ shows it (core/testing.py: leftovers).
        child_env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in record.placement.gpu_ids),
                     RUN_TAG_ENV: self.run_tag}
        saved = {key: os.environ.get(key) for key in child_env}
        resource_tracker.ensure_running()  # the head's own helper: started outside the run's environment
        os.environ.update(child_env)
        try:
            process = _spawn.Process(target=run_actor_process, args=(payload, record.turn),
                                     name=f"postrain-{spec.name}", daemon=True)
            process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        record.process, record.pid = process, process.pid
        record.last_heartbeat = time.monotonic()
        record.note = ""
        self.node.spawn(self._note_exit, record, process)

    async def _note_exit(self, record: ActorRecord, process: BaseProcess) -> None:
        """Wait for `process` to end, kill what is left of its process group, remove its (and any
        dead process of the run's) shared memory, and set the record's `exited`. Cancelled (the
        head closes): the group, shared memory and `exited` are left as they are; `shutdown`
        kills the groups and sweeps the run's shared memory."""
        await _wait_process(process)
        assert process.pid is not None   # started (`_spawn`) before this watcher
        _kill_group(process.pid)  # its children (nsjail workers) do not outlive it
        remove_shm_of(process.pid)  # a killed process cannot clean up its shared memory
        sweep_shm(self.run_tag)
        if record.process is process:
            record.exited.set()

    async def _await_ready(self, record: ActorRecord) -> None:
        """Wait for READY or an exit, while the actor's heartbeats say it lives: silence for
        start_timeout_s ends the wait (a setup that beats may take as long as it needs).
        ActorStartError says which. Cancelled: the record stays "starting" with its process
        alive; the caller kills it (`start` does)."""
        spec = record.spec
        silent_s = 0.0
        while not (record.ready.is_set() or record.exited.is_set()):
            silent_s = time.monotonic() - record.last_heartbeat
            if silent_s >= spec.start_timeout_s:
                break
            with anyio.move_on_after(spec.start_timeout_s - silent_s):
                async with anyio.create_task_group() as tg:
                    async def until(event: anyio.Event) -> None:
                        """Cancel the waiting once `event` is set. Cancelled: nothing to undo."""
                        await event.wait()
                        tg.cancel_scope.cancel()
                    tg.start_soon(until, record.ready)
                    tg.start_soon(until, record.exited)
        if record.ready.is_set():
            record.state = "running"
            self._add_event(spec.name, "started", f"pid {record.pid}, incarnation {record.incarnation}")
            return
        where: dict[str, Any] = {"actor": spec.name, "cls": spec.cls, "log_path": self.log_path(spec.name)}
        if not record.exited.is_set():
            doing = f" (last doing: {record.note})" if record.note else ""
            reason = (f"went silent for {silent_s:.1f} s before READY{doing}, over start_timeout_s = "
                      f"{spec.start_timeout_s}; a setup that heartbeats is not limited, so look at its log "
                      "for where it stopped")
            raise ActorStartError(f"actor {spec.name} ({spec.cls}) {reason}", reason=reason, **where)
        await _wait_exit(record)
        why = describe_exit(record.process.exitcode)
        tb = record.crash_traceback
        reason = f"{why} before READY" + (f": {_last_line(tb)}" if tb else "")
        raise ActorStartError(f"actor {spec.name} ({spec.cls}) {why} before READY"
                              + (f":\n{tb}" if tb else ""), reason=reason, traceback=tb, **where)

    async def _watch(self, record: ActorRecord) -> None:
        """Owns the actor from its first READY: waits for exits and restarts with backoff.
        Cancelled (the head closes): not atomic; an incarnation being started may be left
        running, which `shutdown` (and the actor's death with its head) then ends."""
        while True:
            await _wait_exit(record)
            why = describe_exit(record.process.exitcode)
            if record.crash_traceback:
                why += f"; its traceback:\n{record.crash_traceback}"
            record.last_exit = why
            if record.stop_requested:
                return
            self._add_event(record.spec.name, "exited", why)
            while True:
                if record.restarts >= record.spec.max_restarts:
                    record.state = "failed"
                    self.scheduler.release(record.spec.name)
                    self._add_event(record.spec.name, "gave_up",
                                    f"{record.restarts} restarts used (max_restarts = {record.spec.max_restarts})")
                    return
                delay = record.spec.restart_backoff_s * (2 ** record.restarts)
                record.restarts += 1
                record.state = "restarting"
                self._add_event(record.spec.name, "restarting", f"restart {record.restarts} in {delay:g} s")
                await anyio.sleep(delay)
                if record.stop_requested:
                    return
                self._spawn(record)
                try:
                    await self._await_ready(record)
                    break
                except ActorStartError as exc:
                    self._kill(record)
                    await _wait_exit(record)
                    self._add_event(record.spec.name, "exited", str(exc))

    def _kill(self, record: ActorRecord) -> None:
        """SIGKILL the actor's process group (it and its children), or the actor alone while
        it has not made its group yet."""
        if _alive(record):
            if not _kill_group(record.process.pid):
                try:
                    os.kill(record.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    async def watch_heartbeats(self) -> None:
        """Every interval, kill the running actors whose heartbeats stopped (their watcher
        restarts them). Cancelled: each pass is synchronous, so none is left half done."""
        while True:
            await anyio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            for record in self.records.values():
                silent_s = now - record.last_heartbeat
                if record.state == "running" and silent_s > self.heartbeat_timeout_s and _alive(record):
                    self._add_event(record.spec.name, "hung", f"no heartbeat for {silent_s:.1f} s; killing it")
                    record.crash_traceback = f"hung: no heartbeat for {silent_s:.1f} s"
                    record.state = "hung"
                    self._kill(record)

    def _add_event(self, name: str, event: str, detail: str) -> None:
        self.events.append(ActorEvent(time.time(), name, event, detail))
        log.log(logging.WARNING if event in ("exited", "gave_up", "hung") else logging.INFO,
                "actor %s %s: %s", name, event, detail)
        self._event_added.set()
        self._event_added = anyio.Event()


def _last_line(tb: str) -> str:
    """The last exception of a formatted traceback ("ValueError: ..."), its message's lines
    joined: what went wrong, in one line."""
    lines = tb.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    rest = lines[starts[-1] + 1:] if starts else lines
    first = next((i for i, line in enumerate(rest) if line and not line[0].isspace()), None)
    if first is None:
        return lines[-1].strip() if lines else ""
    return " ".join(line.strip() for line in rest[first:] if line.strip())


def _fault_from_outside(record: ActorRecord) -> bool:
    """Whether a start that ended before READY is worth another try: the process was killed by
    a signal without reporting an error of its own, or it is still there but went silent."""
    process = record.process
    if process is None or record.crash_traceback:
        return False
    return process.exitcode is None or process.exitcode < 0


def _kill_group(pgid: int) -> bool:
    """SIGKILL process group `pgid` (an actor's: it leads its group). False when no such group
    exists (the actor has not made it yet, or everything in it has ended)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _alive(record: ActorRecord) -> bool:
    return record.process is not None and record.process.exitcode is None and record.process.is_alive()


async def _wait_exit(record: ActorRecord) -> None:
    """Wait for the record's current process to exit (its `_note_exit` task sets `exited`).
    Cancelled: nothing changes; the process is neither joined nor killed."""
    await record.exited.wait()
    record.process.join(timeout=1)


async def _wait_process(process: BaseProcess | None) -> None:
    """Wait for a multiprocessing process to exit, without blocking the loop.
    Only `_note_exit` calls this: one waiter per process descriptor. Cancelled: nothing
    changes; the process runs on, unjoined."""
    if process is None:
        return
    while process.exitcode is None:
        try:
            with anyio.move_on_after(0.5):
                await anyio.wait_readable(process.sentinel)
        except (OSError, ValueError):
            await anyio.sleep(0.01)
        process.join(timeout=0)
