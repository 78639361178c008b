"""Shared test settings, the `gpu` marker's skip rule, and `small_disk`: a real full disk for the
tests of full-disk behaviour."""
import logging
import subprocess

import pytest


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
