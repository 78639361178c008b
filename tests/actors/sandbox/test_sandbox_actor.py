"""The sandbox actor in a real process, over real sockets, running real nsjail."""
from __future__ import annotations

import anyio
import pytest

from postrain.actors.records import (ExecReply, ExecRequest, ExecStreamItem, RunIoCasesReply, RunIoCasesRequest,
                                     RunTestsReply, RunTestsRequest, SandboxStats)
from postrain.actors.env.actor import RemoteSandbox
from postrain.core.testing import async_test
from postrain.core import ActorSpec, RemoteError, Supervisor
from postrain.sandbox import read_audit_log

SMALL = {"wall_time_s": 2.0, "cpu_time_s": 2, "memory_mb": 192, "max_processes": 24,
         "work_dir_size_mb": 8, "max_output_bytes": 65536}


def sandbox_spec(tmp_path, **options):
    options = {"num_workers": 2, "policy": SMALL, "audit_log": str(tmp_path / "audit.jsonl"), **options}
    return ActorSpec(name="sandbox", cls="postrain.actors.sandbox:SandboxActor", options=options,
                     cpus=0.5, memory_mb=0, start_timeout_s=60)


@async_test
async def test_exec_concurrent_stream_tests_and_audit(tmp_path):
    async with Supervisor.open() as sup:
        ref = await sup.start(sandbox_spec(tmp_path))
        reply = ExecReply.from_wire(await ref.ask("exec", ExecRequest("print(input() * 2)", stdin=b"ab\n").to_wire()))
        assert reply.status == "ok" and reply.stdout == b"abab\n" and reply.mode == "warm"

        results = {}

        async def one(i):
            results[i] = ExecReply.from_wire(await ref.ask("exec", ExecRequest(f"print({i} ** 2)").to_wire()))
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        assert {i: r.stdout for i, r in results.items()} == {i: f"{i * i}\n".encode() for i in range(6)}

        items = [ExecStreamItem.from_wire(item) async for item in ref.stream(
            "exec_stream", {"code": "import sys\nfor i in range(3):\n    print(i, flush=True)\n"})]
        assert [i.kind for i in items][-1] == "result" and items[-1].result.status == "ok"
        streamed = b"".join(i.data for i in items if i.kind == "output" and i.name == "stdout")
        assert streamed == items[-1].result.stdout == b"0\n1\n2\n"

        timeout = await ref.ask("exec", ExecRequest("while True: pass", limits={"wall_time_s": 0.5}).to_wire())
        assert ExecReply.from_wire(timeout).status == "timeout"

        report = RunTestsReply.from_wire(await ref.ask("run_tests", RunTestsRequest(
            solution="def sq(x):\n    return x * x\n",
            tests="from solution import sq\ndef test_a():\n    assert sq(3) == 9\n"
                  "def test_b():\n    assert sq(2) == 5\n").to_wire()))
        assert report.passed == {"test_a": True, "test_b": False} and report.result.status == "ok"
        cases = await ref.ask("run_io_cases", RunIoCasesRequest("print(int(input()) + 1)",
                                                                [["1", "2"], ["5", "7"]]).to_wire())
        assert RunIoCasesReply.from_wire(cases).passed == [True, False]

        stats = SandboxStats.from_wire(await ref.ask("stats"))
        assert stats.by_status["ok"] >= 10 and stats.by_status["timeout"] == 1
        assert stats.queued == 0 and stats.running == 0 and stats.workers == 2

    audit = read_audit_log(tmp_path / "audit.jsonl")
    assert len(audit) == stats.by_status["ok"] + stats.by_status["timeout"] + stats.by_status.get("nonzero_exit", 0)
    assert all(entry["requester"] and len(entry["sha256"]) == 64 for entry in audit)


@async_test
async def test_bad_requests_come_back_typed_and_the_actor_keeps_serving(tmp_path):
    async with Supervisor.open() as sup:
        ref = await sup.start(sandbox_spec(tmp_path, num_workers=1))
        with pytest.raises(RemoteError, match="limits may set only"):
            await ref.ask("exec", {"code": "pass", "limits": {"enable_network": True}})
        with pytest.raises(RemoteError, match="wall_time_s must be a finite number > 0"):
            await ref.ask("exec", {"code": "pass", "limits": {"wall_time_s": -1}})
        with pytest.raises(RemoteError, match="ExecRequest travels as a dict, got str"):
            await ref.ask("exec", "print(1)")
        with pytest.raises(RemoteError, match=r"ExecRequest.code must be of type str, got int 1"):
            await ref.ask("exec", {"code": 1})
        with pytest.raises(RemoteError, match="stats takes no body"):
            await ref.ask("stats", {"verbose": True})
        assert (await ref.ask("exec", {"code": "print('still serving')"}))["stdout"] == b"still serving\n"


@async_test
async def test_sessions_over_the_wire_with_cap_owner_check_and_audit(tmp_path):
    from postrain.actors.sandbox.client import remote_session
    spec = sandbox_spec(tmp_path, num_workers=1, max_sessions_per_worker=1,
                        session_limits={"call_wall_time_s": 3.0, "memory_mb": 128})
    async with Supervisor.open() as sup:
        ref = await sup.start(spec)
        async with remote_session(ref, files={"data/n.txt": b"20\n"}) as s:
            await s.run("cd data && export N=$(cat n.txt)")
            result = await s.run_python("import os; print(int(os.environ['N']) + 1, os.getcwd())")
            assert result.status == "ok" and result.stdout == b"21 /work/data\n" and result.mode == "session"
            assert await s.write_file("data/out.txt", "x") == 1
            assert await s.read_file("/work/data/out.txt") == b"x"
            assert (await s.run("sleep 5", timeout_s=0.3)).status == "timeout"

            # the cap (1 worker x 1 session): a second open waits, counted as queued
            second = {}

            async def open_second():
                async with remote_session(ref) as other:
                    second["pwd"] = (await other.run("pwd")).stdout
            async with anyio.create_task_group() as tg:
                tg.start_soon(open_second)
                while (await ref.ask("stats"))["queued"] < 1:
                    await anyio.sleep(0.02)
                stats = await ref.ask("stats")
                assert stats["open_sessions"] == 1 and stats["max_sessions"] == 1
                await ref.ask("session_close", {"session_id": s.session_id})
            assert second["pwd"] == b"/work\n"
            with pytest.raises(RemoteError, match="UnknownSession: no open session"):
                await s.run("true")
        with pytest.raises(RemoteError, match="exactly one of 'command'"):
            async with remote_session(ref) as s:
                await ref.ask("session_exec", {"session_id": s.session_id, "command": "ls", "code": "1"})
        with pytest.raises(RemoteError, match="unknown session limit"):
            await ref.ask("session_open", {"limits": {"disk": 1}})
        assert (await ref.ask("stats"))["open_sessions"] == 0
    kinds = [entry["kind"] for entry in read_audit_log(tmp_path / "audit.jsonl")]
    assert kinds.count("session_open") == kinds.count("session_close") == 3
    assert kinds.count("session_call") == 4  # commands and snippets; file calls are not commands


@async_test
async def test_the_reaper_closes_sessions_whose_episode_vanished(tmp_path):
    async with Supervisor.open() as sup:
        ref = await sup.start(sandbox_spec(tmp_path, num_workers=1, session_idle_timeout_s=0.4))
        opened = await ref.ask("session_open", {})
        assert (await ref.ask("stats"))["open_sessions"] == 1
        with anyio.fail_after(20):
            while (await ref.ask("stats"))["open_sessions"]:
                await anyio.sleep(0.1)
        with pytest.raises(RemoteError, match="UnknownSession"):
            await ref.ask("session_exec", {"session_id": opened["session_id"], "command": "true"})
    closes = [e for e in read_audit_log(tmp_path / "audit.jsonl") if e["kind"] == "session_close"]
    assert [e["reason"] for e in closes] == ["reaped"]


class RecordingRef:
    """A sandbox actor's reference that records how long each call of a session may wait."""

    def __init__(self, ref):
        self.ref, self.timeouts = ref, {}

    async def call(self, kind, request=None, timeout_s=30.0):
        self.timeouts[kind.name] = timeout_s
        return await self.ref.call(kind, request, timeout_s=timeout_s)


@async_test
async def test_a_session_whose_calls_wait_for_a_worker_is_neither_reaped_nor_given_up(tmp_path):
    from postrain.actors.sandbox.client import ASK_SLACK_S, remote_session
    async with Supervisor.open() as sup:
        ref = await sup.start(sandbox_spec(tmp_path, num_workers=1, session_idle_timeout_s=0.4))
        recording = RecordingRef(ref)
        async with remote_session(recording) as s:
            async with anyio.create_task_group() as tg:
                # the one worker is busy for 3 s: the session's calls queue behind it, past its idle timeout
                tg.start_soon(ref.ask, "exec", ExecRequest("import time; time.sleep(3)",
                                                           limits={"wall_time_s": 10.0}).to_wire())
                while (await ref.ask("stats"))["running"] < 1:
                    await anyio.sleep(0.02)
                result = await s.run("echo alive > note.txt; cat note.txt")
                assert await s.write_file("more.txt", b"x") == 1 and await s.read_file("note.txt") == b"alive\n"
                graded = await RemoteSandbox(recording).exec("print(6 * 7)", timeout_s=5.0)   # as a grader runs
            assert result.status == "ok" and result.stdout == b"alive\n" and graded.stdout == b"42\n"
        # every call that takes a worker waits for one as long as a command does (a busy pool's queue)
        waits = {name: recording.timeouts[name] for name in ("session_exec", "session_read_file", "session_write_file",
                                                              "exec")}
        assert all(wait >= ASK_SLACK_S for wait in waits.values()), waits
    closes = [e for e in read_audit_log(tmp_path / "audit.jsonl") if e["kind"] == "session_close"]
    assert [e["reason"] for e in closes] == ["closed"]        # by its episode, not the reaper


@pytest.mark.slow
@async_test
async def test_the_balancer_grows_the_pool_for_sessions_waiting_to_open(tmp_path):
    from postrain.actors.sandbox.client import remote_session
    from postrain.cli.balancer import Balancer
    from postrain.cli.config import BalancerSection
    from postrain.core import Inventory, Scheduler
    config = BalancerSection(interval_s=0.2, grow_when_queued=1, grow_after_ticks=1, shrink_after_idle_s=60,
                             min_workers=1, max_workers=3, worker_cpus=0.1)
    scheduler = Scheduler(Inventory(cpu_ids=(0, 1), memory_mb=4096))
    async with Supervisor.open(scheduler=scheduler, heartbeat_interval_s=0.2) as sup:
        ref = await sup.start(sandbox_spec(tmp_path, num_workers=1, max_sessions_per_worker=1,
                                           num_spare_sessions=1))
        balancer = Balancer(sup, config)
        outputs = []

        async def episode(i):
            async with remote_session(ref) as s:
                outputs.append((await s.run(f"sleep 0.6; echo {i}")).stdout)

        async with anyio.create_task_group() as tg:
            tg.start_soon(balancer.run)
            with anyio.fail_after(60):
                async with anyio.create_task_group() as episodes:
                    for i in range(3):
                        episodes.start_soon(episode, i)
            tg.cancel_scope.cancel()
        grows = [d for d in balancer.decisions if d.action == "grow"]
        assert grows and grows[0].figures["queued"] >= 1, balancer.decisions
        assert sorted(outputs) == [b"0\n", b"1\n", b"2\n"]
        stats = await ref.ask("stats")
        assert stats["workers"] >= 2 and stats["max_sessions"] == stats["workers"]
