"""The one-status rule: precedence between the outcomes of a run."""
from __future__ import annotations

import signal

import pytest

from postrain.sandbox import ExecResult, Status
from postrain.sandbox.result import classify


def status(exit_code=None, sig=None, cpu_s=0.0, killed_for=None, stderr=b"", memory_cgroup=False):
    return classify(exit_code=exit_code, signal=sig, cpu_s=cpu_s, cpu_limit_s=2,
                    killed_for=killed_for, stderr=stderr, memory_cgroup=memory_cgroup)


@pytest.mark.parametrize("kwargs,expected", [
    ({"exit_code": 0}, Status.OK),
    ({"exit_code": 3}, Status.NONZERO_EXIT),
    ({"sig": signal.SIGSEGV}, Status.KILLED_BY_SIGNAL),
    ({"sig": signal.SIGXCPU}, Status.TIMEOUT),
    ({"sig": signal.SIGKILL, "cpu_s": 2.0}, Status.TIMEOUT),
    ({"sig": signal.SIGKILL, "memory_cgroup": True}, Status.MEMORY_LIMIT),
    ({"sig": signal.SIGKILL}, Status.KILLED_BY_SIGNAL),
    ({"exit_code": 1, "stderr": b"Traceback...\nMemoryError\n"}, Status.MEMORY_LIMIT),
    ({"exit_code": 1, "stderr": b"MemoryError mentioned\nValueError: x\n"}, Status.NONZERO_EXIT),
    ({"sig": signal.SIGKILL, "killed_for": "timeout"}, Status.TIMEOUT),
    ({"sig": signal.SIGKILL, "killed_for": "output"}, Status.OUTPUT_TRUNCATED),
    ({"exit_code": 0, "killed_for": "output"}, Status.OUTPUT_TRUNCATED),
])
def test_exactly_one_status_by_precedence(kwargs, expected):
    assert status(**kwargs) is expected


def test_status_values_are_the_documented_names():
    assert [s.value for s in Status] == ["ok", "nonzero_exit", "timeout", "memory_limit",
                                         "output_truncated", "killed_by_signal", "sandbox_error"]


def test_result_to_dict_and_summary():
    result = ExecResult(Status.KILLED_BY_SIGNAL, signal=11, stdout=b"\xffx")
    data = result.to_dict()
    assert data["status"] == "killed_by_signal" and data["stdout"] == "\ufffdx"
    assert "SIGSEGV" in result.summary() and not result.ok


from hypothesis import given, strategies as st  # noqa: E402


@given(exit_code=st.one_of(st.none(), st.integers(0, 255)),
       sig=st.one_of(st.none(), st.sampled_from(list(signal.Signals))),
       cpu_s=st.floats(0, 10), killed_for=st.sampled_from([None, "timeout", "output"]),
       stderr=st.binary(max_size=64), memory_cgroup=st.booleans())
def test_every_outcome_maps_to_exactly_one_status(exit_code, sig, cpu_s, killed_for, stderr, memory_cgroup):
    got = status(exit_code=exit_code, sig=sig, cpu_s=cpu_s, killed_for=killed_for, stderr=stderr,
                 memory_cgroup=memory_cgroup)
    assert isinstance(got, Status)
    if got is Status.SANDBOX_ERROR:
        assert exit_code is None and sig is None and killed_for is None
    if killed_for == "output":
        assert got is Status.OUTPUT_TRUNCATED
    elif killed_for == "timeout":
        assert got is Status.TIMEOUT
    elif got is Status.OK:
        assert exit_code == 0 and sig is None
