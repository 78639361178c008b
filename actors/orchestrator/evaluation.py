"""Held-out evaluation of the current policy, through the same rollout pool as training.

Each evaluation scores the first `num_eval_tasks` held-out tasks greedily (temperature
0) and, with `eval_samples_per_task` > 0, also that many sampled episodes per task at
the run's temperature. Every episode has its own fixed seed, so every evaluation of a
run meets the same random draws. A task's score is its reward's `correct` component
(the total reward when there is none); a failed episode scores 0.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

import anyio

from ..tools import STOP_STRINGS
from .options import OrchestratorOptions
from .rollout_pool import RolloutPool


class Evaluator:
    """Evaluates into `evals` ({"before": x, "sampled_before": y, ...}), a run's accuracies so far."""

    def __init__(self, task, options: OrchestratorOptions, pool: RolloutPool, metrics,
                 emit: Callable[[str], None]):
        self.task = task                 # TaskSpec: its held-out tasks
        self.options = options
        self.pool = pool
        self.metrics = metrics
        self.emit = emit
        self.evals: dict[str, float] = {}   # phase -> accuracy; written by `phase` and the run's restore

    async def phase(self, phase: str, label: str) -> None:
        """Evaluate into `evals` (`phase`, and `sampled_<phase>` when `eval_samples_per_task` > 0),
        its metrics row and a printed line. Cancelled: no row or line; `evals` may hold the
        greedy score of this phase."""
        greedy = await self.score(0.0, 1)
        self.evals[phase] = greedy
        line = f"held-out accuracy {label}: {greedy:.3f}"
        row = {"accuracy": greedy}
        num_samples = self.options.eval_samples_per_task
        if num_samples:
            temperature = self.options.sampling.temperature
            sampled = await self.score(temperature, num_samples)
            self.evals[f"sampled_{phase}"] = row["accuracy_sampled"] = sampled
            line += f" greedy, {sampled:.3f} sampled (temperature {temperature}, {num_samples} per task)"
        self.metrics.log("eval", phase=phase, **row)
        self.emit(line)

    def skip_warm_start(self) -> None:
        """No warm start: its scores are those before it."""
        self.evals.update({k.replace("before", "after_sft"): v for k, v in self.evals.items()})

    async def score(self, temperature: float, samples_per_task: int) -> float:
        """Mean score over `samples_per_task` episodes per held-out task at `temperature` (0:
        greedy). Cancelled: the episodes in flight are abandoned; nothing is recorded."""
        options = self.options
        tasks = self.task.eval_tasks(options.task_options)[: options.num_eval_tasks]
        episodes = [(task, i * samples_per_task + k) for i, task in enumerate(tasks)
                    for k in range(samples_per_task)]
        scores = [0.0] * len(episodes)

        async def one(index, task, episode_seed):
            """Score one episode into `scores[index]`. Cancelled: abandoned, its score stays 0."""
            sampling = dataclasses.replace(options.sampling, temperature=temperature, stop=list(STOP_STRINGS),
                                           seed=options.seed * 1_000_003 + episode_seed)
            try:
                rollout = await self.pool.rollout(task, sampling)
            except Exception:
                return  # a failed episode scores 0
            scores[index] = rollout.reward.components.get("correct", rollout.reward.total)
        async with anyio.create_task_group() as tg:
            for index, (task, episode_seed) in enumerate(episodes):
                tg.start_soon(one, index, task, episode_seed)
        return statistics.fmean(scores) if scores else 0.0
