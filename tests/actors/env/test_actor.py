"""The environment actor, as real processes under a real supervisor with the tiny generator:
an environment class named as the task (`scripted_envs:CountdownEnv`), one episode driver
(training's rollout and `postrain eval` give the same reward for the same episode), a sandbox
looked up only when the environment runs code, and options checked with the fix named."""
from __future__ import annotations

from pathlib import Path

import pytest

from postrain.actors import Reward, TaskOptionsError, get_task
from postrain.actors.env.actor import EnvironmentActor, EnvironmentOptions
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.cli.eval import evaluate
from postrain.core import ActorSpec, Supervisor
from postrain.core.errors import ActorStartError, ConfigError
from postrain.core.options import validate_options
from postrain.core.testing import async_test

HERE = Path(__file__).resolve().parents[1]   # tests/actors: scripted_envs.py
TASK = "scripted_envs:CountdownEnv"                  # tests/actors/scripted_envs.py
SANDBOXED = "scripted_envs:SandboxedCountdownEnv"
GENERATOR = ActorSpec(name="generator", cls="postrain.actors.generator:GeneratorActor", cpus=0.5,
                      memory_mb=0, options={"model": "tiny", "kv_cache_mb": 16})
SAMPLING = {"max_new_tokens": 8, "seed": 3}


@pytest.fixture(autouse=True)
def scripted_envs_importable(monkeypatch):
    """The test environments import by path here and in spawned actors (they inherit sys.path)."""
    monkeypatch.syspath_prepend(str(HERE))


def env_spec(name: str, **options) -> ActorSpec:
    return ActorSpec(name=name, cls="postrain.actors.env:EnvironmentActor", cpus=0.1, memory_mb=0,
                     max_restarts=0, options=options)


def actions_of(rollout: dict) -> list[str]:
    """Each turn's action text: a run of sampled ids (loss_mask 1), decoded as the actor did."""
    runs, run = [], []
    for token, sampled in zip(rollout["token_ids"], rollout["loss_mask"]):
        if sampled:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    return [byte_tokenizer().decode(ids, skip_special_tokens=True) for ids in runs]


def replay(actions: list[str]):
    """A scripted policy for `postrain eval` that plays `actions` in order."""
    queue = list(actions)

    async def policy(messages):
        return queue.pop(0)
    return policy


@async_test
async def test_training_and_eval_give_the_same_reward_for_the_same_episode():
    # task = "pkg.mod:EnvClass"; no sandbox actor runs: CountdownEnv declares none
    cases = {"env-done": {"target": 2}, "env-truncated": {"target": 99}}
    async with Supervisor.open(heartbeat_interval_s=0.5) as sup:
        await sup.start(GENERATOR)
        rollouts = {}
        for name, task_options in cases.items():
            ref = await sup.start(env_spec(name, task=TASK, task_options=task_options))
            rollouts[name] = await ref.ask("rollout", {"task": {"id": "countdown-eval-0"}, "sample_id": "s0",
                                                      "sampling": SAMPLING}, timeout_s=120)
    for name, task_options in cases.items():
        rollout = rollouts[name]
        actions = actions_of(rollout)
        reward = Reward.from_dict(rollout["reward"])
        chars = sum(len(a) for a in actions) / 100
        # the reward rule: every step's reward summed per component, plus truncated()'s
        if name == "env-done":
            assert rollout["num_turns"] == len(actions) == 2
            assert reward.components == pytest.approx({"chars": chars, "step": 0.5, "finished": 1.0})
            assert reward.weights == {"finished": 2.0}
        else:
            assert rollout["num_turns"] == len(actions) == 3
            assert reward.components == pytest.approx({"chars": chars, "step": 0.75, "truncated": -1.0})
        # the same episode through `postrain eval`'s path: the same task, the same actions
        result = await evaluate("tiny", TASK, task_options, None, 8, policy=replay(actions))
        assert result["task"] == TASK and result["num_tasks"] == 1 and result["num_failed"] == 0
        assert result["accuracy"] == pytest.approx(reward.total)
        # the cause the environment named travels with the rollout and is counted by eval alike
        assert rollout.get("cause") == ("counted_down" if name == "env-done" else None)
        assert result["causes"] == ({"counted_down": 1} if name == "env-done" else {})
        # tokens in, tokens out: the bookkeeping lines up, and no tool call was made
        num = len(rollout["token_ids"])
        assert {len(rollout[key]) for key in ("loss_mask", "behavior_logprobs", "policy_versions")} == {num}
        assert all((v >= 0) == bool(m) for v, m in zip(rollout["policy_versions"], rollout["loss_mask"]))
        assert rollout["num_policy_tokens"] == sum(rollout["loss_mask"]) and rollout["tool_statuses"] == []
        assert {hop["hop"] for hop in rollout["timeline"]} == {"episode", "generate"}


@async_test
async def test_a_sandbox_is_needed_only_by_an_environment_that_runs_code_and_options_are_checked():
    async with Supervisor.open(heartbeat_interval_s=0.5) as sup:
        await sup.start(GENERATOR)
        needs = r"needs the sandbox actor 'sandbox' \(task '" + SANDBOXED + "' runs code "
        with pytest.raises(ActorStartError, match=needs + r".*fix: add a SandboxActor named 'sandbox'"):
            await sup.start(env_spec("env-a", task=SANDBOXED))
        with pytest.raises(ActorStartError, match=r"declares uses_sandbox = True\) but environment actor "
                                                  r"'env-b' has sandbox = ''; fix: add a SandboxActor"):
            await sup.start(env_spec("env-b", task=SANDBOXED, sandbox=""))
        with pytest.raises(ActorStartError, match=r"needs the sandbox actor 'jail' \(its options name "
                                                  r"sandbox = 'jail'\)"):
            await sup.start(env_spec("env-c", task=TASK, sandbox="jail"))
        with pytest.raises(ActorStartError, match=r"task_options.targte = 2: unknown field"):
            await sup.start(env_spec("env-d", task=TASK, task_options={"targte": 2}))
        # a task that runs no code starts without any sandbox actor in the run
        await sup.start(env_spec("env-e", task=TASK))
        assert "sandbox" not in sup.records


def test_environment_options_name_each_bad_field():
    assert set(EnvironmentOptions.model_fields) == {"task", "task_options", "tasks", "model", "chat_template", "generator", "sandbox", "scorers",
                                                     "step_timeout_s", "max_total_tokens", "context"}
    with pytest.raises(ConfigError, match=r"options.task_options: 1 bad task option\(s\) of task "
                                          r"'arithmetic': task_options.max_digts = 2: unknown field"):
        validate_options(EnvironmentActor, {"task_options": {"max_digts": 2}})
    with pytest.raises(ConfigError, match=r"options.env_options: unknown field"):
        validate_options(EnvironmentActor, {"env_options": {"max_digits": 2}})
    with pytest.raises(ConfigError, match=r"options.task = 'nope': unknown task 'nope'"):
        validate_options(EnvironmentActor, {"task": "nope"})
    with pytest.raises(ConfigError, match=r"options.step_timeout_s = 0: Input should be greater than 0"):
        validate_options(EnvironmentActor, {"step_timeout_s": 0})
    options = validate_options(EnvironmentActor, {"task": TASK, "task_options": {"target": 1}})
    assert options.task_options == {"target": 1} and options.sandbox is None
    rule = r"task_options.target = 0: Input should be greater than or equal to 1"
    with pytest.raises(ConfigError, match=rule):
        validate_options(EnvironmentActor, {"task": TASK, "task_options": {"target": 0}})
    with pytest.raises(TaskOptionsError, match=rule):
        get_task(TASK).check_options({"target": 0})
