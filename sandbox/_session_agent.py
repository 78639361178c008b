"""In-jail agent of a session: one jail that lives for one episode.

Runs INSIDE nsjail, appended by the host to `_zygote.py`'s source (it uses its framing, `execute`
and `install_seccomp`), so it imports nothing of postrain. One config frame in, "ready" out, then
one reply per request: exec (a bash command or a Python snippet), read_file, write_files, exit.

Design note. The session's state is what a call leaves behind, never a live process: its files in
/work (the jail's own tmpfs, which lives as long as the jail), and the working directory and
exported environment that the command's shell writes on exit (a bash EXIT trap, to a state file
in /run/postrain) and that the agent hands to the next call. Each call otherwise runs exactly as
a warm execution does (`execute` with req["session"]): its own PID namespace whose init's exit
kills every process the call started, the sandbox uid, rlimits and the seccomp filter; those
processes are forked ahead, between calls (`prepare`), and wait for the call's request, so a call
starts with one write; a bash command's shell is that namespace's init itself ("as_init"). So a
call that times out loses only its own changes to cwd and environment, and nothing of the code
runs between calls.
File requests run in a forked child that has dropped to the sandbox uid, so they see and create
exactly what the code would.
"""
import stat

_STATE_PATH = "/run/postrain/state"
_MAX_STATE_BYTES = 1 << 20
_NAMES_PATH = "/run/postrain/names"
# On exit the shell writes "cwd\n\0" and then NAME=value\0 per exported variable, with builtins
# only (no fork on the call's path).
_PROLOGUE = ("trap '{ builtin pwd; builtin printf \"\\0\"; builtin compgen -e >" + _NAMES_PATH + "; "
             "builtin mapfile -t __names <" + _NAMES_PATH + "; for __name in \"${__names[@]}\"; do "
             "builtin printf \"%s=%s\\0\" \"$__name\" \"${!__name}\"; done; } >" + _STATE_PATH
             + " 2>/dev/null' EXIT\n")
_VOLATILE_ENV = (b"_", b"SHLVL", b"PWD")
_SIOCSIFADDR = 0x8916


def _session_exec(req, cfg, state):
    """One call in the session's cwd and environment; on a normal end, keep the state it left."""
    if "command" in req:
        argv = [cfg["bash"], "--noprofile", "--norc", "-c", _PROLOGUE + req["command"]]
    else:
        argv = [cfg["python"], "-c", req["code"]]
    _unlink_state()
    prepared, state["prepared"] = state["prepared"], None
    as_init = "command" in req and prepared is not None  # only a prepared init can become the shell
    reply = execute({**req, "session": True, "as_init": as_init, "exec_argv": argv,
                     "cwd": state["cwd"], "env": state["env"], "files": {}, "argv": [], "code": ""},
                    cfg, prepared)
    if reply["killed_for"] is None and "command" in req:
        _load_state(state)
    _unlink_state()
    return reply


def _unlink_state():
    for path in (_STATE_PATH, _NAMES_PATH):
        try:
            os.unlink(path)
        except OSError:
            pass


def _load_state(state):
    """cwd and environment from the state file the call's EXIT trap wrote (none: keep the old)."""
    try:
        fd = os.open(_STATE_PATH, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        data = os.read(fd, _MAX_STATE_BYTES + 1)
    finally:
        os.close(fd)
    cwd, sep, rest = data.partition(b"\n\0")
    if not sep or len(data) > _MAX_STATE_BYTES or not cwd.startswith(b"/"):
        return
    env = {}
    for entry in rest.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key and key not in _VOLATILE_ENV:
            env[key] = value
    state["cwd"], state["env"] = cwd, env


# ---------------------------------------------------------------- files, as the sandbox uid
def _as_sandbox_user(cfg, action):
    """Run action() in a child that dropped to the sandbox uid; its msgpack reply."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
            os.chdir("/work")
            reply = action()
        except OSError as exc:
            reply = {"error": f"{exc.strerror or exc}"}
        except BaseException as exc:  # noqa: BLE001 - reported to the host
            reply = {"error": f"{exc!r}"}
        view = memoryview(msgpack.packb(reply, use_bin_type=True))
        while view:
            view = view[os.write(w, view):]
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        chunk = os.read(r, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    data = b"".join(chunks)
    return msgpack.unpackb(data, raw=False) if data else {"error": "the file helper died"}


def _read_file(path, max_bytes):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            return {"error": "is a directory"}
        if not stat.S_ISREG(mode):
            return {"error": "not a regular file"}
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        return {"error": f"larger than {max_bytes} bytes"}
    return {"data": b"".join(chunks)}


def _write_files(files):
    for name, data in files.items():
        parent = os.path.dirname(name)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(name, "wb") as f:
            f.write(data)
    return {"written": len(files)}


# ---------------------------------------------------------------- the network allowlist
def _start_forwarder(routes):
    """A process that accepts each connection to an allowed destination (an address on the jail's
    own loopback) and hands the connected socket to that route's host proxy (SCM_RIGHTS over a
    unix socket that only the jail's root can reach); the host relays it to the destination. The
    jail has no other way out: its network namespace holds only lo."""
    import socket
    listeners = {}
    for index, (address, port, path) in enumerate(routes):
        if not address.startswith("127."):
            _add_loopback_address(address, index + 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(64)
        listeners[sock.fileno()] = (sock, path)
    if os.fork() != 0:
        for sock, _ in listeners.values():
            sock.close()
        return
    os.closerange(0, 3)  # the host's pipes belong to the agent alone
    while True:
        readable, _, _ = select.select(list(listeners), [], [])
        for fd in readable:
            sock, path = listeners[fd]
            client, _ = sock.accept()
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as proxy:
                    proxy.connect(path)
                    socket.send_fds(proxy, [b"c"], [client.fileno()])
            except OSError:
                pass  # the host proxy is gone: the session is ending
            client.close()


def _add_loopback_address(address, index):
    """Give lo the address `address` (alias lo:index), so the jail can dial it."""
    import fcntl
    import socket
    ifreq = struct.pack("16sH2s4s8s", f"lo:{index}".encode(), socket.AF_INET, b"\0\0",
                        socket.inet_aton(address), b"\0" * 8)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), _SIOCSIFADDR, ifreq)


# ---------------------------------------------------------------- the agent's loop
def session_main():
    cfg = recv()
    state = {"cwd": b"/work", "env": {k.encode(): v.encode() for k, v in cfg["env"].items()},
             "prepared": None}
    if cfg["routes"]:
        _start_forwarder(cfg["routes"])
    send({"kind": "ready", "pid": os.getpid()})
    while True:
        if state["prepared"] is None:
            state["prepared"] = prepare(cfg)  # between calls, off the next call's path
        try:
            req = recv()
        except EOFError:
            return
        kind = req.get("kind")
        if kind == "exit":
            return
        try:
            if kind == "exec":
                reply = _session_exec(req, cfg, state)
            elif kind == "read_file":
                reply = _as_sandbox_user(cfg, lambda: _read_file(req["path"], req["max_bytes"]))
            elif kind == "write_files":
                reply = _as_sandbox_user(cfg, lambda: _write_files(req["files"]))
            else:
                reply = {"error": f"unknown request kind {kind!r}"}
        except Exception as exc:  # noqa: BLE001 - report, stay alive for the next call
            reply = {"error": f"session agent failed: {exc!r}"}
        send(reply)


session_main()
