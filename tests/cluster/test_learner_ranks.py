"""The learner data-parallel across two nodes of a local Ray cluster (ray.cluster_utils.Cluster):
its two ranks, placed on two nodes and given the rendezvous the head hands out, train a step
to the same weights as one process (to 1e-6) and checkpoint together; and a real short RL
run through `postrain up` with the learner on two ranks across the nodes finishes with a
balanced ledger. Weights published from the learner reach a receiver on its node through
/dev/shm and one on the other node on the sealed channel, bit for bit."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from postrain.actors.learner.learner import Learner, LearnerConfig  # noqa: E402
from postrain.actors.weights.messages import weight_chunks, weights_digest  # noqa: E402
from postrain.actors.learner.group import interface_holding  # noqa: E402
from postrain.cli.cluster_up import ClusterLaunch, meeting_point_on_node  # noqa: E402
from postrain.core import ActorSpec, CurveKeys, Node  # noqa: E402
from postrain.core.cluster import ClusterScheduler  # noqa: E402
from postrain.core.identity import server_key_of  # noqa: E402
from postrain.core.config import complete_rendezvous, parse_config  # noqa: E402
from postrain.core.ray_nodes import connect  # noqa: E402
from postrain.core.testing import async_test, to_toml  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "actors" / "learner"))
from test_learner_dp import CONFIG, batch  # noqa: E402  (the tiny model and its batches)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes of two CPUs each (the head's first)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def learner_entry(**options) -> dict:
    return {"name": "learner", "cls": "postrain.actors.learner:LearnerActor", "ranks": 2, "cpus": 1,
            "memory_mb": 64, "placement": "spread", "max_restarts": 0, "options": options}


@async_test
async def test_two_ranks_on_two_nodes_train_like_one_process_and_checkpoint_together(two_nodes, tmp_path):
    options = {"model": CONFIG["model"], "learner": {k: v for k, v in CONFIG.items() if k != "model"},
               "group_timeout_s": 60}
    config = parse_config({"cluster": {"address": two_nodes.address}, "actors": [learner_entry(**options)]})
    cluster = connect(config.cluster)
    keys = CurveKeys.generate()
    try:
        nodes = cluster.nodes()
        plan = ClusterScheduler(nodes).plan(config.actors, {"learner-rank1": "learner"})
        assert [p.node for p in plan] == [nodes[0].name, nodes[1].name]      # spread: one rank a node
        agents = cluster.start_agents(nodes, keys=keys, run_tag="ranks1", log_dir=str(tmp_path / "logs"))
        try:
            launch = ClusterLaunch(cluster, nodes, plan)
            complete_rendezvous(config.actors, meeting_point_on_node(agents, launch))
            assert config.actors[1].rendezvous.address == nodes[0].address
            address = {}

            async def start(placed, spec):
                address[placed.name] = await anyio.to_thread.run_sync(agents.start, spec, placed.node)
            async with anyio.create_task_group() as tg:      # both at once: each waits only for its READY
                for placed, spec in zip(plan, config.actors):
                    tg.start_soon(start, placed, spec)
            async with Node("head", keys) as head:
                learner = head.ref(address["learner"], "learner", server_key=server_key_of(keys, "learner"))
                for step in range(2):
                    metrics = await learner.ask("train", batch(step).to_wire(), timeout_s=120)
                weights = (await learner.ask("get_weights", None, timeout_s=60))["weights"]
                await learner.ask("save_checkpoint", {"path": str(tmp_path / "ckpt")}, timeout_s=60)
                await learner.ask("train", batch(2).to_wire(), timeout_s=120)
                loaded = await learner.ask("load_checkpoint", {"path": str(tmp_path / "ckpt")}, timeout_s=60)
                reloaded = (await learner.ask("get_weights", None, timeout_s=60))["weights"]
                # the follower loaded it too: the next step's all-reduce would diverge otherwise
                again = await learner.ask("train", batch(2).to_wire(), timeout_s=120)
        finally:
            agents.stop()
    finally:
        cluster.disconnect()

    single = Learner(LearnerConfig(**CONFIG, seed=0))
    expected = [single.train_step(batch(step)) for step in range(2)]
    for name, tensor in single.state_dict().items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(reloaded[name], weights[name], atol=0, rtol=0, msg=name)
    assert metrics["loss"] == pytest.approx(expected[-1]["loss"], abs=1e-6)
    assert loaded["policy_version"] == 2
    assert again["loss"] == pytest.approx(single.train_step(batch(2))["loss"], abs=1e-6)
    follower_log = (tmp_path / "logs" / "learner-rank1.log").read_text()
    assert f"GLOO_SOCKET_IFNAME={interface_holding(nodes[1].address)}" in follower_log


RUN = {"run": {"name": "ranks", "driver": "orchestrator"},
       "shared": {"model": "tiny", "task": "arithmetic",
                  "task_options": {"include_instructions": False, "max_digits": 1}},
       "head": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 120},
       "actors": [
           {"name": "sandbox", "cls": "postrain.actors.sandbox:SandboxActor", "cpus": 0.2,
            "memory_mb": 0, "options": {"mode": "warm", "num_workers": 1}},
           {"name": "generator", "cls": "postrain.actors.generator:GeneratorActor", "cpus": 0.5,
            "memory_mb": 0, "options": {"kv_cache_mb": 16}},
           {**learner_entry(learner={"lr": 1e-3}), "memory_mb": 0},
           {"name": "env", "cls": "postrain.actors.env:EnvironmentActor", "cpus": 0.1, "memory_mb": 0},
           {"name": "orchestrator", "cls": "postrain.actors.orchestrator:OrchestratorActor", "cpus": 0.1,
            "memory_mb": 0, "options": {"num_steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
                                        "max_staleness": 1, "sft_steps": 1, "sft_batch_size": 4,
                                        "num_eval_tasks": 0,
                                        "sampling": {"max_new_tokens": 16}}}]}


@pytest.mark.variants     # the two ranks on two nodes are checked without a whole run above
def test_a_short_run_with_the_learner_on_two_ranks_across_nodes_balances_its_ledger(two_nodes, tmp_path):
    doc = json.loads(json.dumps(RUN))
    doc["cluster"] = {"address": two_nodes.address}
    doc["run"]["run_dir"] = str(tmp_path / "runs")
    (tmp_path / "run.toml").write_text(to_toml(doc))
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config",
                             str(tmp_path / "run.toml")], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    nodes = dict(re.findall(r"started ([\w-]+) on node (\S+) \(tcp://", result.stdout))
    assert nodes["learner"] != nodes["learner-rank1"]
    summary = json.loads((tmp_path / "runs" / "ranks" / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["steps"] == 2 and ledger["created"] == 2 * 2 * 2
    assert ledger["created"] == ledger["in_flight"] + ledger["trained"] + ledger["dropped"]
    assert ledger["in_flight"] == 0 and ledger["trained"] == summary["samples"] > 0


@pytest.mark.variants     # sealed sends across nodes: test_weight_assembly.py
@async_test
async def test_weights_reach_a_receiver_on_the_learners_node_through_shm_and_one_on_another_node_sealed(
        two_nodes, tmp_path):
    """Same node by node identity: `near` binds tcp like every cluster actor, yet gets one message
    (its tensors through /dev/shm); `far` gets chunks whose bytes travel on its sealed channel.
    Both then hold the learner's weights bit for bit, and no log of the run holds its key."""
    cluster = connect(parse_config({"cluster": {"address": two_nodes.address}, "actors": []}).cluster)
    keys = CurveKeys.generate()
    try:
        nodes = cluster.nodes()
        agents = cluster.start_agents(nodes, keys=keys, run_tag="sealed1", log_dir=str(tmp_path / "logs"))
        try:
            receiver = "postrain.actors.weights:WeightReceiverActor"
            specs = [("learner", "postrain.actors.learner:LearnerActor", {"model": "tiny"}, nodes[0]),
                     ("near", receiver, {}, nodes[0]), ("far", receiver, {}, nodes[1])]
            address = {}
            for name, cls, options, node in specs:
                spec = ActorSpec(name=name, cls=cls, options=options, cpus=0.5, memory_mb=0, max_restarts=0)
                address[name] = await anyio.to_thread.run_sync(agents.start, spec, node.name)
            assert all(a.startswith(f"tcp://{nodes[0].address}") for a in address.values())  # one machine
            async with Node("head", keys) as head:
                learner = head.ref(address["learner"], "learner", server_key=server_key_of(keys, "learner"))
                report = await learner.ask("publish", {"targets": ["near", "far"], "chunk_mb": 1.0},
                                           timeout_s=120)
                weights = (await learner.ask("get_weights", None, timeout_s=60))["weights"]
                digests = [await head.ref(address[name], name, server_key=server_key_of(keys, name)).ask("digest")
                           for name in ("near", "far")]
        finally:
            agents.stop()
    finally:
        cluster.disconnect()
    assert report["num_messages"] == 1 + len(weight_chunks(weights, 1.0))
    assert digests == [{"version": 0, "digest": weights_digest(weights)}] * 2
    every_log = b"".join(path.read_bytes() for path in (tmp_path / "logs").iterdir())
    assert b"published weights v0" in every_log
    for form in (keys.bulk_key, keys.bulk_key.hex().encode(), repr(keys.bulk_key).encode()):
        assert form not in every_log
