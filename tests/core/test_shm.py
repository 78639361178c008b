"""Shared-memory files in /dev/shm (core/shm.py): who may read them, and the clean-up of what a
killed process left, which names a run's files by its run tag (issue 32)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess

import pytest

from postrain.core import shm
from postrain.core.supervisor import run_tag_for

pytestmark = pytest.mark.skipif(shm.SHM_DIR is None, reason="no /dev/shm on this host")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_segments_are_readable_by_their_user_only(monkeypatch):
    monkeypatch.setenv(shm.RUN_TAG_ENV, "t" * 12)
    path = shm.write_segment(b"x" * 4096)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.stat(path).st_uid == os.geteuid()
    finally:
        shm.cleanup_shm()


def test_sweep_leaves_what_it_cannot_remove_and_says_so(caplog):
    """A directory, or another user's file, named like a dead writer's file of the run: the sweep
    (which a head runs as it opens) neither crashes nor removes them; it logs what it left."""
    tag, pid = os.urandom(6).hex(), _dead_pid()
    ours = os.path.join(shm.SHM_DIR, f"postrain-{pid}-{tag}_aa")
    a_dir = os.path.join(shm.SHM_DIR, f"postrain-{pid}-{tag}_bb")
    foreign = os.path.join(shm.SHM_DIR, f"postrain-{pid}-{tag}_cc")
    with open(ours, "wb"):
        pass
    os.mkdir(a_dir)
    with open(foreign, "wb"):
        pass
    try:
        if os.geteuid() == 0:
            os.chown(foreign, 54321, 54321)  # another local user's file
        with caplog.at_level(logging.WARNING, logger="postrain.core"):
            assert shm.sweep_shm(tag) == 1
            assert shm.remove_shm_of(pid) == 0
        assert not os.path.exists(ours)
        assert os.path.isdir(a_dir)
        assert os.path.exists(foreign) or os.geteuid() != 0
        assert a_dir in caplog.text and "not a regular file" in caplog.text
        if os.geteuid() == 0:
            assert foreign in caplog.text and "owned by uid 54321" in caplog.text
    finally:
        shutil.rmtree(a_dir, ignore_errors=True)
        for path in (ours, foreign):
            if os.path.exists(path):
                os.unlink(path)


def test_run_tag_is_kept_with_the_folder_and_not_predictable_from_its_path(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    tag = run_tag_for(str(folder))
    assert tag == run_tag_for(str(folder)), "a resumed head must find what a killed one left"
    assert tag != hashlib.sha1(str(folder).encode()).hexdigest()[:12]
    secrets = [p for p in folder.iterdir()]
    assert len(secrets) == 1 and stat.S_IMODE(secrets[0].stat().st_mode) == 0o600
    shutil.rmtree(folder)
    folder.mkdir()
    assert run_tag_for(str(folder)) != tag, "the same path names another run: another tag"
