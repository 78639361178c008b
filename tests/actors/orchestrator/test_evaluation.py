"""The held-out evaluation (actors/orchestrator/evaluation.py) through the real rollout pool: an
environment that fails most episodes with one error stops the run there, before a warm start or
RL steps are spent on it, and its first failure is shown with the user's traceback; the causes
an environment names are counted in the evaluation's row and line."""
from __future__ import annotations

import trio

from postrain.actors.env.api import Reward
from postrain.actors.env.user_errors import EnvironmentErrors, EnvironmentErrorStop
from postrain.actors.orchestrator.evaluation import Evaluator
from postrain.actors.orchestrator.ledger import SampleLedger
from postrain.actors.orchestrator.options import OrchestratorOptions
from postrain.actors.orchestrator.rollout_pool import RolloutPool
from postrain.actors.orchestrator.work import WorkSignal
from postrain.actors.records import ROLLOUT, Rollout
from postrain.actors.tasks import TaskMixture, get_task
from postrain.core.errors import RemoteError

REASON = "environment raised KeyError: 'answer' at my_env.py:9"
TRACEBACK = "Traceback (most recent call last; postrain's frames left out):\n  File ...\nKeyError: 'answer'"


class BrokenEnv:
    """An environment actor's reference whose every episode fails as a user's buggy environment
    makes it fail (actors/env/actor.py: the reason, then the user's traceback)."""

    name = "env"

    async def call(self, kind, request, timeout_s=None):
        assert kind is ROLLOUT, kind
        raise RemoteError("EnvironmentFailure", f"{REASON}\n{TRACEBACK}")


class Keeper:
    published_version = 0


def evaluate(tmp_path, max_fraction: float) -> tuple[list[str], Exception | None]:
    """The evaluation before a run of 4 held-out arithmetic tasks, every episode failing: the lines
    shown, and what it raised."""
    shown: list[str] = []
    options = OrchestratorOptions(num_eval_tasks=4, max_environment_error_fraction=max_fraction)
    pool = RolloutPool([BrokenEnv()], Keeper(), SampleLedger(tmp_path / "ledger.jsonl"), 8, 0,
                       WorkSignal(None, None), ["generator"], EnvironmentErrors(max_fraction, shown.append))
    evaluator = Evaluator(TaskMixture.single(get_task("arithmetic")), options, pool, metrics=None, emit=shown.append)
    try:
        trio.run(evaluator.score_by_task, 0.0, 1, "before")
    except EnvironmentErrorStop as exc:
        return shown, exc
    return shown, None


def test_an_evaluation_that_fails_mostly_by_one_error_stops_the_run(tmp_path):
    shown, stopped = evaluate(tmp_path, 0.5)
    assert str(stopped) == (f"{REASON} in 4 of 4 episodes of the evaluation before; fix your environment "
                            "(docs/environments.md)")
    assert shown == ["the first environment failure (shown once; a step or an evaluation that fails mostly "
                     f"by one error stops): {REASON}", *TRACEBACK.splitlines()]


def test_with_a_fraction_of_one_an_evaluation_scores_its_failures_zero(tmp_path):
    shown, stopped = evaluate(tmp_path, 1.0)
    assert stopped is None and len(shown) == 1 + len(TRACEBACK.splitlines())


class CausingEnv:
    """An environment actor's reference whose episodes name a cause: an even sampling seed is
    right ("ok"), an odd one wrong ("wrong_unit"), one seed in four names none."""

    name = "env"

    async def call(self, kind, request, timeout_s=None):
        seed = request.sampling.seed
        cause = None if seed % 4 == 3 else "ok" if seed % 2 == 0 else "wrong_unit"
        return Rollout(token_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0], policy_versions=[-1, 0],
                       reward=Reward({"correct": float(seed % 2 == 0)}), num_turns=1, num_policy_tokens=1,
                       cause=cause)


class Rows:
    def __init__(self):
        self.rows: list[tuple[str, dict]] = []

    def log(self, kind, **row):
        self.rows.append((kind, row))


def test_an_evaluation_counts_the_causes_its_environment_names_in_its_row_and_line(tmp_path):
    shown: list[str] = []
    metrics = Rows()
    pool = RolloutPool([CausingEnv()], Keeper(), SampleLedger(tmp_path / "ledger.jsonl"), 8, 0,
                       WorkSignal(None, None), ["generator"], EnvironmentErrors(0.5, shown.append))
    evaluator = Evaluator(TaskMixture.single(get_task("arithmetic")), OrchestratorOptions(num_eval_tasks=8),
                          pool, metrics=metrics, emit=shown.append)
    trio.run(evaluator.phase, "before", "before")
    (kind, row), = metrics.rows
    assert kind == "eval" and row["accuracy"] == 0.5
    assert row["causes"] == {"ok": 4, "wrong_unit": 2}        # seeds 3 and 7 named none
    assert shown[-1].startswith("held-out accuracy before: 0.500 (8 episodes, ")
    assert shown[-1].endswith(" s; causes: ok 4, wrong_unit 2)")


def test_a_run_without_rl_steps_reports_the_warm_starts_scores_as_after_rl(tmp_path):
    pool = RolloutPool([CausingEnv()], Keeper(), SampleLedger(tmp_path / "ledger.jsonl"), 8, 0,
                       WorkSignal(None, None), ["generator"], EnvironmentErrors(0.5, print))
    evaluator = Evaluator(TaskMixture.single(get_task("arithmetic")), OrchestratorOptions(num_eval_tasks=8),
                          pool, metrics=Rows(), emit=print)
    evaluator.evals.update({"before": 0.0, "after_sft": 0.5, "sampled_after_sft": 0.25, "task:a:after_sft": 0.5})
    evaluator.skip_rl()      # the driver, when no RL step was trained: no third evaluation of one policy
    assert evaluator.evals["after"] == 0.5 and evaluator.evals["sampled_after"] == 0.25
    assert evaluator.evals["task:a:after"] == 0.5 and evaluator.evals["before"] == 0.0
