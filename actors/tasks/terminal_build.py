"""The pieces terminal tasks are made of: a task dict, reference steps, and verifying scripts.

A terminal task (plain data, it travels over the wire) is:

    {"id": "terminal-count_errors-0", "kind": "count_errors", "prompt": "...",
     "files": {"logs/app.log": "..."},        # laid into the session's work dir (/work)
     "setup": "chmod -x tools/*.sh",          # a bash script run once after the files ("": none)
     "check": "python3 -I - <<'EOF' ...",     # a bash script run in /work at the end: exit 0 = solved
     "solution": [{"command", "stdout", "stderr", "exit_code"}, ...]}   # the reference steps

Each reference step records exactly what the command prints in a fresh session (a test runs
every solution in a real session and compares), so demonstrations show true outputs. Checks are
Python programs (`python_check`) with a few helpers (`CHECK_PRELUDE`): `fail(msg)`, `text(path)`,
`lines(path)`, `expect_lines(path, want)`, `unchanged(path, sha256)` (of the file's exact bytes:
`sha256(text)` of the text as the task wrote it), `files_under(root)`; a
check runs `python3 -I` (isolated: nothing the agent put in /work shadows the standard library).
"""
from __future__ import annotations

import dataclasses
import hashlib
import random

CHECK_PRELUDE = '''\
import hashlib, json, os, subprocess, sys
def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)
def text(path):
    if not os.path.isfile(path):
        fail(path + " does not exist")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
def lines(path):
    return [line.rstrip() for line in text(path).strip("\\n").splitlines()]
def expect_lines(path, want):
    got = [line.removeprefix("./") for line in lines(path)]
    if got != want:
        fail(f"{path} holds {got[:6]!r} ({len(got)} lines), expected {len(want)} other lines")
def sha(path):
    if not os.path.isfile(path):
        fail(path + " does not exist")
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
def unchanged(path, digest):
    if sha(path) != digest:  # of the bytes: a CRLF rewrite or a re-encoding is a change
        fail(path + " was changed; the task says to leave it as it is")
def files_under(root):
    out = []
    for folder, _, names in os.walk(root):
        out += [os.path.join(folder, n) for n in names]
    return sorted(out)
def run(argv):
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
'''


@dataclasses.dataclass(frozen=True)
class Step:
    """One reference command and what it prints in a fresh session (stdout, stderr, exit code)."""

    command: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def python_check(body: str) -> str:
    """A bash script that runs `body` (Python, after `CHECK_PRELUDE`) with python3 -I."""
    return f"python3 -I - <<'POSTRAIN_CHECK'\n{CHECK_PRELUDE}{body.strip()}\nPOSTRAIN_CHECK\n"


def sha256(text: str) -> str:
    """The digest `unchanged` compares with: of `text`'s UTF-8 bytes, as the task lays the file out."""
    return hashlib.sha256(text.encode()).hexdigest()


def make_task(kind: str, index: int, prompt: str, files: dict[str, str], check: str,
              solution: list[Step], setup: str = "") -> dict:
    return {"id": f"terminal-{kind}-{index}", "kind": kind, "prompt": prompt.strip(),
            "files": dict(files), "setup": setup, "check": check,
            "solution": [step.to_dict() for step in solution]}


def rng_for(kind: str, index: int) -> random.Random:
    """The seeded generator of one task instance: the suite is the same on every machine."""
    return random.Random(f"terminal:{kind}:{index}")


def listing(lines: list[str]) -> str:
    """What `cat` of a file of `lines` (or a command printing them) shows: one per line."""
    return "".join(f"{line}\n" for line in lines)


WORDS = ("apple", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island",
         "juniper", "kettle", "lantern", "meadow", "nectar", "orchid", "pepper", "quartz",
         "raven", "saffron", "timber", "umber", "velvet", "willow", "yarrow", "zephyr")
NAMES = ("ada", "bela", "chen", "dara", "emil", "fatou", "goran", "hana", "ivo", "jun", "kofi",
         "lena", "mira", "nils", "omar", "priya", "quinn", "rosa", "sami", "tove")
