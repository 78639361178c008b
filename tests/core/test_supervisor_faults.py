"""Faults around an actor's life, with real processes: a kill or a silence before READY, a slow
setup, a stopped (SIGSTOP) actor, and what a dead actor leaves (children, shared memory)."""
import os
import signal

import anyio
import pytest

from postrain.core import ActorSpec, ActorStartError, Supervisor
from postrain.core.testing import assert_nothing_left, async_test, leftovers
from postrain.core.shm import process_lives

ECHO = "postrain.core.testing:EchoActor"


def spec(name, **kw):
    kw.setdefault("cpus", 0.25)
    kw.setdefault("memory_mb", 0)
    kw.setdefault("restart_backoff_s", 0.05)
    kw.setdefault("cls", ECHO)
    return ActorSpec(name=name, **kw)


async def wait_until(predicate, timeout_s=20.0):
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.02)


async def wait_in_setup(sup, name):
    """Until actor `name`'s heartbeats say its slow setup runs; its pid then."""
    await wait_until(lambda: name in sup.records and sup.records[name].note.startswith("loading"))
    return sup.records[name].pid


@async_test
async def test_a_start_killed_by_a_signal_before_ready_is_started_again_within_the_budget():
    async with Supervisor.open(heartbeat_interval_s=0.2) as sup:
        async with anyio.create_task_group() as tg:
            started = []

            async def start():
                started.append(await sup.start(spec("gen", options={"setup_s": 2})))
            tg.start_soon(start)
            first_pid = await wait_in_setup(sup, "gen")
            os.kill(first_pid, signal.SIGKILL)  # the OOM killer during a model load
        [ref] = started
        record = sup.records["gen"]
        assert record.state == "running" and record.restarts == 1 and record.pid != first_pid
        assert [e.event for e in sup.events] == ["exited", "restarting", "started"]
        assert "killed by signal SIGKILL before READY" in sup.events[0].detail
        assert await ref.ask("echo", 1) == 1


@async_test
async def test_a_start_that_fails_by_itself_fails_once_with_its_error():
    async with Supervisor.open() as sup:
        with pytest.raises(ActorStartError) as caught:
            await sup.start(spec("bad", max_restarts=3, options={"fail_setup": True}))
        assert caught.value.reason == ("exited with code 1 before READY: RuntimeError: setup failed on "
                                       "purpose (options.fail_setup)")
        assert sup.records["bad"].incarnation == 1, "no retry: it would fail the same way"
        assert sup.events == []


@async_test
async def test_a_slow_setup_that_keeps_heartbeating_outlives_start_timeout_s():
    async with Supervisor.open(heartbeat_interval_s=0.2) as sup:
        ref = await sup.start(spec("slow", start_timeout_s=4, options={"setup_s": 6}))
        assert sup.records["slow"].incarnation == 1, "the load was not taken for a hang"
        assert await ref.ask("echo", "up") == "up"


SLOW_IMPORT = """
import time
time.sleep(6)  # an actor module whose imports are slow (torch on a loaded machine)
from postrain.core.testing import EchoActor
"""


@async_test
async def test_an_import_slower_than_start_timeout_s_still_starts_because_the_process_beats_meanwhile(
        tmp_path, monkeypatch):
    (tmp_path / "slow_import_actor.py").write_text(SLOW_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned process starts with this sys.path
    async with Supervisor.open(heartbeat_interval_s=0.2) as sup:
        ref = await sup.start(spec("slow", cls="slow_import_actor:EchoActor", start_timeout_s=4))
        assert sup.records["slow"].incarnation == 1, "the import was not taken for a hang"
        assert await ref.ask("echo", "up") == "up"


@async_test
async def test_a_start_that_goes_silent_is_killed_after_start_timeout_s_and_counts_against_the_budget():
    async with Supervisor.open(heartbeat_interval_s=0.2) as sup:
        async with anyio.create_task_group() as tg:
            async def start():
                with pytest.raises(ActorStartError, match="went silent for .* before READY \\(last doing: "
                                                          "loading for 60.0 s\\), over start_timeout_s = 4"):
                    await sup.start(spec("stuck", start_timeout_s=4, max_restarts=0, options={"setup_s": 60}))
            tg.start_soon(start)
            pid = await wait_in_setup(sup, "stuck")
            os.kill(pid, signal.SIGSTOP)  # a node hiccup: the process is there but does nothing
        await wait_until(lambda: not process_lives(pid))


@async_test
async def test_a_stopped_actor_is_found_by_missed_heartbeats_and_restarted():
    async with Supervisor.open(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0) as sup:
        ref = await sup.start(spec("echo"))
        first_pid = sup.records["echo"].pid
        os.kill(first_pid, signal.SIGSTOP)
        event = await sup.wait_for_event("echo", "hung", timeout_s=10)
        assert "no heartbeat" in event.detail
        await sup.wait_running("echo", timeout_s=20, min_restarts=1)
        assert sup.records["echo"].pid != first_pid and await ref.ask("echo", 2) == 2


@async_test
async def test_a_handler_that_blocks_the_loop_inside_keep_alive_is_not_hung():
    async with Supervisor.open(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0) as sup:
        ref = await sup.start(spec("loader"))
        assert await ref.ask("block_alive", {"s": 2.5}, timeout_s=10) == "done"
        assert [e.event for e in sup.events] == ["started"], "no hang, no restart"


@async_test
async def test_a_dead_actors_children_and_shared_memory_go_with_it_and_a_closed_run_leaves_nothing():
    async with Supervisor.open(heartbeat_interval_s=0.2) as sup:
        ref = await sup.start(spec("sandbox"))
        child = await ref.ask("spawn_child")            # an nsjail worker stands for it
        segment = await ref.ask("leave_shm", {"n": 1 << 20})
        assert os.path.exists(segment) and os.path.basename(segment).split("-")[2].startswith(sup.run_tag)
        found = leftovers(sup.run_tag)
        assert len(found.processes) == 2 and segment in found.segments  # (and the sender's pooled ones)
        os.kill(sup.records["sandbox"].pid, signal.SIGKILL)  # the actor alone, as the OOM killer does
        await sup.wait_running("sandbox", min_restarts=1)
        await wait_until(lambda: not process_lives(child))
        assert not any(path in leftovers(sup.run_tag).segments for path in found.segments)
        await ref.ask("spawn_child")
        await ref.ask("leave_shm", {"n": 1 << 20})
        run_tag = sup.run_tag
    assert_nothing_left(run_tag)


@async_test
async def test_a_killed_sandbox_actor_takes_its_nsjail_workers_and_their_jails_with_it():
    import psutil
    policy = {"wall_time_s": 60.0, "cpu_time_s": 60, "memory_mb": 192, "max_processes": 24,
              "work_dir_size_mb": 8, "max_output_bytes": 65536}
    sandbox = spec("sandbox", cls="postrain.actors.sandbox:SandboxActor", cpus=0.5,
                   options={"num_workers": 2, "policy": policy})
    async with Supervisor.open(heartbeat_interval_s=0.2) as sup:
        ref = await sup.start(sandbox)
        async with anyio.create_task_group() as tg:
            async def busy():  # a worker in the middle of an execution when its actor dies
                try:
                    await ref.ask("exec", {"code": "import time\ntime.sleep(60)"}, timeout_s=60)
                except Exception:
                    pass
            tg.start_soon(busy)
            actor = psutil.Process(sup.records["sandbox"].pid)
            await wait_until(lambda: len(actor.children(recursive=True)) >= 4)  # 2 nsjails, their jails
            await anyio.sleep(0.5)  # the execution is under way
            jailed = [p.pid for p in actor.children(recursive=True)]
            os.kill(actor.pid, signal.SIGKILL)  # the actor alone, as the OOM killer does
            await wait_until(lambda: not any(process_lives(pid) for pid in jailed), timeout_s=10)
            await sup.wait_running("sandbox", min_restarts=1, timeout_s=60)
            tg.cancel_scope.cancel()
        run_tag = sup.run_tag
    assert_nothing_left(run_tag)
