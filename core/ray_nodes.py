"""The cluster on Ray: membership, each node's inventory, and one postrain node agent per node.

The only module of postrain that imports Ray, and it is imported only for a config with a
`[cluster]` section (`pip install -e '.[cluster]'`):

    cluster = connect(ClusterSection(address="auto"))   # ClusterUnreachable: one line, within a minute
    nodes = cluster.nodes()                              # [NodeInventory], the head's node first
    agents = cluster.start_agents(nodes, keys=CurveKeys.generate(), run_tag=tag, log_dir="/shared/run/logs")
    address = agents.start(spec, node="10.0.0.2")        # the actor's tcp address, once it is READY
    agents.stop()                                        # every actor, then every agent

Design note. Ray does what a cluster engine does well and nothing more: it knows the nodes,
their resources and their liveness, and it starts one long-lived `NodeAgent` on each node
(a Ray actor pinned to the node, using no CPU of Ray's accounting). Each agent runs the
single-host kernel there: a `Supervisor` (core/supervisor.py) whose scheduler holds that
node's inventory, so the actors it starts are spawned, pinned, watched, restarted and killed
with their process group exactly as on one host, and die with the agent. The agent's
supervisor binds its control socket and every actor's inbox on the node's own address
with CurveZMQ (`CurveKeys`, made by the head per run and handed to each agent sealed to the
agent's own enrolment key, core/enrol.py: Ray carries public keys and ciphertext, never a
secret), so a peer without the run's key is refused. Each actor's spec (its options may hold an
API key or a token) reaches its agent sealed the same way. Data flows actor to actor over those
sockets, never through Ray or the head. Each agent's registry knows its own actors and the
addresses of the others' (`add_peers`), so `Actor.lookup` finds an actor on any node.

An actor that dies is restarted by its node's agent on the address it had (the port it
was given at its first start), so peers on other nodes reach it again without a new lookup.
A node that dies takes its actors with it: its agent, once its raylet is gone, kills them
and exits (Ray would leave it running). The head notices (`Agents.dead_nodes`, or the agent's
supervisor no longer answering) and places them again (cli/node_watch.py); `Agents.start`
then tells every agent, and through it every actor, where they moved; one that fits on no
node left and that the run can go without is gone for good (`Agents.remove_peers`).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
from dataclasses import asdict
from typing import Any, Awaitable, Callable, TypeVar

import msgpack
import ray

from .atomic_write import make_private_folder
from .cluster import AgentLostError, NodeInventory
from .config import ActorSpec, ClusterSection
from .enrol import EnrolmentKey, seal_for
from .errors import PostrainError
from .scheduler import GpuInfo, Inventory
from .transport import CurveKeys, free_tcp_port

AGENT_START_TIMEOUT_S = 120.0
_T = TypeVar("_T")


def versions_here() -> dict[str, str]:
    """The Python and postrain versions of this process: every node must run the head's."""
    from importlib.metadata import version
    return {"python": sys.version.split()[0], "postrain": version("postrain")}


class ClusterUnreachable(PostrainError):
    """No Ray cluster answers at the configured address."""


def connect(section: ClusterSection) -> "RayCluster":
    """Join the Ray cluster at `section.address` as a driver; ClusterUnreachable (one line naming
    the address and what to check) when it does not answer within connect_timeout_s."""
    address = section.address
    if address != "auto":
        _check_gcs_answers(address, section.connect_timeout_s)
    try:
        # logging_level: ray annotates it as int, but takes a level name too (its default is "info")
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", configure_logging=False)
    except (ConnectionError, RuntimeError, TimeoutError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterUnreachable(
            f"no Ray cluster answers at [cluster] address = {address!r} ({first}); check that this machine "
            "belongs to a running cluster (`ray status`), or set address to the head's HOST:PORT") from None
    return RayCluster(address)


def _check_gcs_answers(address: str, timeout_s: float) -> None:
    """ClusterUnreachable unless a gRPC server (Ray's GCS speaks gRPC) answers at HOST:PORT
    within timeout_s: `ray.init` itself waits minutes on a port that is open but not Ray's."""
    import grpc

    host, port = address.rsplit(":", 1)
    fix = ("check that `ray start --head` runs there, that the port is the head's GCS port (6379 by "
           "default), and that this machine can reach it")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterUnreachable(f"no Ray cluster answers at [cluster] address = {address!r} "
                                 f"({exc.strerror or exc}); {fix}") from None
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise ClusterUnreachable(f"no Ray cluster answers at [cluster] address = {address!r} (the port is "
                                 f"open but did not answer as Ray's GCS within {timeout_s:g} s); {fix}") from None
    finally:
        channel.close()


class RayCluster:
    """A connection to a running Ray cluster (this process is one of its drivers)."""

    def __init__(self, address: str):
        self.address = address

    def nodes(self) -> list[NodeInventory]:
        """The live nodes, the head's first: what Ray declares of each (CPUs, GPUs, memory) as
        core ids 0..N-1 and GPU ids 0..G-1 of that node. A node's name is its IP address, or
        IP-NODEID8 where several nodes share an address (nodes on one machine)."""
        alive = [n for n in ray.nodes() if n.get("Alive")]
        alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeManagerAddress"],
                                  n["NodeID"]))
        ips = [n["NodeManagerAddress"] for n in alive]
        nodes = []
        for n in alive:
            ip, resources = n["NodeManagerAddress"], n["Resources"]
            name = ip if ips.count(ip) == 1 else f"{ip}-{n['NodeID'][:8]}"
            inventory = Inventory(cpu_ids=tuple(range(int(resources.get("CPU", 0)))),
                                  memory_mb=int(resources.get("memory", 0)) // (1 << 20),
                                  gpus=tuple(GpuInfo(i, "gpu", 0) for i in range(int(resources.get("GPU", 0)))))
            nodes.append(NodeInventory(name, ip, inventory))
        self._node_ids = {node.name: n["NodeID"] for node, n in zip(nodes, alive)}
        return nodes

    def start_agents(self, nodes: list[NodeInventory], *, keys: CurveKeys, run_tag: str, log_dir: str,
                     heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 30.0) -> "Agents":
        """One NodeAgent on each of `nodes` (from `nodes()`), each serving its supervisor, and each
        running the head's Python and postrain versions (else PostrainError naming both)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        agent_class = ray.remote(num_cpus=0, max_restarts=0)(NodeAgent)
        # Any: Ray's ActorHandle types a method of an undecorated class without its `.remote`
        handles: dict[str, Any] = {}
        for node in nodes:
            strategy = NodeAffinitySchedulingStrategy(node_id=self._node_ids[node.name], soft=False)
            handles[node.name] = agent_class.options(scheduling_strategy=strategy).remote(
                node.name, node.address, asdict(node.inventory), run_tag, log_dir,
                heartbeat_interval_s, heartbeat_timeout_s)
        try:
            versions = ray.get([h.versions.remote() for h in handles.values()], timeout=AGENT_START_TIMEOUT_S)
            publics = ray.get([h.enrolment_key.remote() for h in handles.values()], timeout=60)
            secrets = msgpack.packb(keys.to_dict())   # through Ray only sealed (core/enrol.py)
            ray.get([h.enrol.remote(seal_for(public, secrets, enrolment_context(node, run_tag)))
                     for (node, h), public in zip(handles.items(), publics)], timeout=AGENT_START_TIMEOUT_S)
        except Exception as exc:
            for handle in handles.values():
                ray.kill(handle)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise PostrainError(f"the node agents did not start (within {AGENT_START_TIMEOUT_S:g} s: {first}); "
                                "check that postrain and the same Python are installed on every node") from None
        agents = Agents(handles, {name: self._node_ids[name] for name in handles},
                        dict(zip(handles, ray.get([h.supervisor_address.remote() for h in handles.values()],
                                                  timeout=60))), dict(zip(handles, publics)), run_tag)
        here = versions_here()
        for name, theirs in zip(handles, versions):
            if theirs != here:
                agents.stop()
                raise PostrainError(f"node {name} runs {theirs}, the head {here}: install the same postrain "
                                    "and Python on every node")
        return agents

    def disconnect(self) -> None:
        ray.shutdown()


def enrolment_context(node: str, run_tag: str) -> bytes:
    """What a sealed box of the run's keys is bound to: one agent's node, in one run."""
    return f"node={node}|run={run_tag}".encode()


def spec_context(node: str, run_tag: str) -> bytes:
    """What a sealed actor spec is bound to: one agent's node, in one run (never a box of keys)."""
    return enrolment_context(node, run_tag) + b"|actor spec"


class Agents:
    """The run's node agents, by node name. Invariant: `handles` holds the agents of the nodes
    not lost (`forget` removes one); node_ids, supervisor_addresses and enrolment_keys keep every
    node's."""

    def __init__(self, handles: dict[str, Any], node_ids: dict[str, str], supervisor_addresses: dict[str, str],
                 enrolment_keys: dict[str, bytes], run_tag: str):
        self.handles = handles                       # node name -> its NodeAgent (a Ray actor handle)
        self.node_ids = node_ids                     # node name -> Ray's node id
        self.supervisor_addresses = supervisor_addresses   # node name -> its agent's supervisor (tcp + Curve)
        self.enrolment_keys = enrolment_keys         # node name -> its agent's public enrolment key
        self.run_tag = run_tag

    def dead_nodes(self) -> list[str]:
        """The nodes of `handles` that Ray reports dead (its health checks: seconds after a
        node's raylet stops answering)."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return [name for name in self.handles if self.node_ids[name] not in alive]

    def forget(self, node: str) -> None:
        """A lost node: its agent is no longer called (and killed, should it still live)."""
        handle = self.handles.pop(node)
        try:
            ray.kill(handle)
        except Exception:   # its node is gone, and the agent with it
            pass

    def start(self, spec: ActorSpec, node: str, timeout_s: float = 300.0) -> str:
        """Start `spec` on `node`'s agent; its address once READY. Every agent learns it (and
        tells its actors, when `spec` ran elsewhere before: Supervisor.add_peers)."""
        # Every agent first learns the name, so that the actor is known by its key (core/identity.py)
        # to the others' actors from its setup on, before it is anyone's peer.
        for reply in [h.expect.remote([spec.name]) for h in self.handles.values()]:
            try:
                ray.get(reply, timeout=60)
            except ray.exceptions.RayActorError:   # a node lost meanwhile: the head notices it
                pass
        # sealed to the node's agent: an option may be a secret, and Ray keeps its calls' arguments
        box = seal_for(self.enrolment_keys[node], spec.model_dump_json().encode(),
                       spec_context(node, self.run_tag))
        try:
            address: str = ray.get(self.handles[node].start.remote(box), timeout=timeout_s)
        except ray.exceptions.RayActorError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise AgentLostError(f"the agent of node {node} is gone ({first})", node=node) from None
        told = [h.add_peers.remote({spec.name: address}) for h in self.handles.values()]
        for reply in told:
            try:
                ray.get(reply, timeout=60)
            except ray.exceptions.RayActorError:   # a node lost meanwhile: the head notices it
                pass
        return address

    def remove_peers(self, gone: dict[str, str]) -> None:
        """Tell every agent, and through it every actor, that the actors `gone` ({name: reason})
        are gone for good (Supervisor.remove_peers)."""
        told = [h.remove_peers.remote(gone) for h in self.handles.values()]
        for reply in told:
            try:
                ray.get(reply, timeout=60)
            except ray.exceptions.RayActorError:   # a node lost meanwhile: the head notices it
                pass

    def free_port(self, node: str) -> int:
        """A tcp port free now on `node`'s address (a collective group's meeting point there)."""
        port: int = ray.get(self.handles[node].free_port.remote(), timeout=60)
        return port

    def status(self) -> dict[str, dict[str, Any]]:
        """Each node's supervisor status (as `postrain status` shows one host's)."""
        return dict(zip(self.handles, ray.get([h.status.remote() for h in self.handles.values()], timeout=60)))

    def stop(self) -> None:
        """Stop every actor (its agent's supervisor shuts it down), then the agents. An agent
        that does not answer (its node died since it was last checked) is killed with the rest."""
        try:
            ray.wait([h.stop.remote() for h in self.handles.values()], num_returns=len(self.handles),
                     timeout=120)
        finally:
            for handle in self.handles.values():
                ray.kill(handle)


class NodeAgent:
    """Runs on one node, as a Ray actor: a single-host Supervisor in its own thread (a trio loop)
    that Ray's calls drive. It starts without the run's keys and with an enrolment key pair
    (core/enrol.py); `enrol` opens the keys the head sealed to it and starts the supervisor.
    Invariant: after `enrol` returns, `self.supervisor` is serving."""

    def __init__(self, node: str, address: str, inventory: dict[str, Any], run_tag: str, log_dir: str,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float):
        from .scheduler import Scheduler

        self.node, self.address = node, address
        self._raylet_pid = os.getppid()        # the node's raylet starts its workers
        node_inventory = Inventory(cpu_ids=tuple(inventory["cpu_ids"]), memory_mb=inventory["memory_mb"],
                                   gpus=tuple(GpuInfo(**g) for g in inventory["gpus"]))
        self._settings: dict[str, Any] = dict(scheduler=Scheduler(node_inventory), bind=f"tcp://{address}:0",
                              log_dir=log_dir, run_tag=run_tag,
                              heartbeat_interval_s=heartbeat_interval_s, heartbeat_timeout_s=heartbeat_timeout_s)
        self._enrolment = EnrolmentKey()
        make_private_folder(log_dir)

    def enrolment_key(self) -> bytes:
        """The public half of this agent's enrolment key: the head seals the run's keys to it."""
        return self._enrolment.public

    def enrol(self, box: dict[str, bytes]) -> None:
        """Open the run's keys (sealed to this agent for this node and run) and start serving."""
        keys = msgpack.unpackb(self._enrolment.open(box, enrolment_context(self.node, self._settings["run_tag"])))
        self._settings["keys"] = CurveKeys.from_dict(keys)
        self._opened = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"postrain-agent-{self.node}", daemon=True)
        self._thread.start()
        self._opened.wait()
        if self._failure is not None:
            raise self._failure

    def _serve(self) -> None:
        import trio
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by enrol (a failed open) or the next call
            self._failure = exc
            self._opened.set()

    async def _main(self) -> None:
        import trio

        from .supervisor import Supervisor
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with Supervisor.open(**self._settings) as supervisor:
            self.supervisor = supervisor
            self._opened.set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._die_with_node)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    async def _die_with_node(self) -> None:
        """Once the node's raylet is gone (this process is re-parented), the node is lost to the
        cluster, and Ray leaves its workers running: kill every actor here at once and exit, so
        that nothing of the run outlives its node. Cancelled (the agent stops): nothing to undo."""
        import trio
        while os.getppid() == self._raylet_pid:
            await trio.sleep(0.5)
        print(f"postrain node agent {self.node}: the node's raylet (pid {self._raylet_pid}) is gone; "
              "killing this node's actors and exiting", file=sys.stderr, flush=True)
        self.supervisor.kill_all()
        os._exit(1)

    def _call(self, fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        import trio
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def versions(self) -> dict[str, str]:
        return versions_here()

    def supervisor_address(self) -> str:
        """Where this node's supervisor serves (tcp + Curve): the head asks it `status`, which
        also tells it the agent lives."""
        return self.supervisor.address

    def start(self, box: dict[str, bytes]) -> str:
        """Start the actor whose spec the head sealed to this agent (`Agents.start`), its inbox on
        this node's address (tcp + Curve, any free port); its address once READY."""
        spec = json.loads(self._enrolment.open(box, spec_context(self.node, self._settings["run_tag"])))
        spec = ActorSpec.model_validate({**spec, "bind": f"tcp://{self.address}:0"})

        async def start() -> str:
            return (await self.supervisor.start(spec)).address
        return self._call(start)

    def free_port(self) -> int:
        return free_tcp_port(self.address)

    def expect(self, names: list[str]) -> None:
        """Actors about to start on some node: this node's actors will know them by their keys."""
        async def expect() -> None:
            self.supervisor.expect(names)
        self._call(expect)

    def add_peers(self, addresses: dict[str, str]) -> None:
        async def add() -> None:
            self.supervisor.add_peers(addresses)
        self._call(add)

    def remove_peers(self, gone: dict[str, str]) -> None:
        async def remove() -> None:
            self.supervisor.remove_peers(gone)
        self._call(remove)

    def status(self) -> dict[str, Any]:
        async def status() -> dict[str, Any]:
            return self.supervisor.status()
        return self._call(status)

    def stop(self) -> None:
        """Stop every actor of this node (the supervisor's shutdown) and end the loop."""
        async def stop() -> None:
            self._stop.set()
        self._call(stop)
        self._thread.join(timeout=120)
