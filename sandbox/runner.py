"""Run code in nsjail: cold mode (a fresh jail per execution) and the `Sandbox` facade.

Cold mode starts nsjail once per execution. The task's files (main.py and any extras) sit in a
host temp dir mounted read-only at /task; a tiny prelude copies them into the private tmpfs /work
(the cwd, size-limited) and runs /work/main.py as `__main__`. The host reads stdout and stderr up
to the cap, kills nsjail on overflow or at the wall limit, and reads CPU time from wait4.

`Sandbox` is what callers use: the same `run()` for cold and warm mode (a `WarmPool`), an
`async arun()` for trio (it runs `run` in a worker thread, so many can be in flight at once, up to
the number of warm workers; the rest wait for a free worker), and an optional audit log.

    from postrain.sandbox import Sandbox, Policy
    with Sandbox(Policy(wall_time_s=2), mode="warm", num_workers=2) as sb:
        result = sb.run("print(sum(range(10)))")
        assert result.status == "ok" and result.stdout == b"45\\n"
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .audit import AuditLog
from .policy import HOST_UID, Policy, PolicyError, SandboxError, nsjail_argv, python_flags, site_paths
from .result import NOT_STARTED, ExecResult, Status, classify
from .session import AsyncSession, Session, SessionLimits, open_session
from .session_jail import SessionPool
from .warm import DEFAULT_PRELOAD, WarmPool

if TYPE_CHECKING:
    import trio

LANGUAGES = ("python",)
_PRELUDE = """\
import builtins, os, sys, types
sys.path.extend(%r)
if not hasattr(builtins, 'exit'):
    builtins.exit = builtins.quit = sys.exit
def _copy(src, dst):
    for name in os.listdir(src):
        s, d = src + '/' + name, dst + '/' + name
        if os.path.isdir(s):
            os.mkdir(d); _copy(s, d)
        else:
            with open(s, 'rb') as f, open(d, 'wb') as g: g.write(f.read())
_copy('/task', '/work')
del _copy
sys.argv[0] = '/work/main.py'; sys.path.insert(0, '/work')
_m = types.ModuleType('__main__'); _m.__file__ = '/work/main.py'; _m.__builtins__ = __builtins__
sys.modules['__main__'] = _m
with open('/work/main.py', 'rb') as _f: _src = _f.read()
try:
    exec(compile(_src, '/work/main.py', 'exec'), _m.__dict__)
except SystemExit:
    raise
except BaseException as _e:
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
"""
_SAFE_NAME = re.compile(r"^(?!/)(?!.*(^|/)\.\.(/|$))[A-Za-z0-9._/-]+$")


@functools.lru_cache(maxsize=8)
def _site_paths_for(python: str, enable_site_hooks: bool) -> list[str]:
    return site_paths(Policy(python=python, enable_site_hooks=enable_site_hooks))


def _site_paths(policy: Policy) -> list[str]:
    return _site_paths_for(policy.python, policy.enable_site_hooks)


def check_files(files: dict[str, bytes] | None) -> dict[str, bytes]:
    """Validate extra task files: relative names, no '..', not main.py."""
    out = {}
    for name, data in (files or {}).items():
        if not _SAFE_NAME.match(name) or name == "main.py":
            raise PolicyError(f"file name {name!r} is not allowed: names must be relative paths of "
                              f"[A-Za-z0-9._/-] without '..' and not main.py; fix: rename the file")
        out[name] = data.encode() if isinstance(data, str) else bytes(data)
    return out


def write_task_files(task_dir: str, files: dict[str, bytes]) -> None:
    """Lay `files` out under `task_dir` (made here) for a jail to read at /task, readable by the
    jail's user only: folders 0700 and files 0600 of its host uid (HOST_UID, when we are root
    and can give them away; else ours), so no other local user reads a task's hidden tests. The
    temp folder around it stays 0700 and ours."""
    owner = HOST_UID if os.geteuid() == 0 else None
    made = [task_dir]
    os.mkdir(task_dir, 0o700)
    for name, data in files.items():
        parent = task_dir
        for part in name.split("/")[:-1]:  # names are checked: relative, no '..' (check_files)
            parent = os.path.join(parent, part)
            if not os.path.isdir(parent):
                os.mkdir(parent, 0o700)
                made.append(parent)
        fd = os.open(os.path.join(task_dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            if owner is not None:
                os.fchown(f.fileno(), owner, owner)
            f.write(data)
    if owner is not None:
        for folder in made:
            os.chown(folder, owner, owner)


def run_cold(code: str, *, policy: Policy, stdin: bytes = b"", files: dict[str, bytes] | None = None,
             argv: list[str] | None = None,
             on_output: Callable[[str, bytes], None] | None = None) -> ExecResult:
    """Run Python source in a fresh jail; always returns a result (never raises for the code)."""
    files = check_files(files)
    run_dir = tempfile.mkdtemp(prefix="postrain-cold-")
    task_dir = os.path.join(run_dir, "task")  # mounted read-only at /task
    try:
        write_task_files(task_dir, {"main.py": code.encode(), **files})
        log_path = os.path.join(run_dir, "nsjail.log")
        jail = nsjail_argv(policy, cold=True, task_dir=task_dir, log_path=log_path)
        prelude = _PRELUDE % (_site_paths(policy),)
        cmd = jail + [policy.python, *python_flags(policy), "-c", prelude, *(argv or [])]
        return _run_jail(cmd, policy, stdin, log_path, memory_cgroup="--cgroup_mem_max" in jail,
                         on_output=on_output)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run_jail(cmd: list[str], policy: Policy, stdin: bytes, log_path: str,
              memory_cgroup: bool, on_output=None) -> ExecResult:
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, bufsize=0, close_fds=True)
    except OSError as exc:
        return ExecResult(Status.SANDBOX_ERROR, mode="cold", error=f"{NOT_STARTED}could not start nsjail: {exc}")
    out, killed_for = _pump(proc, stdin, policy, t0, on_output)
    _, wait_status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)  # keep Popen from waiting again
    wall_s = time.monotonic() - t0
    cpu_s = usage.ru_utime + usage.ru_stime  # nsjail's own share is a fraction of a millisecond
    exit_code, sig, error = _read_outcome(log_path, proc.returncode)
    if error and killed_for is None:
        return ExecResult(Status.SANDBOX_ERROR, wall_s=wall_s, mode="cold", error=error,
                          stderr=bytes(out["stderr"]))
    status = classify(exit_code=exit_code, signal=sig, cpu_s=cpu_s, cpu_limit_s=policy.cpu_time_s,
                      killed_for=killed_for, stderr=bytes(out["stderr"]), memory_cgroup=memory_cgroup)
    if killed_for is not None:
        exit_code, sig = None, signal.SIGKILL
    return ExecResult(status, exit_code=exit_code, signal=sig, wall_s=wall_s, cpu_s=cpu_s,
                      stdout=bytes(out["stdout"]), stderr=bytes(out["stderr"]),
                      stdout_truncated=out["stdout_truncated"], stderr_truncated=out["stderr_truncated"],
                      mode="cold")


def _pump(proc: subprocess.Popen, stdin: bytes, policy: Policy, t0: float, on_output=None):
    """Feed stdin, collect capped output, kill nsjail at the wall limit or on a flood."""
    cap = policy.max_output_bytes
    # _run_jail opens all three pipes
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out: dict[str, Any] = {"stdout": bytearray(), "stderr": bytearray(), "stdout_truncated": False,
                           "stderr_truncated": False}
    killed_for = None
    sel = selectors.DefaultSelector()
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    for fd in names:
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(bytes(stdin))
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    deadline = t0 + policy.wall_time_s
    open_reads = set(names)
    while open_reads:
        remaining = deadline - time.monotonic()
        if remaining <= 0 and killed_for is None:
            killed_for = "timeout"
            _stop(proc)
        for key, _ in sel.select(max(remaining, 0) if killed_for is None else 1.0):
            fd = key.fd
            if fd not in names:
                try:
                    pending = pending[os.write(fd, pending[:65536]):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    sel.unregister(fd)
                    proc.stdin.close()
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                sel.unregister(fd)
                open_reads.discard(fd)
                continue
            name = names[fd]
            room = cap - len(out[name])
            kept = chunk[:max(room, 0)]
            out[name] += kept
            if on_output is not None and kept:
                on_output(name, kept)
            if len(chunk) > room:
                out[f"{name}_truncated"] = True
                if killed_for is None:
                    killed_for = "output"
                    _stop(proc)
    sel.close()
    if not proc.stdin.closed:
        proc.stdin.close()
    return out, killed_for


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM makes nsjail SIGKILL and reap its jailed init, whose exit takes the whole PID
    namespace with it; SIGKILL to nsjail itself would return before the jailed processes are gone."""
    proc.terminate()


_EXITED = re.compile(r"exited with status: (\d+)")
_SIGNALED = re.compile(r"terminated with signal: \w+ \((\d+)\)")


def _read_outcome(log_path: str, returncode: int) -> tuple[int | None, int | None, str]:
    """(exit_code, signal, error) of the jailed process, from nsjail's log."""
    try:
        with open(log_path, errors="replace") as f:
            log = f.read()
    except OSError:
        log = ""
    exited, signaled = _EXITED.findall(log), _SIGNALED.findall(log)
    if exited:
        return int(exited[-1]), None, ""
    if signaled:
        return None, int(signaled[-1]), ""
    problems = [line for line in log.splitlines() if line.startswith(("[E]", "[F]"))]
    detail = "; ".join(problems[-3:]) or f"nsjail exited {returncode} without a report"
    return None, None, f"nsjail failed: {detail}"


class Sandbox:
    """Runs untrusted Python in nsjail, warm or cold, with one API; optionally audited.

    mode: "warm" (a pool of `num_workers` pre-started zygotes; fastest) or "cold" (a fresh jail
    per run; `num_workers` is then only the number of concurrent runs `arun` allows).
    """

    def __init__(self, policy: Policy | None = None, *, mode: str = "warm", num_workers: int = 1,
                 audit_log: str | os.PathLike | None = None,
                 preload: tuple[str, ...] = DEFAULT_PRELOAD, num_spare_sessions: int = 2) -> None:
        if mode not in ("warm", "cold"):
            raise PolicyError(f"mode must be 'warm' or 'cold', got {mode!r}; fix: pass mode='warm'")
        if num_workers < 1:
            raise PolicyError(f"num_workers must be >= 1, got {num_workers}; fix: pass at least 1")
        self.policy = policy or Policy()
        self.mode = mode
        self.num_workers = num_workers
        self.audit = AuditLog(audit_log) if audit_log else None
        self._pool = (WarmPool(self.policy, num_workers, preload=preload)
                      if mode == "warm" and not self.policy.network_allow else None)
        # (the trio run's token, its limiter of num_workers); built by `arun` in each trio run
        self._limiter: tuple[trio.lowlevel.TrioToken, trio.CapacityLimiter] | None = None
        self._session_pool = SessionPool(self.policy, num_spare_sessions)
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()  # open ones; closed with us

    def run(self, code: str, *, lang: str = "python", stdin: bytes | str = b"",
            files: dict[str, bytes] | None = None, argv: list[str] | None = None,
            policy: Policy | None = None, requester: str = "local",
            on_output: Callable[[str, bytes], None] | None = None) -> ExecResult:
        """Run `code` once; blocks. `policy` overrides the limits for this run only;
        `on_output(name, chunk)` sees stdout/stderr as it arrives (called in this thread)."""
        if lang not in LANGUAGES:
            raise PolicyError(f"lang must be one of {LANGUAGES}, got {lang!r}; fix: pass lang='python'")
        if isinstance(stdin, str):
            stdin = stdin.encode()
        policy = policy or self.policy
        if policy.network_allow:
            raise PolicyError("Policy.network_allow applies to sessions only; fix: run the code in "
                              "sandbox.session() or drop network_allow for single runs")
        if self._pool is not None and (policy.python, policy.readonly_mounts, policy.env,
                                       policy.enable_network) != (self.policy.python,
                                                                  self.policy.readonly_mounts,
                                                                  self.policy.env,
                                                                  self.policy.enable_network):
            raise PolicyError("a warm run's policy may change limits only, not python, mounts, env or "
                              "network (those are fixed when the workers start); fix: use mode='cold' "
                              "or a second Sandbox")
        t0 = time.monotonic()
        if self._pool is not None:
            files = check_files(files)
            result = self._pool.execute(code, stdin=stdin, files=files, argv=argv, policy=policy,
                                        on_output=on_output)
        else:
            result = run_cold(code, policy=policy, stdin=stdin, files=files, argv=argv,
                              on_output=on_output)
        if self.audit is not None:
            self.audit.record(requester=requester, code=code, stdin=stdin, files=files, policy=policy,
                              result=result, queued_s=time.monotonic() - t0 - result.wall_s)
        return result

    async def arun(self, code: str, **kwargs) -> ExecResult:
        """`run` for trio: runs in a worker thread; at most `num_workers` at once.

        Cancellation: the caller stops waiting at once (the thread is abandoned); the execution
        itself still ends within its wall limit and its worker returns to the pool.
        """
        import trio
        token = trio.lowlevel.current_trio_token()
        if self._limiter is None or self._limiter[0] is not token:
            self._limiter = (token, trio.CapacityLimiter(self.num_workers))
        return await trio.to_thread.run_sync(functools.partial(self.run, code, **kwargs),
                                             limiter=self._limiter[1], abandon_on_cancel=True)

    def session(self, files: dict[str, bytes | str] | None = None,
                limits: SessionLimits | dict | None = None, *, requester: str = "local") -> Session:
        """Open a session (a jail for one episode; see `postrain.sandbox.session`) with `files`
        laid into /work. Use it as a context manager, or close it yourself."""
        limits = SessionLimits.of(limits)
        session = open_session(self._session_pool, files, limits, audit=self.audit, requester=requester)
        self._sessions.add(session)
        return session

    @contextlib.asynccontextmanager
    async def asession(self, files: dict[str, bytes | str] | None = None,
                       limits: SessionLimits | dict | None = None, *, requester: str = "local"):
        """`session` for trio: `async with sandbox.asession() as s: await s.run("ls")`.
        Cancelled while opening: the open finishes in its thread and the session is closed."""
        import trio
        opened = functools.partial(self.session, files, limits, requester=requester)
        session = AsyncSession(await trio.to_thread.run_sync(opened))
        try:
            yield session
        finally:
            await session.close()

    def prewarm_sessions(self, limits: SessionLimits | dict | None = None) -> None:
        """Start keeping spare jails for sessions of these limits (in the background)."""
        self._session_pool.prewarm(SessionLimits.of(limits).shape)

    def num_spare_sessions(self, limits: SessionLimits | dict | None = None) -> int:
        """Jails started ahead for sessions of these limits, ready now."""
        return self._session_pool.num_spares(SessionLimits.of(limits).shape)

    def resize(self, num_workers: int) -> int:
        """Change the number of warm workers (or, cold, of concurrent `arun` runs); blocks while
        new workers start. Runs in flight finish; surplus workers close when idle."""
        if num_workers < 1:
            raise PolicyError(f"num_workers must be >= 1, got {num_workers}; fix: pass at least 1")
        if self._pool is not None:
            self._pool.resize(num_workers)
        self.num_workers = num_workers
        self._limiter = None  # the next `arun` builds one of the new size (the pool still bounds runs)
        return num_workers

    def close(self) -> None:
        for session in list(self._sessions):
            session.close()
        self._session_pool.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self.audit is not None:
            self.audit.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run(code: str, *, policy: Policy | None = None, mode: str = "cold", **kwargs) -> ExecResult:
    """One-off execution (cold by default: no pool to start and close)."""
    with Sandbox(policy, mode=mode) as sandbox:
        return sandbox.run(code, **kwargs)


__all__ = ["Sandbox", "run", "run_cold", "check_files", "SandboxError"]
