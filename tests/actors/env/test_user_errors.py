"""Failures of the user's own code (actors/env/user_errors.py): the reason names their file:line, the
traceback shows their frames only (an environment's, a reward function's run in a worker thread),
the failure crosses the wire whole, the first is shown once, and one error failing most of a step
stops it in one line."""
from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import trio

from postrain.actors.env import EnvironmentErrors, EnvironmentErrorStop, run_episode
from postrain.actors.env.user_errors import MAX_FRAMES, drop_reason, failure_of, reported_failure, user_error
from postrain.actors.tasks.rewards import load_reward
from postrain.core.errors import RemoteError
from user_code_with_a_typo import TYPO_LINE, USER_CODE

JUDGE_LINE = 1 + USER_CODE.splitlines().index('    return {"correct": 1.0 / len(completion)}')
HEADER = "Traceback (most recent call last; postrain's frames left out):"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """USER_CODE as the user's module my_code.py (importable by name, as a config names it)."""
    (tmp_path / "my_code.py").write_text(USER_CODE)
    spec = importlib.util.spec_from_file_location("my_code", tmp_path / "my_code.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "my_code", module)
    return module


def episode_failure(module) -> Exception:
    async def say_hi(messages):
        return "hi"

    async def play():
        try:
            await run_episode(module.MyEnv(), {}, say_hi)
        except Exception as exc:   # noqa: BLE001 - the failure under test
            return exc
    return trio.run(play)


def frames(text: str) -> list[tuple[str, int, str]]:
    return [(file.rsplit("/", 1)[-1], int(line), name)
            for file, line, name in re.findall(r'^  File "(.*)", line (\d+), in (\w+)$', text, re.MULTILINE)]


def test_an_environments_error_names_the_users_line_and_shows_only_their_frames(user_module):
    exc = episode_failure(user_module)
    error = "AttributeError: 'MyEnv' object has no attribute 'targte'"
    assert drop_reason(exc) == f"environment raised {error} at my_code.py:{TYPO_LINE}"
    shown = user_error(exc).traceback
    assert shown.splitlines()[0] == HEADER and shown.splitlines()[-1] == error
    assert frames(shown) == [("my_code.py", TYPO_LINE - 3, "step"), ("my_code.py", TYPO_LINE, "score")]


def test_a_reward_function_run_in_a_worker_thread_shows_its_own_frame_not_the_threads(user_module):
    reward = load_reward("my_code:judge")
    with pytest.raises(Exception) as info:
        trio.run(lambda: reward.score("", {"answer": "1"}, answer_field="answer"))
    assert drop_reason(info.value) == ("reward function 'my_code:judge' raised ZeroDivisionError: float "
                                       f"division by zero at my_code.py:{JUDGE_LINE}")
    assert frames(user_error(info.value).traceback) == [("my_code.py", JUDGE_LINE, "judge")]


def test_a_deep_traceback_keeps_its_innermost_frames(user_module):
    with pytest.raises(ZeroDivisionError) as info:
        user_module.deep(2 * MAX_FRAMES)
    shown = user_error(info.value).traceback
    # 2 * MAX_FRAMES + 1 calls of deep and the test's own frame: the innermost MAX_FRAMES are shown
    assert f"[... {MAX_FRAMES + 2} earlier frames]" in shown
    assert shown.endswith("ZeroDivisionError: division by zero")


def test_a_failure_crosses_the_wire_as_its_reason_then_the_users_traceback(user_module):
    exc = episode_failure(user_module)
    sent = reported_failure(exc)
    # what the environment actor's caller gets (core/inbox.py: the type's name and str(exc))
    received = RemoteError(type(sent).__name__, str(sent), "the actor's own traceback")
    assert failure_of(received) == failure_of(exc) == (drop_reason(exc), user_error(exc).traceback)
    assert failure_of(RemoteError("ActorDiedError", "environment raised ActorDiedError: env died")) is None
    assert failure_of(ValueError("not the environment's")) is None


def test_the_first_failure_is_shown_once_and_one_error_failing_most_of_a_step_stops_it(user_module):
    shown = []
    errors = EnvironmentErrors(0.5, show=shown.append)
    exc = episode_failure(user_module)
    reasons = [errors.record(exc) for _ in range(3)]
    assert reasons == [drop_reason(exc)] * 3 and errors.record(RemoteError("ActorDiedError", "died")) is None
    assert shown[0].endswith(f": {drop_reason(exc)}") and shown[1] == HEADER
    assert sum(line == HEADER for line in shown) == 1 and errors.num_failures == 3
    errors.check(reasons[:2] + ["another reason"] * 2, 4, "samples of step 3")   # half: goes on
    with pytest.raises(EnvironmentErrorStop) as info:
        errors.check(reasons + ["another reason"], 4, "samples of step 3")
    assert str(info.value) == (f"{drop_reason(exc)} in 3 of 4 samples of step 3; fix your environment "
                               "(docs/environments.md)")
    EnvironmentErrors(1.0, show=shown.append).check(reasons, 3, "samples of step 1")   # 1.0: never
