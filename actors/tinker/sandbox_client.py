"""The sandbox extension's records and its client: run code in the postrain server's nsjail jails
from your own loop, with the same base URL and API key as the tinker SDK ([tinker](../../docs/tinker.md)).

    from postrain.actors.tinker import SandboxClient
    sandbox = SandboxClient("http://127.0.0.1:8000", "tml-local")   # default: $TINKER_BASE_URL, $TINKER_API_KEY
    result = sandbox.run("import solution; assert solution.add(2, 3) == 5",
                         files={"solution.py": completion_text}, timeout_s=5)
    reward = 1.0 if result.exit_code == 0 else 0.0         # result.timed_out, .stdout, .stderr, .duration_s
    # from asyncio or trio: await sandbox.arun(...)

The wire (POST /api/v1/postrain/sandbox/run, header X-API-Key) is `SandboxRunRequest` as JSON,
answered with `SandboxRunResult`; a refusal is the API's `{"detail": MESSAGE}` with its status,
raised here as `TinkerAPIError`. A 429 (every jail of the server busy) is retried after its
Retry-After, up to `max_retries` times, as the tinker SDK retries its own 429s. Only pydantic,
httpx and anyio are used here: the server's side is `sandbox_runs.py`.
"""
from __future__ import annotations

import os
import time
from typing import Literal

import anyio
import httpx
from pydantic import BaseModel, ConfigDict, Field

from .errors import TinkerAPIError

SANDBOX_RUN_PATH = "/api/v1/postrain/sandbox/run"
RunStatus = Literal["ok", "nonzero_exit", "timeout", "memory_limit", "output_truncated", "killed_by_signal",
                 "sandbox_error"]


class SandboxRunRequest(BaseModel):
    """One run: `code` is a Python program, run as /work/main.py (the cwd) with `files` beside it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str = Field(description="Python source, run as the program's main module in a fresh jail")
    files: dict[str, str] = Field(default_factory=dict, description="text files laid in /work beside "
                                  "main.py: relative names of [A-Za-z0-9._/-], no '..', not main.py")
    stdin: str = Field("", description="the program's standard input")
    timeout_s: float | None = Field(None, gt=0, description="the run's wall limit, seconds (its CPU limit "
                                    "too, rounded up); None: the server's sandbox_timeout_s; at most its "
                                    "sandbox_max_timeout_s")


class SandboxRunResult(BaseModel):
    """What happened: exactly one `status` (postrain.sandbox's), and the capped output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: RunStatus = Field(description="ok, nonzero_exit, timeout, memory_limit, output_truncated, "
                           "killed_by_signal or sandbox_error (the sandbox failed, not the code)")
    exit_code: int | None = Field(description="the program's exit status; None when a signal or a limit ended it")
    signal: int | None = Field(description="the signal that ended it, if one did")
    timed_out: bool = Field(description="status == 'timeout': the wall or CPU limit ended it")
    duration_s: float = Field(description="wall seconds from the program's start to its end")
    stdout: str = Field(description="standard output, UTF-8 (invalid bytes replaced), at most the cap")
    stderr: str = Field(description="standard error, likewise")
    stdout_truncated: bool = Field(description="stdout passed the server's cap: the run was killed there")
    stderr_truncated: bool = Field(description="stderr passed the cap")
    error: str = Field("", description="for sandbox_error: what failed")

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class SandboxClient:
    """Runs code in a postrain Tinker server's jails (module docstring). Thread-safe for `run`."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, max_retries: int = 10,
                 request_timeout_s: float = 300.0):
        base_url = base_url or os.environ.get("TINKER_BASE_URL")
        if not base_url:
            raise ValueError("SandboxClient needs the server's base URL; pass base_url= or set TINKER_BASE_URL "
                             "(as for tinker.ServiceClient)")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        key = api_key if api_key is not None else os.environ.get("TINKER_API_KEY")
        self._headers = {"X-API-Key": key} if key else {}
        self._timeout = httpx.Timeout(request_timeout_s, connect=30.0)
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout)

    def run(self, code: str, *, files: dict[str, str] | None = None, stdin: str = "",
            timeout_s: float | None = None) -> SandboxRunResult:
        """Run `code` in a fresh jail on the server; blocks until it ends. TinkerAPIError for a
        refusal (400 a bad request, 401 the key, 404 the extension off, 429 past max_retries)."""
        body = SandboxRunRequest(code=code, files=files or {}, stdin=stdin, timeout_s=timeout_s).model_dump()
        for attempt in range(self.max_retries + 1):
            response = self._http.post(SANDBOX_RUN_PATH, json=body)
            wait_s = _retry_after_s(response, attempt, self.max_retries)
            if wait_s is None:
                return _result(response)
            time.sleep(wait_s)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def arun(self, code: str, *, files: dict[str, str] | None = None, stdin: str = "",
                   timeout_s: float | None = None) -> SandboxRunResult:
        """`run` for asyncio or trio. Cancelled: the request is dropped; the run on the server still
        ends within its timeout."""
        body = SandboxRunRequest(code=code, files=files or {}, stdin=stdin, timeout_s=timeout_s).model_dump()
        async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
            for attempt in range(self.max_retries + 1):
                response = await http.post(SANDBOX_RUN_PATH, json=body)
                wait_s = _retry_after_s(response, attempt, self.max_retries)
                if wait_s is None:
                    return _result(response)
                await anyio.sleep(wait_s)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def close(self) -> None:
        """Close the connections `run` keeps open."""
        self._http.close()

    def __enter__(self) -> "SandboxClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _retry_after_s(response: httpx.Response, attempt: int, max_retries: int) -> float | None:
    """Seconds to wait before retrying a 429 with retries left; None: answer this response."""
    if response.status_code != 429 or attempt >= max_retries:
        return None
    try:
        return max(float(response.headers.get("retry-after", "1")), 0.0)
    except ValueError:
        return 1.0


def _result(response: httpx.Response) -> SandboxRunResult:
    """The result of a 200; TinkerAPIError with the server's detail for anything else."""
    if response.status_code == 200:
        return SandboxRunResult.model_validate(response.json())
    try:
        detail = str(response.json().get("detail", response.text))
    except (ValueError, AttributeError):
        detail = response.text
    retry = response.headers.get("retry-after")
    raise TinkerAPIError(response.status_code, detail,
                         retry_after_s=float(retry) if retry and retry.isdigit() else None)


__all__ = ["SANDBOX_RUN_PATH", "SandboxClient", "SandboxRunRequest", "SandboxRunResult"]
