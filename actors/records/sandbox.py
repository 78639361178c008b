"""The sandbox actor's messages (actors/sandbox/actor.py): executions, test runs, sessions, stats.

    env --ExecRequest--> sandbox (`exec`; `exec_stream` yields ExecStreamItem) --ExecReply--> env
    env --RunTestsRequest / RunIoCasesRequest--> sandbox --RunTestsReply / RunIoCasesReply--> env
    env --SessionOpenRequest--> sandbox --SessionOpened--> env; then SessionExecRequest (-> ExecReply),
        SessionReadFileRequest (-> SessionFileData), SessionWriteFileRequest (-> SessionFileWritten),
        SessionCloseRequest (-> SessionClosed)
    head --RESIZE (core's ResizeRequest)--> sandbox --(core's ResizeReply)-->;  `stats` -> SandboxStats

Bytes travel as bytes. `limits` of a request may change only the per-execution limits in
LIMIT_FIELDS (mounts, network and environment belong to the actor); the values are checked by
the actor's Policy when it runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrain.core.messages import MessageKind
from postrain.core.record import Record, RecordError, codec

LIMIT_FIELDS = ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_size_mb",
                "work_dir_size_mb", "max_open_files", "max_output_bytes")


def _check_limits(record: Record, limits: dict[str, Any] | None) -> None:
    unknown = sorted(set(limits or {}) - set(LIMIT_FIELDS))
    if unknown:
        raise RecordError(f"limits may set only {', '.join(LIMIT_FIELDS)}; got {unknown}; "
                          f"fix: drop those keys (mounts, network and env belong to the actor)")


@dataclass(frozen=True, slots=True)
class ExecRequest(Record):
    """`exec` and `exec_stream`: run `code` (python) with `stdin`, `files` {path: bytes} laid into
    its work dir, `argv`, and `limits` (LIMIT_FIELDS) over the actor's policy."""

    code: str
    stdin: bytes | str | None = None
    files: dict[str, Any] | None = None
    argv: list[str] | None = None
    limits: dict[str, Any] | None = None

    def _check(self) -> None:
        _check_limits(self, self.limits)


@dataclass(frozen=True, slots=True)
class ExecReply(Record):
    """One execution's result (a `postrain.sandbox.ExecResult` on the wire; `status` is its str
    value: ok, nonzero_exit, timeout, ...). Also the reply of `session_exec` (mode "session")."""

    status: str
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    mode: str = "cold"
    error: str = ""

    @classmethod
    def of(cls, result: Any) -> "ExecReply":   # a postrain.sandbox.ExecResult
        """The reply of an ExecResult."""
        return cls(status=result.status.value, exit_code=result.exit_code, signal=result.signal,
                   wall_s=float(result.wall_s), cpu_s=float(result.cpu_s), stdout=result.stdout,
                   stderr=result.stderr, stdout_truncated=result.stdout_truncated,
                   stderr_truncated=result.stderr_truncated, mode=result.mode, error=result.error)

    def to_result(self) -> Any:
        """The ExecResult (postrain.sandbox) this reply carries."""
        from postrain.sandbox import ExecResult, Status
        return ExecResult(Status(self.status), exit_code=self.exit_code, signal=self.signal,
                          wall_s=self.wall_s, cpu_s=self.cpu_s, stdout=self.stdout, stderr=self.stderr,
                          stdout_truncated=self.stdout_truncated, stderr_truncated=self.stderr_truncated,
                          mode=self.mode, error=self.error)


_EXEC_REPLY = codec(ExecReply.to_wire, ExecReply.from_wire)
_EXEC_REPLIES = codec(lambda replies: [r.to_wire() for r in replies],
                      lambda replies: [ExecReply.from_wire(r) for r in replies])


@dataclass(frozen=True, slots=True)
class ExecStreamItem(Record):
    """One item of `exec_stream`: output as it comes (kind "output": `name` stdout|stderr, `data`),
    then the result (kind "result": `result`)."""

    kind: str
    name: str | None = None
    data: bytes | None = None
    result: ExecReply | None = field(default=None, metadata=_EXEC_REPLY)

    def _check(self) -> None:
        if self.kind == "output" and not (self.name in ("stdout", "stderr") and self.data is not None):
            self.fail_field("name", self.name, "stdout or stderr, with data, for an output item")
        if (self.kind == "result") != (self.result is not None):
            self.fail_field("kind", self.kind, "'result' exactly when the item carries a result ('output' else)")


@dataclass(frozen=True, slots=True)
class RunTestsRequest(Record):
    """`run_tests`: pytest `tests` against `solution` (module `solution`), each test within
    `test_timeout_s`."""

    solution: str
    tests: str
    test_timeout_s: float = 2.0
    limits: dict[str, Any] | None = None

    def _check(self) -> None:
        _check_limits(self, self.limits)


@dataclass(frozen=True, slots=True)
class RunTestsReply(Record):
    """The `run_tests` report: passed {test name: bool}, errors {test name: message}, a collection
    error if the tests could not be collected, and the pytest run's result."""

    passed: dict[str, bool]
    errors: dict[str, str]
    result: ExecReply = field(metadata=_EXEC_REPLY)
    collect_error: str | None = None

    @classmethod
    def of(cls, report: Any) -> "RunTestsReply":   # a postrain.sandbox.TestReport
        """The reply of a `postrain.sandbox.TestReport`."""
        return cls(passed=dict(report.passed), errors=dict(report.errors), result=ExecReply.of(report.result),
                   collect_error=report.collect_error)


@dataclass(frozen=True, slots=True)
class RunIoCasesRequest(Record):
    """`run_io_cases`: `code` once per [stdin, expected stdout] case."""

    code: str
    cases: list[list[str]]
    limits: dict[str, Any] | None = None

    def _check(self) -> None:
        if any(len(case) != 2 for case in self.cases):
            self.fail_field("cases", self.cases, "a list of [stdin, expected] pairs")
        _check_limits(self, self.limits)


@dataclass(frozen=True, slots=True)
class RunIoCasesReply(Record):
    """A verdict and a result per case, in order."""

    passed: list[bool]
    results: list[ExecReply] = field(metadata=_EXEC_REPLIES)


@dataclass(frozen=True, slots=True)
class SessionOpenRequest(Record):
    """`session_open`: a jail for one episode with `files` {path: bytes} in its work dir;
    `limits`: `postrain.sandbox.SessionLimits` fields over the actor's session limits."""

    files: dict[str, Any] | None = None
    limits: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class SessionOpened(Record):
    """The `session_open` reply: the session's id and its limits (SessionLimits fields)."""

    session_id: str
    limits: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SessionExecRequest(Record):
    """`session_exec`: one call in a session: exactly one of `command` (bash) or `code` (python)."""

    session_id: str
    command: str | None = None
    code: str | None = None
    stdin: bytes | str | None = None
    timeout_s: float | None = None

    def _check(self) -> None:
        if (self.command is None) == (self.code is None):
            raise RecordError("session_exec needs exactly one of 'command' (bash) or 'code' (python) "
                              "as a str; fix: send {'session_id': ..., 'command': 'ls'}")


@dataclass(frozen=True, slots=True)
class SessionReadFileRequest(Record):
    """`session_read_file`: a file of the session's work dir (relative, or under /work)."""

    session_id: str
    path: str


@dataclass(frozen=True, slots=True)
class SessionFileData(Record):
    """The `session_read_file` reply."""

    data: bytes


@dataclass(frozen=True, slots=True)
class SessionWriteFileRequest(Record):
    """`session_write_file`: write `data` to `path` in the session's work dir."""

    session_id: str
    path: str
    data: bytes | str


@dataclass(frozen=True, slots=True)
class SessionFileWritten(Record):
    """The `session_write_file` reply: bytes written."""

    size: int


@dataclass(frozen=True, slots=True)
class SessionSnapshotRequest(Record):
    """`session_snapshot`: the session's work dir as a tar, for a grader (reply: SessionFileData)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class SessionCloseRequest(Record):
    """`session_close`: end the session now."""

    session_id: str


@dataclass(frozen=True, slots=True)
class SessionClosed(Record):
    """The `session_close` reply: calls served, seconds open, and why it ended (when a limit did)."""

    num_calls: int
    wall_s: float
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class SandboxStats(Record):
    """`stats`: executions by status so far, requests queued and running, workers, mode, sessions."""

    by_status: dict[str, int]
    queued: int
    running: int
    workers: int
    mode: str
    open_sessions: int
    max_sessions: int


# The sandbox actor's messages (actors/sandbox/actor.py).
EXEC = MessageKind("exec", ExecRequest, ExecReply)
EXEC_STREAM = MessageKind("exec_stream", ExecRequest, ExecStreamItem, stream=True)
RUN_TESTS = MessageKind("run_tests", RunTestsRequest, RunTestsReply)
RUN_IO_CASES = MessageKind("run_io_cases", RunIoCasesRequest, RunIoCasesReply)
SESSION_OPEN = MessageKind("session_open", SessionOpenRequest, SessionOpened)
SESSION_EXEC = MessageKind("session_exec", SessionExecRequest, ExecReply)
SESSION_READ_FILE = MessageKind("session_read_file", SessionReadFileRequest, SessionFileData)
SESSION_SNAPSHOT = MessageKind("session_snapshot", SessionSnapshotRequest, SessionFileData)
SESSION_WRITE_FILE = MessageKind("session_write_file", SessionWriteFileRequest, SessionFileWritten)
SESSION_CLOSE = MessageKind("session_close", SessionCloseRequest, SessionClosed)
SANDBOX_STATS = MessageKind("stats", None, SandboxStats)
