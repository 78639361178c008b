"""The sandbox actor: serves code-execution requests over the microkernel.

It owns one `postrain.sandbox.Sandbox` (a warm pool by default) and runs as many executions at
once as it has workers (`num_workers`, by default one per core of its CPU share); the rest wait
in its queue, up to `max_queued`, beyond which a request is refused with `SandboxQueueFull` (the
head's balancer sees them as `queued` in the heartbeat load and can add workers). Every execution is
audited (JSONL) when `audit_log` is set; the requester recorded is the sender's actor name.

Handlers (every body and reply a record of actors/records/sandbox.py; bytes travel as bytes):

    exec                ExecRequest -> ExecReply (status, exit_code, signal, wall_s, cpu_s, stdout, ...)
    exec_stream         ExecRequest -> ExecStreamItem (kind "output": name, data)..., then one with
                        kind "result" and the ExecReply
    run_tests           RunTestsRequest -> RunTestsReply {passed: {name: bool}, errors, collect_error, result}
    run_io_cases        RunIoCasesRequest -> RunIoCasesReply {passed: [bool], results}
    session_open        SessionOpenRequest {files?, limits?: SessionLimits fields} -> SessionOpened
                        {session_id, limits}: a jail for one episode (waits in the queue while the
                        actor has max_sessions_per_worker * num_workers sessions open)
    session_exec        SessionExecRequest {session_id, command (bash) | code (python), stdin?,
                        timeout_s?} -> ExecReply (mode "session")
    session_read_file   SessionReadFileRequest {session_id, path} -> SessionFileData {data}
    session_snapshot    SessionSnapshotRequest {session_id} -> SessionFileData {data: a tar of /work}
    session_write_file  SessionWriteFileRequest {session_id, path, data} -> SessionFileWritten {size}
    session_close       SessionCloseRequest {session_id} -> SessionClosed {num_calls, wall_s, reason}
    stats               no body -> SandboxStats: counters by status, queued, running, open sessions
    resize              core's ResizeRequest {num_workers, cpu_ids?} -> ResizeReply {num_workers,
                        previous}: grow or shrink the warm pool (the head's balancer sends it); with
                        cpu_ids the actor first re-pins itself to the cores the scheduler now
                        reserves for it, so new workers run there

The client side of sessions (`remote_session`) is actors/sandbox/client.py.

A session belongs to the actor that opened it (others get UnknownSession, as does an id that
was closed or reaped). The reaper closes a session with no call for `session_idle_timeout_s`
(its episode vanished: the environment died or forgot it), never one with a call queued for a
worker or running, however long the queue; a session's own limits end it too,
and every session ends with the actor. Session calls share the workers with executions: they
count as queued and running in the load, and opens waiting for a session slot count as queued,
so the balancer grows the pool (and with it the session cap) by both.

`limits` may change the per-execution limits of the actor's policy (records.LIMIT_FIELDS:
wall_time_s, cpu_time_s, memory_mb, max_processes, ...); a bad value comes back as a
RemoteError naming the field.

Options: `SandboxOptions` below (the config reference in the docs lists them).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import time
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.to_thread
from pydantic import Field, field_validator

from postrain.core import RESIZE, Actor, Load, Options, ResizeReply, ResizeRequest, handler
from postrain.core.errors import PostrainError
from postrain.sandbox import (ExecResult, Policy, PolicyError, Sandbox, Session, SessionLimits, run_io_cases,
                              run_tests)

from ..records import (EXEC, EXEC_STREAM, RUN_IO_CASES, RUN_TESTS, SANDBOX_STATS, SESSION_CLOSE, SESSION_EXEC,
                       SESSION_OPEN, SESSION_READ_FILE, SESSION_SNAPSHOT, SESSION_WRITE_FILE, ExecReply,
                       ExecRequest, ExecStreamItem, RunIoCasesReply, RunIoCasesRequest, RunTestsReply,
                       RunTestsRequest, SandboxStats, SessionClosed, SessionCloseRequest, SessionExecRequest,
                       SessionFileData, SessionFileWritten, SessionOpened, SessionOpenRequest,
                       SessionReadFileRequest, SessionSnapshotRequest, SessionWriteFileRequest)


class SandboxQueueFull(PostrainError, RuntimeError):
    """More requests are waiting than `max_queued`; retry later or add sandbox workers."""


class UnknownSession(PostrainError, KeyError):
    """No open session of this id belongs to the asking actor (never opened, closed or reaped)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _policy(fields: dict[str, Any]) -> Policy:
    converted: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return Policy(**converted)


@dataclasses.dataclass
class OpenSession:
    session: Session
    owner: str      # the actor that opened it; the only one that may use it
    slot: object    # its token of SandboxActor.session_slots
    num_calls: int = 0   # its calls received and not yet answered, queued for a worker or running:
                         # the reaper never closes a session that has one (its episode is alive)


class SandboxOptions(Options):
    mode: Literal["warm", "cold"] = Field("warm", description="'warm': a pool of ready jails (fast); "
                                          "'cold': a fresh nsjail per execution")
    num_workers: int | None = Field(None, ge=1, description="executions at once (warm workers); "
                                    "none: one per core of the actor's CPU share")
    policy: dict[str, Any] = Field(default_factory=dict, description="`postrain.sandbox.Policy` fields: "
                                   "wall_time_s, cpu_time_s, memory_mb, max_processes, ... (the jail's limits)")
    audit_log: str | None = Field(None, description="append one JSONL audit record per execution to this file")
    max_queued: int = Field(1024, ge=0, description="requests that may wait for a worker; beyond it a "
                            "request is refused with SandboxQueueFull")
    max_sessions_per_worker: int = Field(16, ge=1, description="open sessions per worker; opens beyond "
                                         "num_workers * this wait in the queue (an open session mostly "
                                         "waits for its model between calls; idle, it holds under 10 MB "
                                         "besides its files)")
    session_idle_timeout_s: float = Field(300.0, gt=0, description="a session with no call for this "
                                          "long is closed by the reaper (its episode vanished)")
    session_limits: dict[str, Any] = Field(default_factory=dict, description="default "
                                           "`postrain.sandbox.SessionLimits` fields of this actor's "
                                           "sessions (a session_open's limits change them further)")
    num_spare_sessions: int = Field(2, ge=0, description="session jails kept started ahead, so an "
                                    "open takes one instead of starting nsjail")

    @field_validator("session_limits")
    @classmethod
    def _check_session_limits(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            SessionLimits.of(value)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, value: dict[str, Any]) -> dict[str, Any]:
        known = {f.name for f in dataclasses.fields(Policy)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown Policy field(s) {unknown}; known: {sorted(known)}")
        try:
            _policy(value)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        return value


class SandboxActor(Actor):
    Options = SandboxOptions

    async def setup(self) -> None:
        """Start the sandbox (its warm workers). Cancelled: the process is ending (a start past
        its timeout); its workers die with it."""
        opts = self.options
        self.num_workers = opts.num_workers or max(1, len(os.sched_getaffinity(0)))
        self.max_queued = opts.max_queued
        make = functools.partial(Sandbox, _policy(opts.policy), mode=opts.mode,
                                 num_workers=self.num_workers, audit_log=opts.audit_log,
                                 num_spare_sessions=opts.num_spare_sessions)
        self.sandbox = await anyio.to_thread.run_sync(make)
        self.session_limits = SessionLimits.of(opts.session_limits)
        if opts.num_spare_sessions:
            self.sandbox.prewarm_sessions(self.session_limits)
        self.sessions: dict[str, OpenSession] = {}  # each holds one of session_slots' tokens
        self.session_slots = anyio.CapacityLimiter(self.num_workers * opts.max_sessions_per_worker)
        self.node.spawn(self._reap_sessions)
        self.limiter = anyio.CapacityLimiter(self.num_workers)
        self.num_queued = 0   # requests waiting for a worker; invariant: 0 <= num_queued
        self.num_running = 0  # executions in flight; 0 <= num_running <= num_workers (after a shrink:
        #                       once the surplus runs end)
        self.status_counts: collections.Counter[str] = collections.Counter()

    async def teardown(self) -> None:
        """Close the sandbox. Cancelled: the close still runs to its end in its thread."""
        await anyio.to_thread.run_sync(self.sandbox.close)

    def load(self) -> Load:
        """A pool's load: executions waiting, running, and the workers (it handles RESIZE)."""
        return super().load().replace(queued=self.num_queued, running=self.num_running,
                                      workers=self.num_workers,
                                      figures={"open_sessions": len(self.sessions),
                                               "max_sessions": int(self.session_slots.total_tokens)})

    # ------------------------------------------------------------ handlers
    @handler(EXEC, concurrent=True)
    async def exec(self, request: ExecRequest, msg) -> ExecReply:
        """One execution's result. Cancelled: as `_in_worker` (queued: nothing ran; running: it
        still ends within its wall limit and frees its worker)."""
        kwargs = self._run_kwargs(request, msg.sender)
        return ExecReply.of(await self._in_worker(self.sandbox.run, **kwargs))

    @handler(EXEC_STREAM, concurrent=True)
    async def exec_stream(self, request: ExecRequest, msg):
        """Output chunks as they arrive, then the result. Cancelled (the caller stops reading):
        the run goes on in the node's task group until it ends within its limits; its chunks
        are dropped."""
        kwargs = self._run_kwargs(request, msg.sender)
        send, receive = anyio.create_memory_object_stream[ExecStreamItem | Exception](
            max_buffer_size=math.inf)

        def on_output(name: str, data: bytes) -> None:  # in the worker thread
            try:
                anyio.from_thread.run_sync(send.send_nowait, ExecStreamItem("output", name=name, data=data))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the caller stopped listening; the run still ends within its limits

        async def execute() -> None:
            """Run it and hand the result to the reader. Cancelled (the node closes): as
            `_in_worker`; the reader gets no result."""
            async with send:
                try:
                    result = await self._in_worker(self.sandbox.run, on_output=on_output, **kwargs)
                    item: ExecStreamItem | Exception = ExecStreamItem("result", result=ExecReply.of(result))
                except Exception as exc:  # noqa: BLE001 - handed to the stream's reader
                    item = exc
                try:
                    send.send_nowait(item)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass

        self.node.spawn(execute)  # runs in the node's task group; this generator only reads
        async with receive:
            async for item in receive:
                if isinstance(item, Exception):
                    raise item
                yield item

    @handler(RUN_TESTS, concurrent=True)
    async def run_tests(self, request: RunTestsRequest, msg) -> RunTestsReply:
        """The test report of a solution. Cancelled: as `exec`."""
        report = await self._in_worker(run_tests, self.sandbox, request.solution, request.tests,
                                       test_timeout_s=float(request.test_timeout_s),
                                       policy=self._policy(request.limits), requester=msg.sender)
        return RunTestsReply.of(report)

    @handler(RUN_IO_CASES, concurrent=True)
    async def run_io_cases(self, request: RunIoCasesRequest, msg) -> RunIoCasesReply:
        """A verdict per stdin/expected case. Cancelled: as `exec`."""
        cases = [(str(stdin), str(expected)) for stdin, expected in request.cases]
        verdicts = await self._in_worker(run_io_cases, self.sandbox, request.code, cases,
                                         policy=self._policy(request.limits), requester=msg.sender)
        return RunIoCasesReply(passed=[v.passed for v in verdicts],
                               results=[ExecReply.of(v.result) for v in verdicts])

    @handler(SESSION_OPEN, concurrent=True)
    async def session_open(self, request: SessionOpenRequest, msg) -> SessionOpened:
        """A new session's id. Waits (counted as queued) while all session slots are taken.
        Cancelled while waiting: nothing opened; while opening: the open finishes in its thread
        and the session is closed at once."""
        limits = SessionLimits.of(request.limits, self.session_limits)
        slot = object()
        await self._queued(self.session_slots.acquire_on_behalf_of(slot))
        opened = None
        try:
            opened = await anyio.to_thread.run_sync(functools.partial(
                self.sandbox.session, request.files or None, limits, requester=msg.sender),
                limiter=_unlimited())
        finally:
            if opened is None:
                self.session_slots.release_on_behalf_of(slot)
        self.sessions[opened.session_id] = OpenSession(opened, msg.sender, slot)
        return SessionOpened(session_id=opened.session_id, limits=limits.to_dict())

    @handler(SESSION_EXEC, concurrent=True)
    async def session_exec(self, request: SessionExecRequest, msg) -> ExecReply:
        """A call's result. Cancelled: as `exec` (the session's next call waits for it)."""
        with self._calling(request.session_id, msg.sender) as session:
            run, source = (session.run, request.command) if request.command is not None else \
                (session.run_python, request.code)
            return ExecReply.of(await self._in_worker(run, source, request.stdin, request.timeout_s))

    @handler(SESSION_READ_FILE, concurrent=True)
    async def session_read_file(self, request: SessionReadFileRequest, msg) -> SessionFileData:
        """The file's bytes. Cancelled: the read finishes in its thread."""
        with self._calling(request.session_id, msg.sender) as session:
            return SessionFileData(await self._in_worker(session.read_file, request.path))

    @handler(SESSION_SNAPSHOT, concurrent=True)
    async def session_snapshot(self, request: SessionSnapshotRequest, msg) -> SessionFileData:
        """The work dir as a tar, for a grader (`Session.snapshot`). Cancelled: it finishes in its thread."""
        with self._calling(request.session_id, msg.sender) as session:
            return SessionFileData(await self._in_worker(session.snapshot))

    @handler(SESSION_WRITE_FILE, concurrent=True)
    async def session_write_file(self, request: SessionWriteFileRequest, msg) -> SessionFileWritten:
        """Bytes written. Cancelled: the write finishes in its thread."""
        with self._calling(request.session_id, msg.sender) as session:
            return SessionFileWritten(await self._in_worker(session.write_file, request.path, request.data))

    @handler(SESSION_CLOSE, concurrent=True)
    async def session_close(self, request: SessionCloseRequest, msg) -> SessionClosed:
        """Calls, seconds open, end reason. Cancelled: the session is gone already (atomic)."""
        session = self._entry(request.session_id, msg.sender).session
        self._forget(session)
        await anyio.to_thread.run_sync(session.close, limiter=_unlimited())
        return SessionClosed(num_calls=session.num_calls, reason=session.end_reason,
                             wall_s=round(time.monotonic() - session.opened_at, 6))

    @handler(RESIZE)
    async def resize(self, request: ResizeRequest) -> ResizeReply:
        """The kernel's pool protocol (core/load.py). Runs in flight finish; surplus workers
        close when idle. Cancelled while new workers start: atomic; the thread call cannot be
        abandoned, so the pool, num_workers and the limiter all end at the asked size."""
        num_workers = request.num_workers
        if request.cpu_ids:
            pin_process(request.cpu_ids)
        previous = self.num_workers
        await anyio.to_thread.run_sync(self.sandbox.resize, num_workers, limiter=_unlimited())
        self.num_workers = num_workers
        self.limiter.total_tokens = num_workers
        self.session_slots.total_tokens = num_workers * self.options.max_sessions_per_worker
        return ResizeReply(num_workers=num_workers, previous=previous)

    @handler(SANDBOX_STATS)
    async def stats(self, body: None) -> SandboxStats:
        """Counters by status, queued, running, workers. Does not wait (cancel-safe)."""
        return SandboxStats(by_status=dict(self.status_counts), queued=self.num_queued,
                            running=self.num_running, workers=self.num_workers, mode=self.sandbox.mode,
                            open_sessions=len(self.sessions),
                            max_sessions=int(self.session_slots.total_tokens))

    # ------------------------------------------------------------ internals
    def _policy(self, limits: dict | None) -> Policy:
        """The actor's policy with a request's `limits` (their keys checked by its record)."""
        return self.sandbox.policy.replace(**limits) if limits else self.sandbox.policy

    def _run_kwargs(self, request: ExecRequest, sender: str) -> dict:
        stdin = request.stdin or b""
        return {"code": request.code, "stdin": stdin.encode() if isinstance(stdin, str) else stdin,
                "files": request.files or None, "argv": list(request.argv or []),
                "policy": self._policy(request.limits), "requester": sender}

    def _entry(self, session_id: str, sender: str) -> OpenSession:
        entry = self.sessions.get(session_id)
        if entry is None or entry.owner != sender:
            raise UnknownSession(f"no open session {session_id!r} of {sender!r} (never "
                                 f"opened, closed, or reaped after session_idle_timeout_s="
                                 f"{self.options.session_idle_timeout_s}); fix: session_open a new one")
        return entry

    @contextlib.contextmanager
    def _calling(self, session_id: str, sender: str):
        """The session of one call, counted in its `num_calls` until the call is answered: a call
        queued behind other work keeps its session from the reaper however long it waits."""
        entry = self._entry(session_id, sender)
        entry.num_calls += 1
        try:
            yield entry.session
        finally:
            entry.num_calls -= 1

    def _forget(self, session: Session) -> None:
        """Drop a session from the table and free its slot (once)."""
        entry = self.sessions.pop(session.session_id, None)
        if entry is not None:
            self.session_slots.release_on_behalf_of(entry.slot)

    async def _reap_sessions(self) -> None:
        """Close sessions idle past session_idle_timeout_s. Runs until the process ends;
        cancelled between checks (atomic)."""
        timeout_s = self.options.session_idle_timeout_s
        while True:
            await anyio.sleep(min(timeout_s / 4, 5.0))
            now = time.monotonic()
            for entry in list(self.sessions.values()):
                session = entry.session
                if now - session.last_active > timeout_s and not session.in_call and not entry.num_calls:
                    self._forget(session)
                    await anyio.to_thread.run_sync(session.close, "reaped", limiter=_unlimited())

    async def _queued(self, wait):
        """Await `wait` (a worker or a session slot), counted as queued; SandboxQueueFull beyond
        max_queued. Cancelled: nothing was taken."""
        if self.num_queued >= self.max_queued:
            raise SandboxQueueFull(f"sandbox queue is full ({self.num_queued} waiting, max_queued="
                                   f"{self.max_queued}); fix: retry later or add sandbox workers")
        self.num_queued += 1
        try:
            await wait
        finally:
            self.num_queued -= 1

    async def _in_worker(self, fn, *args, **kwargs):
        """Run a blocking sandbox call in a thread once a worker is free.

        Cancelled while queued: nothing ran. Cancelled while running: the caller stops waiting;
        the execution still ends within its wall limit and frees its worker."""
        await self._queued(self.limiter.acquire())
        self.num_running += 1
        try:
            result = await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs),
                                                    limiter=_unlimited(), abandon_on_cancel=True)
        finally:
            self.num_running -= 1
            self.limiter.release()
        for res in _results_of(result):
            self.status_counts[res.status.value] += 1
        return result


def pin_process(cpu_ids) -> None:
    """Pin every thread of this process (and so the workers it starts next) to `cpu_ids`."""
    cores = {int(c) for c in cpu_ids}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass  # the thread ended meanwhile


def _results_of(value) -> list[ExecResult]:
    """The execution results in a sandbox call's return value (none for file calls)."""
    if isinstance(value, ExecResult):
        return [value]
    if isinstance(value, list):
        return [v.result for v in value]
    result = getattr(value, "result", None)
    return [result] if isinstance(result, ExecResult) else []


_UNLIMITED = None


def _unlimited():
    """A thread limiter big enough that only our own CapacityLimiter decides concurrency."""
    global _UNLIMITED
    if _UNLIMITED is None:
        _UNLIMITED = anyio.CapacityLimiter(10_000)
    return _UNLIMITED
