"""The sandbox actor: serves code-execution requests over the microkernel.

It owns one `postrain.sandbox.Sandbox` (a warm pool by default) and runs as many executions at
once as it has workers (`num_workers`, by default one per core of its CPU share); the rest wait
in its queue, up to `max_queued`, beyond which a request is refused with `SandboxQueueFull` (the
head's balancer sees them as `queued` in the heartbeat load and can add workers). Every execution is
audited (JSONL) when `audit_log` is set; the requester recorded is the sender's actor name.

Handlers (bodies are msgpack maps; bytes travel as bytes):

    exec          {code, stdin?, files?, argv?, limits?}  -> result map (status, exit_code, signal,
                                                             wall_s, cpu_s, stdout, stderr, ...)
    exec_stream   same body -> {"kind": "output", "name": "stdout"|"stderr", "data": bytes}...,
                               then {"kind": "result", ...the exec result map}
    run_tests     {solution, tests, test_timeout_s?, limits?} -> {passed: {name: bool}, errors,
                                                                  collect_error, result}
    run_io_cases  {code, cases: [[stdin, expected], ...], limits?} -> {passed: [bool], results}
    session_open        {files?: {path: bytes}, limits?: {SessionLimits fields}}
                        -> {session_id, limits}: a jail for one episode (waits in the queue while
                        the actor has max_sessions_per_worker * num_workers sessions open)
    session_exec        {session_id, command? (bash) | code? (python), stdin?, timeout_s?}
                        -> the exec result map (mode "session")
    session_read_file   {session_id, path} -> {data: bytes}
    session_write_file  {session_id, path, data} -> {size}
    session_close       {session_id} -> {num_calls, wall_s, reason}
    stats         {} -> counters by status, queued, running, open sessions
    resize        {num_workers, cpu_ids?} -> {num_workers, previous}: grow or shrink the warm
                  pool (the head's balancer sends it); with cpu_ids the actor first re-pins itself
                  to the cores the scheduler now reserves for it, so new workers run there

A session belongs to the actor that opened it (others get UnknownSession, as does an id that
was closed or reaped). The reaper closes a session with no call for `session_idle_timeout_s`
(its episode vanished: the environment died or forgot it); a session's own limits end it too,
and every session ends with the actor. Session calls share the workers with executions: they
count as queued and running in the load, and opens waiting for a session slot count as queued,
so the balancer grows the pool (and with it the session cap) by both.

`limits` may change the per-execution limits of the actor's policy (wall_time_s, cpu_time_s,
memory_mb, max_processes, max_file_size_mb, work_dir_size_mb, max_open_files,
max_output_bytes); a bad value comes back as a RemoteError naming the field.

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

from postrain.core import RESIZE, Actor, Load, Options, ResizeRequest, handler
from postrain.core.errors import PostrainError
from postrain.sandbox import (ExecResult, Policy, PolicyError, Sandbox, Session, SessionLimits,
                              Status, run_io_cases, run_tests)

LIMIT_FIELDS = ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_size_mb",
                "work_dir_size_mb", "max_open_files", "max_output_bytes")


class SandboxQueueFull(PostrainError, RuntimeError):
    """More requests are waiting than `max_queued`; retry later or add sandbox workers."""


class UnknownSession(PostrainError, KeyError):
    """No open session of this id belongs to the asking actor (never opened, closed or reaped)."""

    def __str__(self) -> str:
        return str(self.args[0])


def result_from_wire(data: dict) -> ExecResult:
    """The ExecResult a result map (`result_to_wire`) carries."""
    fields = {k: data[k] for k in ("exit_code", "signal", "wall_s", "cpu_s", "stdout", "stderr",
                                   "stdout_truncated", "stderr_truncated", "mode", "error") if k in data}
    return ExecResult(Status(data["status"]), **fields)


def result_to_wire(result: ExecResult) -> dict:
    return {"status": result.status.value, "exit_code": result.exit_code, "signal": result.signal,
            "wall_s": result.wall_s, "cpu_s": result.cpu_s, "stdout": result.stdout,
            "stderr": result.stderr, "stdout_truncated": result.stdout_truncated,
            "stderr_truncated": result.stderr_truncated, "mode": result.mode, "error": result.error}


def _policy(fields: dict[str, Any]) -> Policy:
    return Policy(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


@dataclasses.dataclass
class OpenSession:
    session: Session
    owner: str      # the actor that opened it; the only one that may use it
    slot: object    # its token of SandboxActor.session_slots


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
    @handler("exec", concurrent=True)
    async def exec(self, body, msg):
        """One execution's result. Cancelled: as `_in_worker` (queued: nothing ran; running: it
        still ends within its wall limit and frees its worker)."""
        kwargs = self._run_kwargs(body, msg.sender)
        return result_to_wire(await self._in_worker(self.sandbox.run, **kwargs))

    @handler("exec_stream", stream=True, concurrent=True)
    async def exec_stream(self, body, msg):
        """Output chunks as they arrive, then the result. Cancelled (the caller stops reading):
        the run goes on in the node's task group until it ends within its limits; its chunks
        are dropped."""
        kwargs = self._run_kwargs(body, msg.sender)
        send, receive = anyio.create_memory_object_stream(max_buffer_size=math.inf)

        def on_output(name: str, data: bytes) -> None:  # in the worker thread
            try:
                anyio.from_thread.run_sync(send.send_nowait,
                                           {"kind": "output", "name": name, "data": data})
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the caller stopped listening; the run still ends within its limits

        async def execute() -> None:
            """Run it and hand the result to the reader. Cancelled (the node closes): as
            `_in_worker`; the reader gets no result."""
            async with send:
                try:
                    result = await self._in_worker(self.sandbox.run, on_output=on_output, **kwargs)
                    item = {"kind": "result", **result_to_wire(result)}
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

    @handler("run_tests", concurrent=True)
    async def run_tests(self, body, msg):
        """The test report of a solution. Cancelled: as `exec`."""
        policy = self._policy(body.get("limits"))
        report = await self._in_worker(run_tests, self.sandbox, body["solution"], body["tests"],
                                       test_timeout_s=float(body.get("test_timeout_s", 2.0)),
                                       policy=policy, requester=msg.sender)
        return {"passed": report.passed, "errors": report.errors,
                "collect_error": report.collect_error, "result": result_to_wire(report.result)}

    @handler("run_io_cases", concurrent=True)
    async def run_io_cases(self, body, msg):
        """A verdict per stdin/expected case. Cancelled: as `exec`."""
        policy = self._policy(body.get("limits"))
        cases = [(str(stdin), str(expected)) for stdin, expected in body["cases"]]
        verdicts = await self._in_worker(run_io_cases, self.sandbox, body["code"], cases,
                                         policy=policy, requester=msg.sender)
        return {"passed": [v.passed for v in verdicts],
                "results": [result_to_wire(v.result) for v in verdicts]}

    @handler("session_open", concurrent=True)
    async def session_open(self, body, msg):
        """A new session's id. Waits (counted as queued) while all session slots are taken.
        Cancelled while waiting: nothing opened; while opening: the open finishes in its thread
        and the session is closed at once."""
        body = _map(body, "session_open")
        limits = SessionLimits.of(body.get("limits"), self.session_limits)
        files = body.get("files") or None
        slot = object()
        await self._queued(self.session_slots.acquire_on_behalf_of(slot))
        opened = None
        try:
            opened = await anyio.to_thread.run_sync(functools.partial(
                self.sandbox.session, files, limits, requester=msg.sender), limiter=_unlimited())
        finally:
            if opened is None:
                self.session_slots.release_on_behalf_of(slot)
        self.sessions[opened.session_id] = OpenSession(opened, msg.sender, slot)
        return {"session_id": opened.session_id, "limits": limits.to_dict()}

    @handler("session_exec", concurrent=True)
    async def session_exec(self, body, msg):
        """A call's result map. Cancelled: as `exec` (the session's next call waits for it)."""
        body = _map(body, "session_exec")
        session = self._session(body, msg.sender)
        has_command, has_code = isinstance(body.get("command"), str), isinstance(body.get("code"), str)
        if has_command == has_code:
            raise PolicyError("session_exec needs exactly one of 'command' (bash) or 'code' (python) "
                              "as a str; fix: send {'session_id': ..., 'command': 'ls'}")
        run = session.run if has_command else session.run_python
        result = await self._in_worker(run, body["command"] if has_command else body["code"],
                                       body.get("stdin"), body.get("timeout_s"))
        return result_to_wire(result)

    @handler("session_read_file", concurrent=True)
    async def session_read_file(self, body, msg):
        """{data}. Cancelled: the read finishes in its thread."""
        body = _map(body, "session_read_file")
        session = self._session(body, msg.sender)
        return {"data": await self._in_worker(session.read_file, body.get("path"))}

    @handler("session_write_file", concurrent=True)
    async def session_write_file(self, body, msg):
        """{size}. Cancelled: the write finishes in its thread."""
        body = _map(body, "session_write_file")
        session = self._session(body, msg.sender)
        data = body.get("data")
        if not isinstance(data, (bytes, str)):
            raise PolicyError(f"session_write_file needs 'data' as bytes or str, got "
                              f"{type(data).__name__}")
        return {"size": await self._in_worker(session.write_file, body.get("path"), data)}

    @handler("session_close", concurrent=True)
    async def session_close(self, body, msg):
        """{num_calls, wall_s, reason}. Cancelled: the session is gone already (atomic)."""
        session = self._session(_map(body, "session_close"), msg.sender)
        self._forget(session)
        await anyio.to_thread.run_sync(session.close, limiter=_unlimited())
        return {"num_calls": session.num_calls, "reason": session.end_reason,
                "wall_s": round(time.monotonic() - session.opened_at, 6)}

    @handler(RESIZE)
    async def resize(self, body):
        """The kernel's pool protocol (core/load.py). Runs in flight finish; surplus workers
        close when idle. Cancelled while new workers start: atomic; the thread call cannot be
        abandoned, so the pool, num_workers and the limiter all end at the asked size."""
        request = ResizeRequest.from_wire(body)
        num_workers = request.num_workers
        if request.cpu_ids:
            pin_process(request.cpu_ids)
        previous = self.num_workers
        await anyio.to_thread.run_sync(self.sandbox.resize, num_workers, limiter=_unlimited())
        self.num_workers = num_workers
        self.limiter.total_tokens = num_workers
        self.session_slots.total_tokens = num_workers * self.options.max_sessions_per_worker
        return {"num_workers": num_workers, "previous": previous}

    @handler("stats")
    async def stats(self, body):
        """Counters by status, queued, running, workers. Does not wait (cancel-safe)."""
        return {"by_status": dict(self.status_counts), "queued": self.num_queued,
                "running": self.num_running, "workers": self.num_workers, "mode": self.sandbox.mode,
                "open_sessions": len(self.sessions),
                "max_sessions": int(self.session_slots.total_tokens)}

    # ------------------------------------------------------------ internals
    def _policy(self, limits) -> Policy:
        limits = dict(limits or {})
        unknown = sorted(set(limits) - set(LIMIT_FIELDS))
        if unknown:
            raise PolicyError(f"limits may set only {', '.join(LIMIT_FIELDS)}; got {unknown}; "
                              f"fix: drop those keys (mounts, network and env belong to the actor)")
        return self.sandbox.policy.replace(**limits) if limits else self.sandbox.policy

    def _run_kwargs(self, body, sender: str) -> dict:
        if not isinstance(body, dict) or not isinstance(body.get("code"), str):
            raise PolicyError(f"a sandbox request must be a map with a str 'code', got "
                              f"{type(body).__name__}; fix: send {{'code': '...'}}")
        stdin = body.get("stdin") or b""
        return {"code": body["code"], "stdin": stdin.encode() if isinstance(stdin, str) else stdin,
                "files": body.get("files") or None, "argv": list(body.get("argv") or []),
                "policy": self._policy(body.get("limits")), "requester": sender}

    def _session(self, body: dict, sender: str) -> Session:
        entry = self.sessions.get(body.get("session_id"))
        if entry is None or entry.owner != sender:
            raise UnknownSession(f"no open session {body.get('session_id')!r} of {sender!r} (never "
                                 f"opened, closed, or reaped after session_idle_timeout_s="
                                 f"{self.options.session_idle_timeout_s}); fix: session_open a new one")
        return entry.session

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
            for session in [entry.session for entry in self.sessions.values()]:
                if now - session.last_active > timeout_s and not session.in_call:
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


def _map(body, kind: str) -> dict:
    if not isinstance(body, dict):
        raise PolicyError(f"a {kind} request must be a map, got {type(body).__name__}; "
                          f"fix: send {{'session_id': ..., ...}}")
    return body


_UNLIMITED = None


def _unlimited():
    """A thread limiter big enough that only our own CapacityLimiter decides concurrency."""
    global _UNLIMITED
    if _UNLIMITED is None:
        _UNLIMITED = anyio.CapacityLimiter(10_000)
    return _UNLIMITED


_ASK_SLACK_S = 300.0  # waiting for a worker or a session slot, on top of a call's own wall limit


class RemoteSession:
    """A session of a sandbox actor, with `postrain.sandbox.AsyncSession`'s methods (so a tool
    takes either). Open it with `remote_session(ref, ...)`."""

    def __init__(self, ref, session_id: str, limits: dict) -> None:
        self.ref = ref
        self.session_id = session_id
        self.limits = limits

    async def run(self, command: str, stdin: bytes | str | None = None,
                  timeout_s: float | None = None) -> ExecResult:
        return await self._exec({"command": command}, stdin, timeout_s)

    async def run_python(self, code: str, stdin: bytes | str | None = None,
                         timeout_s: float | None = None) -> ExecResult:
        return await self._exec({"code": code}, stdin, timeout_s)

    async def read_file(self, path: str) -> bytes:
        reply = await self.ref.ask("session_read_file", {"session_id": self.session_id, "path": path})
        return reply["data"]

    async def write_file(self, path: str, data: bytes | str) -> int:
        reply = await self.ref.ask("session_write_file", {"session_id": self.session_id,
                                                          "path": path, "data": data})
        return reply["size"]

    async def close(self) -> dict:
        return await self.ref.ask("session_close", {"session_id": self.session_id})

    async def _exec(self, body: dict, stdin, timeout_s) -> ExecResult:
        body = {"session_id": self.session_id, **body}
        if stdin is not None:
            body["stdin"] = stdin
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        wall_s = float(timeout_s or self.limits["call_wall_time_s"])
        return result_from_wire(await self.ref.ask("session_exec", body, timeout_s=wall_s + _ASK_SLACK_S))


@contextlib.asynccontextmanager
async def remote_session(ref, files: dict | None = None, limits: dict | None = None):
    """`async with remote_session(sandbox_ref, files=...) as s: await s.run("ls")`; the session is
    closed on the way out, even when cancelled (a lost actor: the reaper closes it)."""
    body = {}
    if files:
        body["files"] = files
    if limits:
        body["limits"] = dict(limits)
    reply = await ref.ask("session_open", body, timeout_s=_ASK_SLACK_S)
    session = RemoteSession(ref, reply["session_id"], reply["limits"])
    try:
        yield session
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await session.close()
            except PostrainError:
                pass  # the actor is gone or has reaped it: nothing of the session is left
