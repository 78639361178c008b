"""`postrain bench messaging`: actor messaging against raw pyzmq, in one run.

Ours: the head process asks an `EchoActor` (a real actor process started by
the supervisor) over ipc. Peer: a raw pyzmq PAIR socket ping-pong over ipc
with a plain blocking echo loop in a spawned process, same payloads.

Figures (medians over repeats):
- rtt_p50_us, rtt_p99_us: small request/reply round trip (a 64-byte body);
- oneway_msgs_per_s: pipelined one-way messages, counted until the last is handled;
- tensor_64mib_ms: a 64 MiB float32 tensor from one process to another, until the
  receiver has it resident and has replied (ours: through /dev/shm with a handle
  on the wire; peer: a zero-copy ZeroMQ send).
"""
from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time

import anyio
import numpy as np
import torch
import zmq

from postrain.core import ActorSpec, Scheduler, Supervisor
from postrain.core.scheduler import Inventory

PAYLOAD = b"x" * 64
TENSOR_BYTES = 64 << 20


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- peer: raw pyzmq -----------------------------------------------------------

def _raw_echo_server(address: str) -> None:
    sock = zmq.Context().socket(zmq.PAIR)
    sock.bind(address)
    while True:
        frames = sock.recv_multipart(copy=False)
        head = frames[0].bytes
        if head == b"stop":
            return
        if head == b"count":
            num = int(frames[1].bytes)
            for _ in range(num):
                sock.recv_multipart(copy=False)
            sock.send(b"done")
        elif head == b"bulk":
            sock.send(str(len(frames[1].buffer)).encode())
        else:
            sock.send_multipart(frames, copy=False)


def _measure_raw(num_calls: int, num_oneway: int, repeats: int) -> dict:
    address = f"ipc://{tempfile.gettempdir()}/postrain-bench-raw-{os.getpid()}.sock"
    server = multiprocessing.get_context("spawn").Process(target=_raw_echo_server, args=(address,))
    server.start()
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    try:
        for _ in range(200):
            sock.send(PAYLOAD)
            sock.recv()
        rtts, rates, bulk = [], [], []
        tensor = np.ones(TENSOR_BYTES // 4, dtype=np.float32)
        for _ in range(repeats):
            for _ in range(num_calls):
                start = time.perf_counter()
                sock.send(PAYLOAD)
                sock.recv()
                rtts.append(time.perf_counter() - start)
            start = time.perf_counter()
            sock.send_multipart([b"count", str(num_oneway).encode()])
            for _ in range(num_oneway):
                sock.send(PAYLOAD)
            sock.recv()
            rates.append(num_oneway / (time.perf_counter() - start))
            for _ in range(3):
                start = time.perf_counter()
                sock.send_multipart([b"bulk", memoryview(tensor)], copy=False)
                sock.recv()
                bulk.append(time.perf_counter() - start)
        sock.send(b"stop")
    finally:
        server.join(timeout=10)
        sock.close(linger=0)
    return _figures(rtts, rates, bulk)


# -- ours: actors --------------------------------------------------------------

async def _measure_actors(num_calls: int, num_oneway: int, repeats: int) -> dict:
    inventory = Inventory.detect()
    scheduler = Scheduler(Inventory(inventory.cpu_ids, inventory.memory_mb))
    async with Supervisor.open(scheduler=scheduler) as supervisor:
        ref = await supervisor.start(ActorSpec(name="echo", cls="postrain.core.testing:EchoActor",
                                               cpus=1.0, memory_mb=0))
        for _ in range(200):
            await ref.ask("echo", PAYLOAD)
        rtts, rates, bulk = [], [], []
        tensor = torch.ones(TENSOR_BYTES // 4, dtype=torch.float32)
        for _ in range(repeats):
            for _ in range(num_calls):
                start = time.perf_counter()
                await ref.ask("echo", PAYLOAD)
                rtts.append(time.perf_counter() - start)
            before = await ref.ask("num_told")
            start = time.perf_counter()
            for _ in range(num_oneway):
                await ref.tell("told", PAYLOAD)
            after = await ref.ask("num_told")
            rates.append((after - before) / (time.perf_counter() - start))
            for _ in range(3):
                start = time.perf_counter()
                nbytes = await ref.ask("nbytes", tensor)
                bulk.append(time.perf_counter() - start)
                assert nbytes == TENSOR_BYTES, nbytes
    return _figures(rtts, rates, bulk)


def _figures(rtts, rates, bulk) -> dict:
    return {"rtt_p50_us": round(_percentile(rtts, 0.5) * 1e6, 1),
            "rtt_p99_us": round(_percentile(rtts, 0.99) * 1e6, 1),
            "oneway_msgs_per_s": round(statistics.median(rates)),
            "tensor_64mib_ms": round(statistics.median(bulk) * 1e3, 2)}


def run(quick: bool = False) -> dict:
    num_calls, num_oneway, repeats = (500, 5000, 1) if quick else (3000, 50000, 3)
    peer = _measure_raw(num_calls, num_oneway, repeats)
    ours = anyio.run(_measure_actors, num_calls, num_oneway, repeats, backend="trio")
    return {"config": {"transport": "ipc", "payload_bytes": len(PAYLOAD), "num_calls": num_calls,
                       "num_oneway": num_oneway, "repeats": repeats, "tensor_bytes": TENSOR_BYTES},
            "results": ours, "peer": peer}
