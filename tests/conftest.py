"""Shared test settings, the `gpu` marker's skip rule, `small_disk`: a real full disk for the
tests of full-disk behaviour, and `rank_processes`: the ranks of a gloo group as real processes."""
import compileall
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest


def pytest_sessionstart(session):
    """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, as on some CI images), each of the
    hundreds of processes the suite starts (actors, `postrain` commands) would compile postrain's
    modules from source again, about 0.4 s of CPU each; compiled once here, they are read instead
    (Python checks each file's bytecode against its source, so an edit is never missed)."""
    if sys.flags.dont_write_bytecode:
        root = Path(__file__).resolve().parent.parent
        for name in ("actors", "bench", "cli", "core", "ext", "sandbox", "tests"):
            compileall.compile_dir(root / name, quiet=1, workers=0)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, with the reason, where torch sees no CUDA GPU."""
    import torch
    if torch.cuda.is_available():
        return
    reason = "needs a CUDA GPU (torch here: " + ("a CPU build)" if torch.version.cuda is None else "no GPU visible)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _quiet_logs():
    logging.getLogger("postrain.core").setLevel(logging.ERROR)
    yield


@pytest.fixture
def small_disk(tmp_path):
    """mount(size_kb) -> a folder on a fresh tmpfs of that size (a disk that really fills up:
    writes fail with ENOSPC), unmounted after the test. Skips where mounting is not permitted
    (it needs root, or CAP_SYS_ADMIN in a user namespace)."""
    mounted = []

    def mount(size_kb: int):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"a full disk is simulated with a tmpfs, and mounting one is not permitted here "
                        f"({result.stderr.strip() or result.returncode}); run as root to include this test")
        mounted.append(folder)
        return folder
    try:
        yield mount
    finally:
        for folder in reversed(mounted):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def run_rank_processes(args: list[list[str]], timeout_s: float = 300) -> list[str]:
    """One `python ARGS` process per rank (one thread each), all at once; their stdouts, once
    every one exited 0 (else the test fails with the first failing rank's stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, *map(str, rank_args)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank_args in args]
    try:
        logs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (_, stderr)) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank}: {stderr[-3000:]}"
    return [stdout for stdout, _ in logs]


@pytest.fixture(scope="session")
def rank_processes():
    """run_rank_processes (above), for tests that start a process group's ranks."""
    return run_rank_processes
