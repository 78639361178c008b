"""The sandbox extension's server side: POST /api/v1/postrain/sandbox/run runs the caller's code in
postrain's nsjail jails (postrain.sandbox), what hosted Tinker does not have: a loop that holds only
the server's URL and key grades its samples here (the client: sandbox_client.py).

    runs = SandboxRuns(num_workers=2, timeout_s=10, max_timeout_s=60, max_output_bytes=1 << 20,
                       memory_mb=512, refuse=service._refuse)
    answer = await runs.run(body)          # a SandboxRunResult as a dict; TinkerAPIError for a refusal
    runs.close()                           # at server stop

Design note. Every run is a `Sandbox.arun` of a warm `postrain.sandbox.Sandbox` with
`num_workers` jailed zygotes, started at the first run (a server whose loop never grades starts
no jail): each run is a fresh child in a fresh PID, IPC and mount namespace with no network, as
uid 1000, under the Policy's limits, so the code reaches nothing of the server (its memory, its
files, its port, the key). Admission is the one rule: at most `num_workers` runs are accepted
and not yet finished; past it the request is refused at once with 429 and Retry-After (the
service's `_refuse`), never queued, so a flood of runs cannot hold the server's connections.
A run's `timeout_s` above `max_timeout_s` is a 400 naming the cap, not silently cut.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, NoReturn

import trio
from pydantic import ValidationError

from postrain.sandbox import NOT_STARTED, ExecResult, Policy, PolicyError, Sandbox, SandboxError, Status

from .errors import TinkerAPIError
from .sandbox_client import SandboxRunRequest, SandboxRunResult

log = logging.getLogger("postrain.tinker")

MAX_INPUT_BYTES = 16 << 20      # code + files + stdin of one run, UTF-8 bytes; past it a 413


class SandboxRuns:
    """The runs of one server (module docstring). Invariant: 0 <= num_running <= num_workers."""

    def __init__(self, *, num_workers: int, timeout_s: float, max_timeout_s: float, max_output_bytes: int,
                 memory_mb: int, refuse: Callable[[str], NoReturn], enabled: bool = True):
        self.num_workers, self.timeout_s, self.max_timeout_s = num_workers, min(timeout_s, max_timeout_s), max_timeout_s
        self.enabled, self._refuse = enabled, refuse
        self.policy = Policy(wall_time_s=max_timeout_s, cpu_time_s=math.ceil(max_timeout_s), memory_mb=memory_mb,
                             max_output_bytes=max_output_bytes)
        self.num_running = 0                    # runs admitted and not finished; changed on the trio thread only
        self._sandbox: Sandbox | None = None    # started by the first run (under _starting), closed at stop
        self._starting = trio.Lock()

    async def run(self, body: dict) -> dict:
        """Run the request's code; its SandboxRunResult as a dict. Refused (TinkerAPIError): 404 when
        the extension is off, 400 a bad request, 413 too large, 429 every jail busy, 503 the
        sandbox cannot start. Cancelled (the server stops): the caller stops waiting; the run ends
        within its timeout and frees its jail."""
        request = self._request(body)
        timeout_s = request.timeout_s if request.timeout_s is not None else self.timeout_s
        if self.num_running >= self.num_workers:
            self._refuse(f"the sandbox runs {self.num_running} programs, the most it runs at once "
                         f"(sandbox_workers={self.num_workers}); wait for a run to end, or raise the limit with "
                         "`postrain serve --tinker --sandbox-workers N`")
        self.num_running += 1
        log.debug("tinker: sandbox run admitted (%d of %d running)", self.num_running, self.num_workers)
        try:
            sandbox = await self._started()
            policy = self.policy.replace(wall_time_s=float(timeout_s), cpu_time_s=math.ceil(timeout_s))
            result = await sandbox.arun(request.code, stdin=request.stdin.encode(),
                                        files={name: text.encode() for name, text in request.files.items()},
                                        policy=policy, requester="tinker-sandbox-extension")
        except PolicyError as exc:          # a file name the sandbox refuses
            raise TinkerAPIError(400, f"postrain/sandbox/run: {exc}") from None
        finally:
            self.num_running -= 1
        if result.status is Status.SANDBOX_ERROR and result.error.startswith(NOT_STARTED):
            raise TinkerAPIError(503, f"postrain/sandbox/run: the sandbox could not start the run "
                                      f"({result.error}); nothing of the code ran", retry_after_s=5, category="server")
        return result_record(result).model_dump()

    def _request(self, body: dict) -> SandboxRunRequest:
        if not self.enabled:
            raise TinkerAPIError(404, "postrain/sandbox/run: the sandbox extension is off on this server (started "
                                      "with --no-sandbox); restart it without --no-sandbox to run code")
        try:
            request = SandboxRunRequest.model_validate(body)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                                 for e in exc.errors()[:5])
            raise TinkerAPIError(400, f"postrain/sandbox/run: the body is not a valid request ({problems}); send "
                                      '{"code": "...", "files": {}, "stdin": "", "timeout_s": 5}') from None
        if request.timeout_s is not None and request.timeout_s > self.max_timeout_s:
            raise TinkerAPIError(400, f"postrain/sandbox/run: timeout_s={request.timeout_s:g} is past the server's "
                                      f"cap (sandbox_max_timeout_s={self.max_timeout_s:g}); ask for at most that, or "
                                      "raise it with `postrain serve --tinker --sandbox-max-timeout-s S`")
        size = (len(request.code.encode()) + len(request.stdin.encode())
                + sum(len(name.encode()) + len(text.encode()) for name, text in request.files.items()))
        if size > MAX_INPUT_BYTES:
            raise TinkerAPIError(413, f"postrain/sandbox/run: code, files and stdin hold {size} bytes, past the "
                                      f"{MAX_INPUT_BYTES} a run takes; send less")
        return request

    async def _started(self) -> Sandbox:
        """The warm Sandbox, started by the first run (in a thread: its jails take a while).
        Cancelled while starting: the start finishes in its thread and is kept."""
        async with self._starting:
            if self._sandbox is None:
                try:
                    self._sandbox = await trio.to_thread.run_sync(
                        lambda: Sandbox(self.policy, mode="warm", num_workers=self.num_workers))
                except SandboxError as exc:
                    raise TinkerAPIError(503, f"postrain/sandbox/run: the sandbox cannot start its jails ({exc})",
                                         retry_after_s=5, category="server") from None
                log.info("tinker: sandbox extension started %d warm jails", self.num_workers)
            return self._sandbox

    def close(self) -> None:
        """Stop the jails (at server stop); a run still going is killed with its jail."""
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


def result_record(result: ExecResult) -> SandboxRunResult:
    """The wire record of a sandbox ExecResult."""
    return SandboxRunResult(status=result.status.value, exit_code=result.exit_code, signal=result.signal,
                            timed_out=result.status is Status.TIMEOUT, duration_s=round(result.wall_s, 6),
                            stdout=result.stdout.decode("utf-8", "replace"),
                            stderr=result.stderr.decode("utf-8", "replace"),
                            stdout_truncated=result.stdout_truncated, stderr_truncated=result.stderr_truncated,
                            error=result.error)


__all__ = ["MAX_INPUT_BYTES", "SandboxRuns", "result_record"]
