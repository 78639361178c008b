"""Learning-health warnings: a run that stops learning says so, once per kind, while it runs.

Beside the no-signal warning (learning_signal.py: every group of a step has equal rewards),
`HealthWatch` looks at each RL step's train row and each evaluation and warns, at most once
per code and run (a progress line, and a `warning` row of metrics.jsonl with its `code`):

    reward_collapse    the mean training reward of the last k steps is at most half of the
                       best k-step mean so far (which was > 0.05)
    entropy_collapse   the mean policy entropy of the last k steps is under a tenth of the first
                       k steps' (the policy became near-deterministic; exploration is gone:
                       harmful while rewards are short of the task's best, the mark of a
                       solved task otherwise)
    accuracy_collapse  a held-out evaluation after RL started scores at most half of the best
                       one since the warm start (which was > 0.05)
    eval_all_zero      an evaluation other than the one before training scores 0 on every task
                       (greedy and sampled): the output format, the parser, or the policy broke

k = window_steps (5). The counts restart with the process: a resumed run may warn again.
"""
from __future__ import annotations

import statistics
from typing import Callable

HEALTH_WINDOW_STEPS = 5
COLLAPSE_FRACTION = 0.5        # "falling by half"
MIN_PEAK = 0.05                # a peak under this is noise, not something to collapse from
ENTROPY_FLOOR_FRACTION = 0.1


class HealthWatch:
    """Warnings of one run (module docstring). Invariant: each code in `warned` at most once."""

    def __init__(self, window_steps: int = HEALTH_WINDOW_STEPS):
        self.window = window_steps
        self.rewards: list[float] = []       # reward_mean per RL step, in order
        self.entropies: list[float] = []     # entropy per RL step, in order
        self.best_reward_window = float("-inf")
        self.warned: set[str] = set()

    def _warn(self, code: str, line: str, **figures) -> list[dict]:
        if code in self.warned:
            return []
        self.warned.add(code)
        return [{"line": f"warning: {line}", "row": {"code": code, **figures}}]

    def check_step(self, step: int, row: dict) -> list[dict]:
        """Warnings after RL step `step` whose train row is `row` (reward_mean, entropy)."""
        out, k = [], self.window
        if isinstance(row.get("reward_mean"), (int, float)):
            self.rewards.append(float(row["reward_mean"]))
            if len(self.rewards) >= k:
                recent = statistics.fmean(self.rewards[-k:])
                self.best_reward_window = max(self.best_reward_window, recent)
                best = self.best_reward_window
                if best > MIN_PEAK and recent <= COLLAPSE_FRACTION * best:
                    out += self._warn("reward_collapse", f"step {step}: reward collapse: the mean reward of the "
                                      f"last {k} steps is {recent:.3f}, under half of its best {k}-step mean {best:.3f}; "
                                      "lower learner.rl_lr, or try a stabiliser preset (learner.loss: gspo, cispo, "
                                      "tis, icepop) or a KL term (learner.loss = \"kl\")",
                                      step=step, reward_mean_recent=recent, reward_mean_best=best, window_steps=k)
        if isinstance(row.get("entropy"), (int, float)):
            self.entropies.append(float(row["entropy"]))
            if len(self.entropies) >= 2 * k:
                first, recent = statistics.fmean(self.entropies[:k]), statistics.fmean(self.entropies[-k:])
                if first > 0 and recent < ENTROPY_FLOOR_FRACTION * first:
                    out += self._warn("entropy_collapse", f"step {step}: entropy collapse: the policy's mean "
                                      f"entropy fell from {first:.3f} (first {k} steps) to {recent:.3f} (last {k}); "
                                      "it samples nearly one answer per prompt. Where rewards are still "
                                      "short of the task's best, lower learner.rl_lr, raise the sampling "
                                      "temperature, or add learner.entropy_coef / clip_high",
                                      step=step, entropy_first=first, entropy_recent=recent, window_steps=k)
        return out

    def check_eval(self, phase: str, evals: dict[str, float]) -> list[dict]:
        """Warnings after the evaluation `phase` into `evals` (the evaluator's phase -> accuracy)."""
        out = []
        greedy, sampled = evals.get(phase), evals.get(f"sampled_{phase}")
        if phase != "before" and greedy == 0 and sampled in (None, 0):
            out += self._warn("eval_all_zero", f"evaluation {phase}: every held-out task scored 0; check "
                              "the answer format the task expects (`postrain samples RUN` shows what the model "
                              "wrote) and the reward function", phase=phase)
        if phase == "after" or phase.startswith("step_"):
            earlier = [v for p, v in evals.items() if p == "after_sft" or (p.startswith("step_") and p != phase)]
            best = max(earlier, default=0.0)
            if greedy is not None and best > MIN_PEAK and greedy <= COLLAPSE_FRACTION * best:
                out += self._warn("accuracy_collapse", f"evaluation {phase}: accuracy collapse: {greedy:.3f}, "
                                  f"at most half of the best since the warm start, {best:.3f}; lower "
                                  "learner.rl_lr or try a stabiliser preset (learner.loss)",
                                  phase=phase, accuracy=greedy, accuracy_best=best)
        return out


def report_warnings(warnings: list[dict], metrics, emit: Callable[[str], None]) -> None:
    """Each warning as a `warning` row of metrics.jsonl and a line of the run's output."""
    for warning in warnings:
        metrics.log("warning", **warning["row"])
        emit(warning["line"])
