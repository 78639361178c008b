"""Helpers that turn sandbox runs into reward signals.

- `run_io_cases`: run a program once per (stdin, expected stdout) case and compare outside the
  sandbox (robust against a program that tries to game the check: it only ever sees its input).
- `run_tests`: run a test file against a solution in ONE execution and return pass/fail per test.
  Inside, a small driver (no pytest; it would cost ~0.3 s to import) imports the test module,
  finds `test_*` functions and runs each in a forked child with its own time limit, so a test that
  crashes, hangs or calls `os._exit` fails alone. The report is the last marker line on stdout.
  Limitation: the solution runs in the sandbox with the driver, so a solution written to forge the
  report could: it is feedback for the policy, never a grader. Where a reward must hold, use
  `run_io_cases` or the host-judged comparisons of `postrain.sandbox.grader.comparison_tests`.

Both have async twins (`arun_io_cases`, `arun_tests`) for trio callers.
"""
from __future__ import annotations

import dataclasses
import json
import secrets

from .result import ExecResult, Status

_DRIVER = r'''
import json, os, select, signal, sys, time, traceback
MARK = sys.argv[1]
TIMEOUT_S = float(sys.argv[2])
report = {"collect_error": None, "tests": []}
try:
    import test_solution as mod
except BaseException:
    report["collect_error"] = traceback.format_exc(limit=-3)
    mod = None
names = [n for n in dir(mod) if n.startswith("test") and callable(getattr(mod, n))] if mod else []
if mod is not None:
    names.sort(key=lambda n: getattr(getattr(getattr(mod, n), "__code__", None), "co_firstlineno", 0))
for name in names:
    r, w = os.pipe()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            getattr(mod, name)()
            msg = {"passed": True, "error": ""}
        except BaseException as exc:
            msg = {"passed": False, "error": "".join(traceback.format_exception_only(type(exc), exc))[-500:]}
        sys.stdout.flush(); sys.stderr.flush()
        os.write(w, json.dumps(msg).encode()); os._exit(0)
    os.close(w)
    data, deadline = b"", time.monotonic() + TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL); msg = {"passed": False, "error": "timeout"}; break
        chunk = os.read(r, 65536)
        if not chunk:
            try:
                msg = json.loads(data)
            except ValueError:
                msg = {"passed": False, "error": "the test process died without a verdict"}
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    report["tests"].append({"name": name, **msg})
sys.stdout.flush()
print("\n" + MARK + json.dumps(report), flush=True)
'''


@dataclasses.dataclass
class CaseResult:
    passed: bool
    expected: str
    result: ExecResult


@dataclasses.dataclass
class TestReport:
    """Per-test verdicts. `result` is the sandbox execution that produced them."""

    passed: dict[str, bool]
    errors: dict[str, str]
    collect_error: str | None
    result: ExecResult

    @property
    def num_passed(self) -> int:
        return sum(self.passed.values())

    @property
    def num_failed(self) -> int:
        return len(self.passed) - self.num_passed

    @property
    def fraction_passed(self) -> float:
        return self.num_passed / len(self.passed) if self.passed else 0.0


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _judge(result: ExecResult, expected: str) -> CaseResult:
    got = result.stdout.decode("utf-8", "replace")
    passed = result.status is Status.OK and _normalize(got) == _normalize(expected)
    return CaseResult(passed=passed, expected=expected, result=result)


def run_io_cases(sandbox, code: str, cases: list[tuple[str, str]], **run_kwargs) -> list[CaseResult]:
    """One run per case; passed iff status ok and stdout equals expected (trailing space ignored)."""
    return [_judge(sandbox.run(code, stdin=stdin.encode(), **run_kwargs), expected)
            for stdin, expected in cases]


async def arun_io_cases(sandbox, code: str, cases: list[tuple[str, str]],
                        **run_kwargs) -> list[CaseResult]:
    """`run_io_cases` with the cases in flight at once (as many as the sandbox has workers).
    Cancelled: no verdicts; the runs already started still end within their wall limit
    (`Sandbox.arun`)."""
    import trio
    results: list[CaseResult | None] = [None] * len(cases)

    async def one(i: int, stdin: str, expected: str) -> None:
        """Judge case i into results[i]. Cancelled: results[i] stays None (as `arun`)."""
        results[i] = _judge(await sandbox.arun(code, stdin=stdin.encode(), **run_kwargs), expected)

    async with trio.open_nursery() as nursery:
        for i, (stdin, expected) in enumerate(cases):
            nursery.start_soon(one, i, stdin, expected)
    return results  # type: ignore[return-value]


def _tests_request(solution: str, tests: str, test_timeout_s: float) -> tuple[str, dict, list[str], str]:
    mark = "@@postrain-tests-" + secrets.token_hex(8) + "@@"
    files = {"solution.py": solution.encode(), "test_solution.py": tests.encode()}
    return _DRIVER, files, [mark, str(test_timeout_s)], mark


def _parse_report(result: ExecResult, mark: str) -> TestReport:
    text = result.stdout.decode("utf-8", "replace")
    idx = text.rfind(mark)
    if idx < 0:
        why = f"no report (status {result.status.value})"
        return TestReport(passed={}, errors={}, collect_error=why, result=result)
    report = json.loads(text[idx + len(mark):].splitlines()[0])
    passed = {t["name"]: bool(t["passed"]) for t in report["tests"]}
    errors = {t["name"]: t["error"] for t in report["tests"] if t["error"]}
    return TestReport(passed=passed, errors=errors, collect_error=report["collect_error"], result=result)


def run_tests(sandbox, solution: str, tests: str, *, test_timeout_s: float = 2.0,
              **run_kwargs) -> TestReport:
    """Run `tests` (a module that does `from solution import ...`) against `solution`."""
    code, files, argv, mark = _tests_request(solution, tests, test_timeout_s)
    return _parse_report(sandbox.run(code, files=files, argv=argv, **run_kwargs), mark)


async def arun_tests(sandbox, solution: str, tests: str, *, test_timeout_s: float = 2.0,
                     **run_kwargs) -> TestReport:
    """`run_tests` for trio. Cancelled: no report; the run still ends within its wall limit
    and frees its worker (`Sandbox.arun`)."""
    code, files, argv, mark = _tests_request(solution, tests, test_timeout_s)
    return _parse_report(await sandbox.arun(code, files=files, argv=argv, **run_kwargs), mark)
