"""Supervision with real processes: restarts after kill -9, in-flight requests, hangs, give-up, stop."""
import os
import signal

import anyio
import pytest

from postrain.core import (ActorDiedError, ActorSpec, ActorTimeoutError, AuthenticationError, CurveKeys, Load,
                           Supervisor)
from postrain.core import LOOKUP, RESIZE, ActorLocation, LoadError, Lookup, ResizeRequest
from postrain.core.node import Node
from postrain.core.testing import async_test

ECHO = "postrain.core.testing:EchoActor"


def spec(name, **kw):
    kw.setdefault("cpus", 0.25)
    kw.setdefault("memory_mb", 0)
    kw.setdefault("restart_backoff_s", 0.05)
    kw.setdefault("cls", ECHO)
    return ActorSpec(name=name, **kw)


@async_test
async def test_kill_9_under_load_fails_in_flight_requests_and_the_actor_is_restarted():
    async with Supervisor.open() as sup:
        ref = await sup.start(spec("echo"))
        first_pid = sup.records["echo"].pid
        outcomes = []

        async def caller():
            try:
                outcomes.append(await ref.ask("sleep", {"s": 5}, timeout_s=20))
            except ActorDiedError as exc:
                outcomes.append(exc)
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(caller)
            while (sup.records["echo"].load or Load()).in_flight < 20 and len(outcomes) == 0:
                await anyio.sleep(0.05)  # wait until the actor reports the requests in its heartbeat
            with anyio.fail_after(3):  # typed errors arrive promptly, long before the 20 s timeout
                os.kill(first_pid, signal.SIGKILL)
                while len(outcomes) < 20:
                    await anyio.sleep(0.01)
        assert all(isinstance(o, ActorDiedError) for o in outcomes), outcomes
        await sup.wait_running("echo", min_restarts=1)
        assert sup.records["echo"].pid != first_pid and sup.records["echo"].restarts == 1
        assert any(e.event == "exited" and "SIGKILL" in e.detail for e in sup.events)
        assert await ref.ask("echo", "back") == "back", "the same ref reconnects to the new process"


@async_test
async def test_an_actor_that_keeps_dying_is_given_up_after_max_restarts():
    async with Supervisor.open() as sup:
        await sup.start(spec("echo", max_restarts=1))
        sup.kill("echo")
        await sup.wait_for_event("echo", "started")
        sup.kill("echo")
        event = await sup.wait_for_event("echo", "gave_up")
        assert "max_restarts = 1" in event.detail
        assert sup.records["echo"].state == "failed"
        assert "echo" not in sup.scheduler.placements, "a failed actor's cores are freed"


@async_test
async def test_a_hung_actor_is_detected_by_missing_heartbeats_and_restarted():
    # a heartbeat timeout of 15 intervals: a busy machine that delays a live actor's beats by a
    # second or two does not make its restart look hung too (the bounds below are waits, not figures)
    async with Supervisor.open(heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0) as sup:
        ref = await sup.start(spec("echo"))
        with pytest.raises(ActorTimeoutError):
            await ref.ask("hang", {"s": 60}, timeout_s=0.5)
        event = await sup.wait_for_event("echo", "hung", timeout_s=30)
        assert "no heartbeat" in event.detail
        await sup.wait_running("echo", timeout_s=60)
        assert await ref.ask("echo", 1) == 1


@async_test
async def test_stop_is_a_message_then_a_bounded_wait_then_a_kill():
    async with Supervisor.open() as sup:
        await sup.start(spec("polite"))
        await sup.stop("polite")
        assert sup.records["polite"].process.exitcode == 0
        ref2 = await sup.start(spec("stuck", stop_timeout_s=0.5))
        async with anyio.create_task_group() as tg:
            async def block():
                try:
                    await ref2.ask("hang", {"s": 30}, timeout_s=5)
                except Exception:
                    pass
            tg.start_soon(block)
            await anyio.sleep(0.2)
            await sup.stop("stuck")
        assert sup.records["stuck"].process.exitcode == -signal.SIGKILL
        assert [e.event for e in sup.events if e.name == "stuck"] == ["started", "stopped"], "no restart"


@async_test
async def test_registry_lookup_lets_actors_find_each_other_without_the_head_on_the_data_path():
    async with Supervisor.open() as sup:
        await sup.start(spec("a"))
        await sup.start(spec("b"))
        head = sup.node.ref(sup.address, "head")
        found = await head.call(LOOKUP, Lookup("b"))
        assert found == ActorLocation(sup.records["b"].address, same_node=True,   # its own actor
                                      server_key=None)                          # no keys: no Curve
        assert found.address != sup.address
        sup.add_peers({"elsewhere": "tcp://192.0.2.9:5555"})     # another supervisor's: another node
        assert await head.call(LOOKUP, Lookup("elsewhere")) == ActorLocation("tcp://192.0.2.9:5555", same_node=False)
        status = await head.ask("status")
        assert {a["name"] for a in status["actors"]} == {"a", "b"}


@async_test
async def test_curve_refuses_a_peer_without_an_accepted_key_and_accepts_the_runs_key():
    keys = CurveKeys.generate()
    async with Supervisor.open(keys=keys) as sup:
        ref = await sup.start(spec("public", bind="tcp://0.0.0.0:0"))
        assert ref.address.startswith("tcp://")
        assert await ref.ask("echo", "trusted") == "trusted"
        stranger_keys = CurveKeys.generate()
        stranger_keys = CurveKeys(keys.server_public, b"", stranger_keys.client_public,
                                  stranger_keys.client_secret)
        async with Node("stranger", stranger_keys) as stranger:
            with pytest.raises(AuthenticationError, match="refused our CurveZMQ key") as info:
                await stranger.ref(ref.address, "public", server_key=ref.server_key).ask("echo", "x", timeout_s=10)
        # the fix it names exists: no keys file in the run folder (issue 32), the allowlist does
        assert "run_dir/keys" not in str(info.value) and "allowed_client_keys" in str(info.value)


@async_test
async def test_an_actor_on_loopback_tcp_answers_the_run_and_not_another_local_user():
    async with Supervisor.open(keys=CurveKeys.generate()) as sup:
        ref = await sup.start(spec("local", bind="tcp://127.0.0.1:0"))
        assert await ref.ask("echo", "trusted") == "trusted"
        async with Node("local-user", None) as stranger:   # plain tcp, as any local user can
            with pytest.raises(ActorTimeoutError):
                await stranger.ref(ref.address).ask("echo", "x", timeout_s=3)


@async_test
async def test_heartbeats_carry_a_typed_load_and_a_pool_resizes_by_the_kernels_message():
    async with Supervisor.open(heartbeat_interval_s=0.1) as sup:
        ref = await sup.start(spec("pool", cls="postrain.core.testing:PoolEchoActor"))
        with anyio.fail_after(10):
            while sup.records["pool"].load is None:
                await anyio.sleep(0.05)
        load = sup.records["pool"].load
        assert isinstance(load, Load) and load.is_pool and load.workers == 1 and load.figures == {"note": "mine"}
        assert sup.status()["actors"][0]["load"]["figures"] == {"note": "mine"}, "status carries the wire form"
        assert (await ref.call(RESIZE, ResizeRequest(3))).to_wire() == {"num_workers": 3, "previous": 1}
        with anyio.fail_after(10):
            while sup.records["pool"].load.workers != 3:
                await anyio.sleep(0.05)


@async_test
async def test_an_actor_whose_load_is_not_a_load_record_fails_naming_the_fix():
    async with Supervisor.open(heartbeat_interval_s=0.1) as sup:
        await sup.start(spec("bad", cls="postrain.core.testing:BadLoadActor", max_restarts=0))
        event = await sup.wait_for_event("bad", "gave_up", timeout_s=20)
        assert "must return a postrain.core.Load, got dict" in sup.records["bad"].last_exit, event


def test_a_load_record_refuses_what_the_wire_cannot_carry():
    with pytest.raises(LoadError, match=r"load.queued must be an int >= 0 or None, got -1"):
        Load(queued=-1)
    with pytest.raises(LoadError, match=r"load.figures\['x'\] = \[1\]: keys must be str"):
        Load(figures={"x": [1]})
    with pytest.raises(LoadError, match=r"unknown fields \['sandbox_queued'\]; .* belong in load.figures"):
        Load.from_wire({"sandbox_queued": 3})
    with pytest.raises(LoadError, match="resize needs an int num_workers >= 1, got 0"):
        ResizeRequest.from_wire({"num_workers": 0})
    load = Load(served=2, queued=1, workers=4, backpressure="", figures={"k": 1.5})
    assert Load.from_wire(load.to_wire()) == load and "running" not in load.to_wire()


@async_test
async def test_actor_logs_are_readable_by_the_runs_user_only(tmp_path):
    """An actor's log (its stdout and stderr) is 0600, also where an earlier run left it 0644
    (issue 32)."""
    import stat

    stale = tmp_path / "old.log"
    stale.write_text("earlier run\n")
    stale.chmod(0o644)
    async with Supervisor.open(log_dir=str(tmp_path)) as sup:
        await sup.start(spec("new"))
        await sup.start(spec("old"))
        for name in ("new", "old"):
            assert stat.S_IMODE(os.stat(sup.log_path(name)).st_mode) == 0o600, name
