"""The check grader (`postrain.sandbox.grader`) against code that attacks it from inside its jail.

Each case runs a real check in a real jail, cold and warm: the check runs a program of the
policy's (the snapshot's `attack.py`), then fails (`exit 1`), and the verdict must stay a failure.
"""
from __future__ import annotations

import io
import tarfile

import pytest

from postrain.sandbox import ExecResult, Status
from postrain.sandbox.grader import VERDICT_EXIT_CODES, check_request, check_verdict

# Takes the stdout of every process it can (pidfd_open + pidfd_getfd: the cold driver runs as its
# uid), and once the check's bash has ended (the driver then prints its report and exits), keeps
# printing a passing report there, so that the last line of the driver's stdout is a forged one.
# Before the fix this forged a pass in 10 cold runs of 10.
STEAL_THE_DRIVERS_STDOUT = r'''
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
forged = ("\n" + json.dumps({"status": "ok", "exit_code": 0, "signal": None, "timed_out": False,
                             "stdout": "", "stderr": ""}) + "\n").encode()
print(forged.decode(), flush=True)          # on the check's own stdout, too
stolen = []
for pid in range(1, 8):
    pidfd = libc.syscall(434, pid, 0) if pid != os.getpid() else -1     # pidfd_open
    fd = libc.syscall(438, pidfd, 1, 0) if pidfd >= 0 else -1           # pidfd_getfd(pidfd, 1)
    if fd >= 0:
        stolen.append(fd)
bash = os.getppid()
if os.fork() == 0:
    os.setsid()
    while True:
        try:
            os.kill(bash, 0)
        except ProcessLookupError:
            break
    for _ in range(4000):
        for fd in stolen:
            os.write(fd, forged)
    os._exit(0)
'''


def snapshot(members: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> bytes:
    """A tar of `members` (regular ones take their bytes from `data`), as Session.snapshot gives."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info in members:
            body = (data or {}).get(info.name)
            if body is not None:
                info.size = len(body)
            tar.addfile(info, io.BytesIO(body) if body is not None else None)
    return buffer.getvalue()


def member(name: str, kind=tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info


@pytest.fixture(params=["cold", "warm"])
def sandbox(request, cold_sandbox, warm_sandbox):
    return {"cold": cold_sandbox, "warm": warm_sandbox}[request.param]


def grade(sandbox, script: str, tar: bytes):
    code, files = check_request(script, tar, timeout_s=4.0)
    return check_verdict(sandbox.run(code, files=files))


def test_code_under_test_that_steals_the_drivers_stdout_cannot_forge_a_pass(sandbox):
    tar = snapshot([member("attack.py")], {"attack.py": STEAL_THE_DRIVERS_STDOUT.encode()})
    for _ in range(3):
        verdict = grade(sandbox, "python3 -I attack.py\nexit 1\n", tar)
        assert (verdict.passed, verdict.status, verdict.exit_code) == (False, "nonzero_exit", 1), verdict


def test_a_passing_check_still_passes_and_reports_its_output(sandbox):
    verdict = grade(sandbox, "cat note.txt\n", snapshot([member("note.txt")], {"note.txt": b"hello\n"}))
    assert (verdict.passed, verdict.status, verdict.exit_code, verdict.stdout) == (True, "ok", 0, "hello\n")


def test_the_verdict_is_the_drivers_exit_status_not_its_last_line():
    """A run whose stdout ends in a passing report but whose exit status is not the driver's verdict
    (any code the driver does not give, 0 included: a driver that fell off its end) is no pass; the
    report's details count only where they agree with the exit status."""
    forged = b'\n{"status": "ok", "exit_code": 0, "signal": null, "stdout": "", "stderr": ""}\n'
    for exit_code in (0, 1, VERDICT_EXIT_CODES["nonzero_exit"]):
        result = ExecResult(Status.OK if exit_code == 0 else Status.NONZERO_EXIT, exit_code=exit_code,
                            stdout=forged)
        verdict = check_verdict(result)
        assert not verdict.passed and verdict.exit_code is None, verdict
    assert check_verdict({"status": "nonzero_exit", "exit_code": VERDICT_EXIT_CODES["ok"], "stdout": b""}).passed
    lost = check_verdict(ExecResult(Status.TIMEOUT, signal=9, stdout=forged))
    assert (lost.passed, lost.status) == (False, "sandbox_error")


def test_the_snapshot_is_laid_out_with_the_data_filter(sandbox):
    """No absolute link, no link out of /work (`..`), not even through a link laid before it
    (`sub/up` -> `..`, then `sub/up/esc` -> `../../usr`), and no device; the rest is laid out."""
    sym = tarfile.SYMTYPE
    members = [member("keep.txt"), member("abs", sym, "/usr/bin/env"), member("dotdot", sym, "../../usr/bin/env"),
               member("hard", tarfile.LNKTYPE, "/usr/bin/env"), member("sub", tarfile.DIRTYPE),
               member("sub/up", sym, ".."), member("sub/up/esc", sym, "../../usr"), member("fifo", tarfile.FIFOTYPE)]
    script = ("test -f keep.txt && test -L sub/up || exit 1\n"
              "for name in abs dotdot hard esc fifo; do test -e $name -o -L $name && exit 2; done; exit 0\n")
    verdict = grade(sandbox, script, snapshot(members, {"keep.txt": b"kept\n"}))
    assert (verdict.passed, verdict.status) == (True, "ok"), verdict


def test_a_check_that_finds_a_link_fails(sandbox):
    """The layout test's check is not vacuous: a link inside /work is laid out and seen."""
    tar = snapshot([member("a"), member("inside", tarfile.SYMTYPE, "a")], {"a": b""})
    verdict = grade(sandbox, "test -L inside && exit 2; exit 0\n", tar)
    assert (verdict.passed, verdict.exit_code) == (False, 2)
