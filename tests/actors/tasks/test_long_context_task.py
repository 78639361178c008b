"""The long-context task (actors/tasks/long_context.py): seeded repositories, files opened by name
or paged in order, an exact grade, held-out answers never trained on, options checked by name."""
from __future__ import annotations

import itertools

import pytest
import trio

from postrain.actors import TaskOptionsError, get_task, run_episode

OPTIONS = {"num_files": 3, "file_lines": 2}


def scripted(*actions):
    replies = iter(actions)

    async def policy(messages):
        return next(replies)
    return policy


def test_files_open_by_name_or_in_order_and_the_answer_is_graded_exactly():
    spec = get_task("long_context")
    task = spec.eval_tasks(OPTIONS)[0]
    assert task == spec.eval_tasks(OPTIONS)[0], "seeded"
    holder = next(name for name, text in task["files"].items() if f"= {task['answer']}" in text)
    episode = trio.run(run_episode, spec.make_env(options=OPTIONS), task,
                       scripted("page", f"<open>{holder}</open>", "<open>nope.cfg</open>",
                                f"<answer> {task['answer']} </answer>"))
    first = next(iter(task["files"]))
    assert episode.messages[2]["content"] == f"{first}:\n{task['files'][first]}"
    assert episode.messages[4]["content"].startswith(f"{holder}:\n")
    assert episode.messages[6]["content"].startswith("No file 'nope.cfg'")
    assert episode.reward.components == {"correct": 1.0} and not episode.truncated
    wrong = trio.run(run_episode, spec.make_env(options=OPTIONS), task, scripted("<answer>0</answer>"))
    assert wrong.reward.components == {"correct": 0.0}
    idle = trio.run(run_episode, spec.make_env(options=OPTIONS), task, scripted(*["x"] * 5))
    assert idle.truncated and idle.num_turns == 5 and idle.reward.components == {"correct": 0.0}
    assert idle.messages[-1]["content"].startswith("Every file was shown")


def test_held_out_answers_are_never_trained_on_and_options_are_checked():
    spec = get_task("long_context")
    held_out = {t["answer"] for t in spec.eval_tasks(OPTIONS)}
    train = list(itertools.islice(spec.train_tasks(0, OPTIONS), 200))
    assert not held_out & {t["answer"] for t in train}
    assert all(len(t["files"]) == 3 for t in train)
    with pytest.raises(TaskOptionsError, match=r"task_options.num_file = 3: unknown field"):
        spec.check_options({"num_file": 3})


def test_the_prompt_form_holds_every_file_and_ends_at_the_first_turn():
    spec = get_task("long_context")
    options = dict(OPTIONS, form="prompt")
    task = spec.eval_tasks(options)[0]
    assert not spec.needs_sandbox(options)
    right = trio.run(run_episode, spec.make_env(options=options), task, scripted(f"<answer>{task['answer']}</answer>"))
    first = right.messages[0]["content"] if right.messages[0]["role"] == "user" else right.messages[1]["content"]
    assert all(f"== {name} ==\n{text}" in first for name, text in task["files"].items())
    assert right.reward.components == {"correct": 1.0} and right.num_turns == 1
    no_answer = trio.run(run_episode, spec.make_env(options=options), task, scripted("<open>app.cfg</open>"))
    assert no_answer.reward.components == {"correct": 0.0} and no_answer.num_turns == 1


def test_the_shell_form_greps_the_files_in_a_real_sandbox_session():
    from postrain.actors.env.api import LocalSandbox
    from postrain.sandbox import Sandbox
    spec = get_task("long_context")
    options = dict(OPTIONS, form="shell")
    task = spec.eval_tasks(options)[0]
    key = task["question"].split("`")[1]
    assert spec.needs_sandbox(options)
    with Sandbox(mode="warm", num_workers=1) as box:
        episode = trio.run(run_episode, spec.make_env(sandbox=LocalSandbox(box), options=options), task,
                           scripted(f"<bash>grep -rh '^{key} =' /work</bash>", f"<answer>{task['answer']}</answer>"))
        silent = trio.run(run_episode, spec.make_env(sandbox=LocalSandbox(box), options=options), task,
                          scripted("I think it is 3."))
    assert f"{key} = {task['answer']}" in episode.messages[-2]["content"]
    assert episode.reward.components == {"correct": 1.0} and episode.num_turns == 2
    assert silent.reward.components == {"correct": 0.0} and silent.num_turns == 1
