"""A KL target per task: an adaptive KL-to-reference coefficient for each task of a mixture that
sets `kl_target` (actors/tasks/mixture.py), for domains that drift at different speeds.

    batch.row_tasks = ["arithmetic", "finance", ...]     # per sample (TrainBatch)
    batch.kl_targets = {"finance": 0.02}                 # the tasks that have a target

Each task with a target has its own `AdaptiveKLController` (ext/kl.py: the coefficient moves by
at most 20% x steps / kl_horizon toward its target each step), starting at the learner's
`kl_coef`, with the learner's `kl_horizon`. A sample of such a task gets its task's coefficient
on its KL term; every other sample gets the learner's own (fixed or adaptive) coefficient, as
without targets. The KL term is the learner's: `kl_kind` per token against the reference
model, reduced by `agg_mode` over the whole batch's counts, so the loss equals the plain one
when every coefficient equals the learner's. After the step each controller moves on its
task's measured KL (a token mean over every rank's samples of it; a task without samples in
the step keeps its coefficient), and the metrics hold `kl_<task>` and `kl_coef_<task>`.

Invariant: every rank holds the same controllers (the measured sums are all-reduced before
any update), and a checkpoint keeps them (`state_dict`), so a resumed run continues with the
coefficients it had.
"""
from __future__ import annotations

from typing import Any

import torch

from postrain.ext import rl_ops

from ..records import TrainBatch
from .batch import LearnerError
from .collectives import Collectives


class TaskKL:
    """The per-task KL controllers of one learner (module docstring)."""

    def __init__(self, initial_coef: float, horizon: int):
        self.initial_coef = initial_coef
        self.horizon = horizon
        self.controllers: dict[str, rl_ops.AdaptiveKLController] = {}
        self._tasks: list[str] = []              # the step's tasks with a target, sorted
        self._sums = torch.zeros(0, 2, dtype=torch.float64)   # per task: KL sum, trained tokens

    def start(self, batch: TrainBatch, default_coef: float, has_reference: bool
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's (coefficient (B,) float32, task index (B,) int64, -1: no target) per sample,
        or None when the batch names no target. LearnerError without a KL reference."""
        if batch.kl_targets is None or batch.row_tasks is None:
            self._tasks = []
            return None
        if not has_reference:
            raise LearnerError(f"the batch sets KL targets per task {batch.kl_targets}, but this learner has no KL "
                               "reference; fix: set learner.reference_model (e.g. \"initial\") and kl_coef > 0")
        if self.initial_coef <= 0:
            raise LearnerError("KL targets per task start at the learner's kl_coef, which is 0 (an adaptive "
                               "coefficient never leaves 0); fix: set learner.kl_coef > 0, e.g. 0.01")
        for task, target in batch.kl_targets.items():
            if task not in self.controllers:
                self.controllers[task] = rl_ops.AdaptiveKLController(self.initial_coef, target, self.horizon)
            self.controllers[task].target = target
        self._tasks = sorted(batch.kl_targets)
        index = {task: i for i, task in enumerate(self._tasks)}
        rows = torch.tensor([index.get(task, -1) for task in batch.row_tasks], dtype=torch.int64)
        coefs = torch.tensor([self.controllers[task].coef if task in index else default_coef
                              for task in batch.row_tasks], dtype=torch.float32)
        self._sums = torch.zeros(len(self._tasks), 2, dtype=torch.float64)
        return coefs, rows

    def measure(self, kl: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
        """Add one micro-batch's per-token KL (B, T) over its trained tokens `mask` to the sums of
        the tasks of its rows (`rows`: task index per sample, -1 none)."""
        per_row = (kl.detach().double() * mask).sum(-1).cpu()
        tokens = mask.sum(-1).double().cpu()
        rows = rows.cpu()
        for i in range(len(self._tasks)):
            mine = rows == i
            self._sums[i, 0] += per_row[mine].sum()
            self._sums[i, 1] += tokens[mine].sum()

    def finish(self, comm: Collectives) -> dict[str, float]:
        """All-reduce the sums, move each task's controller on its measured KL; the step's metrics."""
        if not self._tasks:
            return {}
        comm.all_reduce(self._sums)
        metrics: dict[str, float] = {}
        for i, task in enumerate(self._tasks):
            kl_sum, tokens = (float(x) for x in self._sums[i])
            if tokens:
                metrics[f"kl_{task}"] = kl_sum / tokens
                self.controllers[task].update(kl_sum / tokens, 1)
            metrics[f"kl_coef_{task}"] = float(self.controllers[task].coef)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {task: {"coef": c.coef, "target": c.target} for task, c in self.controllers.items()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.controllers = {task: rl_ops.AdaptiveKLController(float(s["coef"]), float(s["target"]), self.horizon)
                            for task, s in (state or {}).items()}
