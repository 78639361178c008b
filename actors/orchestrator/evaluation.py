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

A mixture (actors/tasks/mixture.py) evaluates each task on its own held-out tasks, episode for
episode (and seed for seed) as a run of that task alone would, and reports the mean of the
tasks' accuracies; each task's own accuracy is in the metrics row (`accuracy_<task>`) and in
`evals` under `task:<name>:<phase>` (the summary's `eval_by_task`).

Causes: an episode whose environment names why it ended so (`Episode.cause`, api.py's
`StepResult`) is counted by that cause; a greedy evaluation's counts are in its metrics row
(`causes`, in a mixture `causes_<task>`) and its printed line, so a task's failures read by kind
(the CAD task's script errors, wrong shapes and missing exports) beside its accuracy.

During RL (`eval_every`), the RL loop waits for an evaluation after the step it follows, so
the learner does not change the policy under it; batches already admitted keep generating
beside it (max_staleness > 0), on the same weights.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Callable

import anyio

from postrain.core.errors import PostrainError
from postrain.core.progress import PhaseProgress
from postrain.core.text import counted, tally

from ..env.tools import STOP_STRINGS
from ..learner.recovery import is_actor_death, short_reason
from .health import HealthWatch, report_warnings
from .options import OrchestratorOptions
from .rollout_pool import RolloutPool, StaleRolloutError
from ..tasks import MixtureTask, TaskMixture

# An evaluation of at least this many episodes prints a progress line at each quarter of them.
PROGRESS_LINES_FROM_EPISODES = 20


class EvaluationIncomplete(PostrainError, RuntimeError):
    """An evaluation that could not score all its episodes, however often it was redone."""


@dataclasses.dataclass
class TaskScores:
    """One evaluation per task: the mean score (of the tasks that have held-out tasks) and the
    episodes counted by the cause their environment named (module docstring)."""

    accuracy: dict[str, float]
    causes: dict[str, collections.Counter[str]]


class Evaluator:
    """Evaluates into `evals` ({"before": x, "sampled_before": y, ...}), a run's accuracies so far."""

    def __init__(self, mixture: TaskMixture, options: OrchestratorOptions, pool: RolloutPool, metrics,
                 emit: Callable[[str], None], report_figures: Callable[[dict], None] | None = None):
        self.mixture = mixture           # the run's tasks: each one's held-out tasks
        self.options = options
        self.pool = pool
        self.metrics = metrics
        self.emit = emit
        self.report_figures = report_figures   # the head's live view: episodes done, elapsed, ETA
        self._progress: PhaseProgress | None = None   # the evaluation under way
        # phase -> accuracy (and, in a mixture, "task:<name>:<phase>" -> that task's); written by
        # `phase` and the run's restore
        self.evals: dict[str, float] = {}
        self.num_repeats = 0                # evaluations redone because episodes were lost to kills
        self.eval_s = 0.0                   # seconds spent evaluating in this start of the run
        self.health = HealthWatch()         # accuracy collapse, all-zero evaluation warnings (health.py)

    def held_out(self) -> list[tuple[MixtureTask, list[dict]]]:
        """Each task's held-out tasks of one evaluation: its first `num_eval_tasks` (the task's own
        setting, else the orchestrator's), or all it has."""
        return [(task, task.eval_tasks(self.options.num_eval_tasks)) for task in self.mixture.tasks]

    def num_tasks(self) -> int:
        """Held-out tasks each evaluation scores, of every task."""
        return sum(len(items) for _, items in self.held_out())

    @property
    def by_task(self) -> dict[str, dict[str, float]]:
        """A mixture's accuracies per task: name -> phase -> accuracy (empty for one task)."""
        out: dict[str, dict[str, float]] = {}
        for key, value in self.evals.items():
            if key.startswith("task:"):
                _, name, phase = key.split(":", 2)
                out.setdefault(name, {})[phase] = value
        return out

    async def phase(self, phase: str, label: str, **context) -> None:
        """Evaluate into `evals` (`phase`, and `sampled_<phase>` when `eval_samples_per_task` > 0),
        its metrics row (with `context`, e.g. the RL step) and a printed line (with progress
        lines at each quarter of a long one: episodes done, elapsed, ETA). Cancelled: no row
        or line; `evals` may hold the greedy score of this phase."""
        start = time.monotonic()
        num_episodes = self.num_tasks() * (1 + self.options.eval_samples_per_task)
        self._progress = PhaseProgress(f"evaluation {label}", num_episodes, self.report_figures)
        scores = await self.score_by_task(0.0, 1, phase)
        greedy = self._record(phase, scores.accuracy)
        line = f"held-out accuracy {label}: {greedy:.3f}"
        row = {**context, "accuracy": greedy, **self._task_figures(phase, "accuracy"), **self._causes(scores)}
        num_samples = self.options.eval_samples_per_task
        if num_samples:
            temperature = self.options.sampling.temperature
            sampled_scores = await self.score_by_task(temperature, num_samples, f"sampled_{phase}")
            sampled = self._record(f"sampled_{phase}", sampled_scores.accuracy)
            row["accuracy_sampled"] = sampled
            row.update(self._task_figures(f"sampled_{phase}", "accuracy_sampled"))
            line += f" greedy, {sampled:.3f} sampled (temperature {temperature}, {num_samples} per task)"
        if not self.mixture.is_single:
            line += " (" + ", ".join(f"{name} {self.evals[f'task:{name}:{phase}']:.3f}"
                                     for name in self.mixture.names if f"task:{name}:{phase}" in self.evals) + ")"
        line += f" ({counted(num_episodes, 'episode')}, {time.monotonic() - start:.1f} s{self._causes_text(scores)})"
        self._progress = None
        self.eval_s += time.monotonic() - start
        self.metrics.log("eval", phase=phase, **row, eval_s=round(time.monotonic() - start, 2))
        self.emit(line)
        report_warnings(self.health.check_eval(phase, self.evals), self.metrics, self.emit)

    def _record(self, phase: str, by_task: dict[str, float]) -> float:
        """Store an evaluation's accuracies (module docstring); returns the run's: the mean over
        the tasks that have held-out tasks (0 when none has)."""
        if not self.mixture.is_single:
            self.evals.update({f"task:{name}:{phase}": value for name, value in by_task.items()})
        accuracy = self.evals[phase] = statistics.fmean(by_task.values()) if by_task else 0.0
        return accuracy

    def _causes(self, scores: TaskScores) -> dict[str, dict[str, int]]:
        """An evaluation's cause counts for its metrics row: `causes` (a mixture: `causes_<task>`),
        only where a cause was named."""
        if self.mixture.is_single:
            causes: collections.Counter[str] = next(iter(scores.causes.values()), collections.Counter())
            return {"causes": dict(causes)} if causes else {}
        return {f"causes_{name}": dict(causes) for name, causes in scores.causes.items() if causes}

    def _causes_text(self, scores: TaskScores) -> str:
        """'; causes: no_export 5, ok 3' (a mixture: each task's, named), or '' when none was named."""
        named = {name: causes for name, causes in scores.causes.items() if causes}
        if not named:
            return ""
        if self.mixture.is_single:
            return "; causes: " + tally(next(iter(named.values())))
        return "; causes: " + "; ".join(f"{name} {tally(causes)}" for name, causes in named.items())

    def _task_figures(self, phase: str, figure: str) -> dict[str, float]:
        """A mixture's per-task figures of one evaluation for its metrics row (`accuracy_<task>`)."""
        return {f"{figure}_{name}": self.evals[f"task:{name}:{phase}"] for name in self.mixture.names
                if f"task:{name}:{phase}" in self.evals}

    def skip_warm_start(self) -> None:
        """No warm start: its scores are those before it."""
        self.evals.update({k.replace("before", "after_sft"): v for k, v in self.evals.items()})

    def skip_rl(self) -> None:
        """No RL step trained: the scores after RL are those after the warm start (or before it)."""
        self.evals.update({k.replace("after_sft", "after"): v for k, v in self.evals.items() if "after_sft" in k})

    async def score_by_task(self, temperature: float, samples_per_task: int, label: str = "") -> TaskScores:
        """Each task's mean score over `samples_per_task` episodes per held-out task at
        `temperature` (0: greedy), for the tasks that have held-out tasks, and its causes; redone
        whole while episodes are lost to actor deaths (module docstring). Cancelled: the episodes
        in flight are abandoned; nothing is recorded."""
        max_repeats = self.options.max_eval_repeats
        for attempt in range(max_repeats + 1):
            scores, causes, lost = await self._score_once(temperature, samples_per_task, label)
            if not lost:
                return TaskScores({name: statistics.fmean(values) for name, values in scores.items() if values},
                                  causes)
            num_episodes = sum(len(values) for values in scores.values())
            what = (f"evaluation {label or 'score'}: {len(lost)} of {num_episodes} episodes could not finish "
                    f"(actors on their path kept dying: {lost[0]})")
            if attempt == max_repeats:
                raise EvaluationIncomplete(f"{what}, in {max_repeats + 1} tries; look at the actors' logs "
                                           "(logs/) for why they die; raise max_eval_repeats only if the "
                                           "cause is external")
            self.num_repeats += 1
            self.metrics.log("eval_repeat", phase=label, attempt=attempt + 1, num_lost=len(lost),
                             num_episodes=num_episodes, reason=lost[0])
            self.emit(f"{what}; redoing the evaluation ({attempt + 2}/{max_repeats + 1})")
            await self.pool.keeper.resync_generators()   # a restarted generator gets the weights first
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _score_once(self, temperature: float, samples_per_task: int, label: str
                          ) -> tuple[dict[str, list[float]], dict[str, collections.Counter[str]], list[str]]:
        """Every episode's score by task, each task's episodes counted by cause, and why each lost
        episode was lost (empty: all scored).
        Each task's episodes have the seeds a run of that task alone gives them. Raises
        EnvironmentErrorStop when one environment error failed most episodes (the pool's `errors`).
        Cancelled: the episodes in flight are abandoned; nothing is recorded."""
        options = self.options
        episodes = [(of.name, task, i * samples_per_task + k) for of, items in self.held_out()
                    for i, task in enumerate(items) for k in range(samples_per_task)]
        scores = [0.0] * len(episodes)
        causes: list[str | None] = [None] * len(episodes)
        lost: list[str] = []
        failures: list[str] = []   # the reason of each episode the environment failed

        async def one(index, task_name, task, episode_seed):
            """Score one episode into `scores[index]` (or its loss into `lost`). Cancelled:
            abandoned, its score stays 0."""
            sampling = dataclasses.replace(options.sampling, temperature=temperature, stop=list(STOP_STRINGS),
                                           seed=options.seed * 1_000_003 + episode_seed)
            try:
                rollout = await self.pool.rollout(task, sampling, task_name=task_name)
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
            causes[index] = rollout.cause
            self._episode_done()
        async with anyio.create_task_group() as tg:
            for index, (task_name, task, episode_seed) in enumerate(episodes):
                tg.start_soon(one, index, task_name, task, episode_seed)
        self.pool.errors.check(failures, len(episodes), f"episodes of the evaluation {label or 'score'}")
        by_task: dict[str, list[float]] = {name: [] for name in self.mixture.names}
        causes_by_task: dict[str, collections.Counter[str]] = {name: collections.Counter()
                                                               for name in self.mixture.names}
        for (task_name, _, _), value, cause in zip(episodes, scores, causes):
            by_task[task_name].append(value)
            if cause:
                causes_by_task[task_name][cause] += 1
        return by_task, causes_by_task, lost

    def _episode_done(self) -> None:
        """Count an episode of the evaluation under way; a line at each quarter of a long one."""
        progress = self._progress
        if progress is None:   # `score_by_task` called outside `phase`
            return
        progress.advance()
        total = progress.total
        quarter = max(1, total // 4)
        if total >= PROGRESS_LINES_FROM_EPISODES and progress.done % quarter == 0 and progress.done < total:
            self.emit(f"  {progress.phase}: {progress.done}/{total} episodes ({progress.timing_text()})")
