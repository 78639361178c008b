"""The check helpers of terminal tasks (actors/tasks/terminal_build.py), run as a check runs them:
bash with the `python_check` script, here on the host in a folder of the test's."""
from __future__ import annotations

import subprocess

import pytest

from postrain.actors.tasks.terminal_build import python_check, sha256

ORIGINAL = "name = demo\nport = 8080\n"


def check(folder, body: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", python_check(body)], cwd=folder, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("rewrite", [ORIGINAL.replace("\n", "\r\n").encode(),   # CRLF
                                     ORIGINAL.replace("\n", "\r").encode(),     # old Mac
                                     ORIGINAL.encode("utf-16"),
                                     ORIGINAL.encode() + b"\n"])
def test_unchanged_compares_the_files_exact_bytes(tmp_path, rewrite):
    body = f"unchanged('app.conf', {sha256(ORIGINAL)!r})\nprint('ok')"
    (tmp_path / "app.conf").write_bytes(ORIGINAL.encode())
    assert check(tmp_path, body).stdout == "ok\n"
    (tmp_path / "app.conf").write_bytes(rewrite)
    result = check(tmp_path, body)
    assert result.returncode == 1
    assert result.stdout == "FAIL: app.conf was changed; the task says to leave it as it is\n"
    (tmp_path / "app.conf").unlink()
    assert check(tmp_path, body).stdout == "FAIL: app.conf does not exist\n"
