"""Sessions: one jail that lives for one episode, its files, cwd and environment kept across calls.

    with Sandbox(Policy()) as sb, sb.session(files={"data.csv": b"a,b\\n1,2\\n"}) as s:
        s.run("mkdir out && cd out && export N=3")
        assert s.run("pwd; echo $N").stdout == b"/work/out\\n3\\n"
        s.run_python("print(open('/work/data.csv').read())")
        s.write_file("out/x.txt", b"hi"); assert s.read_file("out/x.txt") == b"hi"

A session is a whole nsjail of its own, taken from a pool of spares (`session_jail.py`), so
sessions never share anything; closing it ends every process, mount and file of it.

Limits: per call (wall, CPU, output) in each request; session-wide memory, processes and disk by
the jail's cgroup and tmpfs; session wall time and number of calls by `Session` on the host.
"""
from __future__ import annotations

import dataclasses
import posixpath
import threading
import time
import uuid
from typing import Callable

from postrain.core.errors import PostrainError

from .audit import AuditLog
from .policy import PolicyError
from .result import ExecResult, Status
from .session_jail import SessionJail, SessionPool
from .warm import REPLY_GRACE_S, result_from_reply

class SessionClosed(PostrainError, RuntimeError):
    """The session has ended; `reason` says why: "closed", "session_wall_time_s", "max_calls",
    "jail_died", "reaped" (the sandbox actor's reaper: no call for its session_idle_timeout_s)."""

    def __init__(self, session_id: str, reason: str) -> None:
        fixes = {"closed": "open a new session",
                 "session_wall_time_s": "raise SessionLimits.session_wall_time_s or open a new session",
                 "max_calls": "raise SessionLimits.max_calls or open a new session",
                 "jail_died": "open a new session (the jail's process ended)",
                 "reaped": "keep the time between an episode's calls under the sandbox actor's "
                           "session_idle_timeout_s, or raise it in its options"}
        super().__init__(f"session {session_id} has ended ({reason}); fix: {fixes.get(reason, '')}")
        self.session_id = session_id
        self.reason = reason


class SessionFileError(PostrainError, OSError):
    """read_file or write_file failed inside the session; the message names the path and why."""


@dataclasses.dataclass(frozen=True)
class SessionLimits:
    """Limits of one session. Per call: call_*; the rest hold for the whole session."""

    call_wall_time_s: float = 10.0      # per call: wall clock (timeout_s overrides it for one call)
    call_cpu_time_s: int = 10           # per call: CPU seconds of each process
    call_max_output_bytes: int = 65536  # per call: bytes kept of stdout and of stderr; more: killed
    memory_mb: int = 512                # session: memory of its processes (cgroup; also per process)
    max_processes: int = 64             # session: processes at once (cgroup pids and RLIMIT_NPROC)
    work_dir_size_mb: int = 64          # session: size of /work (a tmpfs; its pages count as memory
                                        # on top of memory_mb)
    max_file_size_mb: int = 16          # per file written by the code; also read_file's cap
    max_open_files: int = 256           # per process
    session_wall_time_s: float = 600.0  # session: wall clock from open; then it ends
    max_calls: int = 256                # session: run, run_python, read_file and write_file calls

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise PolicyError(f"SessionLimits.{field.name} must be a finite number > 0, got "
                                  f"{value!r}; fix: pass a positive {field.name}")
            if field.type == "int" and not isinstance(value, int):
                raise PolicyError(f"SessionLimits.{field.name} must be a whole number, got {value!r}")
        if self.memory_mb < 32:
            raise PolicyError(f"SessionLimits.memory_mb must be >= 32, got {self.memory_mb}; "
                              f"fix: raise memory_mb")

    @classmethod
    def of(cls, value: "SessionLimits | dict | None", base: "SessionLimits | None" = None) -> "SessionLimits":
        """`value` as SessionLimits: itself, `base` (or the defaults) with a dict's fields, or `base`."""
        base = base or cls()
        if value is None or isinstance(value, cls):
            return value or base
        if not isinstance(value, dict):
            raise PolicyError(f"session limits must be a SessionLimits or a dict, got "
                              f"{type(value).__name__}; fix: pass e.g. {{'max_calls': 50}}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise PolicyError(f"unknown session limit(s) {unknown}; known: "
                              f"{[f.name for f in dataclasses.fields(cls)]}; fix: drop or rename them")
        return dataclasses.replace(base, **value)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def shape(self) -> tuple[int, int, int]:
        """What is fixed when a jail starts: (memory_mb, max_processes, work_dir_size_mb)."""
        return (self.memory_mb, self.max_processes, self.work_dir_size_mb)


def work_path(path: str) -> str:
    """`path` relative to /work ("a/b" or "/work/a/b" -> "a/b"); PolicyError outside /work."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise PolicyError(f"a session path must be a non-empty str, got {path!r}")
    relative = path[len("/work/"):] if path.startswith("/work/") else path
    normal = posixpath.normpath(relative)
    if relative.startswith("/") or normal == ".." or normal.startswith("../") or normal == ".":
        raise PolicyError(f"session paths must lie under /work, got {path!r}; fix: pass a path "
                          f"relative to /work (e.g. 'repo/app.py') or starting with /work/")
    return normal


class Session:
    """One open session. Calls are serialized (one at a time); `close()` may come from any thread
    and ends a call in flight. Invariant: end_reason is None iff the session is open."""

    def __init__(self, jail: SessionJail, limits: SessionLimits, *, audit: AuditLog | None = None,
                 requester: str = "local", retire: Callable[[SessionJail], None] | None = None) -> None:
        self.session_id = uuid.uuid4().hex[:16]
        self.limits = limits
        self.requester = requester
        self.num_calls = 0
        self.opened_at = time.monotonic()
        self.last_active = self.opened_at  # monotonic end of the latest call (the reaper reads it)
        self.end_reason: str | None = None
        self._jail = jail
        self._retire = retire or SessionJail.close  # how the jail ends once no call uses it
        self._audit = audit
        self._call_lock = threading.Lock()   # one call at a time
        self._state_lock = threading.Lock()  # end_reason, _in_call
        self._in_call = False
        if audit is not None:
            audit.record_session(event="open", session_id=self.session_id, requester=requester,
                                 limits=limits.to_dict())

    @property
    def closed(self) -> bool:
        return self.end_reason is not None

    @property
    def in_call(self) -> bool:
        """A call is running now."""
        return self._in_call

    # ------------------------------------------------------------ the calls
    def run(self, command: str, stdin: bytes | str | None = None, timeout_s: float | None = None) -> ExecResult:
        """Run a bash command line in the session; never raises for the command's own failure."""
        if not isinstance(command, str):
            raise PolicyError(f"a session command must be a str, got {type(command).__name__}")
        if "\0" in command:
            raise PolicyError("a session command must not contain NUL characters (bash cannot read "
                              "them); fix: pass binary data as stdin or through write_file")
        return self._exec({"command": command}, stdin, timeout_s, what=command)

    def run_python(self, code: str, stdin: bytes | str | None = None,
                   timeout_s: float | None = None) -> ExecResult:
        """Run a Python snippet (`python -c code`) in the session's cwd and environment."""
        if not isinstance(code, str):
            raise PolicyError(f"session Python code must be a str, got {type(code).__name__}")
        if "\0" in code:
            raise PolicyError("session Python code must not contain NUL characters (it is passed "
                              "as `python -c`); fix: write '\\0' as an escape inside the code")
        return self._exec({"code": code}, stdin, timeout_s, what=code)

    def read_file(self, path: str) -> bytes:
        """The bytes of a file under /work (SessionFileError: missing, a directory, too large)."""
        relative = work_path(path)
        limit = self.limits.max_file_size_mb * 1024 * 1024
        reply = self._file_request({"kind": "read_file", "path": relative, "max_bytes": limit}, path)
        return reply["data"]

    def snapshot(self) -> bytes:
        """The whole work dir as an uncompressed tar, taken by the agent (never by the code) while
        no call runs, so no process of the session exists to change it: what a grader checks
        (`postrain.sandbox.grader`). Entries the sandbox uid cannot read are left out; symlinks
        stay symlinks. SessionFileError if it exceeds work_dir_size_mb plus headers."""
        limit = (self.limits.work_dir_size_mb + 16) * 1024 * 1024
        return self._file_request({"kind": "snapshot", "max_bytes": limit}, "/work")["data"]

    def write_file(self, path: str, data: bytes | str) -> int:
        """Write a file under /work (parents made as needed); returns its size in bytes."""
        return self.write_files({path: data})

    def write_files(self, files: dict[str, bytes | str]) -> int:
        """Write several files in one call (how a task's files are laid into /work); returns the
        bytes written."""
        checked = {}
        for path, data in files.items():
            data = data.encode() if isinstance(data, str) else bytes(data)
            if len(data) > self.limits.max_file_size_mb * 1024 * 1024:
                raise SessionFileError(f"file {path!r}: {len(data)} bytes exceed max_file_size_mb="
                                       f"{self.limits.max_file_size_mb}; fix: write less or raise the limit")
            checked[work_path(path)] = data
        self._file_request({"kind": "write_files", "files": checked}, ", ".join(sorted(checked)))
        return sum(len(data) for data in checked.values())

    # ------------------------------------------------------------ ending
    def close(self, reason: str = "closed") -> None:
        """End the session (idempotent). Its jail is signalled at once and reaped in the background
        within milliseconds (`Sandbox.close` waits for that): every process, mount and file of it
        goes; no call can reach it any more."""
        with self._state_lock:
            if self.end_reason is not None:
                return
            self.end_reason = reason
            in_call = self._in_call
        if in_call:
            self._jail.terminate()  # the call's thread sees its reply fail and closes the jail
        else:
            self._retire(self._jail)
        if self._audit is not None:
            self._audit.record_session(event="close", session_id=self.session_id,
                                       requester=self.requester, reason=reason,
                                       num_calls=self.num_calls,
                                       wall_s=round(time.monotonic() - self.opened_at, 6))

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _begin(self) -> float:
        """Account one call; its time left in the session. SessionClosed if it has ended."""
        with self._state_lock:
            reason = self.end_reason
        if reason is not None:
            raise SessionClosed(self.session_id, reason)
        if self.num_calls >= self.limits.max_calls:
            self.close("max_calls")
            raise SessionClosed(self.session_id, "max_calls")
        remaining = self.limits.session_wall_time_s - (time.monotonic() - self.opened_at)
        if remaining <= 0:
            self.close("session_wall_time_s")
            raise SessionClosed(self.session_id, "session_wall_time_s")
        self.num_calls += 1
        with self._state_lock:
            self._in_call = True
        return remaining

    def _end_call(self) -> None:
        with self._state_lock:
            self._in_call = False
            ended = self.end_reason is not None
        self.last_active = time.monotonic()
        if ended:
            self._retire(self._jail)

    def _request(self, req: dict, timeout_s: float) -> dict | None:
        """The agent's reply, or None when the jail went away (the session then ends)."""
        try:
            return self._jail.request(req, timeout_s)
        except (OSError, TimeoutError, EOFError, ValueError):
            self.close("jail_died")
            return None

    def _exec(self, body: dict, stdin, timeout_s, *, what: str) -> ExecResult:
        limits = self.limits
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not 0 < timeout_s < float("inf")):
            raise PolicyError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        stdin = (stdin.encode() if isinstance(stdin, str) else bytes(stdin)) if stdin else b""
        with self._call_lock:
            remaining = self._begin()
            try:
                wall_s = min(float(timeout_s or limits.call_wall_time_s), remaining)
                req = {"kind": "exec", **body, "stdin": stdin, "wall_time_s": wall_s,
                       "cpu_time_s": limits.call_cpu_time_s, "memory_mb": limits.memory_mb,
                       "max_processes": limits.max_processes, "max_file_size_mb": limits.max_file_size_mb,
                       "max_open_files": limits.max_open_files,
                       "max_output_bytes": limits.call_max_output_bytes,
                       "work_dir_size_mb": limits.work_dir_size_mb, "stream": False}
                reply = self._request(req, wall_s + REPLY_GRACE_S)
            finally:
                self._end_call()
        if reply is None:
            raise SessionClosed(self.session_id, self.end_reason or "jail_died")
        result = result_from_reply(reply, cpu_limit_s=limits.call_cpu_time_s,
                                   memory_cgroup=self._jail.uses_memory_cgroup, mode="session")
        if result.status is Status.TIMEOUT and wall_s >= remaining:
            self.close("session_wall_time_s")
        if self._audit is not None:
            self._audit.record_session_call(session_id=self.session_id, requester=self.requester,
                                            kind="bash" if "command" in body else "python",
                                            source=what, stdin=stdin, result=result,
                                            call_index=self.num_calls)
        return result

    def _file_request(self, req: dict, what: str) -> dict:
        with self._call_lock:
            self._begin()
            try:
                reply = self._request(req, 30.0)
            finally:
                self._end_call()
        if reply is None:
            raise SessionClosed(self.session_id, self.end_reason or "jail_died")
        if "error" in reply:
            raise SessionFileError(f"{req['kind']} {what!r} failed in session {self.session_id}: "
                                   f"{reply['error']}")
        return reply


def open_session(pool: SessionPool, files: dict | None, limits: SessionLimits, *,
                 audit: AuditLog | None, requester: str) -> Session:
    """Take a jail of the limits' shape from the pool and lay `files` into its /work."""
    jail = pool.take(limits.shape)
    session = Session(jail, limits, audit=audit, requester=requester, retire=pool.retire)
    if files:
        try:
            session.write_files(files)
            session.num_calls = 0  # laying the task's files in is part of opening, not a call
        except BaseException:
            session.close()
            raise
    return session


class AsyncSession:
    """A `Session` for trio: the same methods, awaited; each call runs in a worker thread.

    Cancellation: a cancelled call stops waiting at once; the call itself still ends within its
    limits (the next call waits for it). Leaving `Sandbox.asession` closes the session even when
    cancelled."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def __getattr__(self, name):  # session_id, limits, num_calls, closed, end_reason
        return getattr(self.session, name)

    async def run(self, command: str, stdin: bytes | str | None = None,
                  timeout_s: float | None = None) -> ExecResult:
        return await self._in_thread(self.session.run, command, stdin, timeout_s)

    async def run_python(self, code: str, stdin: bytes | str | None = None,
                         timeout_s: float | None = None) -> ExecResult:
        return await self._in_thread(self.session.run_python, code, stdin, timeout_s)

    async def read_file(self, path: str) -> bytes:
        return await self._in_thread(self.session.read_file, path)

    async def write_file(self, path: str, data: bytes | str) -> int:
        return await self._in_thread(self.session.write_file, path, data)

    async def snapshot(self) -> bytes:
        return await self._in_thread(self.session.snapshot)

    async def close(self) -> None:
        import trio
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.session.close)

    @staticmethod
    async def _in_thread(fn, *args):
        import trio
        return await trio.to_thread.run_sync(lambda: fn(*args), abandon_on_cancel=True)
