"""The `code_tests` reward's sandbox rule (actors/tasks/rewards.py): a sandbox failure the code may
have caused scores 0; one that provably is not the code's (the sandbox could not start the run) is
retried once, then the sample is dropped, never silently."""
from __future__ import annotations

import logging

import pytest
import trio

from postrain.actors import LocalSandbox
from postrain.actors.tasks.rewards import RewardFailure, load_reward
from postrain.sandbox import NOT_STARTED, ExecResult, Policy, Sandbox, Status

TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"
RIGHT = "def add(a, b):\n    return a + b\n"


def score(handle, completion: str = RIGHT):
    return trio.run(lambda: load_reward("code_tests").score(completion, {"tests": TESTS}, answer_field="tests",
                                                             sandbox=handle))


class ScriptedSandbox:
    """A sandbox handle that answers the first calls from `script` (a result, or an exception to
    raise), then runs on `real` (a handle), counting calls."""

    def __init__(self, script: list, real=None) -> None:
        self.script, self.real, self.num_calls = list(script), real, 0

    async def exec(self, code, *, files=None, stdin=None, timeout_s=None):
        self.num_calls += 1
        if self.script:
            answer = self.script.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return await self.real.exec(code, files=files, stdin=stdin, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def cold():
    with Sandbox(Policy(wall_time_s=10.0), mode="cold") as sandbox:
        yield LocalSandbox(sandbox)


@pytest.mark.parametrize("result", [
    ExecResult(Status.SANDBOX_ERROR, mode="warm", error="warm worker failed (EOFError()); restarted"),
    {"status": "sandbox_error", "error": "nsjail failed: nsjail exited 255 without a report"},   # from the wire
])
def test_a_run_that_started_and_ended_as_sandbox_error_scores_0_with_its_reason_logged(result, caplog):
    handle = ScriptedSandbox([result])
    with caplog.at_level(logging.WARNING, logger="postrain.actors.tasks.rewards"):
        assert score(handle).components == {"correct": 0.0}
    assert handle.num_calls == 1
    error = result["error"] if isinstance(result, dict) else result.error
    assert error in caplog.text and "scored 0" in caplog.text


def test_a_run_the_sandbox_could_not_start_is_retried_and_then_scored(cold, caplog):
    handle = ScriptedSandbox([ExecResult(Status.SANDBOX_ERROR, error=f"{NOT_STARTED}no warm worker")], real=cold)
    with caplog.at_level(logging.WARNING, logger="postrain.actors.tasks.rewards"):
        assert score(handle).components == {"correct": 1.0}
    assert handle.num_calls == 2 and "no warm worker" in caplog.text


def test_a_sandbox_that_cannot_start_drops_the_sample_with_the_reason_after_one_retry(monkeypatch, caplog):
    """A real cold sandbox whose nsjail is missing: nothing of the code ran, so the sample is
    dropped (RewardFailure, which the ledger counts), and each try is logged."""
    monkeypatch.setenv("POSTRAIN_NSJAIL", "/nonexistent/nsjail")
    with Sandbox(Policy(wall_time_s=10.0), mode="cold") as sandbox, \
            caplog.at_level(logging.WARNING, logger="postrain.actors.tasks.rewards"):
        with pytest.raises(RewardFailure, match=r"could not start the run .*could not start nsjail.*"
                                                r"not the code's failure, so the sample is dropped"):
            score(LocalSandbox(sandbox))
    assert "try 1 of 2" in caplog.text and "try 2 of 2" in caplog.text


def test_a_sandbox_call_that_raises_drops_the_sample_after_one_retry():
    handle = ScriptedSandbox([OSError("connection reset"), OSError("connection reset")])
    with pytest.raises(RewardFailure, match=r"the sandbox call raised OSError: connection reset; not the code's"):
        score(handle)
    assert handle.num_calls == 2
