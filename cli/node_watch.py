"""The head's watch over a cluster run's nodes: a lost node's actors placed again elsewhere,
and every node's actors for `postrain status` and the live view.

    watch = NodeWatch(agents, launch, config, supervisor, folder, emit=monitor.line)
    async with anyio.create_task_group() as tg:   # once every actor runs
        tg.start_soon(watch.run)                   # NodeLossError: a lost actor that fits nowhere

Design note. A node is lost when Ray reports it dead (its health checks: seconds after its
raylet stops answering), or when its agent's supervisor has not answered the head's
`status` ask for `[cluster] node_timeout_s`, or for 2 s once the connection to it closed (the
agent exits with its raylet, core/ray_nodes.py, so a killed node shows here in about a
second). A lost node costs only what ran there: the head forgets its agent, takes the node
out of its `ClusterScheduler`, and places each of its actors again, in config order, on the
nodes left with room (the same rule as at the start; a `node` hint naming the lost node is
dropped), where that node's agent starts it (a node found lost meanwhile is lost in turn,
and the actor placed once more). `Agents.start` tells every agent, and through
it every actor, the new address (Supervisor.add_peers), so their references follow; a
request in flight to the lost actor failed with ActorDiedError and its caller's retry rules
apply (the orchestrator retries rollouts, its LearnerKeeper restores a learner from the
checkpoint and replays).

An actor that fits on no node left is dropped when the run can go on without it: it is a
replica (`replicas = N`) of an entry with another replica left, and so is every actor that
names it as a single option and cannot work without it (an environment's `generator`), which
is dropped with it (`go_without`). The head tells every agent, and through them every actor,
that they are gone for good (Supervisor.remove_peers, Actor.on_peers_gone): the orchestrator
leaves them out of its rotation, publishes and resyncs, and retries their rollouts in flight
on those left. Otherwise the loss stops the run with one line (NodeLossError), never a hang,
as does the loss of the run's driver (its run state lives in it; `postrain up --resume`
continues from its last checkpoint).

Each loss, each actor placed again and each actor dropped is a progress line and a metrics
row (kinds "node_lost", "replaced" and "dropped"); the run's summary counts them
(`node_losses`, `replacements`, `actors_dropped`), and `postrain status` shows a dropped actor
in state "dropped" with the reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import anyio

from postrain.core.cluster import AgentLostError, ClusterScheduler
from postrain.core.actor_ref import ActorRef
from postrain.core.config import ActorSpec
from postrain.core.control import STATUS
from postrain.core.errors import ActorDiedError, ActorError, PlacementError, PostrainError
from postrain.core.metrics import MetricsWriter
from postrain.core.supervisor import Supervisor

from .cluster_up import ClusterLaunch
from .config import UpConfig

CLOSED_GRACE_S = 2.0   # a node whose agent's connection closed and stayed closed this long is lost


class NodeLossError(PostrainError):
    """A node was lost with an actor the run cannot go on without: its driver, or one that fits
    on no node left and is no replica, or the last replica of its entry (`go_without`)."""


class IndispensableError(PostrainError):
    """The run cannot go on without `actor`: `why` says what it is."""

    def __init__(self, actor: str, why: str):
        super().__init__(f"the run cannot go on without actor {actor!r} ({why})")
        self.actor, self.why = actor, why


def go_without(name: str, specs: dict[str, ActorSpec], groups: dict[str, str], driver: str | None,
               gone: set[str]) -> dict[str, str]:
    """The actors to drop when actor `name` cannot run again: `name` itself, and every actor
    not `gone` already that names one of them as a single option (it cannot work without it),
    each with what it needs ("" for `name`), in that order. `groups`: replica name -> its
    entry. Raises IndispensableError for the first of them the run cannot go without: the
    driver, an actor that is no replica, or the last replica of its entry not dropped."""
    dropped = {name: ""}
    needed = [name]
    while needed:
        one = needed.pop(0)
        for other, spec in specs.items():
            if other not in dropped and other not in gone and one in _single_names(spec.options):
                dropped[other] = one
                needed.append(other)
    for actor in dropped:
        entry = groups.get(actor)
        if actor == driver:
            raise IndispensableError(actor, "the run's driver")
        if entry is None:
            raise IndispensableError(actor, "it has no replicas")
        if not [r for r, e in groups.items() if e == entry and r not in dropped and r not in gone]:
            raise IndispensableError(actor, f"the last replica of {entry!r} left")
    return dropped


def _single_names(options: dict) -> set[str]:
    """The option values that are one name (a str), not a list of them."""
    return {value for value in options.values() if isinstance(value, str)}


@dataclass
class NodeState:
    """The head's view of one node. Invariant: lost_reason is set iff the node is lost; a lost
    node is never asked again."""

    name: str
    address: str                       # the node's address (what its actors bind)
    last_answer: float                 # time.monotonic() of its agent's last `status` answer
    closed: bool = False               # the last ask failed because the connection closed
    status: dict | None = None         # its agent's supervisor status, as last answered
    lost_reason: str = ""
    actors: list[str] = field(default_factory=list)   # the run's actors placed there now


class NodeWatch:
    """Watches the nodes of a running cluster run (`run`), places a lost node's actors again,
    and answers the other nodes' view for the head's status (`remote_status`)."""

    def __init__(self, agents, launch: ClusterLaunch, config: UpConfig, supervisor: Supervisor, folder: Path,
                 emit: Callable[[str], None]):
        self.agents = agents                 # postrain.core.ray_nodes.Agents
        self.supervisor = supervisor
        self.folder = folder
        self.emit = emit
        self.driver = config.run.driver
        self.interval_s = config.head.heartbeat_interval_s
        assert config.cluster is not None  # a launch on nodes comes of the config's [cluster] section
        self.node_timeout_s = config.cluster.node_timeout_s
        self.specs = {spec.name: spec for spec in config.actors}
        self.groups = {name: group for group, names in config.replica_groups().items() for name in names}
        self.scheduler = ClusterScheduler(list(launch.nodes))
        for placed in launch.plan:   # the plan as it runs: each actor on its planned node
            spec = self.specs[placed.name].model_copy(update={"node": placed.node})
            self.scheduler.place(spec, self.groups.get(placed.name))
        now = time.monotonic()
        self.nodes = {node.name: NodeState(node.name, node.address, now) for node in launch.nodes}
        for placed in launch.plan:
            self.nodes[placed.node].actors.append(placed.name)
        self.num_node_losses = 0
        self.num_replacements = 0
        self.dropped: dict[str, tuple[str, str]] = {}   # actor gone for good -> (its last node, why)
        self._refs: dict[str, ActorRef] = {}   # node name -> ActorRef to its agent's supervisor
        self._metrics = MetricsWriter(folder, tensorboard=False, skip_rows_when_full=True)
        supervisor.remote_status = self.remote_status

    # -- the watch ------------------------------------------------------------------------

    async def run(self) -> None:
        """Check the nodes every heartbeat interval until cancelled. Raises NodeLossError. Cancelled:
        between checks nothing is half done; during a loss's placements, the actors started so
        far run on (leaving `node_agents` stops them) and the counts include them."""
        try:
            while True:
                await self.check()
                await anyio.sleep(self.interval_s)
        finally:
            self._metrics.close()

    async def check(self) -> None:
        """Ask every live node's agent for its status, then treat every node found lost."""
        live = [state for state in self.nodes.values() if not state.lost_reason]
        async with anyio.create_task_group() as tg:
            for state in live:
                tg.start_soon(self._ask_status, state)
        dead = set(await anyio.to_thread.run_sync(self.agents.dead_nodes))
        now = time.monotonic()
        for state in live:
            silent_s = now - state.last_answer
            if state.name in dead:
                await self.lose(state, "Ray reports it dead")
            elif state.closed and silent_s >= CLOSED_GRACE_S:
                await self.lose(state, f"its agent's connection closed and it has not answered for "
                                       f"{silent_s:.1f} s")
            elif silent_s >= self.node_timeout_s:
                await self.lose(state, f"its agent has not answered for {silent_s:.1f} s "
                                       f"(node_timeout_s = {self.node_timeout_s:g})")

    async def explain(self) -> None:
        """Check the nodes until one is found lost (which raises, as `check` does) or
        node_timeout_s passes with every node answering: for a failure elsewhere (the driver's)
        that a node's loss may have caused, so that the user reads the cause."""
        deadline = time.monotonic() + self.node_timeout_s
        while time.monotonic() < deadline:
            await self.check()
            if all(time.monotonic() - state.last_answer < self.interval_s + 1.0
                   for state in self.nodes.values() if not state.lost_reason):
                return   # every node answers now: no loss to explain the failure
            await anyio.sleep(self.interval_s)

    async def _ask_status(self, state: NodeState) -> None:
        """One `status` ask to the node's agent. Cancelled: nothing changes."""
        if state.name not in self._refs:
            address = self.agents.supervisor_addresses[state.name]
            self._refs[state.name] = self.supervisor.node.ref(address, f"node agent {state.name}")
        try:
            status = await self._refs[state.name].call(STATUS, timeout_s=max(1.0, self.interval_s))
            state.status = status.to_wire()
        except ActorDiedError:
            state.closed = True
        except ActorError:
            pass
        else:
            state.last_answer, state.closed = time.monotonic(), False

    # -- a lost node ----------------------------------------------------------------------

    async def lose(self, state: NodeState, reason: str) -> None:
        """Forget node `state` and place its actors again (module docstring). Raises NodeLossError."""
        if state.lost_reason:
            return   # lost already (found again by a placement that chose it)
        lost_at = time.monotonic()
        state.lost_reason, state.status = reason, None
        self.num_node_losses += 1
        await anyio.to_thread.run_sync(self.agents.forget, state.name)
        names = [placed.name for placed in self.scheduler.remove_node(state.name)]
        state.actors = []
        self.emit(f"node {state.name} lost ({reason}); its actors: {', '.join(names) or 'none'}")
        self._metrics.log("node_lost", node=state.name, reason=reason, actors=",".join(names))
        if self.driver in names:
            raise NodeLossError(f"node {state.name} was lost ({reason}) with the run's driver "
                                f"{self.driver!r} on it, which is not placed again (its run state lives in "
                                f"it); `postrain up --resume {self.folder}` continues the run from its last "
                                "checkpoint")
        for name in names:
            if name not in self.dropped:
                await self._place_again(name, state.name, lost_at)

    async def _place_again(self, name: str, lost_node: str, lost_at: float) -> None:
        """Place actor `name` (lost with `lost_node`) on a node with room and start it there;
        with none, drop it (`_drop`). Raises NodeLossError when none has room and the run
        cannot go without it. Cancelled: see `run`."""
        spec = self.specs[name]
        if spec.node is not None and self.nodes[spec.node].lost_reason:
            spec = spec.model_copy(update={"node": None})
        while True:
            try:
                placed = self.scheduler.place(spec, self.groups.get(name))
            except PlacementError as exc:
                no_room = (f"node {lost_node} was lost and actor {name!r}, which ran there, fits on no node "
                           "left")
                try:
                    dropped = go_without(name, self.specs, self.groups, self.driver, set(self.dropped))
                except IndispensableError as why:
                    more = "" if (why.actor, why.why) == (name, "it has no replicas") else f"; {why}"
                    raise NodeLossError(f"{no_room} ({exc}){more}; add a node with room and `postrain up "
                                        f"--resume {self.folder}`") from None
                await self._drop(dropped, lost_node, f"{no_room} ({exc})")
                return
            try:
                address = await anyio.to_thread.run_sync(self.agents.start, spec, placed.node)
                break
            except AgentLostError as exc:   # the node chosen was lost too: lose it, then choose again
                self.scheduler.release(name)
                await self.lose(self.nodes[exc.node], str(exc))
        self.supervisor.add_peers({name: address})
        self.nodes[placed.node].actors.append(name)
        self.num_replacements += 1
        after_s = time.monotonic() - lost_at
        self.emit(f"actor {name} placed again on node {placed.node} ({address}), running {after_s:.1f} s "
                  f"after node {lost_node} was lost")
        self._metrics.log("replaced", actor=name, node=placed.node, lost_node=lost_node,
                          running_after_s=round(after_s, 3))

    async def _drop(self, dropped: dict[str, str], lost_node: str, no_room: str) -> None:
        """Drop the actors `dropped` (go_without's answer; the first is the lost one): tell every
        agent and the head's registry they are gone for good, each a line and a metrics row.
        Cancelled: the agents may not all be told; the counts include every actor dropped."""
        where = {name: node for node, state in self.nodes.items() for name in state.actors}
        reasons = {}
        for name, needs in dropped.items():
            reasons[name] = no_room if not needs else f"it needs actor {needs!r}, dropped"
            self.dropped[name] = (where.get(name, lost_node), reasons[name])
        await anyio.to_thread.run_sync(self.agents.remove_peers, reasons)
        self.supervisor.remove_peers(reasons)
        for name, reason in reasons.items():
            entry = self.groups[name]
            replicas = [r for r, e in self.groups.items() if e == entry]
            left = len([r for r in replicas if r not in self.dropped])
            self.emit(f"actor {name} dropped: {reason}; the run goes on with {left} of {len(replicas)} "
                      f"{entry!r} replicas")
            self._metrics.log("dropped", actor=name, node=self.dropped[name][0], reason=reason,
                              replicas_left=left)

    # -- what the head shows -----------------------------------------------------------------

    def remote_status(self) -> dict:
        """The nodes (each: name, address, state "alive" | "lost", reason, actors) and the actors
        of every live node as its agent last answered, each with its `node`."""
        nodes, actors = [], []
        for state in self.nodes.values():
            nodes.append({"name": state.name, "address": state.address,
                          "state": "lost" if state.lost_reason else "alive", "reason": state.lost_reason,
                          "actors": list(state.actors),
                          "free": (state.status or {}).get("pools", {}).get("free", "")})
            for actor in (state.status or {}).get("actors", []):
                actors.append({**actor, "node": state.name})
        for actor in actors:
            if actor["name"] in self.dropped:   # up, but out of the run (it needed one dropped)
                actor["state"] = "dropped"
        shown = {actor["name"] for actor in actors}
        for name, (node, reason) in self.dropped.items():
            if name not in shown:               # lost with its node, not placed again
                actors.append({"name": name, "state": "dropped", "pid": None, "restarts": 0, "address": None,
                               "placement": f"dropped: {reason}", "last_exit": reason,
                               "heartbeat_age_s": None, "note": reason, "load": None, "node": node})
        return {"nodes": nodes, "actors": actors}

    def summary_figures(self) -> dict:
        """What the run's summary gains on a cluster."""
        return {"node_losses": self.num_node_losses, "replacements": self.num_replacements,
                "actors_dropped": len(self.dropped)}
