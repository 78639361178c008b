"""verifiers tasks (actors/tasks/verifiers_env.py) against the installed `verifiers` package: a
taskset written here (no hub data), its @vf.reward functions as reward components with their
weights, a held-out split, a scorer that raises or hangs, and a short real run."""
from pathlib import Path

import pytest
import trio

from postrain.actors.environment import TaskOptionsError
from postrain.actors.tasks import get_task
from postrain.actors.tasks.rewards import RewardFailure
from postrain.cli.eval import evaluate

TASKSET = '''
import time
import verifiers.v1 as vf

class SumData(vf.TaskData):
    answer: str

class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.25)
    async def brief(self, task, trace) -> float:
        return float(len(trace.last_reply) <= 3)

    @vf.metric
    async def length(self, task, trace) -> float:
        return float(len(trace.last_reply))

class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(10):
            for b in range(10):
                yield SumTask(SumData(prompt=f"What is {a} + {b}?", system_prompt="Answer with a number.",
                                      answer=str(a + b)), self.config.task)

class FragileTask(SumTask):
    @vf.reward
    async def fragile(self, task, trace) -> float:
        if trace.last_reply == "boom":
            raise RuntimeError("the scorer broke")
        if trace.last_reply == "hang":
            time.sleep(30)
        return 1.0

class FragileTaskset(vf.Taskset[FragileTask, vf.TasksetConfig]):
    def load(self):
        yield FragileTask(SumData(prompt="What is 1 + 1?", answer="2"), self.config.task)

def sums():
    return SumTaskset(vf.TasksetConfig())

def fragile():
    return FragileTaskset(vf.TasksetConfig())

NOT_A_TASKSET = 42
'''


@pytest.fixture
def tasksets(tmp_path, monkeypatch):
    (tmp_path / "vf_tasks.py").write_text(TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def answers_policy():
    async def act(messages):
        a, b = messages[-1]["content"].removeprefix("What is ").removesuffix("?").split(" + ")
        return str(int(a) + int(b))
    return act


def test_the_held_out_split_is_disjoint_and_the_prompt_is_the_tasks(tasksets):
    spec = get_task("verifiers")
    opts = {"taskset": "vf_tasks:sums", "eval_fraction": 0.2}
    held = spec.eval_tasks(opts)
    train = [t for t, _ in zip(spec.train_tasks(0, opts), range(100 - len(held)))]
    held_prompts = {t["data"]["prompt"] for t in held}
    assert 5 <= len(held) <= 40 and not held_prompts & {t["data"]["prompt"] for t in train}
    assert len(held_prompts | {t["data"]["prompt"] for t in train}) == 100
    env = spec.make_env(options=opts)
    assert trio.run(env.reset, held[0]) == [{"role": "system", "content": "Answer with a number."},
                                            {"role": "user", "content": held[0]["data"]["prompt"]}]


def test_its_rewards_are_the_components_with_their_weights_and_metrics_are_not(tasksets):
    spec = get_task("verifiers")
    opts = {"taskset": "vf_tasks:sums", "num_eval": 1}
    env = spec.make_env(options=opts)
    task = spec.eval_tasks(opts)[0]
    trio.run(env.reset, task)
    result = trio.run(env.step, str(eval(task["data"]["prompt"].removeprefix("What is ").rstrip("?"))))
    assert result.done and result.reward.components == {"correct": 1.0, "brief": 1.0}
    assert result.reward.weights == {"correct": 1.0, "brief": 0.25} and result.reward.total == 1.25
    held = spec.eval_tasks({"taskset": "vf_tasks:sums"})
    scored = trio.run(lambda: evaluate("scripted", "verifiers", {"taskset": "vf_tasks:sums"}, None, 8,
                                       policy=answers_policy()))
    assert scored["num_tasks"] == len(held) and scored["accuracy"] == 1.0


@pytest.mark.parametrize("reply, reason", [("boom", r"verifiers scoring raised .*the scorer broke"),
                                           ("hang", r"verifiers scoring did not return within 0.5 s")])
def test_a_scorer_that_raises_or_hangs_fails_only_its_sample(tasksets, reply, reason):
    spec = get_task("verifiers")
    opts = {"taskset": "vf_tasks:fragile", "eval_fraction": 0.99, "score_timeout_s": 0.5}
    (task,) = spec.eval_tasks(opts)
    env = spec.make_env(options=opts)
    trio.run(env.reset, task)
    with pytest.raises(RewardFailure, match=reason):
        trio.run(env.step, reply)


def test_a_bad_taskset_is_named(tasksets):
    with pytest.raises(TaskOptionsError, match=r"'vf_tasks:NOT_A_TASKSET' is a int, not a verifiers.v1.Taskset"):
        get_task("verifiers").eval_tasks({"taskset": "vf_tasks:NOT_A_TASKSET"})
    with pytest.raises(TaskOptionsError, match=r"cannot load the verifiers taskset 'vf_tasks:nope'"):
        get_task("verifiers").eval_tasks({"taskset": "vf_tasks:nope"})


@pytest.mark.slow
def test_a_short_run_on_a_verifiers_taskset_balances_its_ledger(tasksets, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from task_runs import run_task   # tests/actors/task_runs.py
    summary, folder = run_task(tasksets, "verifiers", {"taskset": "vf_tasks:sums", "num_eval": 2})
    ledger = summary["ledger"]
    assert summary["steps"] == 1 and ledger["created"] == 6 and ledger["in_flight"] == 0
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["trained"] == 6
    assert sorted(p.stem for p in (folder / "logs").iterdir()) == ["env", "generator", "learner", "orchestrator"]
