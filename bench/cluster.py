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
  receiver's sealed channel: core/sealed.py, actors/weight_assembly.py), against the same bytes
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
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import torch
import zmq

from postrain.bench.messaging import _actor_oneway_rate, _actor_round_trips

NODE_CPUS = 2                           # logical CPUs of each local node (this machine's cores)
SEALED_SYNC_ID = bytes(16)              # the bare sealed channel's streams differ by version (the repeat)
PAYLOAD = b"x" * 64
SMOLLM2_135M_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                      "num_heads": 9, "num_kv_heads": 3, "tie_word_embeddings": True,
                      "max_position_embeddings": 2048}
CHUNK_MB = 64.0                         # the orchestrator's default weight_chunk_mb
CHUNK_SWEEP_MB = (16.0, 256.0, None)    # ours at other chunk sizes (None: one message), in config
RL_STEPS = 4
LAYOUTS = {1: {}, 2: {"learner": 1}, 3: {"learner": 2, "generator": 1}}   # actor -> node index; others 0
FULL = {"num_calls": 1000, "num_oneway": 20000, "repeats": 5, "sync_repeats": 3, "model": SMOLLM2_135M_SHAPE}
QUICK = {"num_calls": 200, "num_oneway": 2000, "repeats": 1, "sync_repeats": 1, "model": "tiny"}


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
        self.ray = connect(ClusterSection(address=address))

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


def _ray_node_id(node) -> str:
    """Ray's id of a node named as RayCluster.nodes() names them (IP, or IP-NODEID8)."""
    import ray
    for n in ray.nodes():
        ip = n["NodeManagerAddress"]
        if n.get("Alive") and node.name in (ip, f"{ip}-{n['NodeID'][:8]}"):
            return n["NodeID"]
    raise RuntimeError(f"node {node.name} is not among Ray's live nodes")


# -- peer: raw pyzmq, its server on the far node ---------------------------------------------

class RawServer:
    """Runs on the far node (a Ray actor there): raw pyzmq PAIR servers, plain or CurveZMQ, each
    in its own thread. Messages: anything else is echoed; [b"count", n] then n messages is
    answered b"done"; [b"bulk", *frames] is answered with the bytes received; b"stop" ends."""

    def __init__(self, host: str):
        self.host = host

    def serve_sealed(self, run_key: bytes, sizes: list[int]) -> tuple[str, str]:
        """A sealed channel's receiver (core/sealed.py) and a plain PAIR socket that answers
        b"done" after each stream: repeat i is Stream("bench", i, SEALED_SYNC_ID, 0) of buffers of
        `sizes`, opened into fresh ones as a weight receiver does. (sealed address, ack address)"""
        from postrain.core.sealed import SealedReceiver
        receiver = SealedReceiver(run_key, self.host)
        ack = zmq.Context.instance().socket(zmq.PAIR)
        port = ack.bind_to_random_port(f"tcp://{self.host}")
        threading.Thread(target=_serve_sealed, args=(receiver, ack, sizes), daemon=True).start()
        return receiver.address, f"tcp://{self.host}:{port}"

    def cpu_s(self) -> float:
        """CPU seconds of this process so far (all its threads)."""
        return time.process_time()

    def serve(self, server_keys: tuple[bytes, bytes] | None) -> str:
        sock = zmq.Context.instance().socket(zmq.PAIR)
        if server_keys:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = server_keys
        port = sock.bind_to_random_port(f"tcp://{self.host}")
        threading.Thread(target=_serve_raw, args=(sock,), daemon=True).start()
        return f"tcp://{self.host}:{port}"


def _serve_raw(sock: zmq.Socket) -> None:
    while True:
        frames = sock.recv_multipart(copy=False)
        head = frames[0].bytes
        if head == b"stop":
            sock.close(linger=0)
            return
        if head == b"count":
            for _ in range(int(frames[1].bytes)):
                sock.recv_multipart(copy=False)
            sock.send(b"done")
        elif head == b"bulk":
            sock.send(str(sum(len(f.buffer) for f in frames[1:])).encode())
        else:
            sock.send_multipart(frames, copy=False)


def _serve_sealed(receiver, ack: zmq.Socket, sizes: list[int]) -> None:
    import numpy as np

    from postrain.core.sealed import Stream
    for repeat in itertools.count():
        buffer = np.empty(sum(sizes), dtype=np.uint8)
        offsets = [0, *itertools.accumulate(sizes)]
        receiver.receive(Stream("bench", repeat, SEALED_SYNC_ID, 0),
                         [memoryview(buffer[a:b]) for a, b in zip(offsets, offsets[1:])], timeout_s=600)
        ack.send(b"done")


def sealed_seconds(sender, address: str, ack: zmq.Socket, repeat: int, tensors: list) -> float:
    """Seconds to send the tensors' bytes on the bare sealed channel and hear them opened."""
    from postrain.core.sealed import Stream
    views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in tensors]
    start = time.perf_counter()
    failed = sender.send(Stream("bench", repeat, SEALED_SYNC_ID, 0), views, {address: None}, timeout_s=600)
    assert not failed, failed
    assert ack.recv() == b"done"
    return time.perf_counter() - start


def crypto_seconds(run_key: bytes, tensors: list, repeats: int) -> dict:
    """The sealed channel's crypto alone on the tensors' bytes, in this thread, nothing else of the
    bench running: every piece (the channel's plan and PIECE_BYTES) sealed into a ring of
    buffers as SealedSender does, and opened into a fresh buffer of the state's size as a
    receiver does (weight_assembly.empty_chunk). Medians: {"seal_core_s", "seal_wall_s",
    "open_core_s", "open_wall_s"}, core seconds by time.process_time, wall by perf_counter."""
    import numpy as np

    from postrain.core.sealed import PIECE_BYTES, TAG_BYTES, Stream, piece_plan
    stream = Stream("bench", 0, SEALED_SYNC_ID, 0)
    cipher = stream.cipher(run_key)
    views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in tensors]
    pieces = [(stream.nonce(p), views[i][a:b], stream.header(p))
              for p, (i, a, b) in enumerate(piece_plan([len(v) for v in views], PIECE_BYTES))]
    ring = [bytearray(PIECE_BYTES + TAG_BYTES) for _ in range(4)]
    sealed = [cipher.encrypt(nonce, data, header) for nonce, data, header in pieces]   # what is opened
    figures: dict[str, list[float]] = {name: [] for name in ("seal_core_s", "seal_wall_s", "open_core_s",
                                                             "open_wall_s")}
    for _ in range(repeats):
        core, wall = time.process_time(), time.perf_counter()
        for p, (nonce, data, header) in enumerate(pieces):
            cipher.encrypt_into(nonce, data, header, memoryview(ring[p % 4])[:len(data) + TAG_BYTES])
        figures["seal_core_s"].append(time.process_time() - core)
        figures["seal_wall_s"].append(time.perf_counter() - wall)
        core, wall = time.process_time(), time.perf_counter()
        out = np.empty(sum(len(v) for v in views), dtype=np.uint8)
        start = 0
        for (nonce, data, header), piece in zip(pieces, sealed):
            cipher.decrypt_into(nonce, piece, header, memoryview(out[start:start + len(data)]))
            start += len(data)
        figures["open_core_s"].append(time.process_time() - core)
        figures["open_wall_s"].append(time.perf_counter() - wall)
        del out
    return {name: round(statistics.median(values), 3) for name, values in figures.items()}


def sealed_ratio_bound(plain_send_s: float, plain_cores_busy: float, crypto_core_s: float,
                       cores: int) -> float:
    """The best ratio (plain seconds / sealed seconds) any sealed channel could reach: the plain
    send's work plus the crypto's on `cores` cores, never faster than the plain send itself."""
    best_s = max(plain_send_s, (plain_cores_busy * plain_send_s + crypto_core_s) / cores)
    return round(plain_send_s / best_s, 3)


class RawClient:
    """This process's end of a RawServer link (blocking calls)."""

    def __init__(self, address: str, keys=None):
        self.sock = zmq.Context.instance().socket(zmq.PAIR)
        if keys is not None:       # a postrain CurveKeys: the server's public key, our pair
            self.sock.curve_serverkey = keys.server_public
            self.sock.curve_publickey, self.sock.curve_secretkey = keys.client_public, keys.client_secret
        self.sock.connect(address)
        self.round_trips(100)  # warm up

    def round_trips(self, num_calls: int) -> list[float]:
        rtts = []
        for _ in range(num_calls):
            start = time.perf_counter()
            self.sock.send(PAYLOAD)
            self.sock.recv()
            rtts.append(time.perf_counter() - start)
        return rtts

    def oneway_rate(self, num_oneway: int) -> float:
        start = time.perf_counter()
        self.sock.send_multipart([b"count", str(num_oneway).encode()])
        for _ in range(num_oneway):
            self.sock.send(PAYLOAD)
        self.sock.recv()
        return num_oneway / (time.perf_counter() - start)

    def plain_send(self, tensors: list, server) -> tuple[float, float]:
        """(seconds, cores busy) of one bulk send: CPU seconds of both ends' processes (this one,
        and `server`, the RawServer's Ray actor) over the send's wall time."""
        import ray
        server_cpu, cpu = ray.get(server.cpu_s.remote(), timeout=60), time.process_time()
        seconds = self.bulk_seconds(tensors)
        cpu = time.process_time() - cpu + ray.get(server.cpu_s.remote(), timeout=60) - server_cpu
        return seconds, cpu / seconds

    def bulk_seconds(self, tensors: list, frame_max_bytes: int | None = None) -> float:
        """Seconds to send the tensors' bytes as one zero-copy message (a frame per tensor, or
        per slice of at most frame_max_bytes) and hear the size back."""
        views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in tensors]
        if frame_max_bytes:
            views = [v[i:i + frame_max_bytes] for v in views for i in range(0, len(v), frame_max_bytes)]
        start = time.perf_counter()
        self.sock.send_multipart([b"bulk", *views], copy=False)
        num_bytes = int(self.sock.recv())
        elapsed = time.perf_counter() - start
        assert num_bytes == sum(t.numel() * t.element_size() for t in tensors), num_bytes
        return elapsed

    def close(self) -> None:
        self.sock.send(b"stop")
        self.sock.close(linger=1000)


# -- ours: actors under the node agents ----------------------------------------------------

async def _curve_chunks_gb_per_s(receiver, weights: dict, version: int) -> float:
    """The path weights took to other nodes before the sealed channel: the `load_weights` chunks
    with their tensors in them, over Curve (pipelined as `publish` sent them), from this process
    to the receiver. GB/s from the first chunk sent to the last one's reply."""
    from postrain.actors.learner.publish import weight_messages
    messages = weight_messages(weights, version, CHUNK_MB)
    num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    start = time.perf_counter()
    for message in messages[:-1]:
        await receiver.tell("load_weights", message, timeout_s=600)
    await receiver.ask("load_weights", messages[-1], timeout_s=600)
    return num_bytes / (time.perf_counter() - start) / 1e9


async def _sync_gb_per_s(learner, chunk_mb: float | None) -> float:
    """One publish to the receiver: GB/s of the sync as the learner timed it (first chunk sent to
    last chunk applied). Cancelled: the receiver may hold part of a sync; the next drops it."""
    reply = await learner.ask("publish", {"targets": ["receiver"], "chunk_mb": chunk_mb, "timeout_s": 600},
                              timeout_s=900)
    return reply["num_bytes"] / reply["sync_s"]["receiver"] / 1e9


def _link_specs(nodes, model) -> list[tuple]:
    """The actors of measure_links, in start order. Local nodes are the same two cores (core 0 of
    every node is this machine's core 0): the echo takes a whole core of node 1 first, so that
    the receiver gets core 1 while the learner holds core 0 of node 0, one real core each, as
    on real nodes (with the echo at 0.25 cores, both ends of the sync were pinned to core 0)."""
    from postrain.core.config import ActorSpec
    return [(ActorSpec(name="echo", cls="postrain.core.testing:EchoActor", cpus=1.0, memory_mb=64),
             nodes[1]),
            (ActorSpec(name="learner", cls="postrain.actors.learner:LearnerActor", cpus=1.0,
                       memory_mb=3072, options={"model": model}), nodes[0]),
            (ActorSpec(name="receiver", cls="postrain.actors.weight_receiver:WeightReceiverActor", cpus=1.0,
                       memory_mb=2048, options={"model": model}), nodes[1])]


def measure_links(cluster: LocalOrExisting, nodes, sizes: dict, folder: Path) -> tuple[dict, dict, dict]:
    """Messaging and weight sync from node 0 (this process, the learner) to node 1: (ours, peer,
    config). The agents and the raw servers are stopped before it returns."""
    import anyio
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from postrain.core import CurveKeys

    keys = CurveKeys.generate()
    agents = cluster.ray.start_agents(nodes, keys=keys, run_tag="benchcluster", log_dir=str(folder / "logs"))
    server = ray.remote(num_cpus=0)(RawServer).options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=_ray_node_id(nodes[1]), soft=False)).remote(nodes[1].address)
    try:
        addresses = {spec.name: agents.start(spec, node.name)
                     for spec, node in _link_specs(nodes, sizes["model"])}
        plain = ray.get(server.serve.remote(None), timeout=60)
        curve = ray.get(server.serve.remote((keys.server_public, keys.server_secret)), timeout=60)
        raw = {"plain": plain, "curve": curve, "server": server}
        return anyio.run(_measure_links, keys, addresses, raw, sizes, backend="trio")
    finally:
        agents.stop()
        ray.kill(server)


async def _measure_links(keys, addresses: dict, raw_links: dict, sizes: dict):
    """Cancelled: the raw links are closed (finally); no figures."""
    import ray

    from postrain.core import Node, wire
    from postrain.core.sealed import SealedSender

    ours = {"rtts": [], "rates": [], "sync": []}
    peer = {"rtts": [], "rates": [], "sync": []}
    floor = {"rtts": [], "rates": [], "sync": []}
    one_frame: list[float] = []
    sealed_floor: list[float] = []
    plain_sends: list[tuple[float, float]] = []
    curve_chunks: list[float] = []
    by_chunk: dict[float | None, list[float]] = {mb: [] for mb in CHUNK_SWEEP_MB}
    async with Node("bench", keys) as node:
        echo, learner = node.ref(addresses["echo"]), node.ref(addresses["learner"])
        got = await learner.ask("get_weights", timeout_s=600)
        weights, version = got["weights"], got["version"]
        tensors = [t.contiguous() for t in weights.values()]
        receiver = node.ref(addresses["receiver"])
        raw, raw_curve = RawClient(raw_links["plain"]), RawClient(raw_links["curve"], keys)
        sealed_address, ack_address = ray.get(raw_links["server"].serve_sealed.remote(
            keys.bulk_key, [t.numel() * t.element_size() for t in tensors]), timeout=60)
        sealed, ack = SealedSender(keys.bulk_key), zmq.Context.instance().socket(zmq.PAIR)
        ack.connect(ack_address)
        try:
            await _actor_round_trips(echo, 100)   # warm up
            await _sync_gb_per_s(learner, CHUNK_MB)
            for _ in range(sizes["repeats"]):
                # the raw calls block this loop on purpose: nothing of ours runs meanwhile
                peer["rtts"] += raw.round_trips(sizes["num_calls"])
                ours["rtts"] += await _actor_round_trips(echo, sizes["num_calls"])
                floor["rtts"] += raw_curve.round_trips(sizes["num_calls"])
                peer["rates"].append(raw.oneway_rate(sizes["num_oneway"]))
                ours["rates"].append(await _actor_oneway_rate(echo, sizes["num_oneway"]))
                floor["rates"].append(raw_curve.oneway_rate(sizes["num_oneway"]))
            num_bytes = sum(t.numel() * t.element_size() for t in tensors)
            flat = [torch.cat([t.view(-1).view(torch.uint8) for t in tensors])]   # the state as one frame
            sealed_seconds(sealed, sealed_address, ack, 0, tensors)    # warm up
            for repeat in range(1, sizes["sync_repeats"] + 1):
                plain_sends.append(raw.plain_send(tensors, raw_links["server"]))
                peer["sync"].append(num_bytes / plain_sends[-1][0] / 1e9)
                ours["sync"].append(await _sync_gb_per_s(learner, CHUNK_MB))
                sealed_s = sealed_seconds(sealed, sealed_address, ack, repeat, tensors)
                sealed_floor.append(num_bytes / sealed_s / 1e9)
                curve_chunks.append(await _curve_chunks_gb_per_s(receiver, weights, version))
                floor["sync"].append(num_bytes / raw_curve.bulk_seconds(tensors, wire.FRAME_MAX_BYTES) / 1e9)
                one_frame.append(num_bytes / raw_curve.bulk_seconds(flat) / 1e9)
                for mb in CHUNK_SWEEP_MB:
                    by_chunk[mb].append(await _sync_gb_per_s(learner, mb))
            crypto = crypto_seconds(keys.bulk_key, tensors, sizes["sync_repeats"])
        finally:
            raw.close()
            raw_curve.close()
            sealed.close()
            ack.close(linger=0)
    results, peer_figures = _link_figures(**ours), _link_figures(**peer)
    results.update({f"curve_floor_{k}": v for k, v in _link_figures(**floor).items()})
    results["sealed_floor_weight_sync_gb_per_s"] = round(statistics.median(sealed_floor), 3)
    results["curve_chunks_weight_sync_gb_per_s"] = round(statistics.median(curve_chunks), 3)
    plain_send_s = num_bytes / 1e9 / statistics.median(peer["sync"])
    plain_cores_busy = statistics.median(busy for _, busy in plain_sends)
    cores = len(os.sched_getaffinity(0))
    results.update(crypto, plain_send_s=round(plain_send_s, 3), plain_cores_busy=round(plain_cores_busy, 2),
                   cores=cores, sealed_ratio_bound=sealed_ratio_bound(
                       plain_send_s, plain_cores_busy, crypto["seal_core_s"] + crypto["open_core_s"], cores))
    config = {"sync_bytes": num_bytes, "sync_tensors": len(tensors), "sealed_piece_bytes": sealed.piece_bytes,
              "curve_one_frame_weight_sync_gb_per_s": round(statistics.median(one_frame), 3),
              "weight_sync_gb_per_s_by_chunk_mb": {
                  f"{CHUNK_MB:g}": results["weight_sync_gb_per_s"],
                  **{"whole" if mb is None else f"{mb:g}": round(statistics.median(v), 3)
                     for mb, v in by_chunk.items()}}}
    return results, peer_figures, config


def _link_figures(rtts, rates, sync) -> dict:
    return {"rtt_p50_us": round(_percentile(rtts, 0.5) * 1e6, 1),
            "rtt_p99_us": round(_percentile(rtts, 0.99) * 1e6, 1),
            "oneway_msgs_per_s": round(statistics.median(rates)),
            "weight_sync_gb_per_s": round(statistics.median(sync), 3)}


# -- the default run on K nodes ---------------------------------------------------------------

def default_run_doc(address: str, nodes, run_dir: str) -> dict:
    """The built-in run's config, short (RL_STEPS GRPO steps, no warm start, no evaluation), in
    the [cluster] at `address`, its actors on `nodes` as LAYOUTS[len(nodes)] says."""
    from postrain.cli.up import default_config_path

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
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config", str(path)],
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
    results, peer, config, runs = {}, {}, {}, {}
    cluster = LocalOrExisting(address)
    try:
        with _bench_folder() as folder:
            for k in node_counts:
                nodes = cluster.ensure(k)
                if nodes is None:
                    config[f"nodes_{k}"] = f"skipped: the cluster at {cluster.address} has fewer nodes"
                    continue
                if k == 2:
                    ours, theirs, link_config = measure_links(cluster, nodes, sizes, folder)
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
