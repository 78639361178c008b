"""A folder replaced in one step: a kill or a full disk mid-write leaves the previous one whole.

    write_folder_atomically(Path("runs/x/checkpoint"), lambda tmp: save_files_into(tmp))
    repair_interrupted_write(Path("runs/x/checkpoint"))   # before reading: undoes what a kill left

Design note. The new folder is written as a hidden sibling `.NAME.tmp-PID-XXXX`, its files
fsynced, then swapped with the old one by `renameat2(RENAME_EXCHANGE)` (Linux 3.15+, on
ext4, xfs, btrfs, tmpfs): at every instant NAME is the old folder or the new one, whole.
Where the file system cannot exchange, the old folder is renamed aside
(`.NAME.old-XXXX`) and the new one renamed in; a kill between those two renames leaves
no NAME, and `repair_interrupted_write` (called by every reader) renames the old one back.
A write that fails (ENOSPC, EDQUOT: DiskFullError; anything else: as raised) removes its
hidden folder and leaves NAME as it was. Hidden folders a killed writer left behind are
removed by the next write or repair (those of live processes are left alone).
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from postrain.core.jsonl import disk_full_error, is_disk_full
from postrain.core.shm import process_lives

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE_ERRNOS = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)
enable_exchange = True   # False: the two-rename fallback (tests of that path)


def write_folder_atomically(folder: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call write(tmp_folder), then put tmp_folder in place of `folder` (module docstring)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    repair_interrupted_write(folder)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
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


def repair_interrupted_write(folder: str | os.PathLike) -> None:
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


_LIBC = []


def _libc():
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

