"""Shared-memory segments for bulk arrays: their files in /dev/shm, from creation to removal.

The wire codec (core/wire.py) sends an array of at least `shm_min_bytes` between two processes
of one host as a file here instead of socket frames: the sender writes the array's bytes once
(`write_segment`), the envelope carries the file's path, and the receiver maps the file and
unlinks its name (`map_segment`), so the tensor crosses without a socket copy.

A file is named `postrain-PID-[TAG_]HEX` (PID: the writer; TAG: `$POSTRAIN_RUN_TAG`, which the
supervisor gives every actor of a run and their children inherit), so that what a killed
process leaves is found and removed: by its pid (`remove_shm_of`) or by its run (`sweep_shm`).
A process removes what no receiver took when it ends (`cleanup_shm`, also at exit). Files are
0600 (their writer's user only); /dev/shm is open to every local user, so a receiver maps, and
the clean-up removes, only this user's regular files (never following a link): a receiver refuses
anything else, and the clean-up logs it, never failing on it. Files of the sizes sent again and
again (weights, every policy version) come from a pool allocated ahead of time (`_SegmentPool`).
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import stat
import threading
import uuid

from typing_extensions import Buffer

from .errors import WireError

log = logging.getLogger("postrain.core")

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
DEFAULT_SHM_MIN_BYTES = 1 << 20
RUN_TAG_ENV = "POSTRAIN_RUN_TAG"  # set in every actor process of a supervised run (core/lifecycle.py)

# Every file this process wrote that may still exist (a receiver unlinks what it maps).
_created_shm: set[str] = set()


class _SegmentPool:
    """Shared-memory files allocated ahead of time, by size.

    A fresh tmpfs page costs an allocation and a zeroing before the copy; for
    tensors sent again and again at the same size (weights, every policy
    version) a sender takes a file whose pages already exist and a background
    thread allocates the next one off the critical path.
    Invariant: every path in `_free` exists, is unused and is `size` bytes long;
    sum of pooled sizes <= MAX_POOLED_BYTES."""

    MAX_POOLED_BYTES = 1 << 30

    def __init__(self) -> None:
        self._free: dict[int, list[str]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> str | None:
        with self._lock:
            paths = self._free.get(nbytes)
            return paths.pop() if paths else None

    def refill_soon(self, nbytes: int) -> None:
        with self._lock:
            pooled = sum(size * len(paths) for size, paths in self._free.items())
            if self._free.get(nbytes) or pooled + nbytes > self.MAX_POOLED_BYTES:
                return
        threading.Thread(target=self._allocate, args=(nbytes,), daemon=True).start()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def _allocate(self, nbytes: int) -> None:
        path = _new_shm_path()
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError:
            _unlink_quietly(path)
            return
        _created_shm.add(path)
        with self._lock:
            self._free.setdefault(nbytes, []).append(path)


_pool = _SegmentPool()
atexit.register(lambda: cleanup_shm())  # pooled segments and undelivered tensors die with the process


def _new_shm_path() -> str:
    assert SHM_DIR is not None   # segments are written only where /dev/shm exists (wire._place)
    tag = os.environ.get(RUN_TAG_ENV)
    return os.path.join(SHM_DIR, f"postrain-{os.getpid()}-{tag + '_' if tag else ''}{uuid.uuid4().hex}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _why_not_ours(info: os.stat_result) -> str | None:
    """None when `info` is a regular file of this process's user (what our writers make), else
    why not: /dev/shm is writable by every local user, who may plant anything under our names."""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}"
    return None


def _remove_left_file(path: str) -> bool:
    """Unlink `path`, a file a dead writer of ours left, if it is one: a regular file of this
    process's user. Anything else named like it (a directory, another user's file: /dev/shm is
    writable by every local user) is left and logged, never an error. True if it was removed."""
    try:
        why = _why_not_ours(os.lstat(path))
        if why is None:
            os.unlink(path)
            return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        why = exc.strerror or repr(exc)
    log.warning("shared-memory clean-up left %s: %s", path, why)
    return False


def _shm_names() -> list[str]:
    try:
        return os.listdir(SHM_DIR) if SHM_DIR else []
    except OSError as exc:
        log.warning("shared-memory clean-up cannot list %s: %s", SHM_DIR, exc.strerror)
        return []


def write_segment(raw: Buffer) -> str:
    """Write `raw` (a buffer) to a shared-memory file of this process (a pooled one of its size
    when there is one) and return the file's path; the receiver unlinks it."""
    view = memoryview(raw)
    path = _pool.take(len(view))
    fresh = path is None
    path = path or _new_shm_path()
    fd = os.open(path, os.O_WRONLY | (os.O_CREAT | os.O_EXCL if fresh else 0), 0o600)
    try:
        written = 0
        while written < len(view):  # one copy into tmpfs; no user-space page faults
            written += os.pwrite(fd, view[written:], written)
    finally:
        os.close(fd)
    _created_shm.add(path)
    _pool.refill_soon(len(view))
    return path


def map_segment(path: str, nbytes: int, dtype: str, shape: list[int]) -> mmap.mmap | bytes:
    """The `nbytes` of shared-memory file `path` (an array of `dtype` and `shape`, which the
    error messages name), mapped privately, and the file's name unlinked: the mapping keeps the
    memory alive. WireError when the path is not a postrain file, is gone, or has another size;
    a file that is not this user's regular file (a link, a FIFO, another user's) is refused and
    left in place, its name unlinked only once it is known to be ours."""
    if not SHM_DIR or os.path.dirname(path) != SHM_DIR or \
            not os.path.basename(path).startswith("postrain-"):
        raise WireError(f"shared-memory handle {path!r} is not a postrain file in {SHM_DIR}")
    try:   # read-only, no link followed, no wait on a FIFO: the checks below see what was opened
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise WireError(f"shared-memory tensor {path} is gone: {exc}") from exc
    except OSError as exc:   # ELOOP: a symbolic link
        raise WireError(f"shared-memory handle {path} refused ({exc.strerror}): not a file of ours") from exc
    try:
        info = os.fstat(fd)
        why = _why_not_ours(info)
        if why is not None:
            raise WireError(f"shared-memory handle {path} refused: {why}; left in place")
        os.unlink(path)   # ours: the mapping keeps the memory alive; the name is no longer needed
        if info.st_size != nbytes:
            raise WireError(f"shared-memory file holds {info.st_size} bytes, but dtype {dtype} and "
                            f"shape {shape} need {nbytes}")
        # MAP_PRIVATE: the receiver may write its copy (copy-on-write, which a read-only fd
        # allows); the pages stay shared until then. Pages map lazily on first touch, as
        # torch.multiprocessing's shared tensors do.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE) if nbytes else b""
    finally:
        os.close(fd)


def cleanup_shm() -> int:
    """Unlink every shared-memory file this process wrote that no receiver took, and the pool.

    Receivers unlink what they map, so only undelivered tensors and pooled segments remain.
    Called when an actor stops. Returns how many were removed."""
    removed = 0
    _pool.clear()
    for path in list(_created_shm):
        _created_shm.discard(path)
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def remove_shm_of(pid: int) -> int:
    """Unlink the shared-memory files of a process that has exited (the supervisor calls this);
    what is not this user's regular file is left and logged. Returns how many were removed."""
    if SHM_DIR is None:   # no /dev/shm: nothing was written
        return 0
    prefix = f"postrain-{pid}-"
    return sum(_remove_left_file(os.path.join(SHM_DIR, name))
               for name in _shm_names() if name.startswith(prefix))


def shm_segments(run_tag: str) -> list[tuple[str, int]]:
    """(path, writer pid) of every shared-memory file that processes of run `run_tag` wrote and
    no receiver has taken yet."""
    if SHM_DIR is None:   # no /dev/shm: nothing was written
        return []
    found = []
    for name in _shm_names():
        parts = name.split("-", 2)
        if len(parts) == 3 and parts[0] == "postrain" and parts[1].isdigit() \
                and parts[2].startswith(f"{run_tag}_"):
            found.append((os.path.join(SHM_DIR, name), int(parts[1])))
    return found


def sweep_shm(run_tag: str) -> int:
    """Unlink the shared-memory files of run `run_tag` whose writer has exited (killed, or a
    child that never cleaned up); a live writer's files are left alone, and so is what is not
    this user's regular file (logged: anyone can make a name in /dev/shm). Never raises for what
    it finds there. Returns how many were removed."""
    return sum(_remove_left_file(path) for path, pid in shm_segments(run_tag) if not process_lives(pid))


def process_lives(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a zombie has ended; only its exit
    status waits to be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
