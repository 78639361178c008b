"""`run`: the head asks the orchestrator to drive a run."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Record


@dataclass(frozen=True, slots=True)
class RunRequest(Record):
    """The orchestrator's `run`: the run folder, and whether to resume from its checkpoint."""

    run_folder: str
    resume: bool = False


#: A learner step's reply (`train`, `sft`): float metrics, always with "policy_version" (the
#: version after the step), "loss" and "step"; the rest vary with the objective (see learner.py).
StepMetrics = dict[str, float]
