"""Statuses and the result of one execution.

Every execution ends in exactly one `Status`. When several apply, the first in this order wins:
sandbox_error (the sandbox failed, not the code), output_truncated (we killed it for flooding),
timeout (wall or CPU limit), memory_limit, killed_by_signal, nonzero_exit, ok. `classify` is the
single place that decides it, for cold and warm runs alike.
"""
from __future__ import annotations

import dataclasses
import enum
import signal as _signal


# How `ExecResult.error` begins when the sandbox could not start the run at all (nsjail would not
# start, no warm worker came up): none of the code ran, so that failure is the sandbox's alone. Any
# other sandbox_error came while the code ran, and the code may have caused it.
NOT_STARTED = "not started: "


class Status(str, enum.Enum):
    OK = "ok"
    NONZERO_EXIT = "nonzero_exit"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_TRUNCATED = "output_truncated"
    KILLED_BY_SIGNAL = "killed_by_signal"
    SANDBOX_ERROR = "sandbox_error"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class ExecResult:
    """What happened. exit_code is set iff the code exited; signal iff a signal killed it."""

    status: Status
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0               # from launch to the end of the code, seen by the runner
    cpu_s: float = 0.0                # user + system CPU of the code and the children it waited for
    stdout: bytes = b""               # at most policy.max_output_bytes
    stderr: bytes = b""               # at most policy.max_output_bytes
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    mode: str = "cold"                # "cold", "warm" or "session"
    error: str = ""                   # for sandbox_error: what failed (NOT_STARTED...: nothing ran)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["status"] = self.status.value
        out["stdout"] = self.stdout.decode("utf-8", "replace")
        out["stderr"] = self.stderr.decode("utf-8", "replace")
        return out

    def summary(self) -> str:
        how = (f"exit {self.exit_code}" if self.exit_code is not None else
               f"signal {_signal_name(self.signal)}" if self.signal is not None else "-")
        line = (f"status={self.status.value} ({how}) wall={self.wall_s * 1000:.1f}ms "
                f"cpu={self.cpu_s * 1000:.1f}ms mode={self.mode}")
        return line + (f" error={self.error}" if self.error else "")


def _signal_name(signum: int | None) -> str:
    if signum is None:
        return str(signum)
    try:
        return _signal.Signals(signum).name
    except (ValueError, TypeError):
        return str(signum)


def _ends_in_memory_error(stderr: bytes) -> bool:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return bool(lines) and lines[-1].lstrip().startswith(b"MemoryError")


def classify(*, exit_code: int | None, signal: int | None, cpu_s: float, cpu_limit_s: float,
             killed_for: str | None, stderr: bytes, memory_cgroup: bool) -> Status:
    """The one status of an execution (see the module docstring for the order)."""
    if killed_for == "output":
        return Status.OUTPUT_TRUNCATED
    if killed_for == "timeout" or signal == _signal.SIGXCPU:
        return Status.TIMEOUT
    if signal == _signal.SIGKILL and cpu_s >= 0.5 * cpu_limit_s:
        # The hard RLIMIT_CPU. The kernel checks it against tick-sampled CPU time, which on a
        # loaded host runs ahead of the rusage figure (by 24% seen with eight busy processes on
        # two cores: 1.52 s of a 2 s limit); a memory bomb the OOM killer ends has spent far
        # less CPU than its limit.
        return Status.TIMEOUT
    if signal == _signal.SIGKILL and memory_cgroup:
        return Status.MEMORY_LIMIT  # the cgroup OOM killer is the only other SIGKILL source
    if exit_code is None and signal is None:
        return Status.SANDBOX_ERROR  # the code ended without an exit status: the sandbox lost it
    if exit_code not in (None, 0) and _ends_in_memory_error(stderr):
        return Status.MEMORY_LIMIT
    if signal is not None:
        return Status.KILLED_BY_SIGNAL
    if exit_code:
        return Status.NONZERO_EXIT
    return Status.OK
