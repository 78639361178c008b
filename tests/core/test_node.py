"""ActorRef's reply reading: callers that read the socket themselves (leader/follower) and
the reaper's drain between calls, over a real actor process."""
import anyio
import pytest

from postrain.core import ActorDiedError, ActorSpec, Supervisor
from postrain.core.testing import async_test

ECHO = "postrain.core.testing:EchoActor"


@async_test
async def test_a_cancelled_reader_leaves_the_reference_working_for_other_callers():
    async with Supervisor.open() as sup:
        ref = await sup.start(ActorSpec(name="echo", cls=ECHO, cpus=0.25, memory_mb=0))
        results = []

        async def follower():
            results.append(await ref.ask("sleep", {"s": 0.3}, timeout_s=10))

        async with anyio.create_task_group() as tg:
            with anyio.move_on_after(0.1) as scope:  # the first caller reads replies, then leaves
                tg.start_soon(follower)
                await ref.ask("sleep", {"s": 1.0}, timeout_s=10)
            assert scope.cancelled_caught
        assert results == ["slept"]
        assert await ref.ask("echo", "after", timeout_s=10) == "after"
        assert not ref._reading and not ref._followers and not ref._pending


@async_test
async def test_stream_items_that_arrive_while_the_consumer_is_busy_do_not_time_out():
    async with Supervisor.open() as sup:
        ref = await sup.start(ActorSpec(name="echo", cls=ECHO, cpus=0.25, memory_mb=0))
        items = []
        async for item in ref.stream("count", {"n": 4}, timeout_s=0.5):
            items.append(item["i"])
            await anyio.sleep(0.3)  # slower, in all, than the per-item timeout
        assert items == [0, 1, 2, 3]


async def _many_callers_share_one_reference():
    async with Supervisor.open() as sup:
        ref = await sup.start(ActorSpec(name="echo", cls=ECHO, cpus=0.25, memory_mb=0))
        got = {}

        async def call(i):
            got[i] = await ref.ask("echo", i, timeout_s=10)
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(call, i)
        assert got == {i: i for i in range(50)}
        assert [item["i"] async for item in ref.stream("count", {"n": 3})] == [0, 1, 2]


def test_many_callers_share_one_reference_on_asyncio_with_uvloop():
    anyio.run(_many_callers_share_one_reference, backend="asyncio",
              backend_options={"use_uvloop": True})


@async_test
async def test_a_rebound_reference_fails_what_was_in_flight_and_reaches_the_new_address():
    """An actor started again elsewhere (a cluster node lost): references to it follow."""
    async with Supervisor.open() as sup:
        old = await sup.start(ActorSpec(name="old", cls=ECHO, cpus=0.25, memory_mb=0))
        new = await sup.start(ActorSpec(name="new", cls=ECHO, cpus=0.25, memory_mb=0))
        ref = sup.node.ref(old.address, "moving")
        assert await ref.ask("pid", timeout_s=10) == sup.records["old"].pid
        async with anyio.create_task_group() as tg:
            failures = []

            async def in_flight():
                try:
                    await ref.ask("sleep", {"s": 5}, timeout_s=10)
                except ActorDiedError as exc:
                    failures.append(str(exc))
            tg.start_soon(in_flight)
            await anyio.sleep(0.3)
            assert sup.node.rebind("moving", new.address) == 1
        assert failures and "moved from" in failures[0]
        await sup.stop("old")     # the old address's connection drops: it does not touch the new one
        assert await ref.ask("pid", timeout_s=10) == sup.records["new"].pid
        assert sup.node.rebind("moving", new.address) == 0      # already there

        # a request still waiting for a connection (its actor gone) was never sent: it goes where
        # the actor is started again, without failing
        assert sup.node.rebind("moving", old.address) == 1
        # libzmq drops the pipe to the address left behind in its io thread; a request queued
        # before that would still leave through it (sent, so failed by the next rebind)
        await anyio.sleep(0.5)
        async with anyio.create_task_group() as tg:
            pids = []

            async def waiting():
                pids.append(await ref.ask("pid", timeout_s=10))
            tg.start_soon(waiting)
            await anyio.sleep(0.3)
            assert not pids
            sup.node.rebind("moving", new.address)
        assert pids == [sup.records["new"].pid]


@async_test
async def test_a_peer_gone_for_good_fails_its_requests_at_once_and_is_no_longer_found():
    """An actor lost with its cluster node and placed nowhere again: its references are closed,
    so a request in flight or one waiting for a connection fails now, not at its timeout."""
    async with Supervisor.open() as sup:
        echo = await sup.start(ActorSpec(name="echo", cls=ECHO, cpus=0.25, memory_mb=0))
        sup.add_peers({"far": echo.address, "nowhere": "tcp://127.0.0.1:9"})
        far, nowhere = sup.node.ref(echo.address, "far"), sup.node.ref("tcp://127.0.0.1:9", "nowhere")
        failures = []

        async def ask(ref, body):
            try:
                await ref.ask("sleep", body, timeout_s=60)
            except ActorDiedError as exc:
                failures.append((ref.name, str(exc)))
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask, far, {"s": 30})        # sent, its reply still to come
                tg.start_soon(ask, nowhere, {"s": 0})     # never connected
                await anyio.sleep(0.3)
                sup.remove_peers({"far": "its node was lost", "nowhere": "its node was lost"})
        assert sorted(name for name, _ in failures) == ["far", "nowhere"]
        assert all("closed" in message for _, message in failures)
        with pytest.raises(KeyError, match="no actor named 'far'"):
            sup.ref("far")
