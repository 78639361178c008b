"""Shared fixtures for the sandbox tests: real nsjail, small limits, host-state probes."""
from __future__ import annotations

import os

import psutil
import pytest

from postrain.sandbox import Policy, Sandbox
from postrain.sandbox.policy import HOST_UID

# Set before any worker starts: a host secret that must never be visible inside.
os.environ["POSTRAIN_CANARY_SECRET"] = "canary-7f3a"

SMALL = Policy(wall_time_s=1.5, cpu_time_s=1, memory_mb=160, max_processes=24,
               max_file_size_mb=4, work_dir_size_mb=8, max_open_files=32, max_output_bytes=64 * 1024)


def sandbox_processes_on_host() -> list[int]:
    """Host pids running as the sandbox's host uid (there must be none between runs)."""
    pids = []
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info.get("uids")
        if uids is not None and HOST_UID in (uids.real, uids.effective):
            pids.append(proc.pid)
    return pids


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


@pytest.fixture(params=["warm", "cold"])
def sandbox(request, warm_sandbox, cold_sandbox):
    return warm_sandbox if request.param == "warm" else cold_sandbox
