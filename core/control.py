"""The kernel's own messages between an actor and its head, declared once (core/messages.py).

    location = await head.call(LOOKUP, Lookup(name="generator"))       # ActorLocation
    await head.call(READY, Ready(name, pid, address, incarnation))      # after setup
    await head.send(HEARTBEAT, Heartbeat(name, pid, incarnation, load, note))

An actor's runtime (core/runtime.py) reports READY, a HEARTBEAT every interval and, when it
dies of an exception, CRASHED with its traceback; the head (core/supervisor.py) keeps them for
the actor's current incarnation only, and only from the actor they name. `_whois` is asked by an
authenticating inbox (core/identity.py) for the name behind a client key. Their names start
with "_": no actor may declare a handler for them. The pool protocol (RESIZE) is core/load.py's,
elastic cores' `work` core/lending.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .load import Load
from .messages import MessageKind
from .record import Record, codec


@dataclass(frozen=True, slots=True)
class Lookup(Record):
    """Where does actor `name` live?"""

    name: str


@dataclass(frozen=True, slots=True)
class ActorLocation(Record):
    """Its inbox's address; whether it runs on the asker's node (`same_node`: /dev/shm is shared);
    the Curve key its inbox serves with (None without keys)."""

    address: str
    same_node: bool
    server_key: bytes | None = None


@dataclass(frozen=True, slots=True)
class Ready(Record):
    """The actor's setup is done and its inbox serves at `address`."""

    name: str
    pid: int
    address: str
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class Heartbeat(Record):
    """The actor lives: its load (None for a keep-alive beat while setup or a blocking call runs)
    and what it says it is doing (`note`)."""

    name: str
    pid: int
    incarnation: int = 0
    load: Load | None = field(default=None, metadata=codec(Load.to_wire, Load.from_wire))
    note: str = ""


@dataclass(frozen=True, slots=True)
class Crashed(Record):
    """The actor died of an exception; its traceback, for the exit event."""

    name: str
    pid: int
    incarnation: int = 0
    traceback: str = ""


@dataclass(frozen=True, slots=True)
class Whois(Record):
    """Whose is this client key (Z85)?"""

    key: str


@dataclass(frozen=True, slots=True)
class ActorName(Record):
    """The actor behind a key (identity.CONTROL for the run's control key), None for a stranger."""

    name: str | None = None


LOOKUP = MessageKind("lookup", Lookup, ActorLocation)
READY = MessageKind("_ready", Ready, None)
HEARTBEAT = MessageKind("_heartbeat", Heartbeat, None)
CRASHED = MessageKind("_crashed", Crashed, None)
WHOIS = MessageKind("_whois", Whois, ActorName)


# -- the head (or an actor's supervisor) to the actor: served for the run's control key only.

@dataclass(frozen=True, slots=True)
class Cores(Record):
    """Re-pin every thread of the actor to `cpu_ids`; later compute uses `num_threads` threads
    (elastic cores, core/lending.py). The reply: the affinity in place and the thread count."""

    cpu_ids: list[int]
    num_threads: int

    def _check(self) -> None:
        if not self.cpu_ids or self.num_threads < 1:
            self.fail_field("cpu_ids", self.cpu_ids, f"non-empty, with num_threads >= 1 (got {self.num_threads})")


@dataclass(frozen=True, slots=True)
class MovedPeer(Record):
    """Where a peer runs now: its address, and whether on the told actor's own node."""

    address: str
    same_node: bool


@dataclass(frozen=True, slots=True)
class PeersMoved(Record):
    """Actors started again elsewhere (a cluster node was lost): {name: where}."""

    moved: dict[str, MovedPeer] = field(default_factory=dict, metadata=codec(
        lambda moved: {name: peer.to_wire() for name, peer in moved.items()},
        lambda moved: {name: MovedPeer.from_wire(peer) for name, peer in moved.items()}))


@dataclass(frozen=True, slots=True)
class PeersGone(Record):
    """Actors gone for good (their node lost, no room left for them): {name: reason}."""

    gone: dict[str, str] = field(default_factory=dict)


STOP = MessageKind("_stop", None, None)
CORES = MessageKind("_cores", Cores, Cores)
PEERS_MOVED = MessageKind("_peers_moved", PeersMoved, None)
PEERS_GONE = MessageKind("_peers_gone", PeersGone, None)


# -- the operator (postrain status / down) to the head.

@dataclass(frozen=True, slots=True)
class HeadInfo(Record):
    """The head process: its pid and the address its control plane listens on."""

    pid: int
    address: str


@dataclass(frozen=True, slots=True)
class ActorStatus(Record):
    """One actor as the head (or a node's agent) sees it: its state, process, restarts, address,
    placement, last exit, the age of its last heartbeat, note and load; `node` on a cluster."""

    name: str
    state: str
    restarts: int
    placement: str
    pid: int | None = None
    address: str | None = None
    last_exit: str = ""
    heartbeat_age_s: float | None = None
    note: str = ""
    load: Load | None = field(default=None, metadata=codec(Load.to_wire, Load.from_wire))
    node: str | None = None


@dataclass(frozen=True, slots=True)
class NodeStatus(Record):
    """One node of a cluster run: alive or lost (and why), its actors and its free pools."""

    name: str
    address: str
    state: str
    actors: list[str] = field(default_factory=list)
    reason: str | None = None
    free: str = ""


def _records(kind: type[Record]) -> dict[str, Any]:
    """Field metadata: a list of `kind` records on the wire as a list of their dicts."""
    return codec(lambda items: [item.to_wire() for item in items], lambda items: [kind.from_wire(i) for i in items])


@dataclass(frozen=True, slots=True)
class HeadStatus(Record):
    """`postrain status`: the head, its free pools (`free`: a summary line), every actor and, on
    a cluster's head, the nodes (core/supervisor.py, Supervisor.status, builds its wire form)."""

    head: HeadInfo = field(metadata=codec(HeadInfo.to_wire, HeadInfo.from_wire))
    pools: dict[str, str]
    actors: list[ActorStatus] = field(metadata=_records(ActorStatus))
    nodes: list[NodeStatus] | None = field(default=None, metadata=_records(NodeStatus))


STATUS = MessageKind("status", None, HeadStatus)
SHUTDOWN = MessageKind("shutdown", None, None)     # `postrain down`: the run stops as on Ctrl-C
