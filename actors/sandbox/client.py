"""The client side of the sandbox actor's sessions: a session on a remote sandbox actor, with
`postrain.sandbox.AsyncSession`'s methods, so a tool takes either.

    async with remote_session(sandbox_ref, files={"data/n.txt": b"20\\n"}) as s:
        result = await s.run("cat data/n.txt")            # an ExecResult

Every request is a record of actors/records/sandbox.py; the actor is actors/sandbox/actor.py.
"""
from __future__ import annotations

import contextlib

import anyio

from postrain.core.errors import PostrainError, RemoteError
from postrain.sandbox import ExecResult, SessionFileError

from ..records import (SESSION_CLOSE, SESSION_EXEC, SESSION_OPEN, SESSION_READ_FILE, SESSION_SNAPSHOT,
                       SESSION_WRITE_FILE, SessionClosed, SessionCloseRequest, SessionExecRequest,
                       SessionOpenRequest, SessionReadFileRequest, SessionSnapshotRequest,
                       SessionWriteFileRequest)

ASK_SLACK_S = 300.0  # waiting for a worker or a session slot, on top of a call's own wall limit
FILE_CALL_S = 30.0   # a file request's own limit in the session (sandbox/session.py, _file_request)


class RemoteSession:
    """A session of a sandbox actor (`session_id`, its `limits`: SessionLimits fields). Open it
    with `remote_session(ref, ...)`. Every call that takes a worker (commands, file reads and
    writes, snapshots) waits for one up to ASK_SLACK_S beyond its own limit, as queued work on a
    busy pool does. Each call cancelled: the caller stops waiting; the call ends remotely within
    the session's limits (the session's next call waits for it)."""

    def __init__(self, ref, session_id: str, limits: dict) -> None:
        self.ref = ref
        self.session_id = session_id
        self.limits = limits

    async def run(self, command: str, stdin: bytes | str | None = None,
                  timeout_s: float | None = None) -> ExecResult:
        return await self._exec(SessionExecRequest(self.session_id, command=command, stdin=stdin,
                                                   timeout_s=_seconds(timeout_s)))

    async def run_python(self, code: str, stdin: bytes | str | None = None,
                         timeout_s: float | None = None) -> ExecResult:
        return await self._exec(SessionExecRequest(self.session_id, code=code, stdin=stdin,
                                                   timeout_s=_seconds(timeout_s)))

    async def read_file(self, path: str) -> bytes:
        request = SessionReadFileRequest(self.session_id, path)
        return (await self.ref.call(SESSION_READ_FILE, request, timeout_s=FILE_CALL_S + ASK_SLACK_S)).data

    async def snapshot(self) -> bytes:
        """The work dir as a tar (`Session.snapshot`), what a grader checks."""
        request = SessionSnapshotRequest(self.session_id)
        return (await self.ref.call(SESSION_SNAPSHOT, request, timeout_s=ASK_SLACK_S)).data

    async def write_file(self, path: str, data: bytes | str) -> int:
        request = SessionWriteFileRequest(self.session_id, path, data)
        return (await self.ref.call(SESSION_WRITE_FILE, request, timeout_s=FILE_CALL_S + ASK_SLACK_S)).size

    async def close(self) -> SessionClosed:
        request = SessionCloseRequest(self.session_id)
        return await self.ref.call(SESSION_CLOSE, request)

    async def _exec(self, request: SessionExecRequest) -> ExecResult:
        wall_s = float(request.timeout_s or self.limits["call_wall_time_s"])
        reply = await self.ref.call(SESSION_EXEC, request, timeout_s=wall_s + ASK_SLACK_S)
        return reply.to_result()


def is_file_error(exc: BaseException) -> bool:
    """A session's answer that the file asked for is not there to read (missing, a directory, too
    large: `SessionFileError`, raised here or on a sandbox actor), as against the session or the
    actor failing (closed, reaped, dead, timed out), which is the infrastructure's failure."""
    return isinstance(exc, SessionFileError) or (isinstance(exc, RemoteError)
                                                 and exc.error_type == "SessionFileError")


def _seconds(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else float(timeout_s)


@contextlib.asynccontextmanager
async def remote_session(ref, files: dict | None = None, limits: dict | None = None):
    """`async with remote_session(sandbox_ref, files=...) as s: await s.run("ls")`; the session is
    closed on the way out, even when cancelled (a lost actor: the reaper closes it)."""
    request = SessionOpenRequest(files=files or None, limits=dict(limits) if limits else None)
    opened = await ref.call(SESSION_OPEN, request, timeout_s=ASK_SLACK_S)
    session = RemoteSession(ref, opened.session_id, opened.limits)
    try:
        yield session
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await session.close()
            except PostrainError:
                pass  # the actor is gone or has reaped it: nothing of the session is left
