"""Placement over a cluster's nodes (core/cluster.py) and the config that asks for it
(replicas, node and placement hints, [cluster]): pure, no process starts."""
from __future__ import annotations

import subprocess
import sys

import pytest

from postrain.core.cluster import ClusterScheduler, NodeInventory, describe_plan
from postrain.core.config import parse_config
from postrain.core.errors import ConfigError, PlacementError
from postrain.core.run_options import resolve_options
from postrain.core.scheduler import GpuInfo, Inventory

ECHO = "postrain.core.testing:EchoActor"


def nodes() -> list[NodeInventory]:
    """A head with 2 cores and no GPU, and two GPU nodes with 4 cores and 2 GPUs each."""
    gpus = (GpuInfo(0, "H100", 81559), GpuInfo(1, "H100", 81559))
    return [NodeInventory("head", "10.0.0.1", Inventory(cpu_ids=(0, 1), memory_mb=8192)),
            NodeInventory("gpu-a", "10.0.0.2", Inventory(cpu_ids=(0, 1, 2, 3), memory_mb=65536, gpus=gpus)),
            NodeInventory("gpu-b", "10.0.0.3", Inventory(cpu_ids=(0, 1, 2, 3), memory_mb=65536, gpus=gpus))]


def config(*actors: dict, cluster: bool = True):
    doc = {"actors": [{"cls": ECHO, "memory_mb": 1024, **a} for a in actors]}
    if cluster:
        doc["cluster"] = {"address": "auto"}
    return parse_config(doc)


def plan_of(cfg) -> dict[str, tuple[str, tuple, tuple]]:
    groups = {name: group for group, names in cfg.replica_groups().items() for name in names}
    scheduler = ClusterScheduler(nodes())
    plan = scheduler.plan(cfg.actors, groups)
    return {p.name: (p.node, p.placement.cpu_ids, p.placement.gpu_ids) for p in plan}


def test_replicas_expand_into_named_actors_and_spread_puts_one_per_node():
    cfg = config({"name": "gen", "replicas": 3, "cpus": 1, "placement": "spread"})
    assert [spec.name for spec in cfg.actors] == ["gen-0", "gen-1", "gen-2"]
    assert cfg.replica_groups() == {"gen": ["gen-0", "gen-1", "gen-2"]}
    assert sorted(node for node, _, _ in plan_of(cfg).values()) == ["gpu-a", "gpu-b", "head"]


def test_pack_fills_nodes_in_order_with_specific_cores_and_gpus():
    cfg = config({"name": "learner", "cpus": 2, "gpus": 2}, {"name": "sandbox", "replicas": 3, "cpus": 1},
                 {"name": "gen", "replicas": 2, "cpus": 1, "gpus": 1})
    placed = plan_of(cfg)
    assert placed["learner"] == ("gpu-a", (0, 1), (0, 1))           # the head has no GPU
    assert [placed[f"sandbox-{i}"][:2] for i in range(3)] == [("head", (0,)), ("head", (1,)), ("gpu-a", (2,))]
    assert placed["gen-0"] == ("gpu-b", (0,), (0,)) and placed["gen-1"] == ("gpu-b", (1,), (1,))


def test_a_node_hint_is_obeyed_or_refused_with_what_is_free_there():
    placed = plan_of(config({"name": "a", "cpus": 1, "node": "gpu-b"}))
    assert placed["a"][0] == "gpu-b"
    with pytest.raises(PlacementError, match=r"node 'nowhere', which is not in the cluster; nodes: \['gpu-a'"):
        plan_of(config({"name": "a", "node": "nowhere"}))
    with pytest.raises(PlacementError, match=r"asks for 1 cores, 1 GPUs, 1024 MiB on node 'head'; free there: "
                                             r"2.00 of 2 cores, 8192 of 8192 MiB, GPUs free: none"):
        plan_of(config({"name": "a", "gpus": 1, "node": "head"}))


def test_a_spec_that_fits_nowhere_is_refused_naming_each_nodes_free_room():
    with pytest.raises(PlacementError) as caught:
        plan_of(config({"name": "big", "gpus": 3}))
    message = str(caught.value)
    assert "actor 'big' asks for 1 cores, 3 GPUs" in message and "no node has room" in message
    assert "head: 2.00 of 2 cores" in message and "gpu-b: 4.00 of 4 cores, 65536 of 65536 MiB, GPUs free: [0, 1]" in message


def test_placement_is_atomic_and_releases_give_room_back():
    scheduler = ClusterScheduler(nodes())
    cfg = config({"name": "a", "cpus": 4, "node": "gpu-a"}, {"name": "b", "cpus": 1, "node": "gpu-a"})
    first, second = cfg.actors
    scheduler.place(first)
    with pytest.raises(PlacementError):
        scheduler.place(second)
    assert set(scheduler.placements) == {"a"}
    scheduler.check()
    scheduler.release("a")
    assert scheduler.place(second).node == "gpu-a"
    scheduler.check()


def test_a_lost_node_gives_back_its_placements_and_they_fit_on_the_nodes_left_or_are_refused():
    scheduler = ClusterScheduler(nodes())
    cfg = config({"name": "learner", "cpus": 2, "gpus": 2, "node": "gpu-a"},
                 {"name": "gen", "cpus": 2, "gpus": 1}, {"name": "env", "cpus": 1})
    for spec in cfg.actors:
        scheduler.place(spec)
    assert {p.name: p.node for p in scheduler.placements.values()} == {"learner": "gpu-a", "gen": "gpu-b",
                                                                      "env": "head"}
    lost = scheduler.remove_node("gpu-b")
    assert [p.name for p in lost] == ["gen"] and "gpu-b" not in scheduler.schedulers
    scheduler.check()
    with pytest.raises(PlacementError, match=r"actor 'gen' asks for 2 cores, 1 GPUs.*no node has room"):
        scheduler.place(cfg.actors[1])      # gpu-a's GPUs are the learner's; the head has none
    scheduler.release("learner")
    assert scheduler.place(cfg.actors[1]).node == "gpu-a"
    scheduler.check()


def test_the_plan_is_printed_node_by_node():
    cfg = config({"name": "gen", "replicas": 2, "cpus": 1})
    lines = describe_plan(ClusterScheduler(nodes()).plan(cfg.actors), nodes())
    assert lines[0] == "node head (10.0.0.1; 2 cores, 0 GPUs, 8192 MiB): 2 actors"
    assert lines[1].startswith("  gen-0: cores [0]") and lines[2].startswith("  gen-1: cores [1]")
    assert lines[-1] == "node gpu-b (10.0.0.3; 4 cores, 2 GPUs, 65536 MiB): 0 actors"


def test_config_rules_for_replicas_hints_and_the_cluster_section():
    with pytest.raises(ConfigError, match="node applies only with a .cluster. section|sets node = 'x', which applies"):
        config({"name": "a", "node": "x"}, cluster=False)
    with pytest.raises(ConfigError, match="actor name 'gen-1' is used twice"):
        config({"name": "gen", "replicas": 2}, {"name": "gen-1"})
    with pytest.raises(ConfigError, match="cluster.address = 'http://x': must be 'auto' or HOST:PORT"):
        parse_config({"cluster": {"address": "http://x"}})
    with pytest.raises(ConfigError, match="run.driver = 'd' has replicas"):
        parse_config({"run": {"driver": "d"}, "actors": [{"name": "d", "cls": ECHO, "replicas": 2}]})
    assert parse_config({}).cluster is None


def test_options_naming_a_replicated_entry_are_rewritten_to_its_replicas_or_refused():
    doc = {"actors": [{"name": "echo", "cls": ECHO, "replicas": 2},
                      {"name": "peer", "cls": "postrain.core.testing:CountingDriver", "replicas": 2,
                       "options": {"peer": "echo"}}]}
    cfg = parse_config(doc)
    resolve_options(cfg)
    assert [spec.options["peer"] for spec in cfg.actors[2:]] == ["echo-0", "echo-1"]   # paired i with i
    doc["actors"][1]["replicas"] = 3
    with pytest.raises(ConfigError, match=r"options.peer = 'echo': names an entry with 2 replicas \(echo-0 .. "
                                          r"echo-1\) where one actor is meant"):
        resolve_options(parse_config(doc))


def test_the_built_in_run_with_replicated_generators_and_environments_wires_them_pairwise():
    import tomllib

    from postrain.cli.config import parse_up_config
    from postrain.cli.up import default_config_path

    doc = tomllib.loads(default_config_path().read_text())
    for entry in doc["actors"]:
        if entry["name"] in ("generator", "env"):
            entry["replicas"] = 2
    cfg = parse_up_config(doc)
    options = {spec.name: spec.options for spec in cfg.actors}
    assert options["orchestrator"]["generators"] == ["generator-0", "generator-1"]     # a default, rewritten
    assert options["orchestrator"]["envs"] == ["env-0", "env-1"]
    assert [options[f"env-{i}"]["generator"] for i in range(2)] == ["generator-0", "generator-1"]


def test_a_config_without_a_cluster_section_imports_nothing_of_ray(tmp_path):
    code = ("import sys; from postrain.cli.main import main; status = main(['up', '--dry-run']); "
            "assert 'ray' not in sys.modules, 'ray was imported'; sys.exit(status)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "postrain up:" in result.stdout and "orchestrator" in result.stdout
