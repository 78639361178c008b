"""A node lost mid-run, on a local Ray cluster of three nodes on this machine
(ray.cluster_utils.Cluster): a real short RL run (`postrain up`, the tiny model) spans the
nodes, one node is killed (its raylet, and with it everything it started), and the run
finishes: a lost actor is placed again on a node left with room, a lost generator with no
room left is dropped (with the environment that samples from it) and the run goes on with
the other, the rollouts in flight are retried, the ledger balances, no batch is trained
twice, and the summary, the metrics and the progress lines count the loss, the
re-placement and the actors dropped. `postrain status` shows the nodes and the node of
every actor, before and after the loss. A lost actor the run cannot go without stops it
in one line (the rule: tests/cli/test_node_watch.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter

import psutil
import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from postrain.actors.orchestrator.ledger import read_events  # noqa: E402
from postrain.core.metrics import read_metrics  # noqa: E402
from postrain.core.testing import to_toml  # noqa: E402

# The runs wait on their own events (an actor running, a row written, the run's end) and on
# nothing else; this bound only stops a hung run from holding CI, far above a loaded machine's time.
pytestmark = [pytest.mark.faults, pytest.mark.timeout(1500)]   # node losses join the fault matrix: pytest -m faults (CI time)

NUM_STEPS = 10
TASK_OPTIONS = {"include_instructions": False, "max_digits": 1}


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of two logical CPUs each, which every run keeps: the head's and a second."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture
def nodes(cluster):
    """The cluster's two nodes, and a third of two CPUs for the test to kill. The third is
    removed after the test if the test did not get to kill it (it failed first), so the next
    test finds the cluster as this one did."""
    kept = [node for node in cluster.list_all_nodes() if node.is_head()] + \
        [node for node in cluster.list_all_nodes() if not node.is_head()]
    assert len(kept) == 2, f"the shared cluster holds {len(kept)} nodes, not its 2"
    doomed = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield [*kept, doomed]
    if doomed in cluster.list_all_nodes():
        cluster.remove_node(doomed, allow_graceful=False)
        cluster.wait_for_nodes()


def node_name(node) -> str:
    """The name postrain gives a Ray node (several nodes share this machine's address)."""
    return f"{node.node_ip_address}-{node.node_id[:8]}"


def run_config(address: str, run_dir, head: str, second: str) -> dict:
    """Two generators and two environments (replicas: env-i samples from generator-i), spread
    over the nodes: generator-1 and env-0 land on the third node; the learner and the driver
    on the head's node, the sandbox and a filler on the second, so that neither has a whole
    core left for a generator."""
    common = {"memory_mb": 0, "max_restarts": 3, "restart_backoff_s": 0.05}
    spread = {"placement": "spread", "replicas": 2}
    return {
        "cluster": {"address": address},
        "run": {"name": "lossy", "run_dir": str(run_dir), "driver": "orchestrator"},
        "shared": {"model": "tiny", "task": "arithmetic", "task_options": TASK_OPTIONS},
        "head": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 120},
        "actors": [
            {"name": "filler", "cls": "postrain.core.testing:EchoActor", "cpus": 1, "memory_mb": 0,
             "node": second},
            {"name": "sandbox", "cls": "postrain.actors.sandbox:SandboxActor", "cpus": 0.2,
             "node": second, "options": {"mode": "warm", "num_workers": 1}, **common},
            {"name": "generator", "cls": "postrain.actors.generator:GeneratorActor", "cpus": 1,
             "options": {"kv_cache_mb": 16}, **spread, **common},
            {"name": "learner", "cls": "postrain.actors.learner:LearnerActor", "cpus": 0.5,
             "node": head, "options": {"learner": {"lr": 1e-3}}, **common},
            {"name": "env", "cls": "postrain.actors.env:EnvironmentActor", "cpus": 0.1, "options": {},
             **spread, **common},
            {"name": "orchestrator", "cls": "postrain.actors.orchestrator:OrchestratorActor", "cpus": 0.1,
             "node": head, **common,
             "options": {"num_steps": NUM_STEPS, "prompts_per_step": 2, "samples_per_prompt": 2,
                         "max_staleness": 1, "sft_steps": 0, "num_eval_tasks": 2,
                         "sampling": {"max_new_tokens": 16}}}]}


def status_of(folder, capsys) -> tuple[dict, str]:
    """`postrain status RUN_DIR --json` and the plain `postrain status RUN_DIR`, in this process."""
    from postrain.cli.main import main

    capsys.readouterr()
    assert main(["status", str(folder), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert main(["status", str(folder)]) == 0
    return status, capsys.readouterr().out


def wait_for(predicate, what: str, process):
    """Poll `predicate` (it reads the run's files) until it returns something true, or fail
    once the run has ended without it: the run's own events decide, not a clock (the test's
    timeout mark bounds a hang)."""
    while True:
        found = predicate()
        if found:
            return found
        assert process.poll() is None, f"the run ended before {what}: {process.communicate()[0][-3000:]}"
        time.sleep(0.2)


def rows(folder, kind: str) -> list[dict]:
    return read_metrics(folder, kind) if (folder / "metrics.jsonl").exists() else []


def test_a_node_lost_mid_run_costs_only_what_ran_there(cluster, nodes, tmp_path, capsys):
    head, second, third = (node_name(node) for node in nodes)
    doc = run_config(cluster.address, tmp_path / "runs", head, second)
    (tmp_path / "run.toml").write_text(to_toml(doc))
    folder = tmp_path / "runs" / "lossy"
    process = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config",
                                str(tmp_path / "run.toml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=tmp_path)
    try:
        before, text = wait_for(lambda: (folder / "head.json").exists()
                                and (found := status_of(folder, capsys)) and len(found[0]["actors"]) == 8
                                and found, "every actor running", process)
        assert {(n["name"], n["state"]) for n in before["nodes"]} == {(head, "alive"), (second, "alive"),
                                                                      (third, "alive")}
        where = {actor["name"]: actor["node"] for actor in before["actors"]}
        assert where == {"filler": second, "sandbox": second, "generator-0": head, "generator-1": third,
                         "learner": head, "env-0": third, "env-1": second, "orchestrator": head}
        assert re.search(rf"node {re.escape(third)} \(\S+\): alive, 2 actors", text)
        assert re.search(rf"generator-1\s+running .* node {re.escape(third)} ", text)
        doomed = [actor["pid"] for actor in before["actors"] if actor["node"] == third]

        # a step trained: the run is under way, with rollouts in flight on the third node
        wait_for(lambda: rows(folder, "train"), "a first train row", process)
        cluster.remove_node(nodes[2], allow_graceful=False)      # its raylet, killed
        # the head asks each node for its actors every heartbeat interval: the moved one shows soon
        after, text = wait_for(lambda: (found := status_of(folder, capsys))
                               and {("generator-1", "dropped"), ("env-0", "running")} <= {
                                   (a["name"], a["state"]) for a in found[0]["actors"]
                                   if a["node"] != third or a["state"] == "dropped"} and found,
                               "generator-1 dropped and env-0 placed again, in `postrain status`", process)
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                       for pid in doomed), "an actor outlived its node"
        stdout, _ = process.communicate()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stdout[-4000:]

    # the third node's actors: env-0 placed again; generator-1 fits on no node left, so it is
    # dropped, and env-1 (on the second node), which samples from it, with it
    assert {(n["name"], n["state"]) for n in after["nodes"]} == {(head, "alive"), (second, "alive"),
                                                                 (third, "lost")}
    assert f"node {third}" in text and "lost (" in text
    state = {actor["name"]: (actor["state"], actor["node"]) for actor in after["actors"]}
    assert state["generator-1"] == ("dropped", third) and state["env-1"] == ("dropped", second)
    assert state["generator-0"] == ("running", head)
    assert state["env-0"] in {("running", head), ("running", second)}
    assert re.search(r"generator-1\s+dropped .* node \S+\s+dropped: node \S+ was lost", text)
    assert re.search(rf"node {re.escape(third)} lost \(.*\); its actors: generator-1, env-0", stdout)
    assert re.search(rf"actor generator-1 dropped: node {re.escape(third)} was lost and actor "
                     r"'generator-1', which ran there, fits on no node left \(.*no node has room.*\); the run "
                     r"goes on with 1 of 2 'generator' replicas", stdout)
    assert ("actor env-1 dropped: it needs actor 'generator-1', dropped; the run goes on with 1 of 2 "
            "'env' replicas") in stdout
    assert re.search(r"actor env-0 placed again on node \S+ \(tcp://", stdout)
    dropped = rows(folder, "dropped")
    assert [(row["actor"], row["node"], row["replicas_left"]) for row in dropped] == [
        ("generator-1", third, 1), ("env-1", second, 1)]
    replaced = rows(folder, "replaced")
    assert [(row["actor"], row["lost_node"]) for row in replaced] == [("env-0", third)]
    assert replaced[0]["node"] in (head, second)
    assert [row["node"] for row in rows(folder, "node_lost")] == [third]

    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["node_losses"], summary["replacements"], summary["actors_dropped"]) == (1, 1, 2)
    assert '"actors_dropped": 2' in stdout
    ledger = summary["ledger"]
    assert summary["steps"] == NUM_STEPS
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["in_flight"] == 0
    assert [row["step"] for row in rows(folder, "train")] == list(range(1, NUM_STEPS + 1))
    trained = Counter(event["sample_id"] for event in read_events(folder / "ledger.jsonl")
                      if event["event"] == "trained")
    assert trained and max(trained.values()) == 1, "a sample was trained twice"


def test_a_lost_actor_that_fits_on_no_node_left_stops_the_run_in_one_line(cluster, nodes, tmp_path, capsys):
    head, second, third = (node_name(node) for node in nodes)
    echo = "postrain.core.testing:EchoActor"
    doc = {"cluster": {"address": cluster.address},
           "run": {"name": "full", "run_dir": str(tmp_path / "runs"), "driver": "driver"},
           "head": {"heartbeat_interval_s": 0.5},
           "actors": [   # every core of the head's node and the second taken: nothing else fits there
               {"name": "filler-a", "cls": echo, "cpus": 1, "memory_mb": 0, "node": head},
               {"name": "filler-b", "cls": echo, "cpus": 2, "memory_mb": 0, "node": second},
               {"name": "echo", "cls": echo, "cpus": 1, "memory_mb": 0, "node": third},
               {"name": "driver", "cls": "postrain.core.testing:CountingDriver", "cpus": 1, "memory_mb": 0,
                "node": head, "options": {"peer": "echo", "steps": 1000, "step_s": 0.5}}]}
    (tmp_path / "run.toml").write_text(to_toml(doc))
    folder = tmp_path / "runs" / "full"
    process = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config",
                                str(tmp_path / "run.toml")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path)
    try:
        wait_for(lambda: (folder / "head.json").exists() and (found := status_of(folder, capsys))
                 and [a["state"] for a in found[0]["actors"]].count("running") == 4, "every actor running",
                 process)
        cluster.remove_node(nodes[2], allow_graceful=False)
        stdout, stderr = process.communicate()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert re.search(rf"node {re.escape(third)} lost \(.*\); its actors: echo", stdout), stdout[-3000:] + stderr[-2000:]
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert re.search(rf"node {re.escape(third)} was lost and actor 'echo', which ran there, fits on no node "
                     r"left \(actor 'echo' asks for 1 cores.*no node has room.*\); add a node with room and "
                     rf"`postrain up --resume {re.escape(str(folder))}`", stderr)
