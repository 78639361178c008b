"""postrain.sandbox: run untrusted code in nsjail and say exactly what happened.

    from postrain.sandbox import Sandbox, Policy, Status
    with Sandbox(Policy(wall_time_s=2, memory_mb=256), mode="warm", num_workers=2) as sb:
        r = sb.run("print(input()[::-1])", stdin=b"abc\\n")
        assert r.status is Status.OK and r.stdout == b"cba\\n"

A leaf library: it imports nothing else of postrain. Rewards helpers live in
`postrain.sandbox.rewards` (re-exported here).
"""
from .audit import AuditLog, code_sha256, read_audit_log
from .policy import Policy, PolicyError, SandboxError, nsjail_binary
from .result import ExecResult, Status
from .rewards import CaseResult, TestReport, run_io_cases, run_tests
from .runner import Sandbox, run, run_cold
from .warm import WarmPool, WarmWorker

__all__ = [
    "AuditLog", "CaseResult", "ExecResult", "Policy", "PolicyError", "Sandbox", "SandboxError",
    "Status", "TestReport", "WarmPool", "WarmWorker", "code_sha256", "nsjail_binary",
    "read_audit_log", "run", "run_cold", "run_io_cases", "run_tests",
]
