"""Append-only JSONL files that a full disk or a kill cannot leave with a broken line.

    out = JsonlAppender("runs/x/metrics.jsonl")
    out.append({"kind": "train", "step": 3})     # the whole line, or nothing and DiskFullError
    cut = repair_torn_tail("runs/x/metrics.jsonl")   # on restart: a half-written last line, cut
    rows = read_jsonl("runs/x/metrics.jsonl")        # every whole line (a torn last one skipped)

Design note (whole lines). Each line goes to the kernel in one `write` on an O_APPEND
descriptor (no user-space buffer that could hold half a line). A full disk makes the
kernel write part of it and refuse the rest: `append` then cuts the part back
(ftruncate to where its line began) and raises `DiskFullError`, so the file ends on a
whole line. A process killed inside that `write` cannot cut anything; the next process
that opens the file for a restart calls `repair_torn_tail`, which cuts a last line that
has no newline or is not JSON, and says so. Several processes may append to one file
(lines of up to a page land whole); a line being cut back after ENOSPC can take with it
a line another process appended in the same microseconds (rare, and only on a full disk).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from .errors import DiskFullError

log = logging.getLogger("postrain.jsonl")

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
TAIL_SCAN_BYTES = 1 << 20   # a torn line is looked for in the last MiB (lines are far shorter)


def is_disk_full(exc: BaseException) -> bool:
    """True when `exc` is a write refused for want of space (ENOSPC, EDQUOT), also from a library
    that wraps the OS error in its own type (safetensors' writer says "os error 28")."""
    if isinstance(exc, DiskFullError) or (isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS):
        return True
    return isinstance(exc, Exception) and any(os.strerror(code) in str(exc) for code in DISK_FULL_ERRNOS)


def disk_full_error(path: str | os.PathLike[str], exc: BaseException | None = None) -> DiskFullError:
    """A DiskFullError naming `path`, the space left on its file system and what to do."""
    path = Path(path)
    where = path if path.is_dir() else path.parent
    try:
        free_mb = f"{shutil.disk_usage(where).free / (1 << 20):.1f} MiB free"
    except OSError:
        free_mb = "free space unknown"
    cause = f" ({os.strerror(getattr(exc, 'errno', None) or errno.ENOSPC)})" if exc is not None else ""
    error = DiskFullError(f"disk full writing {path}{cause}, {free_mb} on its file system; free space "
                          "there (old runs, *.rolled-back.jsonl, exported policies) or move the folder to "
                          "a larger disk")
    error.errno = errno.ENOSPC   # still an OSError for `except OSError` callers; str() stays the message
    return error


class JsonlAppender:
    """Appends JSON lines to `path` (created if missing), each whole or not at all.

    Not thread-safe: one writer per instance (several instances and processes may share a file)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def append(self, row: dict[str, Any]) -> None:
        """Write `row` as one line. Raises DiskFullError with the file unchanged on a full disk."""
        self.write_line(json.dumps(row, default=str))

    def write_line(self, text: str) -> None:
        """Write `text` + newline as one line (`text` holds no newline). Whole or not at all."""
        assert self._fd is not None, f"{self.path} is closed"
        data = (text + "\n").encode()
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as exc:
            if written:
                self._take_back(written)
            if is_disk_full(exc):
                raise disk_full_error(self.path, exc) from None
            raise

    def size(self) -> int:
        """Bytes in the file now (every appended line is in the kernel already)."""
        assert self._fd is not None, f"{self.path} is closed"
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _take_back(self, num_bytes: int) -> None:
        """Cut the `num_bytes` this instance just wrote (a part of one line) off the file's end."""
        assert self._fd is not None, f"{self.path} is closed"
        end = os.lseek(self._fd, 0, os.SEEK_CUR)   # O_APPEND: just past our bytes
        os.ftruncate(self._fd, end - num_bytes)


def repair_torn_tail(path: str | os.PathLike[str]) -> tuple[int, bytes] | None:
    """Cut a half-written last line off `path`: one without a newline, or not valid JSON.
    Returns (its offset, its bytes) when one was cut, None when the file ends on a whole line
    (or does not exist). For a process that takes over a file another one was killed writing."""
    path = Path(path)
    if not path.exists():
        return None
    with open(path, "rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        start = max(0, size - TAIL_SCAN_BYTES)
        handle.seek(start)
        tail = handle.read()
        body = tail[:-1] if tail.endswith(b"\n") else tail
        cut = body.rfind(b"\n") + 1           # the last line starts here, in `tail`
        last = body[cut:]
        if not last or (tail.endswith(b"\n") and _is_json(last)):
            return None
        offset = start + cut
        handle.truncate(offset)
        handle.flush()
        os.fsync(handle.fileno())
    return offset, tail[cut:]


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of `path`, one per line; a torn last line (no newline, not JSON) is
    skipped with a warning, a broken line elsewhere raises ValueError naming it."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except ValueError:
            if number == len(lines):   # the last line, with no newline after it: a torn write
                log.warning("%s: skipped a half-written last line (%d bytes)", path, len(line))
                return
            raise ValueError(f"{path}:{number} is not a JSON line ({line[:60]!r}); repair or "
                             "remove it") from None


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True
