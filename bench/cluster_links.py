"""The links figures of `postrain bench cluster` (bench/cluster.py, whose docstring defines each
figure): messaging and one weight sync from node 0 to node 1, ours (actors under the node
agents) against raw pyzmq over the same link, with the floors of the encrypted paths (raw
CurveZMQ, the bare sealed channel) and the crypto's own cost beside them.

`measure_links` is the entry; the peer's server runs on node 1 as a Ray actor (`RawServer`).
No secret rides in a Ray call (Ray keeps its calls' arguments, core/enrol.py): the raw CurveZMQ
server makes its own key pair and gives out the public half, and the bare sealed channel's key,
made here, reaches the raw server sealed to its enrolment key, as the run's keys reach an agent.
"""
from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from pathlib import Path

import torch
import zmq

from postrain.actors.records import GET_WEIGHTS, LOAD_WEIGHTS, PUBLISH, PublishRequest
from postrain.bench.messaging import actor_oneway_rate, actor_round_trips

SEALED_SYNC_ID = bytes(16)              # the bare sealed channel's streams differ by version (the repeat)
SEALED_KEY_CONTEXT = b"postrain bench cluster: the bare sealed channel's key"   # what its box is bound to
PAYLOAD = b"x" * 64
CHUNK_MB = 64.0                         # the orchestrator's default weight_chunk_mb
CHUNK_SWEEP_MB = (16.0, 256.0, None)    # ours at other chunk sizes (None: one message), in config


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
        from postrain.core.enrol import EnrolmentKey
        self.host = host
        self._enrolment = EnrolmentKey()   # the sealed channel's key comes sealed to it

    def enrolment_key(self) -> bytes:
        """The public half of the key that `serve_sealed`'s box is sealed to."""
        return self._enrolment.public

    def serve_sealed(self, box: dict, sizes: list[int]) -> tuple[str, str]:
        """A sealed channel's receiver (core/sealed.py), under the key sealed in `box` (core/enrol.py,
        to `enrolment_key`, under SEALED_KEY_CONTEXT), and a plain PAIR socket that answers
        b"done" after each stream: repeat i is Stream("bench", i, SEALED_SYNC_ID, 0) of buffers of
        `sizes`, opened into fresh ones as a weight receiver does. (sealed address, ack address)"""
        from postrain.core.sealed import SealedReceiver
        receiver = SealedReceiver(self._enrolment.open(box, SEALED_KEY_CONTEXT), self.host)
        ack: zmq.Socket = zmq.Context.instance().socket(zmq.PAIR)
        port = ack.bind_to_random_port(f"tcp://{self.host}")
        threading.Thread(target=_serve_sealed, args=(receiver, ack, sizes), daemon=True).start()
        return receiver.address, f"tcp://{self.host}:{port}"

    def cpu_s(self) -> float:
        """CPU seconds of this process so far (all its threads)."""
        return time.process_time()

    def serve(self, curve: bool) -> tuple[str, bytes | None]:
        """A PAIR server: (its address, and with `curve` the public half of the CurveZMQ key pair
        it made for itself; None without)."""
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.PAIR)
        public = None
        if curve:
            public, secret = zmq.curve_keypair()
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret
        port = sock.bind_to_random_port(f"tcp://{self.host}")
        threading.Thread(target=_serve_raw, args=(sock,), daemon=True).start()
        return f"tcp://{self.host}:{port}", public


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
        # numpy's stubs give ndarray __buffer__ on Python >= 3.12 only
        receiver.receive(Stream("bench", repeat, SEALED_SYNC_ID, 0),
                         [memoryview(buffer[a:b])  # type: ignore[arg-type]
                          for a, b in zip(offsets, offsets[1:])], timeout_s=600)
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
            # numpy's stubs give ndarray __buffer__ on Python >= 3.12 only
            cipher.decrypt_into(nonce, piece, header,
                                memoryview(out[start:start + len(data)]))  # type: ignore[arg-type]
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

    def __init__(self, address: str, server_public: bytes | None = None):
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()   # pyzmq types it Context[Never]
        self.sock = context.socket(zmq.PAIR)
        if server_public is not None:   # CurveZMQ to the server's key, with a client pair of our own
            self.sock.curve_serverkey = server_public
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
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
    from postrain.actors.weights.messages import weight_messages
    messages = weight_messages(weights, version, CHUNK_MB)
    num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    start = time.perf_counter()
    for message in messages[:-1]:
        await receiver.send(LOAD_WEIGHTS, message, timeout_s=600)
    await receiver.call(LOAD_WEIGHTS, messages[-1], timeout_s=600)
    return num_bytes / (time.perf_counter() - start) / 1e9


async def _sync_gb_per_s(learner, chunk_mb: float | None) -> float:
    """One publish to the receiver: GB/s of the sync as the learner timed it (first chunk sent to
    last chunk applied). Cancelled: the receiver may hold part of a sync; the next drops it."""
    reply = await learner.call(PUBLISH, PublishRequest(targets=["receiver"], chunk_mb=chunk_mb, timeout_s=600),
                               timeout_s=900)
    return reply.num_bytes / reply.sync_s["receiver"] / 1e9


def _link_specs(nodes, model) -> list[tuple]:
    """The actors of measure_links, in start order. Local nodes are the same two cores (core 0 of
    every node is this machine's core 0): the echo takes a whole core of node 1 first, so that
    the receiver gets core 1 while the learner holds core 0 of node 0, one real core each, as
    on real nodes (with the echo at 0.25 cores, both ends of the sync were pinned to core 0)."""
    from postrain.core import ActorSpec
    return [(ActorSpec(name="echo", cls="postrain.core.testing:EchoActor", cpus=1.0, memory_mb=64),
             nodes[1]),
            (ActorSpec(name="learner", cls="postrain.actors.learner:LearnerActor", cpus=1.0,
                       memory_mb=3072, options={"model": model}), nodes[0]),
            (ActorSpec(name="receiver", cls="postrain.actors.weights:WeightReceiverActor", cpus=1.0,
                       memory_mb=2048, options={"model": model}), nodes[1])]


def measure_links(ray_cluster, nodes, sizes: dict, folder: Path) -> tuple[dict, dict, dict]:
    """Messaging and weight sync from node 0 (this process, the learner) to node 1 of
    `ray_cluster` (core/ray_nodes.py's RayCluster): (ours, peer, config). `sizes`: FULL or QUICK
    of bench/cluster.py. The agents and the raw servers are stopped before it returns."""
    import anyio
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from postrain.core import CurveKeys

    keys = CurveKeys.generate()
    agents = ray_cluster.start_agents(nodes, keys=keys, run_tag="benchcluster", log_dir=str(folder / "logs"))
    server = ray.remote(num_cpus=0)(RawServer).options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=_ray_node_id(nodes[1]), soft=False)).remote(nodes[1].address)
    try:
        addresses = {spec.name: agents.start(spec, node.name)
                     for spec, node in _link_specs(nodes, sizes["model"])}
        # ray's stubs type an actor handle's methods as the plain methods: .remote is made at run time.
        # curve: (address, its public key)
        plain, _ = ray.get(server.serve.remote(curve=False), timeout=60)  # type: ignore[attr-defined]
        curve = ray.get(server.serve.remote(curve=True), timeout=60)   # type: ignore[attr-defined]
        raw = {"plain": plain, "curve": curve, "server": server}
        return anyio.run(_measure_links, keys, addresses, raw, sizes, backend="trio")
    finally:
        agents.stop()
        ray.kill(server)  # type: ignore[arg-type]  # ray's stubs: .remote() gives a handle, not a union


async def _measure_links(keys, addresses: dict, raw_links: dict, sizes: dict):
    """Cancelled: the raw links are closed (finally); no figures."""
    import ray

    from postrain.core import Node, wire
    from postrain.core.enrol import seal_for
    from postrain.core.identity import server_key_of
    from postrain.core.sealed import SealedSender

    ours: dict[str, list[float]] = {"rtts": [], "rates": [], "sync": []}
    peer: dict[str, list[float]] = {"rtts": [], "rates": [], "sync": []}
    floor: dict[str, list[float]] = {"rtts": [], "rates": [], "sync": []}
    one_frame: list[float] = []
    sealed_floor: list[float] = []
    plain_sends: list[tuple[float, float]] = []
    curve_chunks: list[float] = []
    by_chunk: dict[float | None, list[float]] = {mb: [] for mb in CHUNK_SWEEP_MB}
    async with Node("bench", keys) as node:
        echo, learner = (node.ref(addresses[name], name, server_key=server_key_of(keys, name))
                         for name in ("echo", "learner"))
        got = await learner.call(GET_WEIGHTS, timeout_s=600)
        weights, version = got.weights, got.version
        tensors = [t.contiguous() for t in weights.values()]
        receiver = node.ref(addresses["receiver"], "receiver", server_key=server_key_of(keys, "receiver"))
        raw, raw_curve = RawClient(raw_links["plain"]), RawClient(*raw_links["curve"])
        sealed_key = os.urandom(32)   # the bare sealed channel's own key, to the raw server sealed
        box = seal_for(ray.get(raw_links["server"].enrolment_key.remote(), timeout=60), sealed_key,
                       SEALED_KEY_CONTEXT)
        sealed_address, ack_address = ray.get(raw_links["server"].serve_sealed.remote(
            box, [t.numel() * t.element_size() for t in tensors]), timeout=60)
        sealed = SealedSender(sealed_key)
        ack: zmq.Socket = zmq.Context.instance().socket(zmq.PAIR)
        ack.connect(ack_address)
        try:
            await actor_round_trips(echo, 100)   # warm up
            await _sync_gb_per_s(learner, CHUNK_MB)
            for _ in range(sizes["repeats"]):
                # the raw calls block this loop on purpose: nothing of ours runs meanwhile
                peer["rtts"] += raw.round_trips(sizes["num_calls"])
                ours["rtts"] += await actor_round_trips(echo, sizes["num_calls"])
                floor["rtts"] += raw_curve.round_trips(sizes["num_calls"])
                peer["rates"].append(raw.oneway_rate(sizes["num_oneway"]))
                ours["rates"].append(await actor_oneway_rate(echo, sizes["num_oneway"]))
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
            crypto = crypto_seconds(sealed_key, tensors, sizes["sync_repeats"])
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
