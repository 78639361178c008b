"""The audit log: one JSON line per execution (who asked, a hash of what ran, the policy, the outcome),
and per session: its open (limits), each call (hash, status, times, sizes) and its close (why, how
many calls, how long). Each line's "kind" says which: exec, session_open, session_call, session_close.

Lines are appended under a lock and flushed at once, so a crash loses at most the line being
written. The code itself is not stored, only its sha256 (over main.py, stdin and the extra files),
so the log stays small and holds no task data.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time


def code_sha256(code: str, stdin: bytes = b"", files: dict[str, bytes] | None = None) -> str:
    """sha256 over everything the execution was given, in a fixed order."""
    digest = hashlib.sha256()
    for part in (code.encode(), bytes(stdin)):
        digest.update(len(part).to_bytes(8, "little") + part)
    files = files or {}
    for name in sorted(files):
        data = files[name] if isinstance(files[name], bytes) else str(files[name]).encode()
        digest.update(len(name).to_bytes(8, "little") + name.encode())
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


class AuditLog:
    """Append-only JSONL file; thread-safe."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def record(self, *, requester: str, code: str, stdin: bytes, files, policy, result,
               queued_s: float = 0.0) -> dict:
        entry = {
            "time": time.time(), "kind": "exec", "requester": requester, "sha256": code_sha256(code, stdin, files),
            "policy": {k: v for k, v in policy.to_dict().items() if k not in ("env", "readonly_mounts")},
            "mode": result.mode, "status": result.status.value, "exit_code": result.exit_code,
            "signal": result.signal, "wall_s": round(result.wall_s, 6), "cpu_s": round(result.cpu_s, 6),
            "queued_s": round(max(queued_s, 0.0), 6), "stdout_bytes": len(result.stdout),
            "stderr_bytes": len(result.stderr), "error": result.error,
        }
        return self._write(entry)

    def record_session(self, *, event: str, session_id: str, requester: str, **fields) -> dict:
        """A session's open (its limits) or close (reason, num_calls, wall_s)."""
        return self._write({"time": time.time(), "kind": f"session_{event}", "session_id": session_id,
                            "requester": requester, **fields})

    def record_session_call(self, *, session_id: str, requester: str, kind: str, source: str,
                            stdin: bytes, result, call_index: int) -> dict:
        """One command (kind "bash") or snippet ("python") of a session, and its outcome."""
        return self._write({
            "time": time.time(), "kind": "session_call", "session_id": session_id,
            "requester": requester, "call_index": call_index, "lang": kind,
            "sha256": code_sha256(source, stdin), "status": result.status.value,
            "exit_code": result.exit_code, "signal": result.signal, "wall_s": round(result.wall_s, 6),
            "cpu_s": round(result.cpu_s, 6), "command_bytes": len(source.encode()),
            "stdin_bytes": len(stdin), "stdout_bytes": len(result.stdout),
            "stderr_bytes": len(result.stderr), "error": result.error})

    def _write(self, entry: dict) -> dict:
        line = json.dumps(entry, sort_keys=True)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
        return entry

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_audit_log(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
