"""`postrain bench cluster`: postrain across the nodes of a Ray cluster, against raw pyzmq over
the same links, in one run.

    postrain bench cluster --json [--quick] [--address HOST:PORT]

Without `--address` the bench starts a local Ray cluster (`ray.cluster_utils.Cluster`, nodes of
NODE_CPUS logical CPUs each on this machine) and grows it from one node to three; with it, it
uses the nodes of that running cluster (run it on the head's node; `postrain up` then starts
its node agents on every node, also for the 1-node run). Node 0 is the Ray head's.

Figures (medians over repeats; ours and the peer take turns within each repeat):
- `rtt_p50_us`, `rtt_p99_us`, `oneway_msgs_per_s`: a 64-byte message from this process to an
  actor on node 1 (ours: `EchoActor` under node 1's agent, the real Node/actor API, tcp +
  CurveZMQ) against raw pyzmq PAIR sockets, plain tcp, to a server on node 1. `curve_floor_*`
  (ours only): the same raw pyzmq with CurveZMQ on, the least an encrypted link can reach.
- `weight_sync_gb_per_s`: one weight sync of a SmolLM2-135M-shaped state (538 MB fp32, random
  values of the real model's shapes) from a `LearnerActor` on node 0 to a `WeightReceiverActor`
  on node 1 that assembles the chunks and loads them into its model (the generator's path:
  `publish` with the orchestrator's default `chunk_mb`, the chunks on Curve, their bytes on the
  receiver's sealed channel: core/sealed.py, actors/weights/assembly.py), against the same bytes
  sent by raw pyzmq over plain tcp as one zero-copy multipart message to node 1.
  `sealed_floor_weight_sync_gb_per_s` (ours only): the same bytes on a bare sealed channel
  (core/sealed.py) from this process to a receiver on node 1 that opens them into fresh
  buffers, no actors: what the channel alone reaches. `curve_floor_weight_sync_gb_per_s` (ours
  only): the raw send with CurveZMQ on, in frames of at most wire.FRAME_MAX_BYTES: the bound
  of the path weights took before the sealed channel; `curve_chunks_weight_sync_gb_per_s` (ours
  only): that path itself, the chunks with their tensors in them over Curve, sent from this
  process to the same receiver. The ceiling of any sealed channel here, from figures of the
  same run (ours only): `seal_core_s` and `open_core_s` (CPU seconds of this process, single
  thread, `time.process_time`; `seal_wall_s`, `open_wall_s` beside them) to seal every 4 MiB
  piece of the state into the channel's ring of buffers and to open every piece into a fresh
  buffer of the state's size, as the channel's two ends do, nothing else running;
  `plain_send_s`, the peer's seconds for the same bytes, and `plain_cores_busy`, the CPU
  seconds of both of its ends (both processes) over that wall time; `cores`, the CPUs this
  process may run on (C). A sealed channel does the plain send's work (plain_cores_busy *
  plain_send_s core-seconds) plus the crypto's (K = seal_core_s + open_core_s), on at most C
  cores, and cannot beat the plain send itself, so it takes at least
  max(plain_send_s, (plain_cores_busy * plain_send_s + K) / C), and
  `sealed_ratio_bound` = plain_send_s / that: the best weight-sync ratio a sealed channel
  could reach on this machine (a perfect overlap of crypto and transport on every core;
  when the plain send keeps all C cores busy it is plain_send_s / (plain_send_s + K / C)).
  `config` holds ours at other chunk sizes
  (`weight_sync_gb_per_s_by_chunk_mb`) and the raw Curve send of the whole state as one frame
  (`curve_one_frame_weight_sync_gb_per_s`).
- `samples_per_s_K_nodes` (K = 2, 3): trained samples per second of the default run (short:
  RL_STEPS GRPO steps, no warm start, no evaluation) under `postrain up` with its actors spread
  over K nodes by `node` hints (LAYOUTS); `first_rollout_s_K_nodes`: seconds from starting
  `postrain up` to the first generated sample (the ledger's first `generated` event). Peer:
  the same run on 1 node, so `ratio` is what the extra nodes cost (they share this machine's
  cores: not a speed-up). The cluster's first run (1 node) is run twice and the second kept:
  the first pays for cold caches and Ray's own start (in `config`).
`--quick` (a smoke run): two nodes, the "tiny" model for the sync, fewer repeats, no RL runs.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from postrain.bench import postrain_command
from postrain.bench.cluster_links import CHUNK_MB, PAYLOAD, measure_links

NODE_CPUS = 2                           # logical CPUs of each local node (this machine's cores)
SMOLLM2_135M_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                      "num_heads": 9, "num_kv_heads": 3, "tie_word_embeddings": True,
                      "max_position_embeddings": 2048}
RL_STEPS = 4
LAYOUTS = {1: {}, 2: {"learner": 1}, 3: {"learner": 2, "generator": 1}}   # actor -> node index; others 0
FULL = {"num_calls": 1000, "num_oneway": 20000, "repeats": 5, "sync_repeats": 3, "model": SMOLLM2_135M_SHAPE}
QUICK = {"num_calls": 200, "num_oneway": 2000, "repeats": 1, "sync_repeats": 1, "model": "tiny"}


# -- the Ray cluster ---------------------------------------------------------------------

class LocalOrExisting:
    """The cluster the bench runs on: a local one it starts and grows (`address` None), or a
    running one at `address`. `ensure(k)` returns the first k nodes (NodeInventory), or None
    where a running cluster has fewer."""

    def __init__(self, address: str | None):
        self.local = None
        if address is None:
            from ray.cluster_utils import Cluster
            self.local = Cluster(initialize_head=True, head_node_args={
                "num_cpus": NODE_CPUS, "object_store_memory": 100 << 20, "include_dashboard": False})
            address = self.local.address
        from postrain.core.config import ClusterSection
        from postrain.core.ray_nodes import connect
        self.address = address
        # without pydantic's mypy plugin (pyproject.toml names it) Field(30.0, ...) reads as no default
        self.ray = connect(ClusterSection(address=address))  # type: ignore[call-arg, unused-ignore]

    def ensure(self, num_nodes: int):
        if self.local is not None:
            while len(self.ray.nodes()) < num_nodes:
                self.local.add_node(num_cpus=NODE_CPUS, object_store_memory=100 << 20)
                self.local.wait_for_nodes()
        nodes = self.ray.nodes()
        return nodes[:num_nodes] if len(nodes) >= num_nodes else None

    def close(self) -> None:
        self.ray.disconnect()
        if self.local is not None:
            self.local.shutdown()


# -- the default run on K nodes ---------------------------------------------------------------

def default_run_doc(address: str, nodes, run_dir: str) -> dict:
    """The built-in run's config, short (RL_STEPS GRPO steps, no warm start, no evaluation), in
    the [cluster] at `address`, its actors on `nodes` as LAYOUTS[len(nodes)] says."""
    from postrain.actors.configs.run_config import default_config_path

    doc = tomllib.loads(default_config_path().read_text())
    layout = LAYOUTS[len(nodes)]
    doc["run"].update(name=f"cluster-{len(nodes)}-nodes", run_dir=run_dir)
    doc["cluster"] = {"address": address}
    for actor in doc["actors"]:
        actor["node"] = nodes[layout.get(actor["name"], 0)].name
        if actor["name"] == doc["run"]["driver"]:
            actor["options"].update(sft_steps=0, num_steps=RL_STEPS, num_eval_tasks=0,
                                    eval_samples_per_task=0, checkpoint_every=RL_STEPS)
    return doc


def first_generated_time(ledger_path: Path) -> float:
    """The wall time (epoch seconds) of the ledger's first `generated` event."""
    with ledger_path.open() as lines:
        for line in lines:
            event = json.loads(line)
            if event["event"] == "generated":
                return event["time"]
    raise RuntimeError(f"{ledger_path} has no generated sample")


def run_default(address: str, nodes, folder: Path) -> dict:
    """`postrain up` of default_run_doc on `nodes`: its samples/s, seconds to the first rollout."""
    from postrain.core.testing import to_toml

    runs = Path(tempfile.mkdtemp(prefix="runs-", dir=folder))    # a fresh run folder: never a resume
    doc = default_run_doc(address, nodes, str(runs))
    path = runs / "run.toml"
    path.write_text(to_toml(doc))
    start = time.time()
    result = subprocess.run(postrain_command("up", "--quiet", "--config", str(path)),
                            capture_output=True, text=True, timeout=1800)
    run_folder = runs / doc["run"]["name"]
    if result.returncode != 0:
        raise RuntimeError(f"postrain up on {len(nodes)} nodes failed ({result.returncode}): "
                           f"{result.stderr[-1500:]}; logs in {run_folder / 'logs'}")
    summary = json.loads((run_folder / "summary.json").read_text())
    return {"samples_per_s": summary["samples"] / summary["rl_wall_s"],
            "first_rollout_s": first_generated_time(run_folder / "ledger.jsonl") - start,
            "up_wall_s": time.time() - start, "samples": summary["samples"]}


# -- the whole bench ------------------------------------------------------------------------

@contextlib.contextmanager
def _bench_folder():
    with tempfile.TemporaryDirectory(prefix="postrain-bench-cluster-") as tmp:
        yield Path(tmp)


def run(quick: bool = False, address: str | None = None) -> dict:
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"skipped": "the cluster bench needs Ray: pip install 'postrain[cluster]'"}
    sizes = QUICK if quick else FULL
    load_before = [round(x, 2) for x in os.getloadavg()]
    node_counts = (2,) if quick else (1, 2, 3)
    results, peer, runs = {}, {}, {}
    config: dict[str, Any] = {}
    cluster = LocalOrExisting(address)
    try:
        with _bench_folder() as folder:
            for k in node_counts:
                nodes = cluster.ensure(k)
                if nodes is None:
                    config[f"nodes_{k}"] = f"skipped: the cluster at {cluster.address} has fewer nodes"
                    continue
                if k == 2:
                    ours, theirs, link_config = measure_links(cluster.ray, nodes, sizes, folder)
                    results.update(ours)
                    peer.update(theirs)
                    config.update(link_config)
                if not quick:
                    if k == 1:   # the cluster's first run pays for cold caches and Ray's own start
                        cold = run_default(cluster.address, nodes, folder)
                        config["first_run_1_node_cold"] = {n: round(v, 2) for n, v in cold.items()}
                    runs[k] = run_default(cluster.address, nodes, folder)
    finally:
        cluster.close()
    if 1 in runs:
        for k in sorted(runs)[1:]:
            for name in ("samples_per_s", "first_rollout_s"):
                results[f"{name}_{k}_nodes"] = round(runs[k][name], 2)
                peer[f"{name}_{k}_nodes"] = round(runs[1][name], 2)
            config[f"overhead_per_extra_node_pct_{k}_nodes"] = round(
                (1 - runs[k]["samples_per_s"] / runs[1]["samples_per_s"]) / (k - 1) * 100, 1)
    config.update({
        "cluster": "local (ray.cluster_utils.Cluster)" if address is None else address,
        "node_cpus": NODE_CPUS if address is None else "as the cluster declares",
        "payload_bytes": len(PAYLOAD), "chunk_mb": CHUNK_MB,
        "sync_model": "SmolLM2-135M shapes, random values" if sizes["model"] == SMOLLM2_135M_SHAPE
        else sizes["model"],
        **{k: v for k, v in sizes.items() if k != "model"},
        "runs": {f"{k}_nodes": {name: round(v, 2) for name, v in r.items()} for k, r in runs.items()},
        "rl_run": f"default config, {RL_STEPS} GRPO steps, no warm start, no evaluation; layouts {LAYOUTS}",
        "order": "interleaved within each repeat: peer, ours, sealed floor, curve chunks, curve floor; "
                 "then the crypto alone",
        "load_avg_1_5_15_min": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}})
    return {"config": config, "results": results, "peer": peer}
