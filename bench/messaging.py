"""`postrain bench messaging`: actor messaging against raw pyzmq, in one run.

Ours: the head process asks an `EchoActor` (a real actor process started by
the supervisor) over ipc. Peer: a raw pyzmq PAIR socket ping-pong over ipc
with a plain blocking echo loop in a spawned process, same payloads. Both
servers sit on the same cores (the peer's is pinned to the cores the
scheduler gives the actor) and both clients are the bench's own process.
The two are measured in turn within each repeat (peer, then ours), so load
from other processes on the machine falls on both alike.

Figures (medians over repeats):
- rtt_p50_us, rtt_p99_us: small request/reply round trip (a 64-byte body);
- loop_floor_rtt_p50_us, loop_floor_rtt_p99_us (ours only): the same ping-pong
  over bare pyzmq PAIR sockets with both ends on a trio loop, waiting on the
  socket's descriptor, and no actor code: the least any event-loop actor can
  reach on this machine, measured in the same repeats;
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
from typing import cast

import anyio
import numpy as np
import torch
import zmq

from postrain.core import ActorSpec, Scheduler, Supervisor
from postrain.core.scheduler import Inventory
from postrain.core.testing import ECHO, NBYTES, NUM_TOLD, TOLD

PAYLOAD = b"x" * 64
TENSOR_BYTES = 64 << 20
NUM_BULK = 3   # tensor transfers per repeat


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- peer: raw pyzmq -----------------------------------------------------------

def _raw_echo_server(address: str, cpu_ids: list[int]) -> None:
    if cpu_ids:
        os.sched_setaffinity(0, cpu_ids)
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


def _trio_echo_server(address: str, cpu_ids: list[int]) -> None:
    if cpu_ids:
        os.sched_setaffinity(0, cpu_ids)
    import trio
    trio.run(_trio_echo, zmq.Context().socket(zmq.PAIR), address)


async def _trio_echo(sock: zmq.Socket, address: str) -> None:
    """Echo every message until "stop". Cancelled: the socket stays bound (the process ends)."""
    sock.bind(address)
    while True:
        frames = await _trio_recv(sock)
        if frames[0].bytes == b"stop":
            return
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)


async def _trio_recv(sock: zmq.Socket) -> list:
    """One message, waiting on the socket's descriptor. Cancelled: nothing was received."""
    import trio
    while True:
        if cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:  # an int option
            return sock.recv_multipart(zmq.NOBLOCK, copy=False)
        await trio.lowlevel.wait_readable(sock.FD)


class _EchoPeer:
    """A PAIR socket in this process connected to an echo server process pinned to `cpu_ids`."""

    def __init__(self, name: str, server, cpu_ids: list[int]):
        address = f"ipc://{tempfile.gettempdir()}/postrain-bench-{name}-{os.getpid()}.sock"
        self.server = multiprocessing.get_context("spawn").Process(target=server, args=(address, cpu_ids))
        self.server.start()
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()   # pyzmq types it Context[Never]
        self.sock = context.socket(zmq.PAIR)
        self.sock.connect(address)

    def close(self) -> None:
        try:
            self.sock.send(b"stop")
            self.server.join(timeout=10)
        finally:
            self.sock.close(linger=0)
            if self.server.is_alive():
                self.server.kill()


class _LoopFloor(_EchoPeer):
    """Bare pyzmq PAIR ping-pong with a trio loop at both ends (no actor code)."""

    def __init__(self, cpu_ids: list[int]):
        super().__init__("floor", _trio_echo_server, cpu_ids)

    async def round_trips(self, num_calls: int) -> list[float]:
        """Seconds per ping-pong. Cancelled: a ping may be left unanswered on the PAIR socket,
        so the peer is not reusable; close it."""
        sock, rtts = self.sock, []
        for _ in range(num_calls):
            start = time.perf_counter()
            sock.send(PAYLOAD, zmq.NOBLOCK)
            await _trio_recv(sock)
            rtts.append(time.perf_counter() - start)
        return rtts


class _RawPeer(_EchoPeer):
    """The raw pyzmq client (blocking calls, in this process) and its echo server process."""

    def __init__(self, cpu_ids: list[int]):
        super().__init__("raw", _raw_echo_server, cpu_ids)
        self.round_trips(200)  # warm up

    def round_trips(self, num_calls: int) -> list[float]:
        sock, rtts = self.sock, []
        for _ in range(num_calls):
            start = time.perf_counter()
            sock.send(PAYLOAD)
            sock.recv()
            rtts.append(time.perf_counter() - start)
        return rtts

    def oneway_rate(self, num_oneway: int) -> float:
        sock = self.sock
        start = time.perf_counter()
        sock.send_multipart([b"count", str(num_oneway).encode()])
        for _ in range(num_oneway):
            sock.send(PAYLOAD)
        sock.recv()
        return num_oneway / (time.perf_counter() - start)

    def bulk_seconds(self, tensor: np.ndarray) -> float:
        start = time.perf_counter()
        # numpy's stubs give ndarray __buffer__ on Python >= 3.12 only
        self.sock.send_multipart([b"bulk", memoryview(tensor)], copy=False)  # type: ignore[arg-type]
        self.sock.recv()
        return time.perf_counter() - start


# -- ours: actors --------------------------------------------------------------

async def actor_round_trips(ref, num_calls: int) -> list[float]:
    """Seconds per `echo` ask. Cancelled: no times; a request may still be answered, and dropped."""
    rtts = []
    for _ in range(num_calls):
        start = time.perf_counter()
        await ref.call(ECHO, PAYLOAD)
        rtts.append(time.perf_counter() - start)
    return rtts


async def actor_oneway_rate(ref, num_oneway: int) -> float:
    """Tells per second, counted by the actor. Cancelled: no rate; the tells sent still arrive."""
    before = await ref.call(NUM_TOLD)
    start = time.perf_counter()
    for _ in range(num_oneway):
        await ref.send(TOLD, PAYLOAD)
    after = await ref.call(NUM_TOLD)
    return (after - before) / (time.perf_counter() - start)


async def _actor_bulk_seconds(ref, tensor: torch.Tensor) -> float:
    """Seconds to send `tensor` and hear its size back. Cancelled: no time; an array written to
    shared memory stays there until the node closes."""
    start = time.perf_counter()
    nbytes = await ref.call(NBYTES, tensor)
    elapsed = time.perf_counter() - start
    assert nbytes == TENSOR_BYTES, nbytes
    return elapsed


async def _measure(num_calls: int, num_oneway: int, repeats: int) -> tuple[dict, dict]:
    """Our figures and the peers', `repeats` times each. Cancelled: the peers are closed
    (finally) and the echo actor stopped as the supervisor closes; no figures."""
    inventory = Inventory.detect()
    scheduler = Scheduler(Inventory(inventory.cpu_ids, inventory.memory_mb))
    ours: dict[str, list[float]] = {"rtts": [], "rates": [], "bulk": []}
    peer: dict[str, list[float]] = {"rtts": [], "rates": [], "bulk": []}
    floor_rtts: list[float] = []
    async with Supervisor.open(scheduler=scheduler) as supervisor:
        ref = await supervisor.start(ActorSpec(name="echo", cls="postrain.core.testing:EchoActor",
                                               cpus=1.0, memory_mb=0))
        cpu_ids = list(scheduler.placements["echo"].cpu_ids)
        raw, floor = _RawPeer(cpu_ids), _LoopFloor(cpu_ids)
        try:
            await actor_round_trips(ref, 200)  # warm up
            await floor.round_trips(200)
            tensor = torch.ones(TENSOR_BYTES // 4, dtype=torch.float32)
            for _ in range(repeats):
                # the peer's calls block this loop on purpose: nothing of ours runs meanwhile
                peer["rtts"] += raw.round_trips(num_calls)
                ours["rtts"] += await actor_round_trips(ref, num_calls)
                floor_rtts += await floor.round_trips(num_calls)
                peer["rates"].append(raw.oneway_rate(num_oneway))
                ours["rates"].append(await actor_oneway_rate(ref, num_oneway))
                for _ in range(NUM_BULK):
                    peer["bulk"].append(raw.bulk_seconds(tensor.numpy()))
                    ours["bulk"].append(await _actor_bulk_seconds(ref, tensor))
        finally:
            raw.close()
            floor.close()
    results = _figures(**ours)
    results["loop_floor_rtt_p50_us"] = round(_percentile(floor_rtts, 0.5) * 1e6, 1)
    results["loop_floor_rtt_p99_us"] = round(_percentile(floor_rtts, 0.99) * 1e6, 1)
    return results, _figures(**peer)


def _figures(rtts, rates, bulk) -> dict:
    return {"rtt_p50_us": round(_percentile(rtts, 0.5) * 1e6, 1),
            "rtt_p99_us": round(_percentile(rtts, 0.99) * 1e6, 1),
            "oneway_msgs_per_s": round(statistics.median(rates)),
            "tensor_64mib_ms": round(statistics.median(bulk) * 1e3, 2)}


def run(quick: bool = False) -> dict:
    num_calls, num_oneway, repeats = (500, 5000, 1) if quick else (1000, 20000, 5)
    ours, peer = anyio.run(_measure, num_calls, num_oneway, repeats, backend="trio")
    return {"config": {"transport": "ipc", "payload_bytes": len(PAYLOAD), "num_calls": num_calls,
                       "num_oneway": num_oneway, "repeats": repeats, "tensor_bytes": TENSOR_BYTES,
                       "order": "interleaved: peer, ours, loop floor within each repeat"},
            "results": ours, "peer": peer}
