"""What one run (or session call) leaves in kernel state that no file or process shows: the
security review's probes (issue 32), each in real nsjail.

- IPC: a SysV shared-memory segment one warm run makes is not there for the next run in the same
  worker (each run and each session call gets its own IPC namespace), and so holds no memory
  after its run.
- Cold runs: the task folder on the host (hidden tests) is readable by the jail's user only.
- Session agent: the jail's root, which runs the session agent, cannot make a read-only host
  mount writable (still open: an xfail that turns into a failure once fixed).
"""
from __future__ import annotations

import json
import os
import textwrap


from postrain.sandbox import Sandbox, Status

from .conftest import SMALL, session_limits

# shmget/shmat through libc (no sysv_ipc module needed): run 1 makes a segment with a fixed key
# and writes into it; a later run looks the key up.
_SHM = textwrap.dedent("""
    import ctypes, json, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    KEY, IPC_CREAT = 0x5057, 0o1000
    mode = sys.argv[1] if len(sys.argv) > 1 else MODE
    if mode == "make":
        shm_id = libc.shmget(KEY, 4096, IPC_CREAT | 0o666)
        assert shm_id >= 0, os.strerror(ctypes.get_errno())
        addr = libc.shmat(shm_id, None, 0)
        ctypes.memmove(addr, b"left-by-run-1", 13)
        print(json.dumps({"made": shm_id}))
    else:
        shm_id = libc.shmget(KEY, 0, 0)
        seen = None
        if shm_id >= 0:
            addr = libc.shmat(shm_id, None, 0)
            if addr not in (None, 2**64 - 1):
                seen = ctypes.string_at(addr, 13).decode(errors="replace")
        print(json.dumps({"found": shm_id >= 0, "seen": seen, "errno": ctypes.get_errno()}))
""")


def _shm_code(mode: str) -> str:
    return f"MODE = {mode!r}\n" + _SHM


def test_warm_runs_do_not_share_sysv_shm():
    with Sandbox(SMALL, mode="warm", num_workers=1) as sb:
        first = sb.run(_shm_code("make"))
        assert first.status is Status.OK, first.stderr
        second = sb.run(_shm_code("look"))
        assert second.status is Status.OK, second.stderr
    seen = json.loads(second.stdout)
    assert not seen["found"], f"run 2 saw run 1's shared memory: {seen}"


def test_session_calls_and_sessions_do_not_share_sysv_shm():
    with Sandbox(SMALL, mode="cold", num_spare_sessions=0) as sb:
        limits = session_limits(SMALL)
        with sb.session(limits=limits) as s:
            made = s.run_python(_shm_code("make"))
            assert made.status is Status.OK, made.stderr
            later_call = json.loads(s.run_python(_shm_code("look")).stdout)
        with sb.session(limits=limits) as other:
            other_session = json.loads(other.run_python(_shm_code("look")).stdout)
    assert not later_call["found"], f"a later call saw the segment: {later_call}"
    assert not other_session["found"], f"another session saw the segment: {other_session}"


def test_cold_task_files_are_readable_by_the_jails_user_only(cold_sandbox, tmp_path):
    """The task folder (main.py and the task's files: hidden tests) exists on the host while the
    run goes; no other local user may read it (issue 32). Inspected while the code runs."""
    import glob
    import stat
    import tempfile

    marker = os.urandom(8).hex()
    seen = {}

    def inspect(name, chunk):
        if seen:
            return
        for task in glob.glob(os.path.join(tempfile.gettempdir(), "postrain-cold-*", "task")):
            try:
                with open(os.path.join(task, "main.py")) as f:
                    if marker not in f.read():
                        continue
            except OSError:
                continue
            found = [os.path.dirname(task)] + glob.glob(task + "/**", recursive=True)
            seen.update({os.path.normpath(path): os.lstat(path) for path in found})

    code = f"# {marker}\nprint(open('hidden/deep/test_x.py').read())"
    result = cold_sandbox.run(code, files={"hidden/deep/test_x.py": b"assert 1"}, on_output=inspect)
    assert result.status is Status.OK and result.stdout == b"assert 1\n", result.stderr
    assert len(seen) == 6, sorted(seen)  # run dir, task, main.py, hidden/, deep/, test_x.py
    for path, info in seen.items():
        assert stat.S_IMODE(info.st_mode) & 0o077 == 0, f"{path} is {oct(info.st_mode)}"


# The session agent's (and warm zygote's) position: the jail's root, with its namespace
# capabilities. Run as that root in a jail of the same flags, it tries to make a read-only mount
# of a host folder (0700, host root's) writable and write into it.
_REMOUNT = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
    target = sys.argv[1].encode()
    rc = libc.mount(None, target, None, MS_REMOUNT | MS_BIND, None)
    print("remount", rc, os.strerror(ctypes.get_errno()) if rc else "ok")
    try:
        with open(os.path.join(sys.argv[1], "written-by-jail-root"), "w") as f:
            f.write("x")
        print("wrote")
    except OSError as exc:
        print("refused", exc.strerror)
""")


def test_jail_root_cannot_make_a_read_only_host_mount_writable(tmp_path):
    import subprocess

    from postrain.sandbox.policy import Policy, nsjail_argv

    secret_dir = tmp_path / "ro"
    secret_dir.mkdir(mode=0o700)
    policy = Policy(readonly_mounts=Policy().readonly_mounts + (str(secret_dir),))
    argv = nsjail_argv(policy, cold=False) + [policy.python, "-I", "-S", "-c", _REMOUNT, str(secret_dir)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert "remount" in out.stdout, out.stderr
    assert not (secret_dir / "written-by-jail-root").exists(), out.stdout


def test_the_warm_zygote_and_the_session_agent_are_not_host_root(warm_sandbox, session_sandbox):
    """The warm zygote and the session agent (jail root, with its namespace capabilities) are an
    unprivileged host uid (HOST_ROOT_UID), the code they start another (HOST_UID)."""
    import psutil

    from postrain.sandbox.policy import HOST_ROOT_UID, HOST_UID

    warm_sandbox.run("print(1)")
    session = session_sandbox.sandbox.session(limits=session_limits(SMALL))
    try:
        assert session.run("true").exit_code == 0
        def still_there(read):   # a short-lived jail may end between the listing and the read
            try:
                return read()
            except psutil.NoSuchProcess:
                return None

        jails = [p for p in psutil.Process().children(recursive=True) if still_there(p.name) == "nsjail"]
        inside = [child for jail in jails for child in still_there(jail.children) or []]
        uids = {process: ids for process in inside if (ids := still_there(process.uids)) is not None}
        assert len(jails) >= 2 and uids, [still_there(p.cmdline) for p in jails]
        for process, ids in uids.items():
            assert ids.real in (HOST_ROOT_UID, HOST_UID) and ids.effective != 0, still_there(process.cmdline)
        assert any(ids.real == HOST_ROOT_UID for ids in uids.values())      # the zygote, the agent
    finally:
        session.close()
