"""The supervisor: the head's actor registry and the handlers of the messages actors send it.

`Supervisor` starts actors from specs (placed by the scheduler, core/scheduler.py) and keeps
their processes through `ActorProcesses` (core/lifecycle.py: spawn, READY, watch, restart with
backoff, stop, kill; its design note says how and why). This module is the head's side of the
conversation with its actors: the inbox's handlers (READY, heartbeats, crash reports, lookups,
status, shutdown, elastic work) and the registry they serve.

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
import os
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Iterable

import anyio

from . import wire
from .actor import import_actor_class
from .actor_ref import ActorRef
from .config import ActorSpec
from .control import (CORES, CRASHED, HEARTBEAT, LOOKUP, PEERS_GONE, PEERS_MOVED, READY, SHUTDOWN, STATUS, WHOIS,
                      ActorLocation, ActorName, Cores, Crashed, HeadStatus, Heartbeat, Lookup, MovedPeer, PeersGone,
                      PeersMoved, Ready, Whois)
from .elastic import Home
from .errors import PostrainError
from .identity import Identities, KeyTable, group_secret, keys_for_actor, server_key_of
from .inbox import Inbox
from .lending import WORK, CoreLender, WorkReply, WorkRequest
from .lifecycle import ActorEvent, ActorProcesses, ActorRecord
from .messages import MessageKind
from .node import Node
from .scheduler import Scheduler
from .shm import sweep_shm
from .transport import CurveKeys, ipc_address, is_beyond_loopback, make_socket_dir
from .typed import typed_handler

log = logging.getLogger("postrain.core")


RUN_TAG_SECRET = ".run_tag_secret"  # in a run folder: the random secret its run tag comes from


def run_tag_for(folder: str) -> str:
    """The run tag of the run kept in `folder`: stable for that folder (a resumed run has the tag
    of the run it resumes, so it finds what a killed head left), yet not predictable by another
    local user (who could otherwise plant files under it before the run starts): it comes from a
    random secret in folder/RUN_TAG_SECRET, made on first use, readable by its user only.
    PostrainError where that file is not this user's own, or others may read it."""
    path = os.path.join(folder, RUN_TAG_SECRET)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise PostrainError(
                    f"run tag secret {path} is owned by uid {info.st_uid} with mode "
                    f"{oct(info.st_mode & 0o777)}; it must be this user's (uid {os.geteuid()}) with mode "
                    f"0600; fix: remove the file (the run then gets a new tag)") from None
            secret = f.read()
    else:
        secret = secrets.token_bytes(32)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
    return hashlib.sha256(b"postrain run tag\0" + secret).hexdigest()[:12]


class Supervisor:
    """Use through `async with Supervisor.open(...) as supervisor:`; leaving stops every actor."""

    def __init__(self, node: Node, scheduler: Scheduler, socket_dir: str, *,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float, bind: str,
                 keys: CurveKeys | None, log_dir: str | None = None, run_tag: str | None = None):
        self.run_tag = run_tag or uuid.uuid4().hex[:12]  # hex: names the run's processes and shm files
        self.node = node
        self.scheduler = scheduler
        self.socket_dir = socket_dir
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.keys = keys
        # The actors' processes (each one's stdout and stderr go to log_dir/NAME.log).
        self.processes = ActorProcesses(node, scheduler, run_tag=self.run_tag, log_dir=log_dir,
                                        heartbeat_interval_s=heartbeat_interval_s,
                                        heartbeat_timeout_s=heartbeat_timeout_s,
                                        head_fields=self._head_fields, ref=self.ref)
        self.records: dict[str, ActorRecord] = self.processes.records   # the same dict, by name
        self.events: list[ActorEvent] = self.processes.events           # the same list, oldest first
        self.peers: dict[str, str] = {}   # actors other supervisors run (other nodes): name -> address
        # A cluster's head: () -> {"nodes": [...], "actors": [...]}, the other nodes' view, merged
        # into `status()` (cli/node_watch.py sets it); None on one host.
        self.remote_status: Callable[[], dict[str, Any]] | None = None
        # Each actor's own keys come from the run's seed (core/identity.py); the seed of the
        # collective groups' secrets is the run's too, or this head's own on one host without keys.
        self._key_table = KeyTable(keys) if keys is not None else None
        self._expected: set[str] = set()   # names about to start elsewhere (a cluster): `expect`
        self._group_seed = keys.identity_seed if keys is not None and keys.identity_seed else secrets.token_bytes(32)
        if keys is not None:
            node.identities = Identities((keys.client_public, *keys.allowed_client_keys), self._whois)
        address = ipc_address(socket_dir, "head") if bind == "ipc" else bind
        self.inbox = Inbox(node, address, {
            WHOIS.name: typed_handler(WHOIS, self._on_whois),
            # what an actor says of itself counts only for the actor it names (its own sender name,
            # which an authenticating socket checks against its key); `down` is the operator's
            READY.name: typed_handler(READY, self._on_ready, wants_message=True),
            HEARTBEAT.name: typed_handler(HEARTBEAT, self._on_heartbeat, wants_message=True),
            CRASHED.name: typed_handler(CRASHED, self._on_crashed, wants_message=True),
            LOOKUP.name: typed_handler(LOOKUP, self._on_lookup),
            STATUS.name: typed_handler(STATUS, self._on_status),
            SHUTDOWN.name: typed_handler(SHUTDOWN, self._on_shutdown, control_only=True),
            WORK.name: typed_handler(WORK, self._on_work, senders=self._drives_work)})
        self.lender = CoreLender(self._elastic_homes, self._pin_cores)
        self.shutdown_requested = anyio.Event()  # set by a `shutdown` message (`postrain down`)
        self.address = self.inbox.bound_address
        self._refs: dict[str, ActorRef] = {}

    @classmethod
    @asynccontextmanager
    async def open(cls, *, scheduler: Scheduler | None = None, heartbeat_interval_s: float = 1.0,
                   heartbeat_timeout_s: float = 30.0, bind: str = "ipc", keys: CurveKeys | None = None,
                   log_dir: str | None = None, run_tag: str | None = None) -> AsyncIterator[Supervisor]:
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
            sweep_shm(supervisor.run_tag)
            node.spawn(supervisor.inbox.serve)
            node.spawn(supervisor.processes.watch_heartbeats)
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
        await self.processes.start(self._placed(spec))
        return self.ref(spec.name)

    async def start_in_order(self, specs: Iterable[ActorSpec],
                             started: Callable[[ActorSpec], None] = lambda spec: None) -> None:
        """Start `specs` as `start` would, one after another: each begins its setup once the
        ones before it are READY (an actor may look up, in its setup, those before it), and
        `started(spec)` runs at each READY. All are placed first, then spawned ahead
        (ActorProcesses.spawn_ahead), so their imports overlap; an elastic one is pinned to its
        home then, which is what it holds at its turn too (cores are lent only once the driver
        gives work, after the start). Raises as `start` does, before any spawn where one does
        not fit. Failed or cancelled: those spawned ahead and not started are killed (and
        reaped, within 5 s); those READY stay, for `shutdown`."""
        records: list[ActorRecord] = []
        try:
            for spec in specs:
                records.append(self._placed(spec))
            for record in records:
                self.processes.spawn_ahead(record)
            for record in records:
                await self.processes.start(record)
                started(record.spec)
        except BaseException:
            waiting = [record for record in records if record.spec.name not in self.records]
            for record in waiting:
                self.processes.discard(record)
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                for record in waiting:
                    if record.process is not None:
                        await record.exited.wait()
            raise

    def _placed(self, spec: ActorSpec) -> ActorRecord:
        """A record for `spec`, placed (its address chosen), not yet spawned. Raises
        PlacementError, or ValueError for a name already running or an address it may not bind."""
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
        return ActorRecord(spec, placement, address)

    async def stop(self, name: str) -> None:
        """STOP message, a bounded wait, then SIGKILL. Idempotent. Cancelled: the actor may be
        left running with stop_requested set (not restarted); a later `stop` finishes the job."""
        await self.processes.stop(name)

    async def shutdown(self) -> None:
        """Stop every actor at once (at most 30 s), then SIGKILL whatever lives (its process
        group), wait for the exits (at most 5 s) and remove the run's shared memory. Cancelled:
        the actors not yet stopped are left running, unkilled; `open` runs it shielded."""
        await self.processes.shutdown()

    def kill(self, name: str) -> None:
        """SIGKILL an actor as a crash would (tests, chaos); the supervisor restarts it."""
        self.processes.kill(name)

    def kill_all(self) -> None:
        """SIGKILL every actor's process group now, with no stop message and no restart (a node
        agent whose node is gone: core/ray_nodes.py)."""
        self.processes.kill_all()

    async def wait_for_event(self, name: str, event: str, timeout_s: float = 30.0) -> ActorEvent:
        """Wait until an event `event` for actor `name` is recorded (counting from now).
        Cancelled: nothing changes (it only reads the event list)."""
        return await self.processes.wait_for_event(name, event, timeout_s)

    async def wait_running(self, name: str, timeout_s: float = 30.0, min_restarts: int = 0) -> None:
        """Wait until actor `name` is running after at least `min_restarts` restarts.
        Cancelled: nothing changes (it only reads the record)."""
        await self.processes.wait_running(name, timeout_s, min_restarts)

    def log_path(self, name: str) -> str | None:
        """The file actor `name`'s stdout and stderr go to (None: the head's own)."""
        return self.processes.log_path(name)

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
        told = PeersMoved({name: MovedPeer(address, same_node=name in self.records)
                           for name, address in moved.items()})
        for record in self.records.values():
            if moved and record.state == "running":
                self.node.spawn(self._tell_peers, record.spec.name, PEERS_MOVED, told)

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
                self.node.spawn(self._tell_peers, record.spec.name, PEERS_GONE, PeersGone(dict(gone)))

    async def _tell_peers(self, name: str, kind: MessageKind[Any, Any], peers: PeersMoved | PeersGone) -> None:
        """Tell actor `name` the peers that moved (PEERS_MOVED) or are gone (PEERS_GONE).
        Cancelled: it may not be told; an actor that restarts meanwhile looks its peers up afresh."""
        try:
            await self.ref(name).send(kind, peers, timeout_s=5)
        except Exception as exc:   # it died meanwhile: its next incarnation looks them up again
            log.warning("could not tell actor %s about peers %s: %s", name, sorted(peers.to_wire()), exc)

    def ref(self, name: str) -> ActorRef:
        """A (cached) reference to actor `name`: one of this supervisor's, or a peer's."""
        record = self.records.get(name)
        if record is None and name not in self.peers:
            raise KeyError(f"no actor named {name!r}; known: {sorted({*self.records, *self.peers})}")
        if name not in self._refs:
            self._refs[name] = self.node.ref(record.address if record else self.peers[name], name,
                                             server_key=server_key_of(self.keys, name))
        return self._refs[name]

    def status(self) -> dict[str, Any]:
        """The head, its free pools and every actor; on a cluster's head also the nodes, and the
        actors of every node (each with its `node`)."""
        status = self._own_status()
        if self.remote_status is not None:
            remote = self.remote_status()
            status["nodes"] = remote["nodes"]
            status["actors"] += remote["actors"]
        return status

    def _own_status(self) -> dict[str, Any]:
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

    def _head_fields(self, record: ActorRecord) -> dict[str, Any]:
        """What the head adds to an actor's spawn spec (ActorProcesses): its own address, the
        actor's own keys (core/identity.py), its group's secret when it is a rank of one, and for
        an elastic actor the cores it holds at this moment (lending.py)."""
        spec = record.spec
        fields: dict[str, Any] = {"head_address": self.address, "keys": self._keys_for(spec)}
        if spec.rendezvous is not None:
            fields["group_secret"] = group_secret(self._group_seed, spec.rendezvous.names)
        if spec.elastic and spec.name in self.scheduler.elastic_names():
            holding = self.lender.holding(spec.name, _home(record))
            fields.update(cpu_ids=list(holding.affinity), num_threads=holding.num_threads)
        return fields

    def _keys_for(self, spec: ActorSpec) -> dict[str, Any] | None:
        """Actor `spec.name`'s keys as a dict: its own client pair, the bulk key only if it needs
        it; the run's keys unchanged where they have no seed (made by hand, not `generate`)."""
        if self.keys is None:
            return None
        if not self.keys.identity_seed:
            return self.keys.to_dict()
        return keys_for_actor(self.keys, spec.name, bulk_key=_needs_bulk_key(spec)).to_dict()

    def expect(self, names: Iterable[str]) -> None:
        """Actors about to start under another supervisor (a cluster's other nodes), whose keys
        this one's `_whois` should know before they are peers (they may call during setup)."""
        self._expected.update(names)

    async def _whois(self, public: bytes) -> str | None:
        """The name whose key is `public` (Z85), among this registry's actors, its peers and the
        names expected; CONTROL for the run's control key; None for a stranger."""
        assert self._key_table is not None   # a supervisor with keys asks (its Identities, _on_whois)
        return self._key_table.name_of(public, [*self.records, *self.peers, *self._expected])

    # -- head handlers -------------------------------------------------------------

    async def _on_whois(self, request: Whois) -> ActorName:
        """The actor's name behind a Z85 public key, or None (an actor's authentication handler
        asks, core/identity.py). Does not wait (cancel-safe)."""
        if self._key_table is None:
            return ActorName(None)
        return ActorName(await self._whois(request.key.encode()))

    def _record_for(self, report: Ready | Heartbeat | Crashed, msg: wire.Message) -> ActorRecord | None:
        """The record of the actor `report` names, if the message is its own current incarnation's:
        None for an earlier incarnation, or for a sender that is not the actor it names."""
        record = self.records.get(report.name)
        if record is None or report.incarnation != record.incarnation:
            return None  # a message from an earlier incarnation
        if msg.sender != record.spec.name:
            log.warning("ignored %s about actor %s sent by %r", msg.kind, record.spec.name, msg.sender)
            return None
        return record

    async def _on_ready(self, ready: Ready, msg: wire.Message) -> None:
        """READY from the current incarnation. Does not wait: a cancellation finds it done."""
        record = self._record_for(ready, msg)
        if record is not None:
            record.last_heartbeat = time.monotonic()
            record.address = ready.address
            record.ready.set()

    async def _on_heartbeat(self, beat: Heartbeat, msg: wire.Message) -> None:
        """The actor lives; its load replaces the last one. A malformed heartbeat (its load
        included) is refused by its record and logged by the inbox (a failed tell); the last good
        load is kept. Does not wait (cancel-safe)."""
        record = self._record_for(beat, msg)
        if record is not None:
            record.last_heartbeat = time.monotonic()
            record.note = beat.note
            if beat.load is not None:  # a keep-alive beat (setup, a blocking load) has none
                record.load = beat.load

    async def _on_crashed(self, crashed: Crashed, msg: wire.Message) -> None:
        """Keep the actor's traceback for its exit event. Does not wait (cancel-safe)."""
        record = self._record_for(crashed, msg)
        if record is not None:
            record.crash_traceback = crashed.traceback

    async def _on_lookup(self, lookup: Lookup) -> ActorLocation:
        """Where the actor `lookup` names lives (`server_key`: the Curve key its inbox serves
        with, None without keys). Does not wait (cancel-safe).

        Node identity: this supervisor runs the actors of one node (a cluster's node agent, or the
        single host), and an actor looks up through its own node's supervisor; so an actor of
        `records` shares the asker's node, a peer (`add_peers`: another supervisor's) does not."""
        name = lookup.name
        record = self.records.get(name)
        if record is None:
            if name in self.peers:
                return ActorLocation(self.peers[name], same_node=False, server_key=server_key_of(self.keys, name))
            raise KeyError(f"no actor named {name!r}; known: {sorted({*self.records, *self.peers})}")
        return ActorLocation(record.address, same_node=True, server_key=server_key_of(self.keys, name))

    async def _on_status(self, body: None) -> HeadStatus:
        """`status()` for `postrain status`. Does not wait (cancel-safe)."""
        return HeadStatus.from_wire(self.status())

    def _drives_work(self, name: str) -> bool:
        """Whether actor `name` of this run may send `work` (its class's `drives_work`)."""
        record = self.records.get(name)
        return record is not None and _class_says(record.spec, "drives_work")

    async def _on_work(self, request: WorkRequest) -> WorkReply:
        """An actor starts or stops having work: elastic cores follow (CoreLender.set_busy).
        Cancelled: see CoreLender.set_busy."""
        return await self.lender.set_busy(request.actor, request.busy)

    def _elastic_homes(self) -> dict[str, Home]:
        """The placed elastic actors of this head and their homes (their placements)."""
        return {name: _home(self.records[name]) for name in sorted(self.scheduler.elastic_names())
                if name in self.records}

    async def _pin_cores(self, name: str, cores: Cores) -> Cores:
        """Re-pin actor `name` (the kernel's `_cores`). Cancelled: it may or may not be re-pinned."""
        return await self.ref(name).call(CORES, cores, timeout_s=30)

    async def _on_shutdown(self, body: None) -> None:
        """`postrain down`: set shutdown_requested. Does not wait (cancel-safe)."""
        self.shutdown_requested.set()


def _needs_bulk_key(spec: ActorSpec) -> bool:
    """The spec's `bulk_key`, or where unset its class's `needs_bulk_key`."""
    if spec.bulk_key is not None:
        return spec.bulk_key
    return _class_says(spec, "needs_bulk_key")


def _class_says(spec: ActorSpec, flag: str) -> bool:
    """The spec's actor class's boolean class attribute `flag` (imported here; a class that does
    not import fails its own start, so it says False)."""
    try:
        return bool(getattr(import_actor_class(spec.cls), flag))
    except (ImportError, TypeError):
        return False


def _home(record: ActorRecord) -> Home:
    placement = record.placement
    return Home(frozenset(placement.cpu_ids), placement.num_threads, borrows=record.spec.elastic is True)


def _remove_dir(path: str) -> None:
    try:
        for entry in os.listdir(path):
            os.unlink(os.path.join(path, entry))
        os.rmdir(path)
    except OSError:
        pass
