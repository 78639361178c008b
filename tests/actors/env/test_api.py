"""The Environment API: values, validation, the episode driver's contract, the local sandbox
handle over a real warm nsjail sandbox, and the docs' custom environment (docs/environments.md),
run exactly."""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import trio

from postrain.actors import (Environment, EnvironmentContractError, EnvironmentFailure, EpisodePolicy,
                             LocalSandbox, Reward, SandboxHandle, StepResult, TaskError, TaskOptionsError,
                             checked_reset, checked_step, checked_truncated, drop_reason, get_task,
                             run_episode, validate_observation, validate_step_result)
from postrain.core.testing import async_test
from postrain.sandbox import Policy, Sandbox

README = Path(__file__).resolve().parents[3] / "docs" / "environments.md"  # the page with the example


@pytest.fixture(scope="module")
def sandbox():
    policy = Policy(wall_time_s=5.0, cpu_time_s=5, memory_mb=256, max_processes=24,
                    work_dir_size_mb=8, max_output_bytes=65536)
    with Sandbox(policy, mode="warm", num_workers=2) as sb:
        yield LocalSandbox(sb)


def scripted(*actions):
    """A policy that plays fixed assistant turns and records what it saw."""
    queue, seen = list(actions), []

    async def policy(messages):
        seen.append(messages)
        return queue.pop(0)
    policy.seen = seen
    return policy


# ---------------------------------------------------------------- values and validation
def test_reward_total_weights_and_wire_form():
    r = Reward({"correct": 1, "format": 1.0}, {"format": 0.1})
    assert r.total == pytest.approx(1.1) and r.components == {"correct": 1.0, "format": 1.0}
    assert Reward.from_dict(r.to_dict()) == r and Reward().total == 0.0
    for bad in ({"x": math.nan}, {"x": True}, {"x": "1"}, {1: 1.0}):
        with pytest.raises(EnvironmentContractError, match="finite float"):
            Reward(bad)
    with pytest.raises(EnvironmentContractError, match="must be a dict"):
        Reward([("correct", 1.0)])


@pytest.mark.parametrize("garbage, message", [
    ((None, True, Reward()), "must return a StepResult, got tuple"),
    (None, "must return a StepResult, got NoneType"),
    (StepResult("x", 1), "done must be a bool"),
    (StepResult(b"bytes", False), "observation must be a str or None"),
    (StepResult(None, False), "observation is None but done is False"),
    (StepResult(None, True), "reward is None but done is True"),
    (StepResult(None, True, {"correct": 1.0}), "reward must be a Reward"),
    (StepResult(None, True, Reward(), info=[1]), "info must be a dict"),
    (StepResult(None, True, Reward(), info={"cause": 3}), "info['cause'] must be a short label"),
    (StepResult(None, True, Reward(), info={"cause": "x" * 65}), "info['cause'] must be a short label"),
])
def test_validate_step_result_names_the_problem(garbage, message):
    with pytest.raises(EnvironmentContractError, match=re.escape(message)):
        validate_step_result(garbage)


def test_validate_good_results_and_observations():
    ok = StepResult("next", False)
    assert validate_step_result(ok) is ok
    assert validate_step_result(StepResult(None, True, Reward({"a": 0.5}))).reward.total == 0.5
    assert validate_observation("hi") == "hi"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert validate_observation(msgs) == msgs
    for bad in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}], 42):
        with pytest.raises(EnvironmentContractError, match="reset"):
            validate_observation(bad)


def test_an_environment_class_is_a_task_by_import_path():
    from postrain.actors.tasks.arithmetic import ArithmeticEnv
    spec = get_task("postrain.actors.tasks.arithmetic:ArithmeticEnv")
    assert spec.env_class is ArithmeticEnv and spec.name == "postrain.actors.tasks.arithmetic:ArithmeticEnv"
    assert spec.uses_sandbox and isinstance(spec.make_env(options={"max_turns": 2}), ArithmeticEnv)
    with pytest.raises(TaskOptionsError, match=r"task_options.max_digts = 2: unknown field"):
        spec.make_env(options={"max_digts": 2})     # the env class's options model checks it
    with pytest.raises(TaskError, match="defines no train_tasks; fix: add a classmethod train_tasks"):
        spec.train_tasks(0)
    with pytest.raises(TaskError, match="unknown task 'ArithmeticEnv'"):
        get_task("ArithmeticEnv")
    with pytest.raises(TaskError, match="cannot load task .*no attribute 'Nope'"):
        get_task("postrain.actors.tasks.arithmetic:Nope")
    with pytest.raises(TaskError, match="not a TaskSpec or an Environment subclass"):
        get_task("postrain.actors.tasks.arithmetic:EVAL_SEED")
    with pytest.raises(EnvironmentContractError, match="max_turns must be an int >= 1"):
        Environment(options={"max_turns": 0})
    with pytest.raises(EnvironmentContractError, match="ArithmeticEnv runs code but was given no sandbox"):
        ArithmeticEnv().require_sandbox()


def test_an_environment_without_options_model_gets_its_options_unchecked():
    env = Environment(options={"target": 2, "max_turns": 3})
    assert env.options.target == 2 and env.max_turns == 3                   # attributes, as models read
    assert env.options.get("target", 9) == 2 and env.options.get("nope", 9) == 9   # and as the dict read
    assert env.options["target"] == 2 and "target" in env.options and "nope" not in env.options
    assert Environment().max_turns == Environment.max_turns                 # no option: the class's


# ---------------------------------------------------------------- the episode driver's contract
class Counter(Environment):
    """Counts to options['target'] with intermediate rewards; misbehaves on request."""

    max_turns = 5

    async def reset(self, task):
        self.n, self.mode = 0, task.get("mode")
        if self.mode == "raise_in_reset":
            raise KeyError("no such task")
        return [{"role": "user", "content": "count"}]

    async def step(self, action):
        if self.mode == "raise":
            raise ZeroDivisionError("oops")
        if self.mode == "hang":
            await trio.sleep_forever()
        if self.mode == "garbage":
            return {"observation": "x", "done": False}
        self.n += 1
        done = self.n >= self.options.get("target", 3)
        return StepResult(None if done else f"n={self.n}", done, Reward({"step": 0.25}))

    async def truncated(self):
        return Reward({"truncated": -1.0})


@async_test
async def test_episode_turns_observations_and_summed_rewards():
    policy = scripted("a", "b", "c")
    ep = await run_episode(Counter(), {}, policy)
    assert ep.num_turns == 3 and not ep.truncated
    assert ep.reward.components == {"step": 0.75}
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert ep.messages[2]["content"] == "n=1" and policy.seen[2][-1] == {"role": "user", "content": "n=2"}


@async_test
async def test_episode_truncated_after_max_turns():
    ep = await run_episode(Counter(options={"target": 99, "max_turns": 2}), {}, scripted("a", "b"))
    assert ep.truncated and ep.num_turns == 2
    assert ep.reward.components == {"step": 0.5, "truncated": -1.0}


class TwoActions(EpisodePolicy):
    """A policy with a budget of two actions that records the driver's calls."""

    def __init__(self):
        self.calls, self.num_actions = [], 0

    def begin(self, messages):
        self.calls.append(("begin", len(messages)))

    def can_act(self):
        return self.num_actions < 2

    async def act(self, messages):
        self.num_actions += 1
        self.calls.append(("act", len(messages)))
        return "x"

    def observe(self, messages):
        self.calls.append(("observe", messages[-1]["content"]))


@async_test
async def test_a_policy_out_of_budget_ends_the_episode_as_truncated():
    policy = TwoActions()
    ep = await run_episode(Counter(options={"target": 99}), {}, policy)
    assert ep.truncated and ep.num_turns == 2
    assert ep.reward.components == {"step": 0.5, "truncated": -1.0}
    assert policy.calls == [("begin", 1), ("act", 1), ("observe", "n=1"), ("act", 3), ("observe", "n=2")]


@async_test
async def test_the_final_step_reward_adds_to_the_intermediate_ones():
    class Bonus(Counter):
        async def step(self, action):
            result = await super().step(action)
            if result.done:
                result.reward = Reward({"step": 0.25, "done": 1.0}, {"done": 3.0})
            return result
    ep = await run_episode(Bonus(options={"target": 2}), {}, scripted("a", "b"))
    assert ep.reward.components == {"step": 0.5, "done": 1.0} and ep.reward.total == 3.5


@async_test
async def test_an_episodes_cause_is_the_last_one_its_steps_named():
    class Named(Counter):
        async def step(self, action):
            result = await super().step(action)
            if action != "quiet":
                result.info = {"cause": f"after_{action}"}
            return result
    assert (await run_episode(Named(options={"target": 3}), {}, scripted("a", "b", "quiet"))).cause == "after_b"
    assert (await run_episode(Counter(options={"target": 1}), {}, scripted("a"))).cause is None


@async_test
async def test_failures_become_drop_reasons():
    with pytest.raises(EnvironmentFailure) as info:
        await run_episode(Counter(), {"mode": "raise"}, scripted("a"))
    assert re.fullmatch(r"environment raised ZeroDivisionError: oops at test_api\.py:\d+",
                        drop_reason(info.value))
    with pytest.raises(EnvironmentFailure, match="environment raised KeyError"):
        await run_episode(Counter(), {"mode": "raise_in_reset"}, scripted())
    with pytest.raises(EnvironmentFailure, match=r"environment step did not return within 0.2 s"):
        await run_episode(Counter(), {"mode": "hang"}, scripted("a"), step_timeout_s=0.2)
    with pytest.raises(EnvironmentContractError, match="must return a StepResult, got dict") as info:
        await run_episode(Counter(), {"mode": "garbage"}, scripted("a"))
    assert drop_reason(info.value).startswith("environment contract: step must return a StepResult")


class BadTruncation(Counter):
    async def truncated(self):
        return 0.0


@async_test
async def test_checked_calls_for_a_token_level_driver():
    env = Counter(options={"target": 2})
    assert await checked_reset(env, {}) == [{"role": "user", "content": "count"}]
    assert (await checked_step(env, "a")).observation == "n=1"
    assert (await checked_step(env, "b")).done
    assert (await checked_truncated(env)).components == {"truncated": -1.0}
    with pytest.raises(EnvironmentContractError, match="truncated must return a Reward, got float"):
        await checked_truncated(BadTruncation())
    with pytest.raises(EnvironmentFailure, match="reset did not return within 0.1 s"):
        await checked_reset(type("Slow", (Counter,), {"reset": lambda self, t: trio.sleep_forever()})(),
                            {}, timeout_s=0.1)


# ---------------------------------------------------------------- the local sandbox handle
@async_test
async def test_local_sandbox_exec_and_run_tests(sandbox):
    assert isinstance(sandbox, SandboxHandle)
    r = await sandbox.exec("print(input()[::-1])", stdin="abc\n")
    assert r.ok and r.stdout == b"cba\n"
    r = await sandbox.exec("print(open('data.txt').read())", files={"data.txt": b"hello"})
    assert r.stdout == b"hello\n"
    assert (await sandbox.exec("while True: pass", timeout_s=0.5)).status.value == "timeout"
    report = await sandbox.run_tests("def sq(x):\n    return x * x\n",
                                     "from solution import sq\ndef test_a():\n    assert sq(3) == 9\n")
    assert report.passed == {"test_a": True}


# ---------------------------------------------------------------- the README example, exactly
def readme_example() -> str:
    text = README.read_text()
    marker = text.index("<!-- example: custom-environment -->")
    block = re.search(r"```python\n(.*?)```", text[marker:], re.DOTALL)
    return block.group(1)


@async_test
async def test_readme_custom_environment_runs_as_written(sandbox, tmp_path, monkeypatch):
    (tmp_path / "readme_reverse_env.py").write_text(readme_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        spec = get_task("readme_reverse_env:TASK")
        assert spec.name == "reverse" and spec.uses_sandbox  # the environment actor gives it a sandbox
        assert get_task("readme_reverse_env:ReverseEnv").env_class is spec.env_class
        task = next(spec.train_tasks(0))
        assert task == {"word": "postrain"} and spec.eval_tasks() == [{"word": "learner"}]

        env = spec.make_env(sandbox=sandbox)
        ep = await run_episode(env, task, scripted("<python>\nprint('postrain'[::-1])\n</python>",
                                                   "<answer>niartsop</answer>"))
        assert ep.messages[2] == {"role": "user", "content": "<output>\nniartsop\n</output>"}
        assert ep.reward.components == {"correct": 1.0, "format": 1.0}
        assert ep.reward.total == pytest.approx(1.1)

        ep = await run_episode(spec.make_env(sandbox=sandbox), task, scripted("<answer>postrain"))
        assert ep.reward.components == {"correct": 0.0, "format": 0.0} and ep.num_turns == 1

        env = spec.make_env(sandbox=sandbox, options={"format_weight": 0.5})   # its options model
        assert env.options.format_weight == 0.5
        ep = await run_episode(env, task, scripted("<answer>niartsop</answer>"))
        assert ep.reward.weights == {"format": 0.5}
        with pytest.raises(TaskOptionsError, match=r"task_options.format_wieght = 0.5: unknown field"):
            spec.make_env(sandbox=sandbox, options={"format_wieght": 0.5})
    finally:
        sys.modules.pop("readme_reverse_env", None)
