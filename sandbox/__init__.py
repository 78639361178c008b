"""postrain.sandbox: run untrusted code in nsjail and say exactly what happened.

    from postrain.sandbox import Sandbox, Policy, Status
    with Sandbox(Policy(wall_time_s=2, memory_mb=256), mode="warm", num_workers=2) as sb:
        r = sb.run("print(input()[::-1])", stdin=b"abc\\n")
        assert r.status is Status.OK and r.stdout == b"cba\\n"

    with Sandbox(Policy()) as sb, sb.session(files={"a.txt": b"x"}) as s:   # one jail per episode
        s.run("cd sub 2>/dev/null || mkdir sub && cd sub"); s.run("pwd")     # cwd, env, files persist

A leaf library: it imports nothing else of postrain but its errors. Rewards helpers live in
`postrain.sandbox.rewards` (re-exported here).
"""
from .audit import AuditLog, code_sha256, read_audit_log
from .policy import Policy, PolicyError, SandboxError, nsjail_binary
from .result import NOT_STARTED, ExecResult, Status
from .rewards import CaseResult, TestReport, run_io_cases, run_tests
from .runner import Sandbox, run, run_cold
from .session import AsyncSession, Session, SessionClosed, SessionFileError, SessionLimits
from .warm import WarmPool, WarmWorker

__all__ = [
    "NOT_STARTED", "AsyncSession", "AuditLog", "CaseResult", "ExecResult", "Policy", "PolicyError", "Sandbox",
    "SandboxError", "Session", "SessionClosed", "SessionFileError", "SessionLimits", "Status", "TestReport", "WarmPool", "WarmWorker", "code_sha256", "nsjail_binary",
    "read_audit_log", "run", "run_cold", "run_io_cases", "run_tests",
]
