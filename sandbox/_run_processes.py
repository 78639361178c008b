"""In-jail processes of one run: the launcher, the namespace's init, and the child that runs the
code under its seccomp filter.

Runs INSIDE nsjail, after `_zygote.py` in the same source (the host joins them: warm.py,
`jailed_source`), so it imports nothing of postrain and finds msgpack on the path the zygote
set. The zygote's side of a run (`_zygote.py`: `execute`, `prepare`) forks `launch`, which
unshares a new PID and IPC (and, but for a session, mount) namespace and forks `run_init`, PID 1
there; init mounts a fresh tmpfs at /work and forks `run_child`, which drops to the sandbox uid
(no capabilities left), sets the rlimits, adds the seccomp filter (`install_seccomp`) and runs
the code. See `_zygote.py`'s design note for why nothing of a run survives it.
"""
import atexit
import builtins
import ctypes
import fcntl
import io
import os
import resource
import struct
import sys
import threading
import time
import types

import msgpack

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18


# ---------------------------------------------------------------- seccomp for the executed code
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NR = {  # name -> (x86_64, aarch64)
    "mount": (165, 40), "umount2": (166, 39), "unshare": (272, 97), "setns": (308, 268),
    "pivot_root": (155, 41), "chroot": (161, 51), "ptrace": (101, 117), "bpf": (321, 280),
    "kexec_load": (246, 104), "init_module": (175, 105), "finit_module": (313, 273),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "userfaultfd": (323, 282), "perf_event_open": (298, 241), "open_by_handle_at": (304, 265),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "kcmp": (312, 272),   # another process's fds: a grader's stdout
}
# Answered ENOSYS, as if the kernel lacked them: libc falls back from clone3 to clone (whose
# flags the filter can read), asyncio from a pidfd to waitpid.
_NR_ENOSYS = {"clone3": (435, 435), "pidfd_open": (434, 434)}
_NR_CLONE = (56, 220)
_CLONE_NS_FLAGS = 0x7E020000
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_ENOSYS = 38


def _bpf(code, jt, jf, k):
    return struct.pack("<HBBI", code, jt, jf, k)


def _build_filter():
    """The BPF program (bytes, number of instructions), or None off x86_64/aarch64."""
    machine = os.uname().machine
    if machine not in _AUDIT_ARCH:
        return None  # nsjail's own filter still applies
    col = 0 if machine == "x86_64" else 1
    LD_W_ABS, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06
    kill, allow = _bpf(RET, 0, 0, _RET_KILL_PROCESS), _bpf(RET, 0, 0, _RET_ALLOW)
    prog = [_bpf(LD_W_ABS, 0, 0, 4), _bpf(JEQ, 1, 0, _AUDIT_ARCH[machine]), kill,
            _bpf(LD_W_ABS, 0, 0, 0)]
    if col == 0:  # x32 ABI numbers
        prog += [_bpf(0x35, 0, 1, 0x40000000), kill]  # JGE
    for nrs in _NR.values():
        prog += [_bpf(JEQ, 0, 1, nrs[col]), kill]
    for nrs in _NR_ENOSYS.values():
        prog += [_bpf(JEQ, 0, 1, nrs[col]), _bpf(RET, 0, 0, _RET_ERRNO | _ENOSYS)]
    prog += [_bpf(JEQ, 0, 3, _NR_CLONE[col]), _bpf(LD_W_ABS, 0, 0, 16),  # args[0] low word
             _bpf(JSET, 0, 1, _CLONE_NS_FLAGS), kill]
    prog.append(allow)
    return b"".join(prog), len(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_FILTER = _build_filter()  # built once here, not in each run's child


def install_seccomp():
    """Kill the process on escape-relevant syscalls; clone3 and pidfd_open say ENOSYS."""
    if _FILTER is None:
        return
    blob, count = _FILTER
    buf = ctypes.create_string_buffer(blob)
    fprog = _SockFprog(count, ctypes.addressof(buf))
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


# ---------------------------------------------------------------- the three processes of a run
def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def run_child(req, cfg, in_r, out_w, err_w, filtered=False, keep=()):
    """The executed code's process: drop everything, then exec the code in this interpreter
    (filtered: under its seccomp filter already, which forbids nothing this function does;
    `keep`: more fds to pass on, as 3, 4, ...)."""
    if not filtered:
        install_seccomp()
    os.dup2(in_r, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(keep)) for fd in keep]  # off 3, 4, ...
    for target, fd in enumerate(moved, 3):
        os.dup2(fd, target)
    os.closerange(3 + len(keep), 1 << 16)
    uid, gid = cfg["uid"], cfg["gid"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # from uid 0 to non-zero: every capability is dropped
    mb = 1024 * 1024
    limits = [(resource.RLIMIT_AS, req["memory_mb"] * mb),
              (resource.RLIMIT_CPU, req["cpu_time_s"]),
              (resource.RLIMIT_NPROC, req["max_processes"]),
              (resource.RLIMIT_FSIZE, req["max_file_size_mb"] * mb),
              (resource.RLIMIT_NOFILE, req["max_open_files"]),
              (resource.RLIMIT_CORE, 0)]
    # CPU: SIGXCPU at the limit, SIGKILL a second later; a namespace's init (req["as_init"])
    # cannot die of SIGXCPU, so there SIGKILL comes at the limit itself.
    cpu_grace = 0 if req.get("as_init") else 1
    for which, value in limits:
        hard = value + cpu_grace if which == resource.RLIMIT_CPU else value
        resource.setrlimit(which, (value, hard))
    if req.get("session"):
        _exec_in_session(req)
    os.chdir("/work")
    for name, data in req["files"].items():
        path = os.path.join("/work", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.environ.clear()
    os.environ.update(cfg["env"])
    _exec_python(req)


def _exec_in_session(req):
    """A session's call: exec its program in the session's cwd (else /work) and environment."""
    try:
        os.chdir(req["cwd"])
    except OSError:
        os.chdir("/work")
    os.execve(req["exec_argv"][0], req["exec_argv"], req["env"])


def _exec_python(req):
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                                  errors="backslashreplace", write_through=True)
    sys.argv = ["/work/main.py"] + list(req["argv"])
    sys.path[0] = "/work"
    main = types.ModuleType("__main__")
    main.__file__ = "/work/main.py"
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    code = 0
    try:
        exec(compile(req["code"], "/work/main.py", "exec"), main.__dict__)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # noqa: BLE001 - the code's own error, reported like python does
        import traceback  # preloaded by warm workers; sessions never need it (their start is faster)
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    os._exit(code)


def _read_to_end(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def run_init(req, cfg, in_r, out_w, err_w, st_w, go_r=-1, script_fd=-1):
    """PID 1 of the run's namespace: a fresh /work (a session's call keeps the session's), then
    the child; report its end and exit.
    Prepared ahead (go_r >= 0, `prepare`), it is under the seccomp filter at once, then either
    waits for its request on go_r as the jail's root, or (a session's shell started ahead: `req`
    holds the call's exec_argv) becomes that shell now, which gets `script_fd` as fd 3 and go_r
    as fd 4 (`prepare`). A request with "as_init" makes it the call's process itself, one
    process less to wake per call; the zygote then sees the call end when init does (a pidfd;
    Linux 5.3 or later). Being its namespace's init, that process ignores signals it has no
    handler for unless they come from outside the namespace or are SIGKILL (so RLIMIT_CPU is
    enforced by its hard limit alone, see `run_child`)."""
    filtered = go_r >= 0
    if filtered:
        install_seccomp()
        if req.get("exec_argv"):
            os.close(st_w)
            _run_as_child(req, cfg, in_r, out_w, err_w, filtered=True, keep=(script_fd, go_r))
        req = msgpack.unpackb(_read_to_end(go_r), raw=False)
        os.close(go_r)
        if req.get("as_init"):
            os.close(st_w)
            _run_as_child(req, cfg, in_r, out_w, err_w, filtered=True)
    if not req.get("session"):
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        opts = f"size={req['work_dir_size_mb']}m,mode=0700,uid={cfg['uid']},gid={cfg['gid']}".encode()
        _check(_libc.mount(b"tmpfs", b"/work", b"tmpfs", MS_NOSUID | MS_NODEV, opts), "mount /work")
    pid = os.fork()
    if pid == 0:
        _run_as_child(req, cfg, in_r, out_w, err_w, filtered)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    _, status, usage = os.wait4(pid, 0)
    msg = {"status": status, "cpu_s": usage.ru_utime + usage.ru_stime, "end": time.monotonic()}
    os.write(st_w, msgpack.packb(msg))
    os._exit(0)  # the kernel now kills whatever the code left in this PID namespace


def _run_as_child(req, cfg, in_r, out_w, err_w, filtered, keep=()):
    try:
        run_child(req, cfg, in_r, out_w, err_w, filtered, keep)
    except BaseException as exc:  # noqa: BLE001 - set-up failed before the code ran
        os.write(2, f"sandbox set-up failed: {exc!r}\n".encode())
    os._exit(125)


def launch(req, cfg, in_r, out_w, err_w, st_w, go_r=-1, script_fd=-1):
    """The launcher: new namespaces, fork init, tell the zygote init's pid, exit."""
    try:
        # A fresh IPC namespace too: SysV segments, semaphores and message queues (and POSIX
        # message queues) of one run are gone with it, never seen by the next (issue 32).
        flags = CLONE_NEWPID | CLONE_NEWIPC
        if not req.get("session"):
            flags |= CLONE_NEWNS
        _check(_libc.unshare(flags), "unshare")
        pid = os.fork()
        if pid == 0:
            try:
                run_init(req, cfg, in_r, out_w, err_w, st_w, go_r, script_fd)
            except BaseException as exc:  # noqa: BLE001
                os.write(st_w, msgpack.packb({"error": f"init failed: {exc!r}"}))
            os._exit(1)
        os.write(st_w, msgpack.packb({"pid": pid}))
    except BaseException as exc:  # noqa: BLE001
        os.write(st_w, msgpack.packb({"error": f"launcher failed: {exc!r}"}))
    os._exit(0)
