"""The supervisor: starts actors from specs, watches them, restarts the ones that die.

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
a thread while its setup runs, core/actor.py) is started again; a start that
fails by itself (an exit code, a traceback: a bad import path, a model file
that does not load) fails at once, since a retry would fail the same way.

Nothing outlives a run. Each actor leads its own process group, and the
supervisor kills the group (not only the actor) when it kills, and once more
after every exit, so an actor's children (nsjail workers) end with it. Every
actor gets the run's tag (`run_tag`), which names the shared-memory files it
and its children write (core/wire.py); after every exit, at start and at the
end, the supervisor removes the run's files whose writer is gone
(`wire.sweep_shm`). `postrain.core.testing.leftovers(run_tag)` lists what a
run left behind.

The head's inbox doubles as the registry: actors ask it `lookup` for each
other's addresses and then talk directly, so data never flows through the
head. On a cluster each node's supervisor also knows the other nodes' actors
(`add_peers`), so a lookup finds an actor wherever it runs.

Elastic cores (core/elastic.py, core/lending.py): the run's driver tells the head `work`
{"actor", "busy"} when it gives an actor work and when that work ends; the head's lender
lends the cores of idle elastic actors to busy ones and answers once the re-pinning is done.
An elastic actor (re)starts pinned to the cores it holds at that moment.
"""
from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
from multiprocessing import resource_tracker
import signal
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio

from . import wire
from .actor import CORES, run_actor_process
from .config import ActorSpec
from .errors import ActorStartError
from .elastic import Home
from .inbox import Handler, Inbox
from .lending import CoreLender
from .load import Load
from .node import ActorRef, Node
from .scheduler import Placement, Scheduler
from .transport import CurveKeys, ipc_address, is_beyond_loopback, make_socket_dir

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


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def run_tag_for(key: str) -> str:
    """A stable run tag for `key` (the run folder's path: a resumed run has the tag of the run
    it resumes, so it finds what a killed head left)."""
    return hashlib.sha1(key.encode()).hexdigest()[:12]


class Supervisor:
    """Use through `async with Supervisor.open(...) as supervisor:`; leaving stops every actor."""

    def __init__(self, node: Node, scheduler: Scheduler, socket_dir: str, *,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float, bind: str,
                 keys: CurveKeys | None, log_dir: str | None = None, run_tag: str | None = None):
        self.log_dir = log_dir  # each actor's stdout and stderr go to log_dir/NAME.log
        self.run_tag = run_tag or uuid.uuid4().hex[:12]  # hex: names the run's processes and shm files
        self.node = node
        self.scheduler = scheduler
        self.socket_dir = socket_dir
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.keys = keys
        self.records: dict[str, ActorRecord] = {}
        self.peers: dict[str, str] = {}   # actors other supervisors run (other nodes): name -> address
        # A cluster's head: () -> {"nodes": [...], "actors": [...]}, the other nodes' view, merged
        # into `status()` (cli/node_watch.py sets it); None on one host.
        self.remote_status: Callable[[], dict] | None = None
        self.events: list[ActorEvent] = []
        self._event_added = anyio.Event()
        address = ipc_address(socket_dir, "head") if bind == "ipc" else bind
        self.inbox = Inbox(node, address, {
            "_ready": Handler(self._on_ready), "_heartbeat": Handler(self._on_heartbeat),
            "_crashed": Handler(self._on_crashed), "lookup": Handler(self._on_lookup),
            "status": Handler(self._on_status), "shutdown": Handler(self._on_shutdown),
            "work": Handler(self._on_work)})
        self.lender = CoreLender(self._elastic_homes, self._pin_cores)
        self.shutdown_requested = anyio.Event()  # set by a `shutdown` message (`postrain down`)
        self.address = self.inbox.bound_address
        self._refs: dict[str, ActorRef] = {}

    @classmethod
    @asynccontextmanager
    async def open(cls, *, scheduler: Scheduler | None = None, heartbeat_interval_s: float = 1.0,
                   heartbeat_timeout_s: float = 30.0, bind: str = "ipc", keys: CurveKeys | None = None,
                   log_dir: str | None = None, run_tag: str | None = None):
        """A supervisor serving the head's inbox for the body of the `async with`. Leaving, by
        any way (cancellation included): every actor is stopped under a shield, its process
        group killed and the run's shared-memory files removed, then the socket folder.
        run_tag: names the run's shared memory (default: a fresh one); what an earlier head of
        the same tag left (killed with SIGKILL) is removed as this one opens."""
        socket_dir = make_socket_dir()
        async with Node("head", keys) as node:
            supervisor = cls(node, scheduler or Scheduler(), socket_dir,
                             heartbeat_interval_s=heartbeat_interval_s,
                             heartbeat_timeout_s=heartbeat_timeout_s, bind=bind, keys=keys, log_dir=log_dir,
                             run_tag=run_tag)
            wire.sweep_shm(supervisor.run_tag)
            node.spawn(supervisor.inbox.serve)
            node.spawn(supervisor._watch_heartbeats)
            try:
                yield supervisor
            finally:
                with anyio.CancelScope(shield=True):
                    await supervisor.shutdown()
                _remove_dir(socket_dir)

    # -- public API ------------------------------------------------------------

    async def start(self, spec: ActorSpec) -> ActorRef:
        """Place and start an actor; return once it is READY. Raises PlacementError or
        ActorStartError (with the actor's traceback). Cancelled: the process is killed."""
        if spec.name in self.records and self.records[spec.name].state not in ("stopped", "failed"):
            raise ValueError(f"an actor named {spec.name!r} is already running; names must be unique")
        placement = self.scheduler.place(spec)
        if spec.bind == "ipc":
            address = ipc_address(self.socket_dir, spec.name)
        else:
            address = spec.bind
            if is_beyond_loopback(address) and self.keys is None:
                self.scheduler.release(spec.name)
                raise ValueError(f"actor {spec.name} binds {address} beyond loopback: open the "
                                 "supervisor with keys=CurveKeys.generate()")
        record = ActorRecord(spec, placement, address)
        self.records[spec.name] = record
        try:
            await self._start_within_budget(record)
        except BaseException:
            record.stop_requested = True
            self._kill(record)
            record.state = "failed"
            self.scheduler.release(spec.name)
            raise
        self.node.spawn(self._watch, record)
        return self.ref(spec.name)

    async def _start_within_budget(self, record: ActorRecord) -> None:
        """Spawn until READY: a start killed by a signal or gone silent is spawned again after
        the restart backoff while `max_restarts` allows; a start that failed by itself raises
        at once. Raises ActorStartError. Cancelled: the incarnation being started is left
        running; the caller kills it (`start` does)."""
        spec = record.spec
        while True:
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

    def add_peers(self, addresses: dict[str, str]) -> None:
        """Actors that other supervisors run (on other nodes: core/ray_nodes.py), by name: this
        registry's `lookup` answers their addresses too. Its own actors keep precedence.
        A peer known at another address has moved (started again on another node, its own lost):
        this registry's references and every running actor's (told PEERS_MOVED, core/actor.py)
        point at the new address from then on."""
        moved = {name: address for name, address in addresses.items()
                 if self.peers.get(name, address) != address}
        self.peers.update(addresses)
        for name, address in moved.items():
            self.node.rebind(name, address, same_node=name in self.records)
        told = {name: {"address": address, "same_node": name in self.records}
                for name, address in moved.items()}
        for record in self.records.values():
            if moved and record.state == "running":
                self.node.spawn(self._tell_peers, record.spec.name, wire.PEERS_MOVED, told)

    def remove_peers(self, gone: dict[str, str]) -> None:
        """Actors gone for good ({name: reason}: their node was lost and they fit on no node
        left): `lookup` no longer finds them, this registry's references to them are closed, and
        every running actor is told (PEERS_GONE, core/actor.py)."""
        for name in gone:
            self.peers.pop(name, None)
            self._refs.pop(name, None)
            self.node.close_refs(name)
        for record in self.records.values():
            if gone and record.state == "running":
                self.node.spawn(self._tell_peers, record.spec.name, wire.PEERS_GONE, dict(gone))

    async def _tell_peers(self, name: str, kind: str, peers: dict) -> None:
        """Tell actor `name` the peers that moved (PEERS_MOVED) or are gone (PEERS_GONE).
        Cancelled: it may not be told; an actor that restarts meanwhile looks its peers up afresh."""
        try:
            await self.ref(name).tell(kind, peers, timeout_s=5)
        except Exception as exc:   # it died meanwhile: its next incarnation looks them up again
            log.warning("could not tell actor %s about peers %s: %s", name, sorted(peers), exc)

    def kill_all(self) -> None:
        """SIGKILL every actor's process group now, with no stop message and no restart (a node
        agent whose node is gone: core/ray_nodes.py)."""
        for record in self.records.values():
            record.stop_requested = True
            self._kill(record)

    def log_path(self, name: str) -> str | None:
        """The file actor `name`'s stdout and stderr go to (None: the head's own)."""
        return os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None

    def ref(self, name: str) -> ActorRef:
        """A (cached) reference to actor `name`: one of this supervisor's, or a peer's."""
        record = self.records.get(name)
        if record is None and name not in self.peers:
            raise KeyError(f"no actor named {name!r}; known: {sorted({*self.records, *self.peers})}")
        if name not in self._refs:
            self._refs[name] = self.node.ref(record.address if record else self.peers[name], name)
        return self._refs[name]

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
                    await self.ref(name).ask("_stop", timeout_s=record.spec.stop_timeout_s)
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
        wire.sweep_shm(self.run_tag)

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

    def status(self) -> dict:
        """The head, its free pools and every actor; on a cluster's head also the nodes, and the
        actors of every node (each with its `node`)."""
        status = self._own_status()
        if self.remote_status is not None:
            remote = self.remote_status()
            status["nodes"] = remote["nodes"]
            status["actors"] += remote["actors"]
        return status

    def _own_status(self) -> dict:
        now = time.monotonic()
        return {"head": {"pid": os.getpid(), "address": self.address},
                "pools": {"free": self.scheduler.free_summary()},
                "actors": [{"name": r.spec.name, "state": r.state, "pid": r.pid,
                            "restarts": r.restarts, "address": r.address,
                            "placement": r.placement.describe(), "last_exit": r.last_exit,
                            "heartbeat_age_s": round(now - r.last_heartbeat, 3) if r.last_heartbeat else None,
                            "note": r.note,
                            "load": r.load.to_wire() if r.load is not None else None}
                           for r in self.records.values()]}

    # -- process lifecycle -------------------------------------------------------

    def _spawn(self, record: ActorRecord) -> None:
        record.incarnation += 1
        record.ready = anyio.Event()
        record.exited = anyio.Event()
        record.crash_traceback = ""
        spec = record.spec
        payload = {"name": spec.name, "cls": spec.cls, "options": spec.options, "address": record.address,
                   "head_address": self.address, "head_pid": os.getpid(), "incarnation": record.incarnation,
                   "cpu_ids": list(record.placement.cpu_ids), "num_threads": record.placement.num_threads,
                   "heartbeat_interval_s": self.heartbeat_interval_s, "run_tag": self.run_tag,
                   "keys": self.keys.to_dict() if self.keys else None,
                   "log_path": self.log_path(spec.name),
                   "rendezvous": spec.rendezvous.model_dump() if spec.rendezvous is not None else None}
        if spec.elastic and spec.name in self.scheduler.elastic_names():  # what it holds now (lending.py)
            holding = self.lender.holding(spec.name, _home(record))
            payload.update(cpu_ids=list(holding.affinity), num_threads=holding.num_threads)
        # Inherited by the spawned child only. The run tag is in the child's environment from its
        # first instruction, so that /proc/PID/environ shows it (core/testing.py: leftovers).
        child_env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in record.placement.gpu_ids),
                     wire.RUN_TAG_ENV: self.run_tag}
        saved = {key: os.environ.get(key) for key in child_env}
        resource_tracker.ensure_running()  # the head's own helper: started outside the run's environment
        os.environ.update(child_env)
        try:
            process = _spawn.Process(target=run_actor_process, args=(payload,), name=f"postrain-{spec.name}",
                                     daemon=True)
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

    async def _note_exit(self, record: ActorRecord, process) -> None:
        """Wait for `process` to end, kill what is left of its process group, remove its (and any
        dead process of the run's) shared memory, and set the record's `exited`. Cancelled (the
        head closes): the group, shared memory and `exited` are left as they are; `shutdown`
        kills the groups and sweeps the run's shared memory."""
        await _wait_process(process)
        _kill_group(process.pid)  # its children (nsjail workers) do not outlive it
        wire.remove_shm_of(process.pid)  # a killed process cannot clean up its shared memory
        wire.sweep_shm(self.run_tag)
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
                    async def until(event):
                        """Cancel the waiting once `event` is set. Cancelled: nothing to undo."""
                        await event.wait()
                        tg.cancel_scope.cancel()
                    tg.start_soon(until, record.ready)
                    tg.start_soon(until, record.exited)
        if record.ready.is_set():
            record.state = "running"
            self._add_event(spec.name, "started", f"pid {record.pid}, incarnation {record.incarnation}")
            return
        where = {"actor": spec.name, "cls": spec.cls, "log_path": self.log_path(spec.name)}
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

    async def _watch_heartbeats(self) -> None:
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

    # -- head handlers -------------------------------------------------------------

    def _record_for(self, body) -> ActorRecord | None:
        record = self.records.get(body.get("name")) if isinstance(body, dict) else None
        if record is None or body.get("incarnation") != record.incarnation:
            return None  # a message from an earlier incarnation
        return record

    async def _on_ready(self, body) -> str:
        """READY from the current incarnation. Does not wait: a cancellation finds it done."""
        record = self._record_for(body)
        if record is not None:
            record.last_heartbeat = time.monotonic()
            record.address = body.get("address", record.address)
            record.ready.set()
        return "ok"

    async def _on_heartbeat(self, body) -> None:
        """The actor lives; its load replaces the last one. A malformed load is logged (the
        inbox logs a failed tell) and the last good one kept; the heartbeat still counts.
        Does not wait (cancel-safe)."""
        record = self._record_for(body)
        if record is not None:
            record.last_heartbeat = time.monotonic()
            record.note = str(body.get("note") or "")
            if body.get("load") is not None:  # a keep-alive beat (setup, a blocking load) has none
                record.load = Load.from_wire(body["load"])

    async def _on_crashed(self, body) -> str:
        """Keep the actor's traceback for its exit event. Does not wait (cancel-safe)."""
        record = self._record_for(body)
        if record is not None:
            record.crash_traceback = str(body.get("traceback", ""))
        return "ok"

    async def _on_lookup(self, body) -> dict:
        """{"address", "same_node"} of the actor named in `body`. Does not wait (cancel-safe).

        Node identity: this supervisor runs the actors of one node (a cluster's node agent, or the
        single host), and an actor looks up through its own node's supervisor; so an actor of
        `records` shares the asker's node, a peer (`add_peers`: another supervisor's) does not."""
        name = body.get("name") if isinstance(body, dict) else None
        record = self.records.get(name)
        if record is None:
            if name in self.peers:
                return {"address": self.peers[name], "same_node": False}
            raise KeyError(f"no actor named {name!r}; known: {sorted({*self.records, *self.peers})}")
        return {"address": record.address, "same_node": True}

    async def _on_status(self, body) -> dict:
        """`status()` for `postrain status`. Does not wait (cancel-safe)."""
        return self.status()

    async def _on_work(self, body) -> dict:
        """{"actor", "busy"}: elastic cores follow (CoreLender.set_busy; its reply). Cancelled:
        see CoreLender.set_busy."""
        if not isinstance(body, dict) or not isinstance(body.get("actor"), str) \
                or not isinstance(body.get("busy"), bool):
            raise ValueError(f"work needs {{'actor': name, 'busy': true or false}}, got {body!r}")
        return await self.lender.set_busy(body["actor"], body["busy"])

    def _elastic_homes(self) -> dict[str, Home]:
        """The placed elastic actors of this head and their homes (their placements)."""
        return {name: _home(self.records[name]) for name in sorted(self.scheduler.elastic_names())
                if name in self.records}

    async def _pin_cores(self, name: str, body: dict) -> dict:
        """Re-pin actor `name` (the kernel's `_cores`). Cancelled: it may or may not be re-pinned."""
        return await self.ref(name).ask(CORES, body, timeout_s=30)

    async def _on_shutdown(self, body) -> str:
        """`postrain down`: set shutdown_requested. Does not wait (cancel-safe)."""
        self.shutdown_requested.set()
        return "shutting down"


def _home(record: ActorRecord) -> Home:
    placement = record.placement
    return Home(frozenset(placement.cpu_ids), placement.num_threads, borrows=record.spec.elastic is True)


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


async def _wait_process(process) -> None:
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


def _remove_dir(path: str) -> None:
    try:
        for entry in os.listdir(path):
            os.unlink(os.path.join(path, entry))
        os.rmdir(path)
    except OSError:
        pass
