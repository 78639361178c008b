"""Shared fixtures for the sandbox tests: real nsjail, small limits, host-state probes."""
from __future__ import annotations

import os

import psutil
import pytest

from postrain.sandbox import Policy, Sandbox, SessionLimits
from postrain.sandbox.policy import HOST_UID

# Set before any worker starts: a host secret that must never be visible inside.
os.environ["POSTRAIN_CANARY_SECRET"] = "canary-7f3a"

# wall_time_s: a snippet's start takes seconds on a loaded 2-core machine; the limits under test
# are the CPU, memory and process ones (timeouts are tested with their own wall limits).
SMALL = Policy(wall_time_s=5.0, cpu_time_s=1, memory_mb=160, max_processes=24,
               max_file_size_mb=4, work_dir_size_mb=8, max_open_files=32, max_output_bytes=64 * 1024)


def sandbox_processes_on_host() -> list[int]:
    """Host pids running as the sandbox's host uid, except those in a jail that another process
    tree started (another run or bench on this machine): ours, and orphans, which have left
    their jail (what the tests look for), count."""
    me = os.getpid()
    pids = []
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info.get("uids")
        if uids is not None and HOST_UID in (uids.real, uids.effective) and not _in_anothers_jail(proc, me):
            pids.append(proc.pid)
    return pids


def _in_anothers_jail(proc: psutil.Process, me: int) -> bool:
    """Whether `proc` is under an nsjail whose starter is neither this process nor below it."""
    try:
        ancestors = proc.parents()
        jail = next((i for i, parent in enumerate(ancestors) if parent.name() == "nsjail"), None)
        if jail is None:
            return False
        starters = ancestors[jail + 1:]
        return me not in {parent.pid for parent in starters}
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def small_policy() -> Policy:
    return SMALL


@pytest.fixture(scope="session")
def host_sandbox_pids():
    return sandbox_processes_on_host


@pytest.fixture(scope="session")
def warm_sandbox():
    with Sandbox(SMALL, mode="warm", num_workers=1) as sandbox:
        yield sandbox


@pytest.fixture(scope="session")
def cold_sandbox():
    with Sandbox(SMALL, mode="cold") as sandbox:
        yield sandbox


class SessionAttacks:
    """The abuse suite's third mode: each `run` is a Python snippet in a new session of `sandbox`
    whose limits are the policy's; `current` is the latest one (the suite probes and closes it)."""

    mode = "session"

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.current = None

    def run(self, code: str, *, policy: Policy | None = None, stdin: bytes = b""):
        policy = policy or self.sandbox.policy
        if self.current is not None:
            self.current.close()
        self.current = self.sandbox.session(limits=session_limits(policy))
        return self.current.run_python(code, stdin=stdin)


def session_limits(policy: Policy) -> SessionLimits:
    """The SessionLimits that match a policy's limits."""
    return SessionLimits(call_wall_time_s=policy.wall_time_s, call_cpu_time_s=policy.cpu_time_s,
                         call_max_output_bytes=policy.max_output_bytes, memory_mb=policy.memory_mb,
                         max_processes=policy.max_processes, work_dir_size_mb=policy.work_dir_size_mb,
                         max_file_size_mb=policy.max_file_size_mb, max_open_files=policy.max_open_files)


@pytest.fixture(scope="session")
def session_sandbox():
    with Sandbox(SMALL, mode="cold", num_spare_sessions=1) as sandbox:
        sandbox.prewarm_sessions(session_limits(SMALL))
        yield SessionAttacks(sandbox)


@pytest.fixture(params=["warm", "cold"])
def sandbox(request, warm_sandbox, cold_sandbox):
    return warm_sandbox if request.param == "warm" else cold_sandbox
