"""`postrain bench cluster`: its quick run measures messaging and a weight sync across two nodes
of a local Ray cluster against raw pyzmq; the default run it times is spread over K nodes as its
layouts say and still places; the first rollout is read from the run's ledger."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from postrain.actors.orchestrator.ledger import SampleLedger
from postrain.bench.cluster import LAYOUTS, default_run_doc, first_generated_time
from postrain.bench.cluster_links import sealed_ratio_bound
from postrain.cli.config import load_up_config
from postrain.core.cluster import ClusterScheduler, NodeInventory
from postrain.core.scheduler import Inventory
from postrain.core.testing import to_toml


def nodes(num: int) -> list[NodeInventory]:
    return [NodeInventory(f"10.0.0.{i + 1}", f"10.0.0.{i + 1}", Inventory(cpu_ids=(0, 1), memory_mb=16384))
            for i in range(num)]


@pytest.mark.parametrize("num_nodes", sorted(LAYOUTS))
def test_the_default_run_is_spread_over_k_nodes_and_places(tmp_path, num_nodes):
    doc = default_run_doc("10.0.0.1:6379", nodes(num_nodes), str(tmp_path / "runs"))
    (tmp_path / "run.toml").write_text(to_toml(doc))
    config = load_up_config(tmp_path / "run.toml")
    plan = ClusterScheduler(nodes(num_nodes)).plan(config.actors)
    assert {p.node for p in plan} == {node.name for node in nodes(num_nodes)}
    where = {p.name: p.node for p in plan}
    assert where["learner"] == f"10.0.0.{LAYOUTS[num_nodes].get('learner', 0) + 1}"
    driver = next(spec for spec in config.actors if spec.name == config.run.driver)
    assert driver.options["sft_steps"] == 0 and driver.options["num_eval_tasks"] == 0


def test_the_sealed_ratio_bound_adds_the_crypto_to_the_plain_sends_work_on_the_cores():
    # the plain send keeps both cores busy: every crypto core-second costs half a second
    assert sealed_ratio_bound(0.25, 2.0, 0.3, cores=2) == pytest.approx(0.25 / (0.25 + 0.15), abs=1e-3)
    # it keeps one of four busy: the crypto fits beside it, the plain send's own time is the bound
    assert sealed_ratio_bound(0.25, 1.0, 0.3, cores=4) == 1.0
    assert sealed_ratio_bound(0.25, 1.0, 0.9, cores=4) == pytest.approx(0.25 / 0.2875, abs=1e-3)


def test_the_raw_links_make_their_own_keys_and_get_the_sealed_channels_key_sealed():
    """Ray keeps its calls' arguments: the raw CurveZMQ server gives out only the public half of a
    key pair it made itself, and the bare sealed channel's key travels sealed to the raw server."""
    import pickle

    from postrain.bench.cluster_links import SEALED_KEY_CONTEXT, RawClient, RawServer
    from postrain.core.enrol import EnrolmentError, EnrolmentKey, seal_for

    server = RawServer("127.0.0.1")
    address, public = server.serve(curve=True)
    assert len(public) == 40, "a Z85 public key, nothing more"
    client = RawClient(address, public)      # its warm-up round trips run on the Curve link
    assert len(client.round_trips(3)) == 3
    client.close()
    key = os.urandom(32)
    box = seal_for(server.enrolment_key(), key, SEALED_KEY_CONTEXT)
    assert key not in pickle.dumps(box)
    with pytest.raises(EnrolmentError):      # only the raw server's own key opens it
        EnrolmentKey().open(box, SEALED_KEY_CONTEXT)


def test_the_first_rollout_is_the_ledgers_first_generated_event(tmp_path):
    ledger = SampleLedger(tmp_path / "ledger.jsonl")
    ledger.create("s0")
    ledger.create("s1")
    before = time.time()
    ledger.advance("s1", "generated")
    ledger.advance("s0", "generated")
    ledger.close()
    assert before <= first_generated_time(tmp_path / "ledger.jsonl") <= time.time()
    empty = SampleLedger(tmp_path / "empty.jsonl")
    empty.create("s0")
    empty.close()
    with pytest.raises(RuntimeError, match="has no generated sample"):
        first_generated_time(tmp_path / "empty.jsonl")


@pytest.mark.slow
@pytest.mark.variants     # the bench itself; its parts are tested above
def test_a_quick_run_measures_links_across_two_nodes_against_raw_pyzmq():
    pytest.importorskip("ray")
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "bench", "cluster", "--quick", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "cluster"
    for name in ("rtt_p50_us", "rtt_p99_us", "oneway_msgs_per_s", "weight_sync_gb_per_s"):
        assert report["results"][name] > 0 and report["peer"][name] > 0
        ours, peer = report["results"][name], report["peer"][name]
        assert report["ratio"][name] == pytest.approx(ours / peer, rel=0.02)
        assert report["results"][f"curve_floor_{name}"] > 0
    results = report["results"]
    for name in ("seal_core_s", "open_core_s", "seal_wall_s", "open_wall_s", "plain_send_s",
                 "plain_cores_busy"):
        assert results[name] > 0
    assert 0 < results["sealed_ratio_bound"] <= 1 and results["cores"] >= 1
    config = report["config"]
    assert config["sync_bytes"] > 0 and config["sync_tensors"] > 1
    assert set(config["weight_sync_gb_per_s_by_chunk_mb"]) == {"64", "16", "256", "whole"}


def test_an_address_nobody_answers_at_fails_in_one_line():
    pytest.importorskip("ray")
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "bench", "cluster", "--quick", "--address",
                             "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "postrain bench cluster: no Ray cluster answers at [cluster] address = '127.0.0.1:1'")
