"""`postrain up` with a `[cluster]` section: the plan over the Ray cluster's nodes, one node agent
per node, and every actor started on its node.

    launch = plan_on_cluster(config, path)          # joins the cluster, prints the plan node by node
    async with node_agents(launch, supervisor, folder) as agents:
        await start_on_node(agents, launch, spec, supervisor)   # for each spec, in config order

The head keeps its own supervisor for what the head does (its control socket for `postrain
down` and `status`, the registry); the actors run under the agents (core/ray_nodes.py), and
the head's registry learns their addresses (`Supervisor.add_peers`), so the head follows
the run's driver on whatever node it runs. Every actor binds tcp with CurveZMQ on its node.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from postrain.core.cluster import ClusterScheduler, NodeInventory, NodePlacement, describe_plan
from postrain.core.config import ActorSpec
from postrain.core.errors import PostrainError
from postrain.core.supervisor import Supervisor

from .config import UpConfig

if TYPE_CHECKING:
    from postrain.core.ray_nodes import RayCluster   # imports Ray: loaded only where a [cluster] asks


@dataclass
class ClusterLaunch:
    """A joined cluster, its nodes, and where each actor goes."""

    cluster: RayCluster
    nodes: list[NodeInventory]
    plan: list[NodePlacement]

    def node_of(self, name: str) -> str:
        return next(p.node for p in self.plan if p.name == name)


def plan_on_cluster(config: UpConfig, path: Path) -> ClusterLaunch:
    """Join the Ray cluster, place every actor on its nodes and print the plan node by node.
    Raises PostrainError (one line: Ray missing, an unreachable address, a spec that fits on
    no node); the cluster is left connected only when the plan is returned."""
    try:
        from postrain.core import ray_nodes
    except ImportError as exc:
        raise PostrainError(f"a [cluster] section needs Ray ({exc}): pip install 'postrain[cluster]'") from None
    assert config.cluster is not None  # called for a config with a [cluster] section (up.py)
    cluster = ray_nodes.connect(config.cluster)
    try:
        nodes = cluster.nodes()
        entries = {**config.replica_groups(), **config.rank_groups()}
        groups = {name: group for group, names in entries.items() for name in names}
        plan = ClusterScheduler(nodes).plan(config.actors, groups)
    except BaseException:
        cluster.disconnect()
        raise
    print(f"postrain up: {path} -> {len(plan)} actors on {len(nodes)} nodes of {config.cluster.address}")
    for line in describe_plan(plan, nodes):
        print(f"  {line}")
    return ClusterLaunch(cluster, nodes, plan)


class node_agents:
    """`async with node_agents(launch, supervisor, folder) as agents:` one agent per node for the
    body (the run's keys and tag, logs under folder/logs on each node). Leaving, by any way:
    every actor and agent is stopped (shielded) and the cluster disconnected."""

    def __init__(self, launch: ClusterLaunch, supervisor: Supervisor, folder: Path):
        self.launch, self.supervisor, self.folder = launch, supervisor, folder
        self.agents = None

    async def __aenter__(self):
        start = functools.partial(self.launch.cluster.start_agents, self.launch.nodes,
                                  keys=self.supervisor.keys, run_tag=self.supervisor.run_tag,
                                  log_dir=str((self.folder / "logs").resolve()),
                                  heartbeat_interval_s=self.supervisor.heartbeat_interval_s,
                                  heartbeat_timeout_s=self.supervisor.heartbeat_timeout_s)
        try:
            self.agents = await anyio.to_thread.run_sync(start)
        except BaseException:
            self.launch.cluster.disconnect()
            raise
        return self.agents

    async def __aexit__(self, *exc_info):
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(self.agents.stop)
            finally:
                self.launch.cluster.disconnect()


def meeting_point_on_node(agents, launch: ClusterLaunch):
    """`meeting_point(rank0_name) -> (address, port)` for `complete_rendezvous`: rank 0's node
    address and a port free there (its agent picks it)."""
    def meeting_point(name: str) -> tuple[str, int]:
        node = launch.node_of(name)
        return next(n.address for n in launch.nodes if n.name == node), agents.free_port(node)
    return meeting_point


async def start_on_node(agents, launch: ClusterLaunch, spec: ActorSpec, supervisor: Supervisor) -> str:
    """Start `spec` on its planned node; the head's registry learns its address. Returns the
    progress line. Cancelled: the actor may start all the same; leaving `node_agents` stops it."""
    node = launch.node_of(spec.name)
    address = await anyio.to_thread.run_sync(agents.start, spec, node)
    supervisor.add_peers({spec.name: address})
    return f"  started {spec.name} on node {node} ({address})"
