"""Dataset tasks (actors/tasks/dataset.py) and their reward functions (actors/tasks/rewards.py).

Real files (JSONL, Parquet, a `datasets` folder) made here; the real math-verify; code_tests in a
real nsjail sandbox; `postrain eval` as a user runs it.
"""
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import trio

from postrain.actors.env import LocalSandbox, TaskOptionsError
from postrain.actors.tasks import get_task
from postrain.actors.tasks.dataset import DatasetError
from postrain.actors.tasks.rewards import RewardError, RewardFailure, load_reward
from postrain.cli.eval import evaluate

ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10) for b in range(10)]

USER_REWARDS = '''
import time, trio

def half(completion, example):
    return {"correct": float(completion.strip() == example["answer"]), "short": 0.5}

async def async_match(completion, example):
    await trio.sleep(0)
    return float(completion.strip() == example["answer"])

def boom(completion, example):
    if example["answer"] == "3":
        raise ZeroDivisionError("no threes here")
    return 1.0

def sleepy(completion, example):
    time.sleep(30)
    return 1.0

async def async_sleepy(completion, example):
    await trio.sleep(30)
    return 1.0

def garbage(completion, example):
    return "yes"

def picky(completion, example):
    """For a real run: odd answers raise, multiples of 4 hang, the rest score."""
    answer = int(example["answer"])
    if answer % 2:
        raise ValueError(f"odd answer {answer}")
    if answer % 4 == 0:
        time.sleep(30)
    return {"correct": float(completion.strip() == example["answer"])}
'''


@pytest.fixture
def data(tmp_path, monkeypatch):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS[:20]), tmp_path / "eval.parquet")
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def run_task(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from task_runs import run_task   # tests/actors/task_runs.py
    return run_task


def options(data, **extra):
    return {"path": str(data / "train.jsonl"), "prompt_field": "question", **extra}


def test_a_held_out_fraction_is_disjoint_seeded_and_training_cycles_through_the_rest(data):
    spec = get_task("dataset")
    held = spec.eval_tasks(options(data, eval_fraction=0.2))
    train = list(itertools.islice(spec.train_tasks(0, options(data, eval_fraction=0.2)), 100 - len(held)))
    held_q = {t["example"]["question"] for t in held}
    train_q = {t["example"]["question"] for t in train}
    assert 5 <= len(held) <= 40 and not held_q & train_q and len(held_q | train_q) == 100
    again = list(itertools.islice(spec.train_tasks(0, options(data, eval_fraction=0.2)), 10))
    other = list(itertools.islice(spec.train_tasks(1, options(data, eval_fraction=0.2)), 10))
    assert [t["id"] for t in again] == [t["id"] for t in train[:10]] and again != other
    reseeded = {t["example"]["question"] for t in spec.eval_tasks(options(data, eval_fraction=0.2, split_seed=7))}
    assert reseeded != held_q
    assert held[0]["where"].startswith(str(data / "train.jsonl") + " line ")


def test_an_eval_file_in_parquet_is_the_held_out_set_and_num_eval_caps_it(data):
    spec = get_task("dataset")
    held = spec.eval_tasks(options(data, eval_path=str(data / "eval.parquet"), num_eval=5))
    assert [t["example"] for t in held] == ROWS[:5]
    assert held[2]["where"] == f"{data / 'eval.parquet'} row 3"


def test_a_datasets_folder_and_chat_message_prompts_are_read(data):
    import datasets
    chat = [{"messages": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in ROWS]
    datasets.Dataset.from_list(chat).save_to_disk(str(data / "saved"))
    spec = get_task("dataset")
    held = spec.eval_tasks({"path": str(data / "saved"), "prompt_field": "messages", "eval_fraction": 0.1})
    assert held and held[0]["example"]["messages"][0]["role"] == "user"
    env = spec.make_env(options={"path": str(data / "saved"), "prompt_field": "messages",
                                 "system_prompt": "Be brief."})
    first = trio.run(env.reset, held[0])
    assert first[0] == {"role": "system", "content": "Be brief."} and first[1]["role"] == "user"


def test_a_row_without_the_prompt_or_answer_field_is_named_by_file_and_row(data):
    bad = data / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({"question": "What is 1 + 1?"}) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl line 3 has no field 'answer'.*answer_field"):
        get_task("dataset").eval_tasks({"path": str(bad), "prompt_field": "question"})
    pq.write_table(pa.Table.from_pylist([{"q": "x", "answer": "1"}]), data / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet row 1 has no field 'question'"):
        get_task("dataset").eval_tasks({"path": str(data / "bad.parquet"), "prompt_field": "question"})
    (data / "worse.jsonl").write_text('{"question": "x", "answer": 1}\n{"question": \n')
    with pytest.raises(DatasetError, match=r"worse.jsonl line 2 is not JSON"):
        get_task("dataset").eval_tasks({"path": str(data / "worse.jsonl"), "prompt_field": "question"})
    with pytest.raises(DatasetError, match=r"missing.jsonl does not exist"):
        get_task("dataset").eval_tasks({"path": str(data / "missing.jsonl")})


def test_bad_task_options_are_named():
    with pytest.raises(TaskOptionsError, match=r"task_options.path.*Field required"):
        get_task("dataset").check_options({})
    with pytest.raises(TaskOptionsError, match=r"unknown reward 'fuzzy'.*exact"):
        get_task("dataset").check_options({"path": "x.jsonl", "reward": "fuzzy"})
    with pytest.raises(RewardError, match=r"cannot load reward 'nowhere.mod:fn'"):
        load_reward("nowhere.mod:fn")


@pytest.mark.parametrize("reward, completion, answer, correct", [
    ("exact", "  42 ", "42", 1.0), ("exact", "42.0", "42", 0.0),
    ("exact", "I think <answer>Paris</answer>", "Paris", 1.0),
    ("last_integer", "3 apples and 1,204 pears", "#### 1204", 1.0), ("last_integer", "12", "13", 0.0),
    ("last_integer", "no number", "1", 0.0),
    ("math", "So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("math", "<answer>0.5</answer>", "\\frac{1}{2}", 1.0),
    ("math", "The result is $2\\sqrt{2}$", "\\sqrt{8}", 1.0),
    ("math", "\\boxed{3}", "4", 0.0), ("math", "no idea", "4", 0.0),
])
def test_built_in_rewards(reward, completion, answer, correct):
    result = trio.run(lambda: load_reward(reward).score(completion, {"a": answer}, answer_field="a"))
    assert result.components == {"correct": correct}


def test_code_tests_runs_the_reference_tests_on_the_completion_in_the_sandbox():
    from postrain.sandbox import Sandbox
    tests = "from solution import add\ndef test_one():\n    assert add(1, 2) == 3\ndef test_two():\n    assert add(2, 2) == 4\n"
    reward = load_reward("code_tests")
    assert reward.uses_sandbox and get_task("dataset").needs_sandbox({"path": "x", "reward": "code_tests"})
    assert not get_task("dataset").needs_sandbox({"path": "x", "reward": "math"})
    with Sandbox(mode="warm", num_workers=1) as box:
        async def score(completion):
            return await reward.score(completion, {"tests": tests}, answer_field="tests",
                                      sandbox=LocalSandbox(box))
        good = trio.run(score, "Here:\n```python\ndef add(a, b):\n    return a + b\n```")
        half = trio.run(score, "def add(a, b):\n    return 3")
    assert good.components == {"correct": 1.0} and half.components == {"correct": 0.5}


# Solutions written to forge the code_tests reward rather than to add: each must score 0.
FORGERIES = {
    "equal to everything": "class Any:\n    def __eq__(self, other): return True\n"
                           "def add(a, b): return Any()",
    "a printed report": "import json, sys, os\n"
                        "print('\\n' + json.dumps({'load_error': None, 'results': [{'repr': '3'}, {'repr': '4'}]}))\n"
                        "sys.stdout.flush(); os._exit(0)\ndef add(a, b): return 0",
    "exits at import": "import os\nos._exit(0)",
    "patched builtins": "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
                        "builtins.repr = lambda value: 'None'\ndef add(a, b): return 0",
    "kills its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b): return 0",
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_code_tests_is_judged_on_the_host_so_a_forged_solution_scores_nothing(forgery):
    from postrain.sandbox import Sandbox
    tests = ("import solution\nfrom solution import add\n\ndef test_one():\n    \"Adds.\"\n"
             "    assert add(1, 2) == 3\n    assert solution.add(0, 3) == 3\n\nassert add(2, 2) == 4\n")
    with Sandbox(mode="warm", num_workers=1) as box:
        async def score(completion):
            return await load_reward("code_tests").score(completion, {"tests": tests}, answer_field="tests",
                                                         sandbox=LocalSandbox(box))
        assert trio.run(score, "def add(a, b):\n    return a + b").components == {"correct": 1.0}
        assert trio.run(score, FORGERIES[forgery]).components == {"correct": 0.0}
        if forgery == "patched builtins":  # a forged report claims values: it scores what returning them does
            claims_3 = FORGERIES[forgery].replace("'None'", "'3'")
            assert trio.run(score, claims_3).components == trio.run(score, "def add(a, b): return 3").components


@pytest.mark.parametrize("tests, named", [
    ("from solution import add\ndef test_one():\n    got = add(1, 2)\n    assert got == 3\n", "line 3"),
    ("from solution import add\ndef test_one():\n    assert add(1, 2) == three()\n", "not a literal"),
    ("from solution import add\n", "no `assert CALL == EXPECTED`"),
])
def test_code_tests_refuses_a_test_file_it_cannot_judge_on_the_host_naming_the_line(tests, named):
    from postrain.actors.tasks.rewards import RewardFailure
    with pytest.raises(RewardFailure, match=named):
        trio.run(lambda: load_reward("code_tests").score("def add(a, b): return a + b", {"tests": tests},
                                                         answer_field="tests", sandbox=object()))


def test_with_a_python_tool_the_model_may_run_code_in_the_sandbox_before_it_answers(data):
    from postrain.actors.env import run_episode
    from postrain.sandbox import Sandbox
    spec = get_task("dataset")
    opts = options(data, reward="last_integer", max_tool_calls=1, eval_path=str(data / "eval.parquet"))
    assert spec.needs_sandbox(opts) and not spec.needs_sandbox(options(data))
    task = spec.eval_tasks(opts)[15]   # What is 1 + 5?

    async def tool_then_answer(messages):
        if messages[-1]["role"] == "user" and messages[-1]["content"].startswith("<output>"):
            return f"<answer>{messages[-1]['content'].split()[1]}</answer>"
        return "<python>\nprint(1 + 5)\n</python>"

    async def tool_twice(messages):
        return "<python>\nprint(1 + 5)\n</python>"
    with Sandbox(mode="warm", num_workers=1) as box:
        env = spec.make_env(sandbox=LocalSandbox(box), options=opts)
        episode = trio.run(run_episode, env, task, tool_then_answer)
        stubborn = trio.run(run_episode, spec.make_env(sandbox=LocalSandbox(box), options=opts), task, tool_twice)
    assert episode.messages[0]["role"] == "system" and "<python>" in episode.messages[0]["content"]
    assert episode.messages[3]["content"] == "<output>\n6\n</output>" and episode.num_turns == 2
    assert episode.reward.components == {"correct": 1.0} and not episode.truncated
    assert stubborn.truncated and stubborn.reward.total == 0.0
    assert "No more tool calls" in stubborn.messages[-1]["content"] and stubborn.num_turns == 2


def test_demonstrations_fill_the_template_from_training_rows_and_score_full_marks(data):
    spec = get_task("dataset")
    opts = options(data, reward="math", demonstration="\\boxed{{{answer}}}", system_prompt="Box it.",
                   eval_fraction=0.2)
    demos = spec.demonstrations(30, 0, opts)
    held = {t["example"]["question"] for t in spec.eval_tasks(opts)}
    env = spec.make_env(options=opts)
    for demo, task in zip(demos, itertools.islice(spec.train_tasks(0, opts), 30)):
        assert demo["messages"][:-1] == trio.run(env.reset, task) and task["example"]["question"] not in held
        assert demo["messages"][-1] == {"role": "assistant", "content": f"\\boxed{{{task['example']['answer']}}}"}
        assert trio.run(env.step, demo["messages"][-1]["content"]).reward.components == {"correct": 1.0}
    with pytest.raises(DatasetError, match=r"has no demonstrations; fix: set task option demonstration"):
        spec.demonstrations(1, 0, options(data))
    with pytest.raises(DatasetError, match=r"demonstration '\{solution\}' does not fit .*train.jsonl line"):
        spec.demonstrations(1, 0, options(data, demonstration="{solution}"))


def test_user_rewards_sync_and_async_floats_and_dicts(data):
    example = {"question": "q", "answer": "7"}
    half = trio.run(lambda: load_reward("user_rewards:half").score("7", example, answer_field="answer"))
    assert half.components == {"correct": 1.0, "short": 0.5} and half.total == 1.5
    matched = trio.run(lambda: load_reward("user_rewards:async_match").score("7", example, answer_field="answer"))
    assert matched.components == {"reward": 1.0}


@pytest.mark.parametrize("fn, reason", [
    ("boom", r"reward function 'user_rewards:boom' raised ZeroDivisionError: no threes here"),
    ("sleepy", r"'user_rewards:sleepy' did not return within 0.3 s"),
    ("async_sleepy", r"'user_rewards:async_sleepy' did not return within 0.3 s"),
    ("garbage", r"'user_rewards:garbage' returned 'yes'; fix: return a finite float"),
])
def test_a_reward_that_raises_hangs_or_returns_garbage_fails_its_sample_with_the_reason(data, fn, reason):
    reward = load_reward(f"user_rewards:{fn}")
    with pytest.raises(RewardFailure, match=reason):
        trio.run(lambda: reward.score("x", {"answer": "3"}, answer_field="answer", timeout_s=0.3))


def test_eval_scores_a_policy_with_the_task_reward_and_counts_failed_rewards(data):
    answers = {r["question"]: r["answer"] for r in ROWS}

    async def oracle(messages):
        return f"<answer>{answers[messages[-1]['content']]}</answer>"
    opts = options(data, eval_path=str(data / "eval.parquet"), reward="last_integer")
    result = trio.run(lambda: evaluate("scripted", "dataset", opts, None, 8, policy=oracle))
    assert result["num_tasks"] == 20 and result["accuracy"] == 1.0 and result["num_failed"] == 0
    # the eval file's answers are 0..9 and 1..10: 'boom' raises on the two rows whose answer is "3"
    opts = options(data, eval_path=str(data / "eval.parquet"), reward="user_rewards:boom")
    result = trio.run(lambda: evaluate("scripted", "dataset", opts, None, 8, policy=oracle))
    assert result["num_failed"] == 2 and result["accuracy"] == pytest.approx(18 / 20)


def test_postrain_eval_prints_the_accuracy_of_a_dataset_task(data):
    opts = json.dumps(options(data, eval_fraction=0.1, reward="math", num_eval=3))
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "eval", "--model", "tiny", "--task", "dataset",
                             "--task-options", opts, "--json", "--max-tokens", "4"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    scored = json.loads(result.stdout.strip().splitlines()[-1])
    assert scored["task"] == "dataset" and scored["num_tasks"] == 3 and 0.0 <= scored["accuracy"] <= 1.0
    bad = subprocess.run([sys.executable, "-m", "postrain.cli", "eval", "--model", "tiny", "--task", "dataset",
                          "--task-options", json.dumps({"path": str(data / "nope.jsonl")}), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "nope.jsonl does not exist" in bad.stderr


@pytest.mark.slow
def test_a_short_run_on_a_dataset_task_drops_only_the_samples_whose_reward_raised_or_hung_and_is_tracked(
        data, run_task, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # reading the run's local MLflow store
    opts = options(data, reward="user_rewards:picky", reward_timeout_s=1.0, eval_fraction=0.1)
    summary, folder = run_task(data, "dataset", opts, extra={"tracking": {"backends": ["mlflow"]}})
    ledger = summary["ledger"]
    assert summary["steps"] == 1 and ledger["created"] == 6 and ledger["in_flight"] == 0
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["dropped"] > 0
    reasons = " ".join(ledger["drop_reasons"])
    assert "reward function 'user_rewards:picky' raised ValueError: odd answer" in reasons
    assert "reward function 'user_rewards:picky' did not return within 1.0 s" in reasons
    assert sorted(p.stem for p in (folder / "logs").iterdir()) == ["env", "generator", "learner", "orchestrator"]
    # the tracker got the same train rows as metrics.jsonl, and the summary
    from mlflow.tracking import MlflowClient
    from postrain.core.metrics import read_metrics
    client = MlflowClient((folder / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("postrain").experiment_id])
    steps = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [(row["step"], row["loss"]) for row in read_metrics(folder, "train")]
    assert run.data.metrics["summary/ledger/created"] == 6 and run.info.status == "FINISHED"
