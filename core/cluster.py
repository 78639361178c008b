"""Placement over several machines: which node runs each actor, and on which of its cores and GPUs.

    nodes = [NodeInventory("node-a", "10.0.0.1", Inventory(cpu_ids=(0, 1), memory_mb=8192)),
             NodeInventory("node-b", "10.0.0.2", Inventory(cpu_ids=(0, 1, 2, 3), memory_mb=16384))]
    plan = ClusterScheduler(nodes).plan(config.actors)   # [NodePlacement]; PlacementError if one fits nowhere
    print(describe_plan(plan))

Design note. A cluster is a list of hosts, each placed exactly as one host is today: every
node has its own `Scheduler` (core/scheduler.py) over its own inventory, so an actor gets
*specific* cores and GPU ids of one node, never a share of "the cluster". What this module
adds is only the choice of node, from the spec's hints:
- `node = NAME`: that node, or a refusal (an unknown name lists the nodes; a full node says
  what it has free);
- `placement = "pack"` (default): the first node in the cluster's order with room, so a
  small run fills the first node (the head's, where Ray lists it first) before the next;
- `placement = "spread"`: the node holding the fewest replicas of the same entry so far (ties:
  the most free cores, then the cluster's order), so N generators land on N nodes when
  they have room.
A spec that fits on no node is refused before anything starts, naming what each node has
free. Pure: no process, no network; the nodes come from the cluster's membership
(core/ray_nodes.py) or, in tests, by hand.

Invariant (tests/core/test_cluster.py): every node's Scheduler keeps its own invariants
(`Scheduler.check`), and each placed actor is on exactly one node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import ActorSpec
from .errors import PlacementError, PostrainError
from .scheduler import Inventory, Placement, Scheduler


class AgentLostError(PostrainError):
    """A node's agent died while the head called it: its node is lost (core/ray_nodes.py)."""

    def __init__(self, message: str, node: str):
        super().__init__(message)
        self.node = node


@dataclass(frozen=True)
class NodeInventory:
    """One node: its name (what a spec's `node` names), the address its actors bind and are
    reached at, and what it offers."""

    name: str
    address: str
    inventory: Inventory


@dataclass(frozen=True)
class NodePlacement:
    """Where one actor runs: a node, and its placement on that node."""

    node: str
    placement: Placement

    @property
    def name(self) -> str:
        return self.placement.name

    def describe(self) -> str:
        return f"{self.node}: {self.placement.describe()}"


@dataclass
class ClusterScheduler:
    nodes: list[NodeInventory]
    schedulers: dict[str, Scheduler] = field(default_factory=dict)   # node name -> its scheduler
    placements: dict[str, NodePlacement] = field(default_factory=dict)
    _group_count: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, entry) -> replicas there
    _group_of: dict[str, str] = field(default_factory=dict)                 # placed actor -> its entry

    def __post_init__(self) -> None:
        if not self.nodes:
            raise PlacementError("the cluster has no nodes; start one with `ray start` and try again")
        names = [node.name for node in self.nodes]
        if len(set(names)) != len(names):
            raise PlacementError(f"node names must be unique, got {names}")
        self.schedulers = {node.name: Scheduler(node.inventory) for node in self.nodes}

    def place(self, spec: ActorSpec, group: str | None = None) -> NodePlacement:
        """Reserve a node's resources for `spec` (`group`: the entry it is a replica of, for
        'spread'; default its own name). Atomic: on PlacementError nothing is reserved."""
        if spec.name in self.placements:
            raise PlacementError(f"actor {spec.name!r} is already placed; release it first")
        group = group or spec.name
        asked = f"actor {spec.name!r} asks for {spec.cpus:g} cores, {spec.gpus} GPUs, {spec.memory_mb} MiB"
        if spec.node is not None:
            if spec.node not in self.schedulers:
                raise PlacementError(f"actor {spec.name!r} asks for node {spec.node!r}, which is not in the "
                                     f"cluster; nodes: {sorted(self.schedulers)}")
            try:
                return self._reserve(spec.node, spec, group)
            except PlacementError:
                raise PlacementError(f"{asked} on node {spec.node!r}; free there: "
                                     f"{self.schedulers[spec.node].free_summary()}. Lower its needs or "
                                     "choose another node") from None
        for node in self._candidates(spec, group):
            try:
                return self._reserve(node, spec, group)
            except PlacementError:
                continue
        free = "; ".join(f"{name}: {s.free_summary()}" for name, s in self.schedulers.items())
        raise PlacementError(f"{asked}; no node has room (free: {free}). Lower its needs, run fewer "
                             "actors, or add a node")

    def release(self, name: str) -> None:
        placed = self.placements.pop(name, None)
        if placed is not None:
            self.schedulers[placed.node].release(name)
            self._group_count[(placed.node, self._group_of.pop(name))] -= 1

    def remove_node(self, name: str) -> list[NodePlacement]:
        """A lost node leaves the cluster; returns the placements it held, in the order they
        were made (to be placed again on the nodes left)."""
        lost = [placed for placed in self.placements.values() if placed.node == name]
        for placed in lost:
            self.release(placed.name)
        self.nodes = [node for node in self.nodes if node.name != name]
        del self.schedulers[name]
        return lost

    def plan(self, specs: list[ActorSpec], groups: dict[str, str] | None = None) -> list[NodePlacement]:
        """Place every spec on a scratch copy (a dry run); `groups`: replica name -> its entry."""
        scratch = ClusterScheduler(self.nodes)
        groups = groups or {}
        return [scratch.place(spec, groups.get(spec.name)) for spec in specs]

    def check(self) -> None:
        for name, scheduler in self.schedulers.items():
            scheduler.check()
            assert set(scheduler.placements) == {p.name for p in self.placements.values() if p.node == name}

    def _candidates(self, spec: ActorSpec, group: str) -> list[str]:
        order = [node.name for node in self.nodes]
        if spec.placement == "pack":
            return order
        return sorted(order, key=lambda n: (self._group_count.get((n, group), 0),
                                            -self.schedulers[n].free_cpus(), order.index(n)))

    def _reserve(self, node: str, spec: ActorSpec, group: str) -> NodePlacement:
        placement = self.schedulers[node].place(spec)
        placed = self.placements[spec.name] = NodePlacement(node, placement)
        key = (node, group)
        self._group_count[key] = self._group_count.get(key, 0) + 1
        self._group_of[spec.name] = group
        return placed


def describe_plan(plan: list[NodePlacement], nodes: list[NodeInventory]) -> list[str]:
    """The plan as lines, node by node (every node listed, an idle one too)."""
    lines = []
    for node in nodes:
        mine = [p for p in plan if p.node == node.name]
        cores, gpus = len(node.inventory.cpu_ids), len(node.inventory.gpus)
        lines.append(f"node {node.name} ({node.address}; {cores} cores, {gpus} GPUs, "
                     f"{node.inventory.memory_mb} MiB): {len(mine)} actors")
        lines += [f"  {p.placement.describe()}" for p in mine]
    return lines
