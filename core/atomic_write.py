"""A folder or a file replaced in one step: a kill or a full disk mid-write leaves the previous one
whole. Both are private to the run's user whatever the umask, as is a folder made private here.

    write_folder_atomically(Path("runs/x/checkpoint"), lambda tmp: save_files_into(tmp))
    repair_interrupted_write(Path("runs/x/checkpoint"))   # before reading: undoes what a kill left
    write_file_atomically(Path("runs/x/head.json"), data, mode=0o600)
    make_private_folder(Path("runs/x/logs"))              # 0700, also if it existed looser

Design note. The new folder is written as a hidden sibling `.NAME.tmp-PID-XXXX`, its files
fsynced, then swapped with the old one by `renameat2(RENAME_EXCHANGE)` (Linux 3.15+, on
ext4, xfs, btrfs, tmpfs): at every instant NAME is the old folder or the new one, whole.
Where the file system cannot exchange, the old folder is renamed aside
(`.NAME.old-XXXX`) and the new one renamed in; a kill between those two renames leaves
no NAME, and `repair_interrupted_write` (called by every reader) renames the old one back.
A write that fails (ENOSPC, EDQUOT: DiskFullError; anything else: as raised) removes its
hidden folder and leaves NAME as it was. Hidden folders a killed writer left behind are
removed by the next write or repair (those of live processes are left alone).

Modes. A folder written here is 0700 and every file in it 0600 (checkpoints hold the policy and
the run's state): the hidden folder is made 0700, so nobody else can reach what the writer puts
in it, whatever mode the umask gave that, and each entry is set private before it is put in
place. A file is created under its final mode from the start (O_EXCL, never widened).
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Callable

from postrain.core.errors import PostrainError
from postrain.core.jsonl import disk_full_error, is_disk_full
from postrain.core.shm import process_lives

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE_ERRNOS = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)
enable_exchange = True   # False: the two-rename fallback (tests of that path)


def write_folder_atomically(folder: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Call write(tmp_folder), then put tmp_folder in place of `folder` (module docstring)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    repair_interrupted_write(folder)
    tmp = _tmp_path(folder)
    try:
        tmp.mkdir(mode=0o700)
        write(tmp)
        _make_private(tmp)
        for path in tmp.iterdir():
            _fsync(path)
        _fsync(tmp)
        _put_in_place(tmp, folder)
        _fsync(folder.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise disk_full_error(folder, exc) from None
        raise
    return folder


def write_file_atomically(path: str | os.PathLike[str], data: bytes, mode: int) -> Path:
    """Put a file of `data` in place of `path` in one step (os.replace of a hidden sibling), made
    with `mode` from its creation (the umask can only take bits away); DiskFullError as above."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full_error(path, exc) from None
        raise
    return path


def make_private_folder(folder: str | os.PathLike[str]) -> Path:
    """`folder` (its parents made as needed) as a folder only its user reaches: made 0700, or, where
    it exists, set to 0700. PostrainError where another user owns it; OSError (FileExistsError)
    where it is not a folder."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.geteuid():
        raise PostrainError(f"folder {folder} is owned by uid {info.st_uid}, but it must be private to this "
                            f"user (uid {os.geteuid()}): choose another path, or give it to this user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


def repair_interrupted_write(folder: str | os.PathLike[str]) -> None:
    """Undo what a writer killed inside `write_folder_atomically` left: NAME missing while
    `.NAME.old-*` exists (the fallback's window) gets the old folder back; hidden folders of
    dead writers are removed. Safe to call at any time no other process is writing `folder`."""
    folder = Path(folder)
    if not folder.parent.is_dir():
        return
    olds = sorted(folder.parent.glob(f".{folder.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not folder.exists():
        os.rename(olds.pop(), folder)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in folder.parent.glob(f".{folder.name}.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not process_lives(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _tmp_path(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _make_private(folder: Path) -> None:
    """Every folder under `folder` 0700 and every file 0600 (links are left as they are)."""
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode):
                os.chmod(path, 0o700 if stat.S_ISDIR(mode) else 0o600)


def _put_in_place(tmp: Path, folder: Path) -> None:
    """tmp becomes `folder`; the old `folder`, if any, is removed."""
    if not folder.exists():
        os.rename(tmp, folder)
    elif _exchange(tmp, folder):          # folder is the new one now, tmp the old one
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(folder, old)
        os.rename(tmp, folder)            # a kill between these two: repair_interrupted_write
        shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step; False where the platform or file system cannot."""
    renameat2 = getattr(_libc(), "renameat2", None) if enable_exchange else None
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE_ERRNOS:
        return False
    raise OSError(code, os.strerror(code), str(b))


_LIBC: list[ctypes.CDLL | None] = []   # the C library, once loaded (None: none)


def _libc() -> ctypes.CDLL | None:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

