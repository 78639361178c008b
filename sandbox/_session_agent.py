"""In-jail agent of a session: one jail that lives for one episode.

Runs INSIDE nsjail, appended by the host to the sources of `_zygote.py` (it uses its framing and
`execute`) and `_run_processes.py` (`install_seccomp`), so it imports nothing of postrain. One
config frame in, "ready" out, then one reply per request: exec (a bash command or a Python
snippet), read_file, write_files, snapshot (the work dir as a tar, for a grader), exit.

Design note. The session's state is what a call leaves behind, never a live process: its files in
/work (the jail's own tmpfs, which lives as long as the jail), and the working directory and
exported environment that the command's shell writes on exit (a bash EXIT trap, to a state file
in /run/postrain) and that the agent hands to the next call. Each call otherwise runs exactly as
a warm execution does (`execute` with req["session"]): its own PID namespace whose init's exit
kills every process the call started (and IPC namespace: no SysV object outlives the call),
the sandbox uid, rlimits and the seccomp filter. A bash command's shell is that namespace's
init itself ("as_init"), started ahead, between calls (`prepare` with a shell), with the call's
limits already applied: uid, rlimits (the session's calls share them; a call whose limits
differ gets a shell started then), seccomp, its own PID namespace, and the session's cwd.
Until its call it has read nothing of the session: its argv is fixed (`_SHELL_MAIN`), its
environment empty (but for the policy's locale, `_shell`), and it blocks reading fd 4, a pipe
that only the agent writes. The call writes the session's environment, the state trap and the
command (`_shell_script`) to the shell's fd 3 (an unnamed file of the agent's, out of the code's
reach by any path), then one byte to fd 4; the shell reads and runs them. So a call starts with
two writes, without an exec or bash start-up.
So nothing of the code runs between calls (the shell's start-up cannot be steered by what the
code left: no rc files, no environment; so BASH_ENV, SHELLOPTS and LD_PRELOAD act on the
commands the shell starts, not on the shell itself), and a call that times out loses only its
own changes to cwd and environment. A Python call runs under an init of its own (prepared
ahead as the jail's root when the previous call was Python).
Invariant: a prepared shell's cwd and limits are those of the state and the latest call when it
started; only an exec call changes the state, and it consumes the prepared processes.
File requests run in a forked child that has dropped to the sandbox uid, so they see and create
exactly what the code would.
"""
import stat

_RUN_DIR = "/run/postrain"  # a tmpfs of the jail's own
_STATE_PATH = "/run/postrain/state"
_MAX_STATE_BYTES = 1 << 20
# On exit the shell writes "cwd\n\0" and then its exported variables as `declare -px` prints
# them (one line each, `_exported`): two builtins, no fork on the call's path.
_TRAP = ("builtin trap '{ builtin pwd; builtin printf \"\\0\"; builtin declare -px; } >" + _STATE_PATH
         + " 2>/dev/null' EXIT\n").encode()
# The shell started ahead: wait for the go byte on fd 4; read its call from fd 3 (a file, which
# mapfile reads in blocks), its set-up and its command split by a NUL; close both (plain `exec`:
# redirections on `builtin exec` would be undone); run the set-up, then the command at the top
# level. One line, so that the command's errors read as a `bash -c` shell's ("line 1").
_SHELL_MAIN = ('builtin read -r -n 1 -u 4 __go || builtin exit 125; builtin mapfile -t -d "" -u 3 __call; '
               'exec 3<&- 4<&-; builtin eval "${__call[0]}"; '
               'builtin eval "builtin unset -v __go __call; ${__call[1]}"')
_CALL_LIMITS = ("cpu_time_s", "memory_mb", "max_processes", "max_file_size_mb", "max_open_files")
# Not kept: set by each shell itself, or (IFS) never taken from its environment by bash.
_VOLATILE_ENV = (b"_", b"SHLVL", b"PWD", b"IFS")
_SIOCSIFADDR = 0x8916


def _session_exec(req, cfg, state):
    """One call in the session's cwd and environment; on a normal end of a bash call, its state
    is to be kept (`_after_exec`, once the reply is sent)."""
    limits = {name: req[name] for name in _CALL_LIMITS}
    shell = _shell(cfg, state, limits) if "command" in req else None
    prepared, state["prepared"] = state["prepared"], None
    if prepared is not None and prepared["shell"] != shell:
        discard(prepared)
        prepared = None
    if shell is not None:
        if prepared is None:
            prepared = prepare(cfg, shell)  # none started ahead (the first command, or after Python)
        reply = execute({**req, **shell}, cfg, prepared, _shell_script(req["command"], state["env"]))
    else:
        python = {"session": True, "as_init": False, "exec_argv": [cfg["python"], "-c", req["code"]],
                  "cwd": state["cwd"], "env": state["env"], "files": {}, "argv": [], "code": ""}
        reply = execute({**req, **python}, cfg, prepared)
    state["keep_state"] = reply["killed_for"] is None and shell is not None
    state["shell_limits"] = limits if shell is not None else None
    return reply


def _after_exec(state):
    """Off the call's path: keep the state the call left (if it is to be kept); no state file
    stays for the next call."""
    if state.pop("keep_state", False):
        _load_state(state)
    try:
        os.unlink(_STATE_PATH)
    except OSError:
        pass


def _restart_shell(state):
    """After files changed: a shell started ahead entered its cwd before (the directory may
    only now exist); the loop starts the next one afresh."""
    prepared = state["prepared"]
    if prepared is not None and prepared["shell"] is not None:
        discard(prepared)
        state["prepared"] = None


def _shell(cfg, state, limits):
    """A bash call's request less its command: what a shell started for it is fixed by. Its
    environment holds only the policy's locale variables (the operator's, never the code's)
    that the session still has, so that bash loads that locale as it starts, off the call's
    path."""
    env = {name: value for name, value in cfg["env"].items() if (name == "LANG" or name.startswith("LC_"))
           and state["env"].get(name.encode()) == value.encode()}
    return {**limits, "session": True, "as_init": True, "cwd": state["cwd"], "env": env,
            "script_dir": _RUN_DIR, "exec_argv": [cfg["bash"], "--noprofile", "--norc", "-c", _SHELL_MAIN]}


def _shell_script(command, env):
    """What a shell reads as its call: the set-up (the session's exported variables, where a
    readonly one of bash's is skipped, and the state trap), a NUL, the command (no NUL in it:
    `Session.run` refuses those)."""
    setup = _TRAP
    if env:
        assignments = b" ".join(name + b"=" + _quoted(value) for name, value in env.items())
        setup = b"builtin declare -gx " + assignments + b" 2>/dev/null\n" + setup
    return setup + b"\0" + os.fsencode(command)


def _quoted(value):
    return b"'" + value.replace(b"'", b"'\\''") + b"'"


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
    cwd, sep, exports = data.partition(b"\n\0")
    if not sep or len(data) > _MAX_STATE_BYTES or not cwd.startswith(b"/"):
        return
    state["cwd"], state["env"] = cwd, _exported(exports)


def _exported(text):
    """The variables in `declare -px` output: `declare -FLAGS NAME="value"` (or NAME=$'value'
    where the value holds control characters), one per line; unset and array ones are not in
    an environment. The file is the code's to write: a line of any other shape is skipped."""
    env = {}
    for line in text.split(b"\n"):
        head, sep, quoted = line.partition(b"=")
        words = head.split(b" ")
        if not sep or len(words) != 3 or words[0] != b"declare" or not words[1].startswith(b"-"):
            continue
        flags, name = words[1], words[2]
        value = _unquoted(quoted)
        if (value is not None and b"a" not in flags and b"A" not in flags and name.isascii()
                and name.decode().isidentifier() and name not in _VOLATILE_ENV):
            env[name] = value
    return env


_DOUBLE_QUOTED_ESCAPES = {ord(c): ord(c) for c in '"$`\\'}
_ANSI_C_ESCAPES = {ord(k): v for k, v in {"a": 7, "b": 8, "e": 27, "E": 27, "f": 12, "n": 10, "r": 13,
                                            "t": 9, "v": 11, "\\": 92, "'": 39, '"': 34, "?": 63}.items()}
_OCTAL_DIGITS = [bytes([d]) for d in b"01234567"]


def _unquoted(word):
    """The value of a word quoted as `declare -p` quotes: "..." or $'...' (octal escapes for the
    other bytes); None for anything else."""
    if len(word) >= 2 and word[:1] == b'"' and word[-1:] == b'"':
        body, escapes = word[1:-1], _DOUBLE_QUOTED_ESCAPES
    elif len(word) >= 3 and word[:2] == b"$'" and word[-1:] == b"'":
        body, escapes = word[2:-1], _ANSI_C_ESCAPES
    else:
        return None
    if b"\\" not in body:
        return body
    out, i = bytearray(), 0
    while i < len(body):
        after = body[i + 1:i + 2]
        if body[i] != 0x5C or not after:
            out.append(body[i])
            i += 1
        elif after[0] in escapes:
            out.append(escapes[after[0]])
            i += 2
        elif escapes is _ANSI_C_ESCAPES and after in _OCTAL_DIGITS:
            end = i + 2
            while end < min(i + 4, len(body)) and body[end:end + 1] in _OCTAL_DIGITS:
                end += 1
            out.append(int(body[i + 1:end], 8) & 0xFF)
            i = end
        else:  # a backslash bash keeps
            out.append(0x5C)
            i += 1
    return bytes(out)


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


def _snapshot(max_bytes):
    """The work dir as an uncompressed tar (what the grader checks; `sandbox/grader.py`): every
    entry the sandbox uid can read, symlinks as symlinks (never followed), modes kept; entries it
    cannot read are left out (as they would be to the code)."""
    import io
    import tarfile
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder, dirs, names in os.walk(".", followlinks=False):
            for name in sorted(dirs) + sorted(names):
                path = os.path.join(folder, name)
                try:
                    tar.add(path, arcname=path[2:], recursive=False)
                except OSError:
                    continue
                if buffer.tell() > max_bytes:
                    return {"error": f"the work dir is larger than {max_bytes} bytes"}
    return {"data": buffer.getvalue()}


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
             "prepared": None, "shell_limits": None}
    if cfg["routes"]:
        _start_forwarder(cfg["routes"])
    send({"kind": "ready", "pid": os.getpid()})
    while True:
        if state["prepared"] is None:
            # between calls, off the next call's path: after a bash command, the next one's shell
            limits = state["shell_limits"]
            state["prepared"] = prepare(cfg, _shell(cfg, state, limits) if limits else None)
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
            elif kind == "snapshot":
                reply = _as_sandbox_user(cfg, lambda: _snapshot(req["max_bytes"]))
            elif kind == "write_files":
                reply = _as_sandbox_user(cfg, lambda: _write_files(req["files"]))
                _restart_shell(state)
            else:
                reply = {"error": f"unknown request kind {kind!r}"}
        except Exception as exc:  # noqa: BLE001 - report, stay alive for the next call
            reply = {"error": f"session agent failed: {exc!r}"}
        send(reply)
        if kind == "exec":
            _after_exec(state)


session_main()
