"""Actors over real processes and real sockets: request/reply, tell, streams, errors, both loops."""
import os
import subprocess
import sys

import anyio
import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from postrain.core.testing import async_test
from postrain.core import (ActorSpec, ActorStartError, ActorTimeoutError, RemoteError,
                           MessageKind, Supervisor, handler)
from postrain.core.actor import Actor

ECHO = "postrain.core.testing:EchoActor"


def spec(name, cls=ECHO, **kw):
    kw.setdefault("cpus", 0.25)
    kw.setdefault("memory_mb", 0)
    return ActorSpec(name=name, cls=cls, **kw)


@async_test
async def test_request_reply_tell_and_stream_between_processes():
    async with Supervisor.open() as sup:
        ref = await sup.start(spec("echo"))
        assert sup.records["echo"].pid != os.getpid()
        body = {"text": "hi", "ids": np.arange(5, dtype=np.int32), "t": torch.ones(3, 2)}
        got = await ref.ask("echo", body)
        assert got["text"] == "hi" and got["ids"].tolist() == [0, 1, 2, 3, 4]
        assert torch.equal(got["t"], torch.ones(3, 2))
        for _ in range(10):
            await ref.tell("told", None)
        assert await ref.ask("num_told") == 10  # handlers run in arrival order
        assert [item["i"] async for item in ref.stream("count", {"n": 5})] == [0, 1, 2, 3, 4]
        big = torch.randn(1 << 19)  # 2 MiB: crosses through shared memory
        assert await ref.ask("sum_array", big) == pytest.approx(float(big.sum()), rel=1e-4)


@async_test
async def test_concurrent_requests_are_matched_to_their_replies():
    async with Supervisor.open() as sup:
        ref = await sup.start(spec("echo"))
        results = {}

        async def call(i):
            results[i] = await ref.ask("echo", i)
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(call, i)
        assert results == {i: i for i in range(200)}
        # concurrent handlers overlap: ten 0.3 s sleeps finish well before 3 s of serial time
        with anyio.fail_after(2.5):
            async with anyio.create_task_group() as tg:
                for _ in range(10):
                    tg.start_soon(ref.ask, "sleep", {"s": 0.3})


@async_test
async def test_handler_errors_and_unknown_kinds_come_back_typed_and_the_actor_keeps_serving():
    async with Supervisor.open() as sup:
        ref = await sup.start(spec("echo"))
        with pytest.raises(RemoteError, match="ValueError: failed on purpose") as info:
            await ref.ask("fail", "boom")
        assert info.value.error_type == "ValueError" and "Traceback" in info.value.remote_traceback
        with pytest.raises(RemoteError, match="UnknownKind: no handler for message kind 'nope'"):
            await ref.ask("nope")
        assert await ref.ask("echo", 1) == 1


@async_test
async def test_malformed_frames_get_a_typed_error_reply_and_the_actor_keeps_serving():
    async with Supervisor.open() as sup:
        ref = await sup.start(spec("echo"))
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(ref.address)
        try:
            broken = [msgpack.packb(["echo", 9, 0, "raw", None,
                                     msgpack.ExtType(1, msgpack.packb([1, "float32", [100], False]))]),
                      b"\x00" * 12]  # truncated array frame
            for frames in ([b"\xc1garbage"], broken):
                raw.send_multipart(frames)
                with anyio.fail_after(10):
                    while not raw.poll(0):
                        await anyio.sleep(0.01)
                reply = msgpack.unpackb(raw.recv())
                assert reply[0] == "_error" and reply[5]["type"] == "MalformedMessage"
            assert reply[2] == 9, "the error reply names the broken request"
            assert "truncated" in reply[5]["message"]
        finally:
            raw.close()
        assert await ref.ask("echo", "still here") == "still here"


@pytest.fixture(scope="module")
def echo_in_background():
    """An echo actor process, and a portal into the trio loop (in a thread) that supervises it."""
    from anyio.from_thread import start_blocking_portal
    with start_blocking_portal(backend="trio") as portal:
        manager = portal.wrap_async_context_manager(Supervisor.open())
        sup = manager.__enter__()
        try:
            ref = portal.call(sup.start, spec("echo"))
            yield portal, ref
        finally:
            manager.__exit__(None, None, None)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.lists(st.binary(max_size=40), min_size=1, max_size=3), min_size=1, max_size=6))
def test_arbitrary_bytes_sent_to_an_actor_never_crash_it(echo_in_background, messages):
    portal, ref = echo_in_background
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(ref.address)
    try:
        for frames in messages:
            raw.send_multipart(frames)
        for _ in messages:  # every message gets an error reply (or none, for a valid tell)
            if not raw.poll(2000):
                break
            reply = msgpack.unpackb(raw.recv_multipart()[0])
            assert reply[0] in ("_error", "_reply")
    finally:
        raw.close()
    assert portal.call(lambda: ref.ask("echo", "alive", timeout_s=10)) == "alive"


@async_test
async def test_asyncio_actor_with_uvloop_speaks_the_same_protocol():
    async with Supervisor.open() as sup:
        ref = await sup.start(spec("aecho", cls="postrain.core.testing:AsyncioEchoActor"))
        assert await ref.ask("loop") == "uvloop"
        assert (await ref.ask("echo", np.arange(3))).tolist() == [0, 1, 2]
        assert [item["i"] async for item in ref.stream("count", {"n": 3})] == [0, 1, 2]
        with pytest.raises(RemoteError, match="ValueError"):
            await ref.ask("fail")


@async_test
async def test_a_request_times_out_with_a_typed_error_when_the_actor_is_busy():
    async with Supervisor.open() as sup:
        ref = await sup.start(spec("echo"))
        with pytest.raises(ActorTimeoutError, match="no reply from actor echo .* within 0.3 s"):
            await ref.ask("hang", {"s": 1.5}, timeout_s=0.3)


@async_test
async def test_setup_failure_reports_the_actors_traceback():
    async with Supervisor.open() as sup:
        with pytest.raises(ActorStartError, match="(?s)exited with code 1 before READY.*setup failed on purpose") as info:
            await sup.start(spec("broken", options={"fail_setup": True}))
        assert (info.value.actor, info.value.cls) == ("broken", "postrain.core.testing:EchoActor")
        assert info.value.reason == ("exited with code 1 before READY: RuntimeError: setup failed on purpose "
                                     "(options.fail_setup)"), "one line: how it ended and the error"
        assert "Traceback" in info.value.traceback
        with pytest.raises(ActorStartError, match="has no attribute 'Missing'") as info:
            await sup.start(spec("missing", cls="postrain.core.testing:Missing"))
        assert info.value.reason.endswith("ImportError: module postrain.core.testing has no attribute 'Missing' "
                                          "(from 'postrain.core.testing:Missing')")
        assert sup.scheduler.placements == {}, "a failed start releases its placement"


def test_handler_declarations_are_checked():
    with pytest.raises(TypeError, match="must be `async def`"):
        handler(MessageKind("x"))(lambda self, body: None)
    with pytest.raises(TypeError, match="handler\\(\\) takes a MessageKind"):
        handler("x")
    with pytest.raises(ValueError, match="reserved"):
        @handler(MessageKind("_x"))
        async def h(self, body):
            return None

    class Both(Actor):
        @handler(MessageKind("a"))
        async def a(self, body, msg):
            return msg.sender
    assert set(Both._handler_specs) == {"a"}


HEAD_SCRIPT = """
import anyio
from postrain.core import ActorSpec, Supervisor

async def main():
    async with Supervisor.open() as sup:
        await sup.start(ActorSpec(name="echo", cls="postrain.core.testing:EchoActor", cpus=0.1, memory_mb=0))
        print(sup.records["echo"].pid, flush=True)
        await anyio.sleep(600)   # the head idles until the test kills it

anyio.run(main, backend="trio")
"""


def test_an_actor_dies_with_its_head_even_when_the_head_is_killed_with_sigkill():
    import signal
    import subprocess
    import sys

    import psutil

    head = subprocess.Popen([sys.executable, "-c", HEAD_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        actor = psutil.Process(int(head.stdout.readline()))
        head.send_signal(signal.SIGKILL)
        head.wait(timeout=30)
        actor.wait(timeout=30)   # raises psutil.TimeoutExpired while the orphan lives
    finally:
        head.kill()
        head.stdout.close()


_REUSE_PROBE = """
import resource, sys, threading
from postrain.core.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
faults = []
def step():                        # as a learner's compute thread: a large block, freed, again
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = bytearray(64 * 2**20)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del block
thread = threading.Thread(target=step)
thread.start()
thread.join()
print(faults[-1])
"""


@pytest.mark.parametrize("mode", ["keep", "default"])
def test_an_actor_that_keeps_freed_memory_reuses_large_blocks_without_faulting(mode):
    """A learner's process (keeps_freed_memory) reuses a freed 64 MiB block as it is: the second
    allocation in a compute thread faults in no page; by default glibc maps it afresh (16k pages)."""
    out = subprocess.run([sys.executable, "-c", _REUSE_PROBE, mode], capture_output=True, text=True,
                         check=True)
    faults = int(out.stdout)
    if mode == "keep":
        assert faults < 100, f"{faults} page faults on reusing a freed block"
    else:
        assert faults > 10_000, f"only {faults} page faults: the probe no longer shows glibc's default"
