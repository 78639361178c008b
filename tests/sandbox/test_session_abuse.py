"""Attacks that only sessions invite: state leaking between two sessions, a process left behind
after close, a fork bomb in one session while another works, the owner's death. (Every attack of test_abuse.py also
runs inside a session there; the network attacks are in test_network_allowlist.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from postrain.sandbox import Sandbox, SessionClosed, SessionFileError, SessionLimits, Status
from postrain.sandbox.policy import HOST_UID

LIMITS = SessionLimits(call_wall_time_s=8.0, call_cpu_time_s=4, memory_mb=160, max_processes=24,
                       work_dir_size_mb=8, max_file_size_mb=4)
VISIBLE = """
import json, os
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
print(json.dumps({"pids": [p for p in range(1, 32768) if alive(p) and p != os.getpid()],
                  "files": sorted(os.listdir("/work")), "state": sorted(os.listdir("/run/postrain")),
                  "env": sorted(os.environ)}))
"""


@pytest.fixture(scope="module")
def sandbox(small_policy):
    with Sandbox(small_policy, mode="cold", num_spare_sessions=2) as sb:
        sb.prewarm_sessions(LIMITS)
        yield sb


def in_thread(fn):
    results = []
    thread = threading.Thread(target=lambda: results.append(fn()))
    thread.start()
    return thread, results


def jail_processes(session) -> list[psutil.Process]:
    nsjail = psutil.Process(session._jail._proc.pid)
    return [nsjail, *nsjail.children(recursive=True)]


def test_no_state_leaks_between_two_sessions(sandbox):
    with sandbox.session(limits=LIMITS) as a, sandbox.session(limits=LIMITS) as b:
        a.run("echo secret > /work/a-secret && export A_TOKEN=a && mkdir -p d && cd d")
        busy, _ = in_thread(lambda: a.run("sleep 2 & sleep 2; wait"))
        while not a.in_call:
            pass
        seen = json.loads(b.run_python(VISIBLE).stdout)
        busy.join()
        assert seen["pids"] == [1]          # its own call's init only: none of A's processes
        assert seen["files"] == [] and seen["state"] == [] and "A_TOKEN" not in seen["env"]
        assert b.run("pwd").stdout == b"/work\n"
        a.run("true")
        for session in (a, b):  # between calls: only the next call's shell, waiting, knowing nothing
            assert_only_a_blank_shell_waits(session)
        assert a.run("cat /work/a-secret; pwd; echo $A_TOKEN").stdout == b"secret\n/work/d\na\n"


def assert_only_a_blank_shell_waits(session):
    """Of the code's uid, between calls, one process: the next call's shell, started ahead under
    the call's limits in a PID namespace of its own, its argv the same in every session, its
    environment only the policy's locale, blocked on a read."""
    agent = psutil.Process(session._jail._proc.pid).children()[0]
    deadline = time.monotonic() + 5
    while True:  # the agent starts the shell once it has replied; the last call's processes end
        try:
            shells = [p for p in jail_processes(session) if p.uids().real == HOST_UID]
            if (shells and shells[0].parent() == agent and shells[0].status() == psutil.STATUS_SLEEPING
                    or time.monotonic() > deadline):
                break
        except psutil.NoSuchProcess:  # one ended while we looked: look again
            pass
        time.sleep(0.01)
    assert len(shells) == 1
    shell = shells[0]
    locale = {k: v for k, v in dict(session._jail.policy.env).items() if k == "LANG" or k.startswith("LC_")}
    assert shell.parent() == agent and shell.name() == "bash" and shell.environ() == locale
    assert shell.cmdline()[1:4] == ["--noprofile", "--norc", "-c"] and "A_TOKEN" not in shell.cmdline()[4]
    assert shell.status() == psutil.STATUS_SLEEPING and shell.children() == []
    assert os.readlink(f"/proc/{shell.pid}/ns/pid") != os.readlink(f"/proc/{agent.pid}/ns/pid")
    limits = session.limits
    assert shell.rlimit(psutil.RLIMIT_CPU) == (limits.call_cpu_time_s, limits.call_cpu_time_s)
    assert shell.rlimit(psutil.RLIMIT_NPROC) == (limits.max_processes,) * 2
    assert shell.rlimit(psutil.RLIMIT_AS) == (limits.memory_mb << 20,) * 2
    with open(f"/proc/{shell.pid}/status") as f:
        status = dict(line.split(":", 1) for line in f)
    assert int(status["CapEff"], 16) == 0 and status["Seccomp"].strip() == "2"


def test_nothing_the_code_leaves_runs_between_calls(sandbox):
    """Variables that make a shell run code at its start (BASH_ENV; SHELLOPTS with xtrace and a
    PS4 that runs a command) do not reach the shell started ahead: it starts blank and takes
    the session's environment only once its call comes; the commands it starts get them."""
    with sandbox.session(limits=LIMITS) as s:
        s.write_file("hook.sh", "echo hook >> /work/ran\n")
        assert s.run("export BASH_ENV=/work/hook.sh PS4='$(echo ps4 >> /work/ran)'; set -x; "
                     "export SHELLOPTS; true").ok  # traced here: this call writes /work/ran
        assert s.run("rm /work/ran").ok
        time.sleep(0.3)
        with pytest.raises(SessionFileError, match="No such file"):
            s.read_file("ran")
        result = s.run("echo $BASH_ENV; bash -c true; cat /work/ran")
        assert result.stdout.startswith(b"/work/hook.sh\nhook\n"), result


def test_nothing_of_a_session_survives_close(sandbox):
    session = sandbox.session(limits=LIMITS)
    session.run("echo x > /work/file")
    busy, results = in_thread(lambda: _catch(lambda: session.run(
        "setsid sleep 60 & (trap '' TERM HUP; exec sleep 60) & sleep 60")))
    while not session.in_call:
        pass
    processes = jail_processes(session)
    while len(processes) < 6:   # nsjail, agent, init, bash, and its sleepers
        processes = jail_processes(session)
    session.close()
    busy.join(timeout=10)
    assert isinstance(results[0], SessionClosed) and results[0].reason == "closed"
    gone, alive = psutil.wait_procs(processes, timeout=5)
    assert alive == []
    with pytest.raises(SessionClosed):
        session.read_file("file")


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return exc


def test_a_fork_bomb_in_one_session_leaves_another_working(sandbox):
    with sandbox.session(limits=LIMITS) as bomb, sandbox.session(limits=LIMITS) as other:
        thread, results = in_thread(lambda: bomb.run(":(){ :|:& };:; sleep 4", timeout_s=4))
        while not bomb.in_call:
            pass
        outputs = [other.run(f"echo {i} && ls /usr/bin | wc -l > /dev/null && echo ok") for i in range(5)]
        assert bomb.in_call  # all five ran while the bomb went on
        thread.join()
        assert [r.status for r in outputs] == [Status.OK] * 5
        assert [r.stdout for r in outputs] == [f"{i}\nok\n".encode() for i in range(5)]
        assert results[0].status in (Status.TIMEOUT, Status.OK, Status.NONZERO_EXIT)
        assert bomb.run("echo survived").stdout == b"survived\n"  # and it ended with its call


def test_a_session_ends_when_its_owner_process_dies(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from postrain.sandbox import Policy, Sandbox
        sandbox = Sandbox(Policy(), mode="cold", num_spare_sessions=0)
        session = sandbox.session()
        session.run("echo x > /work/f")
        print(session._jail._proc.pid, flush=True)
        sys.stdin.read()  # until killed
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        nsjail = psutil.Process(int(owner.stdout.readline()))
        jail = [nsjail, *nsjail.children(recursive=True)]
        owner.kill()  # SIGKILL: no close, no atexit
        owner.wait()
        gone, alive = psutil.wait_procs(jail, timeout=10)
        assert alive == []  # the agent read EOF and exited; its namespaces took the rest
    finally:
        owner.kill()
        owner.wait()
