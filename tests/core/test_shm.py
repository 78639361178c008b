"""Shared-memory files in /dev/shm (core/shm.py): who may read them, who may name one to a receiver
and what a receiver maps, and the clean-up of what a killed process left, which names a run's files
by its run tag (issue 32)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import stat
import subprocess
import uuid

import psutil
import pytest
import torch

from postrain.core import CurveKeys, RemoteError, inbox, shm
from postrain.core.inbox import Handler, Inbox
from postrain.core.node import Node
from postrain.core.supervisor import run_tag_for
from postrain.core.testing import async_test
from postrain.core.wire import WireError

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


def test_a_receiver_maps_only_this_users_regular_files_and_leaves_anything_else_in_place(tmp_path):
    """A name in /dev/shm may be anyone's: a link to another file, a FIFO, another user's file
    (as root: a file given to another uid). The receiver opens without following links, checks
    what it opened, and refuses (WireError) before it unlinks or maps anything."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 16)
    names = {kind: os.path.join(shm.SHM_DIR, f"postrain-0-{uuid.uuid4().hex}-{kind}")
             for kind in ("link", "fifo", "foreign")}
    os.symlink(target, names["link"])
    os.mkfifo(names["fifo"], 0o600)
    with open(names["foreign"], "wb") as f:
        f.write(b"x" * 16)
    refusals = {"link": "not a file of ours", "fifo": "not a regular file"}
    if os.geteuid() == 0:
        os.chown(names["foreign"], 54321, 54321)   # another local user's file
        refusals["foreign"] = "owned by uid 54321"
    try:
        for kind, why in refusals.items():
            with pytest.raises(WireError, match=why):
                shm.map_segment(names[kind], 16, "uint8", [16])
            assert os.path.lexists(names[kind]), f"the refused {kind} was left in place"
        assert target.read_bytes() == b"x" * 16
    finally:
        for path in names.values():
            if os.path.lexists(path):
                os.unlink(path)


def _this_hosts_ipv4_beyond_loopback() -> str | None:
    return next((nic.address for nics in psutil.net_if_addrs().values() for nic in nics
                 if nic.family == socket.AF_INET and not nic.address.startswith("127.")), None)


@async_test
async def test_an_inbox_beyond_loopback_takes_a_shared_memory_handle_from_this_host_only(monkeypatch):
    """On a cluster every actor binds tcp on its node's address, and a caller the registry places on
    the same node sends tensors through /dev/shm (same_node): that inbox maps a handle when the
    connection comes from one of this host's addresses, and refuses it (MalformedMessage) from any
    other host, which is simulated here by the inbox's view of the caller's address."""
    host = _this_hosts_ipv4_beyond_loopback()
    if host is None:
        pytest.skip("this host has no address beyond loopback")
    run = CurveKeys.generate()
    tensor = torch.ones(1 << 19)   # 2 MiB: through /dev/shm

    async def size(body):
        return body.numel()
    async with Node("receiver", run) as node:
        local = Inbox(node, f"tcp://{host}:0", {"size": Handler(size)})
        node.spawn(local.serve)
        near = node.ref(local.bound_address, "local", same_node=True)
        assert await near.ask("size", tensor, timeout_s=30) == tensor.numel()
        monkeypatch.setattr(inbox, "is_this_hosts_address", lambda ip: False)
        far = Inbox(node, f"tcp://{host}:0", {"size": Handler(size)})
        node.spawn(far.serve)
        with pytest.raises(RemoteError, match="refused a shared-memory array .* may be on another host"):
            await node.ref(far.bound_address, "far", same_node=True).ask("size", tensor, timeout_s=30)
    shm.cleanup_shm()
