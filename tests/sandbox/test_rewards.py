"""Reward helpers: I/O cases judged outside the jail, and per-test verdicts of a test file."""
from __future__ import annotations

import trio

from postrain.sandbox import Sandbox, Status, run_io_cases, run_tests
from postrain.sandbox.rewards import arun_io_cases, arun_tests

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = """
from solution import add

def test_small():
    assert add(1, 2) == 3

def test_wrong_expectation():
    assert add(1, 2) == 4, "nope"

def test_exits_the_process():
    import os
    os._exit(0)

def test_hangs():
    while True:
        pass

def test_negative():
    assert add(-1, -2) == -3
"""


def test_io_cases_pass_and_fail(sandbox):
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    cases = [("1 2\n", "3"), ("10 20\n", "30\n"), ("2 2\n", "5"), ("x y\n", "0")]
    verdicts = run_io_cases(sandbox, code, cases)
    assert [v.passed for v in verdicts] == [True, True, False, False]
    assert verdicts[3].result.status is Status.NONZERO_EXIT


def test_test_file_verdicts_per_test(sandbox):
    report = run_tests(sandbox, SOLUTION, TESTS, test_timeout_s=0.3)
    assert report.passed == {"test_small": True, "test_wrong_expectation": False,
                             "test_exits_the_process": False, "test_hangs": False,
                             "test_negative": True}
    assert report.num_passed == 2 and report.num_failed == 3 and report.collect_error is None
    assert "nope" in report.errors["test_wrong_expectation"]
    assert report.errors["test_hangs"] == "timeout"


def test_broken_solution_is_a_collect_error(warm_sandbox):
    report = run_tests(warm_sandbox, "def add(a, b) return", TESTS)
    assert report.passed == {} and "SyntaxError" in report.collect_error
    assert report.fraction_passed == 0.0


def test_async_twins(small_policy):
    async def main():
        with Sandbox(small_policy, mode="warm", num_workers=2) as sandbox:
            verdicts = await arun_io_cases(sandbox, "print(int(input()) * 2)", [("2", "4"), ("3", "7")])
            report = await arun_tests(sandbox, SOLUTION, "from solution import add\n"
                                      "def test_a():\n    assert add(2, 2) == 4\n")
            return verdicts, report

    verdicts, report = trio.run(main)
    assert [v.passed for v in verdicts] == [True, False]
    assert report.passed == {"test_a": True}
