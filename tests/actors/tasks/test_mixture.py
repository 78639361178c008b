"""Task mixtures (actors/tasks/mixture.py): the draw follows the weights, groups never mix tasks,
each task keeps its own stream, a mixture of one is the task alone, rewards meet on one scale,
each task evaluates as it would alone, and a bad [[tasks]] table is named with the fix."""
from __future__ import annotations

import itertools

import pytest
import trio
from pydantic import ValidationError

from postrain.actors.configs.run_config import parse_up_config
from postrain.actors.env.api import Reward
from postrain.actors.env.user_errors import EnvironmentErrors
from postrain.actors.orchestrator.dynamic_sampling import BatchRules
from postrain.actors.orchestrator.evaluation import Evaluator, TaskScores
from postrain.actors.orchestrator.ledger import SampleLedger
from postrain.actors.orchestrator.options import OrchestratorOptions
from postrain.actors.orchestrator.run_state import PromptSchedule, check_same_data_order, data_order
from postrain.actors.orchestrator.rollout_pool import RolloutPool
from postrain.actors.orchestrator.scored_sample import ScoredSample
from postrain.actors.orchestrator.warm_start import mixture_demonstrations
from postrain.actors.orchestrator.work import WorkSignal
from postrain.actors.records import ROLLOUT, Rollout, RunState
from postrain.actors.tasks import TaskMixture, get_task
from postrain.core.errors import ConfigError

ONE_DIGIT = {"include_instructions": False, "max_digits": 1}
TWO_DIGITS = {"include_instructions": False, "min_digits": 2, "max_digits": 2}


def mixture(*entries: dict, **options) -> TaskMixture:
    return TaskMixture.of(OrchestratorOptions(tasks=list(entries), **options))


def three_tasks() -> TaskMixture:
    return mixture({"task": "arithmetic", "name": "small", "options": ONE_DIGIT, "weight": 1},
                   {"task": "arithmetic", "name": "large", "options": TWO_DIGITS, "weight": 2},
                   {"task": "reasoning_gym:chain_sum", "weight": 5})


def test_groups_draw_their_task_in_proportion_to_the_weights():
    tasks = three_tasks()
    draws = [tasks.draw(seed=7, batch=b, group=g).name for b in range(50) for g in range(80)]
    counts = [draws.count(name) for name in tasks.names]
    expected = [len(draws) * share for share in tasks.shares]
    chi_square = sum((seen - want) ** 2 / want for seen, want in zip(counts, expected))
    assert chi_square < 13.82, (counts, expected)   # the 0.999 quantile of chi-square, 2 degrees of freedom
    assert tasks.names == ["small", "large", "reasoning_gym_chain_sum"]


def test_each_group_is_one_tasks_item_and_batches_are_a_function_of_seed_and_index():
    tasks = three_tasks()
    schedule = PromptSchedule(tasks, seed=3, prompts_per_step=6)
    batches = [schedule.prompts(b) for b in range(5)]
    streams = {t.name: list(itertools.islice(t.spec.train_tasks(seed=3, options=t.options), 30)) for t in tasks.tasks}
    for b, batch in enumerate(batches):   # group g of batch b: item b * P + g of its task's own stream
        assert [item for _, item in batch] == [streams[of.name][b * 6 + g] for g, (of, _) in enumerate(batch)]
    assert {of.name for batch in batches for of, _ in batch} == set(tasks.names)
    # shares that follow the signal change the draws, not the items a task's groups take
    shifted = PromptSchedule(tasks, seed=3, prompts_per_step=6).prompts(0, [0.0, 0.0, 1.0])
    assert [of.name for of, _ in shifted] == ["reasoning_gym_chain_sum"] * 6
    assert [item for _, item in shifted] == streams["reasoning_gym_chain_sum"][:6]
    jumping = PromptSchedule(tasks, seed=3, prompts_per_step=6)
    assert jumping.prompts(3) == batches[3] and jumping.prompts(1) == batches[1]
    assert PromptSchedule(tasks, seed=4, prompts_per_step=6).prompts(0) != batches[0]


def test_a_mixture_of_one_task_is_that_task_alone():
    alone = PromptSchedule(TaskMixture.single(get_task("arithmetic"), ONE_DIGIT), seed=0, prompts_per_step=4)
    listed = PromptSchedule(mixture({"task": "arithmetic", "options": ONE_DIGIT}), seed=0, prompts_per_step=4)
    stream = get_task("arithmetic").train_tasks(seed=0, options=ONE_DIGIT)
    for b in range(3):
        items = list(itertools.islice(stream, 4))
        assert [item for _, item in alone.prompts(b)] == items == [item for _, item in listed.prompts(b)]
    # the data order of a run of one task keeps the keys it had before mixtures: old checkpoints resume
    assert "tasks" not in data_order(OrchestratorOptions(task_options=ONE_DIGIT))


def test_a_resume_with_another_mixture_is_refused():
    before = OrchestratorOptions(tasks=[{"task": "arithmetic", "weight": 1}, {"task": "code", "weight": 1}])
    after = OrchestratorOptions(tasks=[{"task": "arithmetic", "weight": 3}, {"task": "code", "weight": 1}])
    state = RunState(phase="rl", next_batch=2, evals={}, ledger={}, ledger_events_offset=0, metrics_offset=0,
                     data_order=data_order(before))
    check_same_data_order(state, before)
    with pytest.raises(Exception, match=r"data order changed \(tasks: .*'weight': 1\.0.*'weight': 3\.0"):
        check_same_data_order(state, after)


def sample(task: str, reward: float) -> ScoredSample:
    rollout = Rollout(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -1.0, -1.0],
                      policy_versions=[-1, 0, 0], reward=Reward({"score": reward}), num_turns=1,
                      num_policy_tokens=2)
    return ScoredSample("b0-g0-s0", rollout, task=task)


def test_each_tasks_rewards_are_mapped_from_its_range_onto_zero_to_one_before_advantages():
    tasks = mixture({"task": "arithmetic", "name": "check"},
                    {"task": "arithmetic", "name": "judge", "reward_range": [0, 10]},
                    {"task": "arithmetic", "name": "signed", "reward_range": [-1, 1]})
    rules = BatchRules(mixture=tasks)
    assert [rules.reward(sample("check", r)) for r in (0.0, 1.0)] == [0.0, 1.0]
    assert [rules.reward(sample("judge", r)) for r in (0.0, 5.0, 10.0)] == [0.0, 0.5, 1.0]
    assert [rules.reward(sample("signed", r)) for r in (-1.0, 0.0, 1.0)] == [0.0, 0.5, 1.0]
    # overlong shaping applies on the common scale, after the mapping
    shaped = BatchRules(mixture=tasks, overlong_max_tokens=1, overlong_buffer_tokens=1)
    assert shaped.reward(sample("judge", 10.0)) == 0.0


def test_the_warm_start_takes_each_tasks_demonstrations_by_weight():
    tasks = mixture({"task": "arithmetic", "name": "small", "options": ONE_DIGIT, "weight": 3},
                    {"task": "code", "weight": 1}, {"task": "long_context", "weight": 4})   # long_context has none
    demos = mixture_demonstrations(tasks, 20, seed=0)
    code_prompts = {d["messages"][1]["content"] for d in get_task("code").demonstrations(5, seed=0)}
    assert len(demos) == 20 and sum(d["messages"][1]["content"] in code_prompts for d in demos) == 5
    assert mixture_demonstrations(tasks, 20, seed=0) == demos


class ScoringEnv:
    """An environment actor's reference that records each episode it is sent and scores it by
    its task dict and seed alone, as a deterministic policy and grader would."""

    name = "env"

    def __init__(self):
        self.sent: list[tuple[str, str, int | None]] = []

    async def call(self, kind, request, timeout_s=None):
        assert kind is ROLLOUT, kind
        key = (request.task_name, str(request.task), request.sampling.seed)
        self.sent.append(key)
        score = float(hash(key[1:]) % 3 == 0)
        return Rollout(token_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0], policy_versions=[-1, 0],
                       reward=Reward({"correct": score}), num_turns=1, num_policy_tokens=1,
                       cause="ok" if score else "wrong")


class Keeper:
    published_version = 0


def evaluate(tmp_path, tasks: TaskMixture, **options) -> tuple[TaskScores, list]:
    env = ScoringEnv()
    options = OrchestratorOptions(eval_samples_per_task=2, **options)
    pool = RolloutPool([env], Keeper(), SampleLedger(tmp_path / f"{len(tasks.tasks)}.jsonl"), 8, 0,
                       WorkSignal(None, None), ["generator"], EnvironmentErrors(1.0, lambda line: None))
    evaluator = Evaluator(tasks, options, pool, metrics=None, emit=lambda line: None)
    scores = trio.run(evaluator.score_by_task, 0.7, 2, "sampled_before")
    return scores, env.sent


def test_each_tasks_evaluation_in_a_mixture_is_its_evaluation_alone(tmp_path):
    tasks = mixture({"task": "arithmetic", "name": "small", "options": ONE_DIGIT, "num_eval_tasks": 6},
                    {"task": "arithmetic", "name": "large", "options": TWO_DIGITS}, num_eval_tasks=9)
    together, sent = evaluate(tmp_path, tasks, num_eval_tasks=9)
    for task in tasks.tasks:
        alone, sent_alone = evaluate(tmp_path, TaskMixture.single(task.spec, task.options),
                                     num_eval_tasks=task.num_eval_tasks or 9)
        assert together.accuracy[task.name] == alone.accuracy[task.spec.name]
        assert together.causes[task.name] == alone.causes[task.spec.name]
        assert sum(together.causes[task.name].values()) == 2 * (task.num_eval_tasks or 9)
        mine = sorted(key[1:] for key in sent if key[0] == task.name)
        assert mine == sorted(key[1:] for key in sent_alone) and len(mine) == 2 * (task.num_eval_tasks or 9)


def test_a_mixtures_evaluation_row_counts_each_tasks_causes(tmp_path):
    rows: list[dict] = []
    metrics = type("Rows", (), {"log": lambda self, kind, **row: rows.append(row)})()
    shown: list[str] = []
    tasks = mixture({"task": "arithmetic", "name": "small", "options": ONE_DIGIT},
                    {"task": "arithmetic", "name": "large", "options": TWO_DIGITS}, num_eval_tasks=6)
    pool = RolloutPool([ScoringEnv()], Keeper(), SampleLedger(tmp_path / "ledger.jsonl"), 8, 0,
                       WorkSignal(None, None), ["generator"], EnvironmentErrors(1.0, lambda line: None))
    evaluator = Evaluator(tasks, OrchestratorOptions(num_eval_tasks=6), pool, metrics=metrics, emit=shown.append)
    trio.run(evaluator.phase, "before", "before")
    (row,) = rows
    for name in ("small", "large"):      # ScoringEnv names "ok" for a right episode, "wrong" for another
        assert sum(row[f"causes_{name}"].values()) == 6
        assert row[f"causes_{name}"].get("ok", 0) == round(6 * row[f"accuracy_{name}"])
    assert "causes" not in row and "; causes: small " in shown[-1] and "; large " in shown[-1]


def test_a_bad_tasks_table_is_named_with_the_fix():
    with pytest.raises(ValidationError, match=r"both task and \[\[tasks\]\] are set; fix: state the run's tasks once"):
        OrchestratorOptions(task="code", tasks=[{"task": "arithmetic"}])
    with pytest.raises(ValidationError, match=r"task name\(s\) \['arithmetic'\] are used twice .*fix: give each"):
        OrchestratorOptions(tasks=[{"task": "arithmetic"}, {"task": "arithmetic", "weight": 2}])
    with pytest.raises(ValidationError, match=r"reward_range = \[1.0, 0.0\] must have high > low"):
        OrchestratorOptions(tasks=[{"task": "arithmetic", "reward_range": [1, 0]}])
    with pytest.raises(ValidationError, match=r"tasks.0.weight\n  Input should be greater than 0"):
        OrchestratorOptions(tasks=[{"task": "arithmetic", "weight": 0}])
    with pytest.raises(ValidationError, match=r"max_digts"):
        OrchestratorOptions(tasks=[{"task": "arithmetic", "options": {"max_digts": 2}}])
    with pytest.raises(ValidationError, match=r"task name 'Big Numbers' must be 1-40 characters"):
        OrchestratorOptions(tasks=[{"task": "arithmetic", "name": "Big Numbers"}])
    with pytest.raises(ValidationError, match=r"no task of the mixture \['long_context'\] has any"):
        OrchestratorOptions(sft_steps=5, tasks=[{"task": "long_context"}])


def test_a_run_configs_tasks_tables_reach_the_orchestrator_and_every_environment():
    actor = {"cpus": 0.1, "memory_mb": 0}
    doc = {"run": {"name": "mix", "driver": "orchestrator"},
           "tasks": [{"task": "arithmetic", "weight": 2}, {"task": "reasoning_gym:chain_sum"}],
           "actors": [{"name": "env", "cls": "postrain.actors.env:EnvironmentActor", **actor},
                      {"name": "orchestrator", "cls": "postrain.actors.orchestrator:OrchestratorActor", **actor}]}
    config = parse_up_config(doc)
    assert all([t["task"] for t in spec.options["tasks"]] == ["arithmetic", "reasoning_gym:chain_sum"]
               for spec in config.actors)
    with pytest.raises(ConfigError, match=r"\[\[tasks\]\] and \[shared\] tasks are both set"):
        parse_up_config({**doc, "shared": {"tasks": doc["tasks"]}})


def test_shares_that_follow_the_signal_favour_tasks_that_teach_and_keep_every_floor():
    from postrain.actors.orchestrator.task_weights import TaskWeights, with_floor
    assert with_floor([0.9, 0.08, 0.02], 0.1) == pytest.approx([0.8, 0.1, 0.1])
    tasks = mixture({"task": "arithmetic", "name": "teaches"}, {"task": "arithmetic", "name": "solved"},
                    {"task": "arithmetic", "name": "hopeless"})
    weights = TaskWeights(tasks, "signal", min_share=0.1, max_staleness=1)
    assert weights.shares_for(0) == weights.shares_for(1) == pytest.approx([1 / 3] * 3)
    teaching = [sample("teaches", 0.0), sample("teaches", 1.0)]
    flat = {"solved": [sample("solved", 1.0)] * 2, "hopeless": [sample("hopeless", 0.0)] * 2}
    rules = BatchRules(mixture=tasks)
    for b in range(12):
        row = weights.update(b, [teaching, flat["solved"], flat["hopeless"]], rules.reward)
    shares = weights.shares_for(13)   # after batch 11 (max_staleness 1)
    assert shares[0] == pytest.approx(0.8) and shares[1] == shares[2] == pytest.approx(0.1)
    assert row["share_teaches"] == round(shares[0], 4) and row["signal_solved"] < 0.2
    # a checkpoint keeps what later batches draw with
    restored = TaskWeights(tasks, "signal", min_share=0.1, max_staleness=1)
    restored.load_state_dict(weights.state_dict())
    assert restored.shares_for(12) == weights.shares_for(12) and restored.shares_for(13) == shares
    # fixed weights: the [[tasks]] weights, whatever the rewards
    fixed = TaskWeights(tasks)
    assert fixed.update(0, [teaching], rules.reward) is None and fixed.shares_for(5) == tasks.shares
    with pytest.raises(ValidationError, match=r"min_task_share = 0.4 for 3 tasks asks for more than every group"):
        OrchestratorOptions(tasks=[{"task": "arithmetic", "name": n} for n in "abc"], task_weights="signal",
                            min_task_share=0.4)


def test_kl_targets_per_task_need_a_learner_with_a_reference_and_a_starting_coefficient():
    actor = {"cpus": 0.1, "memory_mb": 0}
    doc = {"run": {"name": "mix", "driver": "orchestrator"},
           "tasks": [{"task": "arithmetic"}, {"task": "code", "kl_target": 0.02}],
           "actors": [{"name": "learner", "cls": "postrain.actors.learner:LearnerActor", **actor},
                      {"name": "orchestrator", "cls": "postrain.actors.orchestrator:OrchestratorActor", **actor}]}
    with pytest.raises(ConfigError, match=r"tasks \['code'\] set kl_target, but learner 'learner' has no "
                                          r"reference_model and no kl_coef > 0; fix: .*reference_model"):
        parse_up_config(doc)
    doc["actors"][0]["options"] = {"learner": {"reference_model": "initial", "kl_coef": 0.01}}
    assert TaskMixture.of(OrchestratorOptions(tasks=doc["tasks"])).kl_targets == {"code": 0.02}
    parse_up_config(doc)
