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
    stats         {} -> counters by status, queued, running
    resize        {num_workers, cpu_ids?} -> {num_workers, previous}: grow or shrink the warm
                  pool (the head's balancer sends it); with cpu_ids the actor first re-pins itself
                  to the cores the scheduler now reserves for it, so new workers run there

`limits` may change the per-execution limits of the actor's policy (wall_time_s, cpu_time_s,
memory_mb, max_processes, max_file_size_mb, work_dir_size_mb, max_open_files,
max_output_bytes); a bad value comes back as a RemoteError naming the field.

Options: `SandboxOptions` below (the config reference in the docs lists them).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.to_thread
from pydantic import Field, field_validator

from postrain.core import RESIZE, Actor, Load, Options, ResizeRequest, handler
from postrain.core.errors import PostrainError
from postrain.sandbox import ExecResult, Policy, PolicyError, Sandbox, run_io_cases, run_tests

LIMIT_FIELDS = ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_size_mb",
                "work_dir_size_mb", "max_open_files", "max_output_bytes")


class SandboxQueueFull(PostrainError, RuntimeError):
    """More requests are waiting than `max_queued`; retry later or add sandbox workers."""


def result_to_wire(result: ExecResult) -> dict:
    return {"status": result.status.value, "exit_code": result.exit_code, "signal": result.signal,
            "wall_s": result.wall_s, "cpu_s": result.cpu_s, "stdout": result.stdout,
            "stderr": result.stderr, "stdout_truncated": result.stdout_truncated,
            "stderr_truncated": result.stderr_truncated, "mode": result.mode, "error": result.error}


def _policy(fields: dict[str, Any]) -> Policy:
    return Policy(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


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
                                 num_workers=self.num_workers, audit_log=opts.audit_log)
        self.sandbox = await anyio.to_thread.run_sync(make)
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
                                      workers=self.num_workers)

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
        return {"num_workers": num_workers, "previous": previous}

    @handler("stats")
    async def stats(self, body):
        """Counters by status, queued, running, workers. Does not wait (cancel-safe)."""
        return {"by_status": dict(self.status_counts), "queued": self.num_queued,
                "running": self.num_running, "workers": self.num_workers, "mode": self.sandbox.mode}

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

    async def _in_worker(self, fn, *args, **kwargs):
        """Run a blocking sandbox call in a thread once a worker is free.

        Cancelled while queued: nothing ran. Cancelled while running: the caller stops waiting;
        the execution still ends within its wall limit and frees its worker."""
        if self.num_queued >= self.max_queued:
            raise SandboxQueueFull(f"sandbox queue is full ({self.num_queued} waiting, max_queued="
                                   f"{self.max_queued}); fix: retry later or add sandbox workers")
        self.num_queued += 1
        try:
            await self.limiter.acquire()
        finally:
            self.num_queued -= 1
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
    if isinstance(value, ExecResult):
        return [value]
    if isinstance(value, list):
        return [v.result for v in value]
    return [value.result]


_UNLIMITED = None


def _unlimited():
    """A thread limiter big enough that only our own CapacityLimiter decides concurrency."""
    global _UNLIMITED
    if _UNLIMITED is None:
        _UNLIMITED = anyio.CapacityLimiter(10_000)
    return _UNLIMITED
