"""Graders out of the policy's reach: checks on a snapshot, and calls judged on the host.

A reward the policy can write is the worst bug an RL system can have, so a grader never runs where
the policy's processes ran or could still run, never under an environment the policy set, and never
trusts a verdict that code of the policy's could have printed. Two graders follow that rule:

- `check_request` / `check_verdict`: a task's check script (bash) run on a snapshot of an episode's
  work dir (`Session.snapshot()`, a tar the session agent takes while no call of the session runs)
  in a fresh jail of its own (a plain `Sandbox.run`: new PID and mount namespaces, a fresh tmpfs
  /work, nothing of the session). Inside, a driver (`python -I -S`, never importing anything from
  /work) makes itself non-dumpable, lays the snapshot into /work (`tarfile`'s data filter, member by
  member: no absolute or escaping link, no device), then starts `bash --noprofile --norc -c SCRIPT`
  with an environment it builds itself (fixed PATH, HOME, LANG; no LD_*, no BASH_ENV, no PYTHON*
  but PYTHONDONTWRITEBYTECODE), stdin /dev/null, stdout and stderr into unnamed memory files, in a
  session of its own. The verdict is bash's wait status as the driver's waitpid sees it, handed
  back as the driver's own exit status (`VERDICT_EXIT_CODES`), a channel no process of the check
  holds. The check's processes run as the driver's uid (cold) and could otherwise take the
  driver's stdout (pidfd_getfd) and print a verdict after its own: they cannot, three times over
  (the driver is not dumpable; pidfd_getfd, kcmp, ptrace, process_vm_* are killed and pidfd_open
  fails; and stdout is a report, not the verdict). Code the check runs can kill or stop the check
  (a fail) but cannot write its verdict.
- `calls_request` / `judge_calls`: a function task's tests (`call == expected`) judged on the host.
  The jail only evaluates each call (in a forked child, with a time limit) and reports the value's
  repr; the expected values never enter the jail, and the host compares `ast.literal_eval` of the
  report with them. A solution that forges the report (prints it, patches the driver, returns an
  object equal to everything) can at most claim plain values, which pass only if they are right.
  `comparison_tests` reads a test file of `assert CALL == EXPECTED` statements (the dataset task's
  `code_tests` reward) into such calls, and refuses a file with any other statement.

Both requests are (code, files) for `Sandbox.run` / a sandbox handle's `exec`; the judges read its
result. See docs/sandbox.md, "Grader contract".
"""
from __future__ import annotations

import ast
import dataclasses
import json
import operator
from collections.abc import Sequence

SNAPSHOT_FILE = "snapshot.tar"
CHECK_FILE = "check.sh"
CALLS_FILE = "calls.json"
MAX_VALUE_CHARS = 100_000   # a reported value's repr beyond this is a failed call
CHECK_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/work",
             "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}

# The driver's exit status is its verdict: a status the driver alone sets (no process of the check
# holds it, as they may hold a pipe), reported by nsjail or the zygote, never read from its output.
# Not 0: an exit of the driver that is not its verdict (it fell off its end, crashed: 1) is no pass.
VERDICT_EXIT_CODES = {"ok": 80, "nonzero_exit": 81, "timeout": 82, "killed_by_signal": 83}
_KIND_OF_EXIT = {code: kind for kind, code in VERDICT_EXIT_CODES.items()}

_CHECK_DRIVER = r"""
import ctypes, io, json, os, signal, subprocess, sys, tarfile
# Not dumpable: no process of the check (same uid) may take this one's fds or memory, even where
# the seccomp filter would let a call through (pidfd_getfd, process_vm_*, ptrace are killed).
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:   # PR_SET_DUMPABLE, 0
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
os.chdir("/work")
with open("%(check)s", "rb") as f:
    script = f.read()
with open("%(snapshot)s", "rb") as f:
    archive = f.read()
os.unlink("%(check)s"); os.unlink("%(snapshot)s")
with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
    for member in tar:   # one at a time: the data filter sees the links laid before this member
        try:
            tar.extract(member, "/work", filter="data")
        except (tarfile.TarError, OSError):
            pass   # refused (an absolute or escaping link, a device, a path out of /work): left out
del archive
out, err = os.memfd_create("stdout"), os.memfd_create("stderr")
timeout_s = %(timeout_s)r
proc = subprocess.Popen(["/bin/bash", "--noprofile", "--norc", "-c", script], cwd="/work",
                        env=%(env)r, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                        close_fds=True, start_new_session=True)
timed_out = False
try:
    proc.wait(timeout=timeout_s)
except subprocess.TimeoutExpired:
    timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
def tail(fd):
    size = os.lseek(fd, 0, os.SEEK_END)
    os.lseek(fd, max(0, size - 4000), os.SEEK_SET)
    return os.read(fd, 4000).decode("utf-8", "replace")
code = proc.returncode
kind = ("timeout" if timed_out else "killed_by_signal" if code < 0 else "ok" if code == 0 else
        "nonzero_exit")
report = {"status": kind, "exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None,
          "stdout": tail(out), "stderr": tail(err)}
sys.stdout.write("\n" + json.dumps(report) + "\n")
sys.stdout.flush()
os._exit(%(exit_codes)r[kind])
"""


@dataclasses.dataclass(frozen=True)
class CheckVerdict:
    """What a check said: `passed` iff it exited 0 within its time; `status` ("ok", "nonzero_exit",
    "timeout", "killed_by_signal", "sandbox_error": no verdict came back), its output's tails."""

    passed: bool
    status: str
    exit_code: int | None
    stdout: str
    stderr: str


def check_request(script: str, snapshot: bytes, *, timeout_s: float) -> tuple[str, dict[str, bytes]]:
    """(code, files) that run the bash `script` on the work dir `snapshot` (a tar, as
    `Session.snapshot()` gives) in a fresh jail; give the run a wall limit above `timeout_s`."""
    code = _CHECK_DRIVER % {"check": CHECK_FILE, "snapshot": SNAPSHOT_FILE, "timeout_s": float(timeout_s),
                            "env": CHECK_ENV, "exit_codes": VERDICT_EXIT_CODES}
    return code, {CHECK_FILE: script.encode(), SNAPSHOT_FILE: bytes(snapshot)}


def check_verdict(result) -> CheckVerdict:
    """The verdict of a `check_request` run (an ExecResult, one from the wire, or its dict): the
    driver's exit status (`VERDICT_EXIT_CODES`). Any other end of the run (no exit status, another
    code) is a failed check (sandbox_error). The driver's last stdout line adds the check's exit code
    and output tails, and only where it agrees with the exit status: it is a report, not the verdict."""
    exit_code, signal_number = _field(result, "exit_code"), _field(result, "signal")
    kind = _KIND_OF_EXIT.get(exit_code) if signal_number is None else None
    if kind is None:
        how = f"exit {exit_code}" if exit_code is not None else f"signal {signal_number}"
        error = _field(result, "error") or _text(_field(result, "stderr"))[-300:]
        return CheckVerdict(False, "sandbox_error", None, "",
                            f"the grader's run ended {_status(result)} ({how}), not with a verdict: {error}")
    try:
        report = json.loads(_text(_field(result, "stdout")).rstrip("\n").rsplit("\n", 1)[-1])
    except ValueError:
        report = None
    if not isinstance(report, dict) or report.get("status") != kind:
        report = {}
    exit_code = report.get("exit_code") if kind == "nonzero_exit" else 0 if kind == "ok" else None
    if not isinstance(exit_code, int) or (exit_code == 0) != (kind == "ok"):
        exit_code = None
    return CheckVerdict(kind == "ok", kind, exit_code, str(report.get("stdout", "")), str(report.get("stderr", "")))


def _field(result, name: str):
    """A field of a run's result: an ExecResult, an ExecReply, or a plain dict of either."""
    return result.get(name) if isinstance(result, dict) else getattr(result, name, None)


def _status(result) -> str:
    status = _field(result, "status")
    return str(getattr(status, "value", status))


def _text(data) -> str:
    data = data or b""
    return data.decode("utf-8", "replace") if isinstance(data, (bytes, bytearray)) else str(data)


# ---------------------------------------------------------------- calls judged on the host
_CALLS_DRIVER = r'''
import ctypes, json, os, select, signal, sys, traceback
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE 0, as every driver; the solution runs in
                                         # this process, so what holds here is the judging on the host
with open("/work/%(calls)s") as f:
    request = json.load(f)
os.unlink("/work/%(calls)s")
sys.path.insert(0, "/work")
report = []
try:
    import solution
    namespace = dict(vars(solution))
    namespace["solution"] = solution
    for line in request.get("imports", []):
        exec(line, namespace)
    load_error = None
except BaseException:
    load_error = traceback.format_exc(limit=-3)[-1500:]
for call in request["calls"] if load_error is None else []:
    r, w = os.pipe()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            msg = {"repr": repr(eval(call, namespace))}
        except BaseException as exc:
            msg = {"error": "".join(traceback.format_exception_only(type(exc), exc))[-500:]}
        sys.stdout.flush(); sys.stderr.flush()
        os.write(w, json.dumps(msg).encode()); os._exit(0)
    os.close(w)
    data = b""
    while True:
        if not select.select([r], [], [], request["timeout_s"])[0]:
            os.kill(pid, signal.SIGKILL); data = b'{"error": "timeout"}'; break
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(r); os.waitpid(pid, 0)
    try:
        report.append(json.loads(data))
    except ValueError:
        report.append({"error": "the call's process died without a value"})
sys.stdout.write("\n" + json.dumps({"load_error": load_error, "results": report}) + "\n")
'''


def calls_request(solution: str, calls: list[str], *, call_timeout_s: float = 2.0,
                  imports: Sequence[str] = ()) -> tuple[str, dict[str, bytes]]:
    """(code, files) that evaluate each call expression (`add(1, 2)`) against `solution` (module
    `solution`, its names and itself in scope, then the `imports` statements run) in the jail and
    report each value's repr; nothing expected goes in."""
    body = json.dumps({"calls": list(calls), "timeout_s": float(call_timeout_s), "imports": list(imports)})
    return _CALLS_DRIVER % {"calls": CALLS_FILE}, {"solution.py": solution.encode(), CALLS_FILE: body.encode()}


def judge_calls(result, calls: list[str], expected: list[str]):
    """A TestReport (`passed` {test_i: bool}, `errors`, `collect_error`, `result`) of a
    `calls_request` run: call i passes iff the jail reported a plain value (a Python literal) equal
    to `expected[i]` (a literal, or + and * of literals), compared here, on the host."""
    from .rewards import TestReport
    try:
        report = json.loads(_text(_field(result, "stdout")).rstrip("\n").rsplit("\n", 1)[-1])
        results, load_error = list(report["results"]), report["load_error"]
    except (ValueError, KeyError, TypeError):
        detail = _field(result, "error") or _text(_field(result, "stderr"))[-1000:]
        return TestReport({}, {}, f"no report (status {_status(result)}): {detail}", result)
    if load_error is not None:
        return TestReport({}, {}, str(load_error), result)
    passed, errors = {}, {}
    for i, (call, want_source) in enumerate(zip(calls, expected)):
        name, want = f"test_{i}", literal_value(want_source)
        got = results[i] if i < len(results) and isinstance(results[i], dict) else {"error": "no value"}
        if "repr" not in got:
            passed[name], errors[name] = False, str(got.get("error", "no value"))
            continue
        text = str(got["repr"])
        try:
            value = ast.literal_eval(text) if len(text) <= MAX_VALUE_CHARS else _NOT_PLAIN
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = _NOT_PLAIN
        passed[name] = value is not _NOT_PLAIN and _equal(value, want)
        if not passed[name]:
            shown = text if len(text) <= 200 else text[:200] + "..."
            errors[name] = f"AssertionError: {call} returned {shown}, expected {want!r}"
    return TestReport(passed, errors, None, result)


_NOT_PLAIN = object()
_OPS = {ast.Add: operator.add, ast.Mult: operator.mul, ast.Sub: operator.sub}


class TestFileError(ValueError):
    """A test file that cannot be judged on the host (a statement that is not a comparison)."""


@dataclasses.dataclass(frozen=True)
class ComparisonTests:
    """A test file read as comparisons judged on the host: `imports` (statements run in the jail
    before the calls), and per test name its (call, expected) pairs; a test passes iff all of its
    comparisons do. Module-level asserts form the test `test_module`."""

    imports: tuple[str, ...]
    tests: dict[str, tuple[tuple[str, str], ...]]

    def flat(self) -> tuple[list[str], list[str]]:
        """The calls and expected sources of every comparison, in order."""
        pairs = [pair for comparisons in self.tests.values() for pair in comparisons]
        return [call for call, _ in pairs], [want for _, want in pairs]

    def judge(self, result):
        """The TestReport per test (not per comparison) of a `calls_request` run of `flat()`."""
        calls, expected = self.flat()
        report = judge_calls(result, calls, expected)
        if report.collect_error is not None:
            return report
        passed, errors, i = {}, {}, 0
        for name, comparisons in self.tests.items():
            verdicts = [f"test_{j}" for j in range(i, i + len(comparisons))]
            i += len(comparisons)
            passed[name] = all(report.passed.get(v, False) for v in verdicts)
            failures = [report.errors[v] for v in verdicts if v in report.errors]
            if failures:
                errors[name] = failures[0]
        return dataclasses.replace(report, passed=passed, errors=errors)


def comparison_tests(source: str) -> ComparisonTests:
    """Read a test file of `assert CALL == EXPECTED` statements (at module level or in `test_*`
    functions; EXPECTED a literal, see `literal_value`) and of import statements. Anything else
    would have to run in the solution's process, where the solution could forge it, so it is
    refused: TestFileError names the line and the fix."""
    try:
        module = ast.parse(source)
    except SyntaxError as exc:
        raise TestFileError(f"the test file does not parse: {exc}") from None
    imports, tests = [], {}

    def comparison(node) -> tuple[str, str]:
        test = node.test if isinstance(node, ast.Assert) else None
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            raise TestFileError(f"line {node.lineno}: {ast.unparse(node)[:80]!r} is not `assert CALL == EXPECTED`; "
                                "tests are judged on the host, where the solution cannot reach them, so each "
                                "must compare a call with a literal; fix: rewrite it so, or grade with a reward "
                                "function of your own")
        want = ast.unparse(test.comparators[0])
        try:
            literal_value(want)
        except (ValueError, SyntaxError, TypeError) as exc:
            raise TestFileError(f"line {node.lineno}: the expected value {want[:80]!r} is not a literal "
                                f"({exc}); fix: write the value out") from None
        return ast.unparse(test.left), want

    for node in module.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(node))
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            tests[node.name] = tuple(comparison(statement) for statement in body)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        else:
            tests.setdefault("test_module", ())
            tests["test_module"] += (comparison(node),)
    tests = {name: pairs for name, pairs in tests.items() if pairs}
    if not tests:
        raise TestFileError("the test file has no `assert CALL == EXPECTED`; fix: add at least one")
    return ComparisonTests(tuple(imports), tests)


def literal_value(source: str):
    """The value of a task author's expected expression: a Python literal, or literals joined by
    +, - and * (`'z' * 12`, `[2] * 10`); ValueError for anything else."""
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult) and any(isinstance(v, int) and v > 10_000 for v in (left, right)):
                raise ValueError(f"expected value {source!r} is too large")
            return _OPS[type(node.op)](left, right)
        return ast.literal_eval(node)
    return value(ast.parse(source, mode="eval").body)


def _equal(got, want) -> bool:
    try:
        return bool(got == want)
    except Exception:  # noqa: BLE001 - plain values compare; anything else is a failure
        return False


__all__ = ["CheckVerdict", "check_request", "check_verdict", "calls_request", "judge_calls", "literal_value",
           "CHECK_ENV", "ComparisonTests", "TestFileError", "comparison_tests", "VERDICT_EXIT_CODES"]
