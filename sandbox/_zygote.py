"""In-jail agent of a warm worker: a zygote that forks a fresh child per execution.

Runs INSIDE nsjail (the host passes this file's source to `python -I -S -c`, and the
site-packages folders as arguments), so it imports nothing of postrain. The host appends
`_run_processes.py` (the launcher, init and child of one run, and the seccomp filter: `launch`,
`install_seccomp`), then the entry point: `main()` for a warm worker, `_session_agent.py` for a
session (which reuses the per-run machinery with `req["session"]` set: no fresh /work, the
session's cwd and environment); warm.py's `jailed_source` joins them. It talks to the host over
fds 0/1 with length-prefixed msgpack frames: one config frame in, "ready" out, then per
execution one request in, output frames (when streaming) and one result out.

Design note. Per execution the zygote forks a launcher that unshares a new PID, IPC and mount
namespace and forks `init` (PID 1 there); init mounts a fresh tmpfs at /work and forks the child that runs
the code after dropping to the sandbox uid (no capabilities left), setting rlimits and adding a
seccomp filter that forbids mount/unshare/setns/ptrace and namespace clones. When init exits (or
the zygote SIGKILLs it on timeout or output flood), the kernel kills every process left in that
PID namespace, and the mount namespace with its tmpfs and the IPC namespace with any SysV or
POSIX-mqueue object go with them: nothing of one run, not a daemonized grandchild, not a file,
not a shared-memory segment, survives into the next. The child skips interpreter start-up,
which is what makes warm runs faster than a bare `python -c`.
"""
import builtins
import os
import select
import signal
import struct
import sys
import time

sys.path.extend(sys.argv[1:])  # site-packages, when the interpreter runs with -S (no site hooks)
if not hasattr(builtins, "exit"):
    # -S: no site.Quitter to assign; sys.exit stands in for both
    builtins.exit = builtins.quit = sys.exit  # type: ignore[assignment]

import msgpack  # noqa: E402

_HEADER = struct.Struct("<I")


# ---------------------------------------------------------------- framing
def _read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv():
    (size,) = _HEADER.unpack(_read_exact(0, 4))
    return msgpack.unpackb(_read_exact(0, size), raw=False)


def send(obj):
    data = msgpack.packb(obj, use_bin_type=True)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(1, view):]


# ---------------------------------------------------------------- the zygote's side of a run
class _Run:
    def __init__(self, cap):
        self.cap = cap
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.truncated = {"stdout": False, "stderr": False}
        self.init_pid = None
        self.final = None
        self.error = None
        self.killed_for = None

    def kill(self, reason):
        if self.killed_for is None:
            self.killed_for = reason
        if self.init_pid is not None:
            try:
                os.kill(self.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def take_output(self, name, chunk):
        buf = self.out[name]
        room = self.cap - len(buf)
        if len(chunk) > room:
            buf += chunk[:max(room, 0)]
            self.truncated[name] = True
            self.kill("output")
        else:
            buf += chunk


def prepare(cfg, shell=None):
    """A session call's processes, forked ahead: launcher and init in a new PID namespace, init
    waiting for its request as the jail's root; or, with `shell` (a bash call's request less its
    command: its limits, cwd and the shell's argv, `_session_agent.py`), init becomes that shell
    at once, as the sandbox uid under those limits, and blocks reading fd 4, a pipe that only the
    agent writes; `execute(..., script=)` writes the call's script to fd 3 (an unnamed file in
    shell["script_dir"], which bash reads whole, where it reads a pipe byte by byte), then one
    byte to fd 4. A call then starts with two writes instead of forks and an exec. Returns the
    agent's ends of its pipes and files, init's pid and `shell`."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    go_r, go_w = os.pipe()
    script_fd = os.open(shell["script_dir"], os.O_TMPFILE | os.O_RDWR, 0o600) if shell else -1
    launcher = os.fork()
    if launcher == 0:
        for fd in (in_w, out_r, err_r, st_r, go_w):
            os.close(fd)
        launch(shell or {"session": True}, cfg, in_r, out_w, err_w, st_w, go_r, script_fd)
        os._exit(1)
    for fd in (in_r, out_w, err_w, st_w, go_r):
        os.close(fd)
    os.waitpid(launcher, 0)
    os.set_blocking(st_r, False)
    try:
        status = os.read(st_r, 1 << 16)  # the launcher's report, written before it exited
    except BlockingIOError:
        status = b""
    run = _Run(0)
    _parse_status(run, status)
    pidfd = os.pidfd_open(run.init_pid) if run.init_pid is not None else -1
    return {"in_w": in_w, "out_r": out_r, "err_r": err_r, "st_r": st_r, "go_w": go_w,
            "status": status, "init_pidfd": pidfd, "init_pid": run.init_pid, "shell": shell,
            "script_fd": script_fd}


def discard(prepared):
    """End processes that `prepare` forked for a call that will not use them."""
    for key in ("in_w", "out_r", "err_r", "st_r", "go_w", "init_pidfd", "script_fd"):
        if prepared[key] >= 0:
            os.close(prepared[key])
    if prepared["init_pid"] is not None:
        try:
            os.kill(prepared["init_pid"], signal.SIGKILL)  # reparented to us, not yet reaped
            os.waitpid(prepared["init_pid"], 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def execute(req, cfg, prepared=None, script=None):
    """Run one request; with `prepared` (from `prepare`), in those waiting processes: a prepared
    shell reads `script` (bytes), a prepared init the request itself."""
    t0 = time.monotonic()
    status_buf = bytearray()
    init_pidfd = -1  # readable once init has ended (with a prepared init only)
    if prepared is None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        launcher = os.fork()
        if launcher == 0:
            for fd in (in_w, out_r, err_r, st_r):
                os.close(fd)
            launch(req, cfg, in_r, out_w, err_w, st_w)
            os._exit(1)
        for fd in (in_r, out_w, err_w, st_w):
            os.close(fd)
        os.waitpid(launcher, 0)
    else:
        in_w, out_r, err_r, st_r = (prepared[k] for k in ("in_w", "out_r", "err_r", "st_r"))
        status_buf += prepared["status"]
        init_pidfd = prepared["init_pidfd"]
        if script is None:
            view = memoryview(msgpack.packb(req, use_bin_type=True))
        else:
            _write_script(prepared, script)
            view = memoryview(b"g")
        try:
            while view:
                view = view[os.write(prepared["go_w"], view):]
        except BrokenPipeError:
            pass  # the child died before its start: the run reports how
        os.close(prepared["go_w"])
    run = _Run(req["max_output_bytes"])
    pending_in = memoryview(req["stdin"])
    if pending_in:
        os.set_blocking(in_w, False)
    else:
        os.close(in_w)
        in_w = -1
    names = {out_r: "stdout", err_r: "stderr"}
    open_fds = {out_r, err_r, st_r} | ({init_pidfd} if init_pidfd >= 0 else set())
    _parse_status(run, status_buf)
    init_end = None
    deadline = t0 + req["wall_time_s"]
    while open_fds:
        timeout = deadline - time.monotonic()
        if timeout <= 0 and run.killed_for is None and run.final is None:
            run.kill("timeout")
        wfds = [in_w] if in_w >= 0 and run.killed_for is None else []
        readable, writable, _ = select.select(list(open_fds), wfds, [],
                                              max(timeout, 0) if run.killed_for is None else 1.0)
        if in_w in writable:
            try:
                pending_in = pending_in[os.write(in_w, pending_in[:65536]):]
            except BlockingIOError:
                pass
            except BrokenPipeError:
                pending_in = pending_in[:0]
            if not pending_in:
                os.close(in_w)
                in_w = -1
        for fd in readable:
            if fd == init_pidfd:
                init_end = time.monotonic()
                open_fds.discard(fd)
                os.close(fd)
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
                os.close(fd)
                continue
            if fd == st_r:
                status_buf += chunk
                _parse_status(run, status_buf)
            else:
                kept = len(run.out[names[fd]])
                run.take_output(names[fd], chunk)
                if req.get("stream") and len(run.out[names[fd]]) > kept:
                    send({"kind": "output", "name": names[fd], "data": bytes(run.out[names[fd]][kept:])})
    if in_w >= 0:
        os.close(in_w)
    _parse_status(run, status_buf, final=True)
    if run.init_pid is not None:
        try:
            _, status, usage = os.wait4(run.init_pid, 0)  # reparented to us when the launcher exited
        except ChildProcessError:
            pass
        else:
            if req.get("as_init"):
                run.final = {"status": status, "cpu_s": usage.ru_utime + usage.ru_stime,
                             "end": init_end or time.monotonic()}
    return _report(req, run, t0)


def _write_script(prepared, script):
    """The call's script into a prepared shell's file (on failure, such as a full disk, the
    prepared processes end: the caller reports the error)."""
    fd, view, offset = prepared["script_fd"], memoryview(script), 0
    try:
        while offset < len(view):
            offset += os.pwrite(fd, view[offset:], offset)
    except OSError:
        discard(prepared)
        raise
    os.close(fd)
    prepared["script_fd"] = -1


def _parse_status(run, buf, final=False):
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(bytes(buf))
    for msg in unpacker:
        if "pid" in msg:
            run.init_pid = msg["pid"]
            if run.killed_for is not None:
                run.kill(run.killed_for)
        elif "error" in msg:
            run.error = msg["error"]
        else:
            run.final = msg


def _report(req, run, t0):
    exit_code = sig = None
    cpu_s = 0.0
    end = time.monotonic()
    if run.final is not None:
        status = run.final["status"]
        cpu_s = run.final["cpu_s"]
        end = run.final["end"]
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
        else:
            exit_code = os.WEXITSTATUS(status)
    elif run.killed_for is not None:
        sig = signal.SIGKILL
    elif run.error is None:
        run.error = "the run ended without a report from its init process"
    return {"exit_code": exit_code, "signal": sig, "cpu_s": cpu_s, "wall_s": end - t0,
            "stdout": bytes(run.out["stdout"]), "stderr": bytes(run.out["stderr"]),
            "stdout_truncated": run.truncated["stdout"], "stderr_truncated": run.truncated["stderr"],
            "killed_for": run.killed_for, "error": run.error}


def main():
    cfg = recv()
    for name in cfg.get("preload", ()):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a missing optional module only costs speed
            pass
    send({"kind": "ready", "pid": os.getpid()})
    while True:
        try:
            req = recv()
        except EOFError:
            return
        if req.get("kind") == "exit":
            return
        try:
            send(execute(req, cfg))
        except Exception as exc:  # noqa: BLE001 - report, stay alive for the next run
            send({"error": f"zygote failed: {exc!r}"})

