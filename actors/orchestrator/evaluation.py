"""Held-out evaluation of the current policy, through the same rollout pool as training.

Each evaluation scores the first `num_eval_tasks` held-out tasks greedily (temperature
0) and, with `eval_samples_per_task` > 0, also that many sampled episodes per task at
the run's temperature. Every episode has its own fixed seed, so every evaluation of a
run meets the same random draws. A task's score is its reward's `correct` component
(the total reward when there is none); an episode the environment fails (it raised or
timed out on the policy's output) scores 0, and an evaluation whose episodes fail mostly by
one environment error stops the run (actors/env/user_errors.py), before a warm start or RL
steps are spent on an environment that cannot score.

Kills (design note). An episode whose actor died (the environment actor, the generator,
the sandbox) is retried by the rollout pool like an RL rollout. One that still cannot
finish (its retries ran out) is not scored 0: the evaluation is incomplete, and it is
redone from the start, up to `max_eval_repeats` times (an `eval_repeat` metrics
row and a line each), then the run stops with EvaluationIncomplete. Every episode has
a fixed seed and the policy does not change during an evaluation, so a repeat meets the
same episodes; a reported accuracy is always the mean over all of them.

During RL (`eval_every`), the RL loop waits for an evaluation after the step it follows, so
the learner does not change the policy under it; batches already admitted keep generating
beside it (max_staleness > 0), on the same weights.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import anyio

from postrain.core.errors import PostrainError
from postrain.core.text import counted

from ..env.tools import STOP_STRINGS
from ..learner.recovery import is_actor_death, short_reason
from .health import HealthWatch, report_warnings
from .options import OrchestratorOptions
from .progress import PhaseProgress
from .rollout_pool import RolloutPool, StaleRolloutError

# An evaluation of at least this many episodes prints a progress line at each quarter of them.
PROGRESS_LINES_FROM_EPISODES = 20


class EvaluationIncomplete(PostrainError, RuntimeError):
    """An evaluation that could not score all its episodes, however often it was redone."""


class Evaluator:
    """Evaluates into `evals` ({"before": x, "sampled_before": y, ...}), a run's accuracies so far."""

    def __init__(self, task, options: OrchestratorOptions, pool: RolloutPool, metrics,
                 emit: Callable[[str], None], report_figures: Callable[[dict], None] | None = None):
        self.task = task                 # TaskSpec: its held-out tasks
        self.options = options
        self.pool = pool
        self.metrics = metrics
        self.emit = emit
        self.report_figures = report_figures   # the head's live view: episodes done, elapsed, ETA
        self._progress: PhaseProgress | None = None   # the evaluation under way
        self.evals: dict[str, float] = {}   # phase -> accuracy; written by `phase` and the run's restore
        self.num_repeats = 0                # evaluations redone because episodes were lost to kills
        self.eval_s = 0.0                   # seconds spent evaluating in this start of the run
        self.health = HealthWatch()         # accuracy collapse, all-zero evaluation warnings (health.py)

    def num_tasks(self) -> int:
        """Held-out tasks each evaluation scores: the first `num_eval_tasks`, or all the task has."""
        return len(self.task.eval_tasks(self.options.task_options)[: self.options.num_eval_tasks])

    async def phase(self, phase: str, label: str, **context) -> None:
        """Evaluate into `evals` (`phase`, and `sampled_<phase>` when `eval_samples_per_task` > 0),
        its metrics row (with `context`, e.g. the RL step) and a printed line (with progress
        lines at each quarter of a long one: episodes done, elapsed, ETA). Cancelled: no row
        or line; `evals` may hold the greedy score of this phase."""
        start = time.monotonic()
        num_episodes = self.num_tasks() * (1 + self.options.eval_samples_per_task)
        self._progress = PhaseProgress(f"evaluation {label}", num_episodes, self.report_figures)
        greedy = await self.score(0.0, 1, phase)
        self.evals[phase] = greedy
        line = f"held-out accuracy {label}: {greedy:.3f}"
        row = {**context, "accuracy": greedy}
        num_samples = self.options.eval_samples_per_task
        if num_samples:
            temperature = self.options.sampling.temperature
            sampled = await self.score(temperature, num_samples, f"sampled_{phase}")
            self.evals[f"sampled_{phase}"] = row["accuracy_sampled"] = sampled
            line += f" greedy, {sampled:.3f} sampled (temperature {temperature}, {num_samples} per task)"
        line += f" ({counted(num_episodes, 'episode')}, {time.monotonic() - start:.1f} s)"
        self._progress = None
        self.eval_s += time.monotonic() - start
        self.metrics.log("eval", phase=phase, **row, eval_s=round(time.monotonic() - start, 2))
        self.emit(line)
        report_warnings(self.health.check_eval(phase, self.evals), self.metrics, self.emit)

    def skip_warm_start(self) -> None:
        """No warm start: its scores are those before it."""
        self.evals.update({k.replace("before", "after_sft"): v for k, v in self.evals.items()})

    async def score(self, temperature: float, samples_per_task: int, label: str = "") -> float:
        """Mean score over `samples_per_task` episodes per held-out task at `temperature` (0:
        greedy), redone whole while episodes are lost to actor deaths (module docstring).
        Cancelled: the episodes in flight are abandoned; nothing is recorded."""
        max_repeats = self.options.max_eval_repeats
        for attempt in range(max_repeats + 1):
            scores, lost = await self._score_once(temperature, samples_per_task, label)
            if not lost:
                return statistics.fmean(scores) if scores else 0.0
            what = (f"evaluation {label or 'score'}: {len(lost)} of {len(scores)} episodes could not finish "
                    f"(actors on their path kept dying: {lost[0]})")
            if attempt == max_repeats:
                raise EvaluationIncomplete(f"{what}, in {max_repeats + 1} tries; look at the actors' logs "
                                           "(logs/) for why they die; raise max_eval_repeats only if the "
                                           "cause is external")
            self.num_repeats += 1
            self.metrics.log("eval_repeat", phase=label, attempt=attempt + 1, num_lost=len(lost),
                             num_episodes=len(scores), reason=lost[0])
            self.emit(f"{what}; redoing the evaluation ({attempt + 2}/{max_repeats + 1})")
            await self.pool.keeper.resync_generators()   # a restarted generator gets the weights first
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _score_once(self, temperature: float, samples_per_task: int,
                          label: str) -> tuple[list[float], list[str]]:
        """Every episode's score, and why each lost episode was lost (empty: all scored). Raises
        EnvironmentErrorStop when one environment error failed most episodes (the pool's `errors`).
        Cancelled: the episodes in flight are abandoned; nothing is recorded."""
        options = self.options
        tasks = self.task.eval_tasks(options.task_options)[: options.num_eval_tasks]
        episodes = [(task, i * samples_per_task + k) for i, task in enumerate(tasks)
                    for k in range(samples_per_task)]
        scores = [0.0] * len(episodes)
        lost: list[str] = []
        failures: list[str] = []   # the reason of each episode the environment failed

        async def one(index, task, episode_seed):
            """Score one episode into `scores[index]` (or its loss into `lost`). Cancelled:
            abandoned, its score stays 0."""
            sampling = dataclasses.replace(options.sampling, temperature=temperature, stop=list(STOP_STRINGS),
                                           seed=options.seed * 1_000_003 + episode_seed)
            try:
                rollout = await self.pool.rollout(task, sampling)
            except Exception as exc:
                if is_actor_death(exc) or isinstance(exc, StaleRolloutError):
                    lost.append(short_reason(exc))
                else:  # the environment failed on the policy's output: the episode scores 0
                    reason = self.pool.errors.record(exc)
                    if reason is not None:
                        failures.append(reason)
                    self._episode_done()
                return
            scores[index] = rollout.reward.components.get("correct", rollout.reward.total)
            self._episode_done()
        async with anyio.create_task_group() as tg:
            for index, (task, episode_seed) in enumerate(episodes):
                tg.start_soon(one, index, task, episode_seed)
        self.pool.errors.check(failures, len(episodes), f"episodes of the evaluation {label or 'score'}")
        return scores, lost

    def _episode_done(self) -> None:
        """Count an episode of the evaluation under way; a line at each quarter of a long one."""
        progress = self._progress
        if progress is None:   # `score` called outside `phase`
            return
        progress.advance()
        total = progress.total
        quarter = max(1, total // 4)
        if total >= PROGRESS_LINES_FROM_EPISODES and progress.done % quarter == 0 and progress.done < total:
            self.emit(f"  {progress.phase}: {progress.done}/{total} episodes ({progress.timing_text()})")
