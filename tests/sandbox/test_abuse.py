"""The abuse suite: each attack, in real nsjail, warm, cold and inside a session.

For every attack: it ends in the expected status, the host is unchanged (no process of the
sandbox uid left, no file written outside the jail), and, in warm mode, the next run in the SAME
worker is clean (empty work dir, no leftover process, limits and environment as configured); in
a session, the session still serves and its next call finds no process of the attack.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import textwrap

import pytest

from postrain.sandbox import Status

HOST_MARKERS = ["/tmp/postrain-pwned", "/root/postrain-pwned", "/postrain-pwned",
                "/usr/postrain-pwned", "/dev/shm/postrain-pwned"]

# Run after each attack in the same warm worker: must find a pristine run.
PROBE = textwrap.dedent("""
    import json, os, errno
    def alive(pid):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    others = [p for p in range(1, 4096) if alive(p) and p != os.getpid()]
    block = bytearray(32 * 1024 * 1024)  # memory is available again
    with open("probe.txt", "w") as f:
        f.write("x")
    print(json.dumps({"files": sorted(os.listdir(".")), "others": others, "uid": os.getuid(),
                      "env": sorted(os.environ), "fds": sorted(int(x) for x in os.listdir("/dev/fd"))
                      if os.path.isdir("/dev/fd") else None}))
""")


@pytest.fixture(params=["warm", "cold", "session"])
def sandbox(request, warm_sandbox, cold_sandbox, session_sandbox):
    """Every attack in each mode: a warm worker, a cold jail, a call inside a session."""
    return {"warm": warm_sandbox, "cold": cold_sandbox, "session": session_sandbox}[request.param]


@pytest.fixture(autouse=True)
def host_stays_clean(host_sandbox_pids):
    """After every attack: no sandboxed process outlived its run, nothing was written on the host."""
    before = set(host_sandbox_pids())  # another run's warm workers on this host are not ours
    yield
    assert set(host_sandbox_pids()) <= before, "a sandboxed process outlived its run"
    for path in HOST_MARKERS:
        assert not os.path.exists(path), f"the code wrote {path} on the host"


def check_next_run_clean(sandbox):
    if sandbox.mode == "session":
        check_session_survives_clean(sandbox.current)
    if sandbox.mode != "warm":
        return
    worker = sandbox._pool.workers[0]
    restarts = worker.num_restarts
    result = sandbox.run(PROBE)
    assert result.status is Status.OK, result.stderr
    probe = json.loads(result.stdout)
    assert probe["files"] == ["probe.txt"]          # nothing left in /work by the previous run
    assert probe["others"] == [1]                    # only this run's init: no leftover process
    assert probe["uid"] == 1000
    assert "POSTRAIN_CANARY_SECRET" not in probe["env"]
    assert worker.num_restarts == restarts           # the attack did not take the worker down


def check_session_survives_clean(session):
    """The attacked session still serves, and its next call finds no process of the attack, the
    sandbox uid, no host environment; once its files are removed, its /work is whole again."""
    assert session.run("rm -rf /work/* /work/.[!.]*").status is Status.OK
    result = session.run_python(PROBE)
    assert result.status is Status.OK, result.stderr
    probe = json.loads(result.stdout)
    assert probe["files"] == ["probe.txt"] and probe["others"] == [1] and probe["uid"] == 1000
    assert "POSTRAIN_CANARY_SECRET" not in probe["env"]
    session.close()


def attack(sandbox, code, **kwargs):
    return sandbox.run(textwrap.dedent(code), **kwargs)


def test_fork_bomb(sandbox):
    result = attack(sandbox, """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    # The pids limit stops the forking; the forked interpreters then spin until the wall limit,
    # or fill the memory limit first where they dirty their copied pages faster than the clock
    # runs out (seen on a loaded machine). Either way a limit ended it and nothing leaked.
    assert result.status in (Status.TIMEOUT, Status.MEMORY_LIMIT), result
    check_next_run_clean(sandbox)


def test_memory_bomb(sandbox):
    result = attack(sandbox, """
        blocks = []
        while True:
            blocks.append(bytearray(8 * 1024 * 1024))
    """)
    assert result.status is Status.MEMORY_LIMIT
    check_next_run_clean(sandbox)


def test_cpu_spin(sandbox, small_policy):
    result = attack(sandbox, "while True:\n    pass\n", policy=small_policy.replace(wall_time_s=30.0))
    assert result.status is Status.TIMEOUT
    assert result.signal in (signal.SIGXCPU, signal.SIGKILL)  # RLIMIT_CPU (1 s) ended it
    assert result.wall_s < 30.0
    check_next_run_clean(sandbox)


def test_sleep_past_wall_limit(sandbox):
    result = attack(sandbox, "import time\ntime.sleep(60)\n")
    assert result.status is Status.TIMEOUT
    assert result.wall_s < 10
    check_next_run_clean(sandbox)


def test_fill_the_disk(sandbox):
    result = attack(sandbox, """
        i = 0
        while True:
            with open(f"fill{i}", "wb") as f:
                f.write(b"x" * (1024 * 1024))
            i += 1
    """)
    assert result.status is Status.NONZERO_EXIT
    assert b"No space left on device" in result.stderr
    check_next_run_clean(sandbox)


def test_one_huge_file(sandbox):
    result = attack(sandbox, "open('big', 'wb').write(b'x' * (6 * 1024 * 1024))\n")
    assert result.status is Status.NONZERO_EXIT
    assert b"File too large" in result.stderr or b"No space left" in result.stderr
    check_next_run_clean(sandbox)


def test_stdout_flood(sandbox, small_policy):
    result = attack(sandbox, """
        import sys
        chunk = "x" * 65536
        while True:
            sys.stdout.write(chunk)
    """, policy=small_policy.replace(wall_time_s=10.0))
    assert result.status is Status.OUTPUT_TRUNCATED
    assert result.stdout_truncated and len(result.stdout) == small_policy.max_output_bytes
    assert result.wall_s < 10.0  # killed on the flood, not at the wall limit
    check_next_run_clean(sandbox)


def test_network_egress(sandbox):
    result = attack(sandbox, """
        import socket
        outcomes = {}
        try:
            socket.create_connection(("1.1.1.1", 80), timeout=0.5)
            outcomes["tcp"] = "connected"
        except OSError as exc:
            outcomes["tcp"] = type(exc).__name__
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"x", ("8.8.8.8", 53))
            outcomes["udp"] = "sent"
        except OSError as exc:
            outcomes["udp"] = type(exc).__name__
        try:
            socket.getaddrinfo("example.com", 80)
            outcomes["dns"] = "resolved"
        except OSError as exc:
            outcomes["dns"] = type(exc).__name__
        outcomes["interfaces"] = [name for _, name in socket.if_nameindex()]
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=0.5)
            outcomes["loopback"] = "up"
        except ConnectionRefusedError:
            outcomes["loopback"] = "up"  # something answered: lo is up
        except OSError as exc:
            outcomes["loopback"] = type(exc).__name__
        print(outcomes)
    """)
    assert result.status is Status.OK, result.stderr
    outcomes = eval(result.stdout)  # noqa: S307 - our own dict literal
    assert outcomes["tcp"] != "connected" and outcomes["udp"] != "sent"
    assert outcomes["dns"] != "resolved"
    assert outcomes["interfaces"] in ([], ["lo"]) and outcomes["loopback"] != "up"  # lo stays down
    check_next_run_clean(sandbox)


def test_read_host_secrets(sandbox, small_policy):
    result = attack(sandbox, """
        import hashlib, os
        found = {}
        for path in ("/etc/shadow", "/etc/passwd", "/proc/1/environ", "/root/.bash_history",
                     "/root/.ssh/id_rsa", "/work/main/README.md"):
            try:
                found[path] = hashlib.sha256(open(path, "rb").read()).hexdigest()
            except OSError:
                pass
        print(repr((found, sorted(os.listdir("/root")), sorted(os.environ))))
    """)
    assert result.status is Status.OK, result.stderr
    found, root_listing, env = eval(result.stdout)  # noqa: S307
    assert set(found) <= {"/etc/passwd"}  # a session's own passwd names the sandbox user
    for path, digest in found.items():
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() != digest, f"the host's {path} was read"
    assert root_listing == [".pyenv"] or root_listing == []  # only the Python prefix's path
    assert "POSTRAIN_CANARY_SECRET" not in env
    assert set(env) == {key for key, _ in small_policy.env}
    check_next_run_clean(sandbox)


def test_write_outside_work_dir(sandbox):
    result = attack(sandbox, f"""
        written = []
        for path in {HOST_MARKERS!r} + ["/task/x", "/bin/x", "/etc/x", "/x"]:
            try:
                open(path, "w").write("pwned")
                written.append(path)
            except OSError:
                pass
        print(written)
    """)
    assert result.status is Status.OK, result.stderr
    assert result.stdout.strip() == b"[]"
    check_next_run_clean(sandbox)


def test_list_host_processes(sandbox):
    result = attack(sandbox, """
        import os
        try:
            print(len(os.listdir("/proc")))
        except OSError:
            print("no /proc")
        visible = []
        for pid in range(1, 4096):
            try:
                os.kill(pid, 0)
                visible.append(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                visible.append(pid)
        print(len(visible))
    """)
    assert result.status is Status.OK, result.stderr
    proc_line, num_visible = result.stdout.decode().split()[-2:] if b"no /proc" not in result.stdout \
        else ("no /proc", result.stdout.split()[-1].decode())
    assert proc_line == "no /proc"
    assert int(num_visible) <= 2  # its own PID namespace: init (and itself)
    check_next_run_clean(sandbox)


def test_signal_the_supervisor(sandbox):
    result = attack(sandbox, """
        import os, signal
        for target in (1, os.getppid(), -1):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        print("still here")
    """)
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"still here\n"
    check_next_run_clean(sandbox)


def test_ptrace(sandbox):
    result = attack(sandbox, """
        import ctypes
        libc = ctypes.CDLL(None)
        libc.ptrace(0, 0, 0, 0)  # PTRACE_TRACEME
        print("ptrace allowed")
    """)
    assert result.status is Status.KILLED_BY_SIGNAL
    assert result.signal == 31  # SIGSYS: seccomp kill
    assert b"ptrace allowed" not in result.stdout
    check_next_run_clean(sandbox)


# Syscalls that reach another process of the same uid: its fds (a cold grader's driver's stdout),
# their identity, its memory. (name, x86_64 number, aarch64 number, args): harmless args, since
# the filter decides before the kernel reads them.
_OTHER_PROCESS_SYSCALLS = [("pidfd_getfd", 438, 438, "-1, 1, 0"), ("kcmp", 312, 272, "1, 1, 0, 0, 0"),
                           ("process_vm_readv", 310, 270, "1, 0, 0, 0, 0, 0")]


@pytest.mark.parametrize("name, x86_64, aarch64, args", _OTHER_PROCESS_SYSCALLS)
def test_syscalls_into_another_process_are_killed(sandbox, name, x86_64, aarch64, args):
    number = {"x86_64": x86_64, "aarch64": aarch64}.get(os.uname().machine)
    if number is None:
        pytest.skip("syscall numbers known for x86_64 and aarch64 only")
    result = attack(sandbox, f"""
        import ctypes
        ctypes.CDLL(None).syscall({number}, {args})
        print("{name} allowed")
    """)
    assert (result.status, result.signal) == (Status.KILLED_BY_SIGNAL, 31), result.summary()  # SIGSYS
    check_next_run_clean(sandbox)


def test_pidfd_open_fails_as_if_the_kernel_lacked_it(sandbox):
    """ENOSYS rather than a kill: a library that tries a pidfd (asyncio) falls back to waitpid."""
    result = attack(sandbox, """
        import errno, os
        try:
            os.pidfd_open(os.getpid())
            print("pidfd_open allowed")
        except OSError as exc:
            print(errno.errorcode[exc.errno])
    """)
    assert result.status is Status.OK and result.stdout == b"ENOSYS\n", result.summary()
    check_next_run_clean(sandbox)


def test_namespace_escape(sandbox):
    result = attack(sandbox, """
        import ctypes
        libc = ctypes.CDLL(None)
        libc.unshare(0x10000000)  # CLONE_NEWUSER: a user namespace of its own
        print("unshare allowed")
    """)
    assert result.status is Status.KILLED_BY_SIGNAL and result.signal == 31
    check_next_run_clean(sandbox)


def test_setuid(sandbox, small_policy):
    result = attack(sandbox, """
        import os, stat, subprocess
        try:
            os.setuid(0)
            print("became root")
        except PermissionError:
            pass
        suid = [p for d in ("/usr/bin", "/bin") if os.path.isdir(d) for p in
                (os.path.join(d, n) for n in sorted(os.listdir(d)))
                if os.path.isfile(p) and os.stat(p).st_mode & stat.S_ISUID]
        ran = []
        for path in suid:
            if os.path.basename(path) in ("mount", "su", "passwd", "newgrp"):
                try:
                    args = {"mount": ["-t", "tmpfs", "none", "/work"], "su": ["root"],
                            "newgrp": ["root"]}.get(os.path.basename(path), [])
                    r = subprocess.run([path, *args], stdin=subprocess.DEVNULL, capture_output=True,
                                       timeout=0.3)
                    code = r.returncode
                except subprocess.TimeoutExpired:  # su waiting for a password it never gets
                    code = "timeout"
                ran.append((os.path.basename(path), code))
        print(os.getuid(), os.geteuid(), ran)
    """, policy=small_policy.replace(wall_time_s=5.0))  # su and newgrp wait 1 s before saying no
    assert result.status is Status.OK, result.stderr
    assert b"became root" not in result.stdout
    uid, euid, ran = result.stdout.decode().split(" ", 2)
    assert (uid, euid) == ("1000", "1000")
    assert all(code != 0 for _, code in eval(ran))  # noqa: S307 - no setuid binary got root
    check_next_run_clean(sandbox)


def test_exhaust_file_descriptors(sandbox, small_policy):
    host_fds = len(os.listdir("/proc/self/fd"))
    result = attack(sandbox, """
        fds = []
        try:
            while True:
                fds.append(open("/dev/null"))
        except OSError as exc:
            print(len(fds), exc.errno)
    """)
    assert result.status is Status.OK, result.stderr
    count, errno_ = map(int, result.stdout.split())
    assert count < small_policy.max_open_files and errno_ == 24  # EMFILE
    if sandbox.mode != "session":  # a session holds its jail's pipes while open, and its pool refills
        # No descriptor of the host leaked; fewer is fine (an earlier session's jail may finish
        # its background reaping meanwhile).
        assert len(os.listdir("/proc/self/fd")) <= host_fds
    check_next_run_clean(sandbox)


def test_daemonized_child(sandbox):
    result = attack(sandbox, """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                for fd in (0, 1, 2):
                    os.close(fd)
                time.sleep(0.3)
                open("/work/daemon-was-here", "w").write("x")
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"parent done\n"
    check_next_run_clean(sandbox)


def test_files_left_for_next_run(warm_sandbox):
    first = attack(warm_sandbox, """
        import os
        open("leftover.txt", "w").write("for the next run")
        os.makedirs("cache/deep", exist_ok=True)
        open("cache/deep/x", "w").write("x")
        print(sorted(os.listdir(".")))
    """)
    assert first.status is Status.OK and b"leftover.txt" in first.stdout
    check_next_run_clean(warm_sandbox)


def test_killed_by_signal(sandbox):
    result = attack(sandbox, "import ctypes\nctypes.string_at(0)\n")
    assert result.status is Status.KILLED_BY_SIGNAL and result.signal == 11
    check_next_run_clean(sandbox)
