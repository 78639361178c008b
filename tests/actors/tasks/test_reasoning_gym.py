"""reasoning-gym tasks (actors/tasks/reasoning_gym.py) with the installed `reasoning-gym` package:
families by name, weighted mixtures, held-out sets by seed, each family's own scorer as the reward
(its part marks, or full marks only), and a short real run (`postrain up`, every role a process,
no sandbox actor)."""
import collections
import itertools
import json
from pathlib import Path

import pytest
import reasoning_gym
import trio

from postrain.actors.env import TaskOptionsError
from postrain.actors.tasks import TaskError, get_task
from postrain.cli.eval import evaluate

MIXTURE = {"families": {"chain_sum": 3.0, "count_bits": 1.0},
           "configs": {"chain_sum": {"max_terms": 2, "max_digits": 1}}, "num_eval": 10}


def answer_of(task) -> str:
    """The generator's own answer to a task dict's problem."""
    dataset = reasoning_gym.create_dataset(task["family"], seed=task["seed"], size=task["size"],
                                           **json.loads(task["config"]))
    return dataset[task["index"]]["answer"]


def oracle_for(tasks):
    """A policy that answers each held-out question with the generator's own answer."""
    answers = {task["question"]: answer_of(task) for task in tasks}

    async def act(messages):
        return f"Thinking done. <answer>{answers[messages[-1]['content']]}</answer>"
    return act


@pytest.fixture
def run_task(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from task_runs import run_task   # tests/actors/task_runs.py
    return run_task


def test_an_unknown_family_lists_the_closest_names():
    with pytest.raises(TaskError, match=r"no task family 'chainsum'; closest: \['chain_sum'"):
        get_task("reasoning_gym:chainsum")
    with pytest.raises(TaskOptionsError, match=r"no task family 'leg_count'; closest: \['leg_counting'"):
        get_task("reasoning_gym").check_options({"families": {"leg_count": 1.0}})


def test_generator_options_are_checked_by_the_generator():
    spec = get_task("reasoning_gym:chain_sum")
    assert spec.check_options({"min_terms": 2, "max_terms": 3})
    with pytest.raises(TaskOptionsError, match=r"max_terms must be >= min_terms"):
        spec.check_options({"min_terms": 4, "max_terms": 2})
    with pytest.raises(TaskOptionsError, match=r"task_options.seed = 1: unknown field"):
        spec.check_options({"seed": 1})
    with pytest.raises(TaskOptionsError, match=r"weight of 'chain_sum' must be > 0"):
        get_task("reasoning_gym").check_options({"families": {"chain_sum": 0.0}})
    with pytest.raises(TaskOptionsError, match=r"configs names 'count_bits', which is not in families"):
        get_task("reasoning_gym").check_options({"families": {"chain_sum": 1.0}, "configs": {"count_bits": {}}})


def test_a_mixture_draws_families_by_weight_and_never_trains_on_a_held_out_question():
    spec = get_task("reasoning_gym")
    held = spec.eval_tasks(MIXTURE)
    assert collections.Counter(t["family"] for t in held) == {"chain_sum": 10, "count_bits": 10}
    train = list(itertools.islice(spec.train_tasks(0, MIXTURE), 400))
    share = sum(t["family"] == "chain_sum" for t in train) / len(train)
    assert 0.68 <= share <= 0.82   # weight 3 of 4
    # chain_sum with 2 one-digit terms has few distinct questions: many repeat the held-out ones
    assert not {t["question"] for t in held} & {t["question"] for t in train}
    assert [t["question"] for t in itertools.islice(spec.train_tasks(0, MIXTURE), 20)] == \
        [t["question"] for t in train[:20]]
    assert [t["question"] for t in spec.eval_tasks({**MIXTURE, "eval_seed": 5})] != [t["question"] for t in held]
    assert all(t["config"] == '{"max_digits": 1, "max_terms": 2}' for t in held if t["family"] == "chain_sum")


def test_each_family_scores_with_its_own_verifier():
    opts = {**MIXTURE, "num_eval": 4}
    held = get_task("reasoning_gym").eval_tasks(opts)
    right = trio.run(lambda: evaluate("scripted", "reasoning_gym", opts, None, 8, policy=oracle_for(held)))
    assert right["num_tasks"] == 8 and right["accuracy"] == 1.0 and right["num_failed"] == 0

    async def wrong(messages):
        return "<answer>-1</answer>"
    wrong_result = trio.run(lambda: evaluate("scripted", "reasoning_gym", opts, None, 8, policy=wrong))
    assert wrong_result["accuracy"] == 0.0
    one = get_task("reasoning_gym:count_bits")
    held_one = one.eval_tasks({"num_eval": 3})
    assert {t["family"] for t in held_one} == {"count_bits"} and len(held_one) == 3
    result = trio.run(lambda: evaluate("scripted", "reasoning_gym:count_bits", {"num_eval": 3}, None, 8,
                                       policy=oracle_for(held_one)))
    assert result["accuracy"] == 1.0


def test_part_marks_are_the_familys_unless_partial_credit_is_off():
    spec = get_task("reasoning_gym:chain_sum")
    options = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "num_eval": 40}
    task = next(t for t in spec.eval_tasks(options) if int(answer_of(t)) > 0)
    answer = answer_of(task)
    replies = {f"<answer>{answer}</answer>": 1.0, f"<answer>1-{answer}</answer>": len(answer) / (len(answer) + 2),
               f"<answer>-{answer}</answer>": len(answer) / (len(answer) + 1), "<answer>x</answer>": 0.0}
    for partial_credit in (True, False):
        env = spec.make_env(options={**options, "partial_credit": partial_credit})
        for reply, marks in replies.items():
            trio.run(env.reset, task)
            got = trio.run(env.step, reply).reward.components["correct"]
            assert got == pytest.approx(marks if partial_credit else float(marks == 1.0)), (reply, partial_credit)


def test_demonstrations_answer_training_problems_in_tags_and_score_full_marks():
    spec = get_task("reasoning_gym")
    demos = spec.demonstrations(12, 0, MIXTURE)
    held = {t["question"] for t in spec.eval_tasks(MIXTURE)}
    train = list(itertools.islice(spec.train_tasks(0, MIXTURE), 12))
    env = spec.make_env(options=MIXTURE)
    for demo, task in zip(demos, train):
        assert demo["messages"][:-1] == trio.run(env.reset, task) and task["question"] not in held
        result = trio.run(env.step, demo["messages"][-1]["content"])
        assert demo["messages"][-1]["content"].startswith("<answer>") and result.reward.components == {"correct": 1.0}
    one = get_task("reasoning_gym:count_bits").demonstrations(2, 0, {"num_eval": 2})
    assert len(one) == 2 and one[0]["messages"][-1]["content"].startswith("<answer>")


@pytest.mark.slow
def test_a_short_run_on_a_mixture_trains_without_a_sandbox_and_balances_its_ledger(tmp_path, run_task):
    summary, folder = run_task(tmp_path, "reasoning_gym", MIXTURE | {"num_eval": 2})
    ledger = summary["ledger"]
    assert summary["steps"] == 1 and ledger["created"] == 6 and ledger["in_flight"] == 0
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["trained"] == 6
    assert 0.0 <= summary["eval_after"] <= 1.0
    assert sorted(p.stem for p in (folder / "logs").iterdir()) == ["env", "generator", "learner", "orchestrator"]
