"""A local Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster): one node agent
per node starts real actor processes, which talk to each other over tcp + CurveZMQ; a peer
without the run's key is refused; an actor killed on its node is restarted there; `postrain up`
runs a driven run with its actors on both nodes; `postrain up --dry-run` prints the plan node by node, and
an address nobody answers at fails with one line."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import anyio
import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from postrain.core import AuthenticationError, CurveKeys, Node  # noqa: E402
from postrain.core.cluster import ClusterScheduler  # noqa: E402
from postrain.core.identity import server_key_of  # noqa: E402
from postrain.core.config import ClusterSection, parse_config  # noqa: E402
from postrain.core.ray_nodes import connect  # noqa: E402
from postrain.core.testing import async_test, to_toml  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes of one CPU each (the head's first)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def run_config(address: str) -> dict:
    """An echo actor and a driver that asks it to echo; one CPU per node makes them two nodes apart."""
    return {"cluster": {"address": address}, "run": {"driver": "driver"}, "actors": [
        {"name": "echo", "cls": "postrain.core.testing:EchoActor", "cpus": 0.5, "memory_mb": 64},
        {"name": "driver", "cls": "postrain.core.testing:CountingDriver", "cpus": 1, "memory_mb": 64,
         "options": {"peer": "echo", "steps": 3}}]}


@async_test
async def test_agents_on_two_nodes_run_actors_that_talk_over_tcp_curve_and_refuse_a_stranger(two_nodes, tmp_path):
    config = parse_config(run_config(two_nodes.address))
    cluster = connect(config.cluster)
    try:
        nodes = cluster.nodes()
        assert len(nodes) == 2 and all(len(node.inventory.cpu_ids) == 1 for node in nodes)
        plan = ClusterScheduler(nodes).plan(config.actors)
        assert [p.node for p in plan] == [nodes[0].name, nodes[1].name]
        keys = CurveKeys.generate()
        agents = cluster.start_agents(nodes, keys=keys, run_tag="clustertest1", log_dir=str(tmp_path / "logs"))
        try:
            specs = {spec.name: spec for spec in config.actors}
            addresses = {p.name: agents.start(specs[p.name], p.node) for p in plan}
            assert all(address.startswith("tcp://") for address in addresses.values())
            status = agents.status()
            assert [[a["name"] for a in status[node.name]["actors"]] for node in nodes] == [["echo"], ["driver"]]
            async with Node("head", keys) as head:
                # the driver (node 2) looks the echo actor (node 1) up through its agent and asks it
                driver = head.ref(addresses["driver"], "driver", server_key=server_key_of(keys, "driver"))
                items = [item async for item in driver.stream(
                    "run", {"run_folder": str(tmp_path)}, timeout_s=60)]
                assert items[-1] == {"summary": {"steps": 3, "num_steps": 3, "complete": True,
                                                 "run_folder": str(tmp_path)}}
                # killed, the echo actor is restarted by its node's agent on the same address
                echo = status[nodes[0].name]["actors"][0]
                os.kill(echo["pid"], signal.SIGKILL)
                with anyio.fail_after(60):
                    while (restarted := agents.status()[nodes[0].name]["actors"][0])["state"] != "running" \
                            or restarted["restarts"] < 1:
                        await anyio.sleep(0.2)
                assert restarted["address"] == echo["address"] and restarted["pid"] != echo["pid"]
                items = [item async for item in driver.stream(
                    "run", {"run_folder": str(tmp_path)}, timeout_s=60)]
                assert items[-1]["summary"]["steps"] == 3
            stranger_keys = CurveKeys.generate()
            stranger_keys = CurveKeys(keys.server_public, b"", stranger_keys.client_public,
                                      stranger_keys.client_secret)
            async with Node("stranger", stranger_keys) as stranger:
                with pytest.raises(AuthenticationError, match="refused our CurveZMQ key"):
                    await stranger.ref(addresses["echo"], "echo", server_key=server_key_of(keys, "echo")).ask(
                        "echo", "x", timeout_s=20)
        finally:
            agents.stop()
    finally:
        cluster.disconnect()


def test_the_runs_secrets_never_travel_in_a_ray_call(two_nodes, tmp_path, monkeypatch):
    """Ray keeps its calls' arguments in its task specs and control store: spy on every actor
    creation and method call the head makes, and look for the secrets in what Ray was given: the
    run's keys, and an actor's options (one may be an API key), which its agent gets sealed."""
    import pickle
    import uuid

    from postrain.core.config import ActorSpec

    import ray.actor
    given = []
    for cls in (ray.actor.ActorClass, ray.actor.ActorMethod):
        def spy(self, args=None, kwargs=None, *rest, _real=cls._remote, **options):
            given.append(pickle.dumps((args, kwargs)))
            return _real(self, args, kwargs, *rest, **options)
        monkeypatch.setattr(cls, "_remote", spy)
    cluster = connect(ClusterSection(address=two_nodes.address))
    try:
        keys = CurveKeys.generate()
        nodes = cluster.nodes()
        agents = cluster.start_agents(nodes, keys=keys, run_tag="secrets1", log_dir=str(tmp_path / "logs"))
        try:
            assert all(state["actors"] == [] for state in agents.status().values()), "the agents serve"
            option = f"an-api-key-{uuid.uuid4().hex}"   # a required option: the driver starts only with it
            driver = ActorSpec(name="driver", cls="postrain.core.testing:CountingDriver", cpus=0.5,
                               memory_mb=64, options={"peer": option})
            assert agents.start(driver, nodes[1].name).startswith("tcp://")
        finally:
            agents.stop()
    finally:
        cluster.disconnect()
    assert len(given) >= 6, "the spy saw the agents' creation and calls"
    secrets = (keys.server_secret, keys.client_secret, keys.bulk_key, keys.identity_seed, option.encode())
    for secret in secrets:
        assert not any(secret in call for call in given)


def test_a_node_agents_log_folder_is_private_also_where_it_existed_looser(tmp_path):
    """An agent's log folder holds every actor's output on its node: 0700, also when the folder was
    there before (another run, a shared file system) with a broader mode."""
    import stat

    from postrain.core.ray_nodes import NodeAgent

    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    previous = os.umask(0o022)
    try:
        NodeAgent("n", "127.0.0.1", {"cpu_ids": [0], "memory_mb": 64, "gpus": []}, "logtag", str(logs),
                  heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700


def up_dry_run(tmp_path, doc: dict, capsys) -> tuple[int, str, str]:
    """`postrain up --dry-run` in this process: (exit status, stdout, stderr)."""
    from postrain.cli.main import main

    (tmp_path / "run.toml").write_text(to_toml(doc))
    capsys.readouterr()
    status = main(["up", "--dry-run", "--config", str(tmp_path / "run.toml")])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_up_dry_run_prints_the_plan_node_by_node(two_nodes, tmp_path, capsys):
    status, out, err = up_dry_run(tmp_path, run_config(two_nodes.address), capsys)
    assert status == 0, err[-2000:]
    lines = [line.strip() for line in out.splitlines()]
    assert f"-> 2 actors on 2 nodes of {two_nodes.address}" in lines[0]
    node_lines = [i for i, line in enumerate(lines) if line.startswith("node ")]
    assert len(node_lines) == 2 and lines[node_lines[0] + 1].startswith("echo: cores [0]")
    assert lines[node_lines[1] + 1].startswith("driver: cores [0]")
    assert not ray.is_initialized()      # a dry run leaves the cluster


def test_up_runs_a_driven_run_with_its_actors_on_two_nodes(two_nodes, tmp_path):
    doc = run_config(two_nodes.address)
    doc["run"].update(name="spread", run_dir=str(tmp_path / "runs"))
    (tmp_path / "run.toml").write_text(to_toml(doc))
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config",
                             str(tmp_path / "run.toml")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    started = dict(re.findall(r"started (\w+) on node (\S+) \(tcp://", result.stdout))
    assert set(started) == {"echo", "driver"} and started["echo"] != started["driver"]
    assert '"steps": 3' in result.stdout and "stopping actors" in result.stdout
    logs = tmp_path / "runs" / "spread" / "logs"
    assert (logs / "echo.log").exists() and (logs / "driver.log").exists()


def test_an_address_nobody_answers_at_fails_in_one_line_naming_it(tmp_path, capsys):
    status, _, err = up_dry_run(tmp_path, run_config("127.0.0.1:9"), capsys)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "no Ray cluster answers at [cluster] address = '127.0.0.1:9'" in err
    assert "ray start --head" in err


def test_a_port_that_is_open_but_not_ray_fails_in_one_line_within_the_timeout(tmp_path, capsys):
    with socket.socket() as listener:      # accepts connections (the backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        doc = run_config(f"127.0.0.1:{listener.getsockname()[1]}")
        doc["cluster"]["connect_timeout_s"] = 1
        status, _, err = up_dry_run(tmp_path, doc, capsys)
    assert status == 2 and err.count("\n") == 1, err[-2000:]
    assert "the port is open but did not answer as Ray's GCS within 1 s" in err
