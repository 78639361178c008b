"""The terminal task family: the suite and its split, every reference solution replayed through the
real environment in a real sandbox session (it passes, and doing nothing fails), demonstrations,
and the session's life: one per episode, closed whatever ended the episode."""
from __future__ import annotations

import pytest
import trio

from postrain.actors import LocalSandbox, TaskOptionsError, get_task, run_episode
from postrain.actors.env import EnvironmentFailure
from postrain.actors.tasks import terminal
from postrain.actors.tasks.terminal import (EVAL_IDS, KIND_NAMES, SUITE, TerminalEnv, demonstration,
                                            eval_tasks, train_split, train_tasks)
from postrain.actors.env.tools import parse_action
from postrain.core.testing import async_test
from postrain.sandbox import Policy, Sandbox


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(Policy(wall_time_s=10.0, cpu_time_s=10, memory_mb=256), mode="warm", num_workers=1) as sb:
        yield sb


def replay(demo: dict):
    """A policy that plays a demonstration's assistant turns in order."""
    turns = [m["content"] for m in demo["messages"] if m["role"] == "assistant"]

    async def policy(messages):
        return turns[sum(m["role"] == "assistant" for m in messages)]
    return policy


def test_the_suite_is_large_deterministic_and_split_by_kind():
    assert len(SUITE) >= 40 and len({t["id"] for t in SUITE}) == len(SUITE)
    assert terminal._build_suite() == SUITE, "built by code, the same every time"
    held_out, train = eval_tasks(), train_split()
    assert {t["kind"] for t in held_out} == set(KIND_NAMES) == {t["kind"] for t in train}
    assert len(held_out) == len(KIND_NAMES) and len(held_out) + len(train) == len(SUITE)
    stream = [t["id"] for _, t in zip(range(100), train_tasks(seed=3))]
    assert stream == [t["id"] for _, t in zip(range(100), train_tasks(seed=3))]
    assert {i.rsplit("-", 2)[0] for i in stream} == {t["id"] for t in train} and not set(stream) & EVAL_IDS
    only = eval_tasks({"kinds": ["fix_unit_test"]})
    assert [t["kind"] for t in only] == ["fix_unit_test"]
    with pytest.raises(TaskOptionsError, match=r"task_options.kinds = \['nope'\]: .*kinds must name "
                                               r"some of .*fix: drop the unknown \['nope'\]"):
        get_task("terminal").eval_tasks({"kinds": ["nope"]})


def test_demonstrations_use_the_bash_tool_and_training_tasks_only():
    spec = get_task("terminal")
    demos = spec.demonstrations(40, seed=1)
    assert demos == spec.demonstrations(40, seed=1)
    prompts = {t["prompt"] for t in eval_tasks()} - {t["prompt"] for t in train_split()}
    for demo in demos:
        assert demo["messages"][1]["content"] not in prompts
        turns = [m["content"] for m in demo["messages"] if m["role"] == "assistant"]
        assert turns[-1] == "<answer>done</answer>"
        assert all(parse_action(t, ("bash",)).well_formed for t in turns)
        assert all(parse_action(t, ("bash",)).kind == "tool_call" for t in turns[:-1])


@async_test
async def test_every_reference_solution_passes_in_a_session_and_doing_nothing_fails(sandbox):
    """Each demonstration (the reference steps with their recorded outputs) replayed through the
    environment: every observation is exactly what the session printed, and the check passes."""
    handle = LocalSandbox(sandbox)
    failures = []

    async def one(task):
        demo = demonstration(task)
        env = TerminalEnv(sandbox=handle)
        try:
            episode = await run_episode(env, task, replay(demo))
        finally:
            await env.close()
        if episode.messages != demo["messages"]:
            pairs = zip(episode.messages, demo["messages"])
            got, want = next((a, b) for a, b in pairs if a != b)
            failures.append(f"{task['id']}: the session printed {got['content']!r}, the demonstration "
                            f"says {want['content']!r}")
        if episode.reward.components["passed"] != 1.0:
            failures.append(f"{task['id']}: the reference solution fails: {episode.infos[-1]}")
        idle = TerminalEnv(sandbox=handle)
        try:
            nothing = await run_episode(idle, task, replay({"messages": [
                {"role": "assistant", "content": "<answer>done</answer>"}]}))
        finally:
            await idle.close()
        if nothing.reward.components["passed"] != 0.0:
            failures.append(f"{task['id']}: doing nothing passes its check")

    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(2)

        async def limited(task):
            async with limiter:
                await one(task)
        for task in SUITE:
            nursery.start_soon(limited, task)
    assert not failures, "\n".join(failures)


@async_test
async def test_an_episode_works_in_one_session_and_is_graded_even_when_out_of_turns(sandbox):
    task = next(t for t in SUITE if t["kind"] == "count_errors")
    env = TerminalEnv(sandbox=LocalSandbox(sandbox), options={"max_turns": 2})
    turns = iter(["<bash>\nmkdir -p tmp && cd tmp && export N=7\n</bash>",
                  "<bash>pwd; echo $N; grep -rh ' ERROR ' ../logs --include=*.log | wc -l > "
                  "../error_count.txt; exit 3</bash>"])

    async def policy(messages):
        return next(turns)
    try:
        episode = await run_episode(env, task, policy)
        session = env.session
    finally:
        await env.close()
    assert episode.truncated and episode.num_turns == 2
    assert episode.messages[-1]["content"] == "<output>\n/work/tmp\n7\n[exit status 3]\n</output>"
    assert episode.reward.components == {"passed": 1.0, "format": 1.0}, "graded on the work done"
    assert session.closed


@async_test
async def test_a_failing_policy_or_a_cancelled_episode_leaves_no_session_open(sandbox):
    task = next(t for t in SUITE if t["kind"] == "fix_config")
    handle = LocalSandbox(sandbox)

    async def crashing(messages):
        if len(messages) > 2:
            raise RuntimeError("the policy died")
        return "<bash>python3 app.py</bash>"
    env = TerminalEnv(sandbox=handle)
    with pytest.raises(RuntimeError, match="the policy died"):
        try:
            await run_episode(env, task, crashing)
        finally:
            await env.close()
    assert env.session.closed

    async def slow(messages):
        return "<bash>sleep 5</bash>"
    env = TerminalEnv(sandbox=handle)
    with trio.move_on_after(1.0) as scope:
        try:
            await run_episode(env, task, slow)
        finally:
            await env.close()   # inside the cancelled scope: the close is shielded
    assert scope.cancelled_caught and env.session.closed


@async_test
async def test_a_task_whose_setup_fails_is_a_clear_error(sandbox):
    task = {**SUITE[0], "id": "broken", "setup": "false"}
    env = TerminalEnv(sandbox=LocalSandbox(sandbox))
    try:
        with pytest.raises(EnvironmentFailure, match="task broken: its setup failed in the session"):
            await run_episode(env, task, replay({"messages": []}))
    finally:
        await env.close()
    assert env.session.closed
